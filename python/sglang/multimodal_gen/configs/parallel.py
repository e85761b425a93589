"""The parallel layout (and the kernel choices) from SGLang's flags: ``--num-gpus = tp x sp x cfg``, ``sp = ulysses x ring``.

Shared by ``sglang serve`` (``ServerArgs``), ``sglang generate`` and the engine, so the same flags
mean the same layout everywhere. Flags, as SGLang names them:

* ``--tp-size``: tensor parallelism (heads and FFN units split; all-reduce twice per block);
* ``--sp-degree``: sequence parallelism; split into ``--ulysses-degree`` x ``--ring-degree``;
* ``--enable-cfg-parallel``: the conditional and unconditional CFG branches on two rank sets;
* ``--num-gpus``: the total; a missing degree is inferred from it, and alone it is the TP size
  (the historic meaning).

When only ``--sp-degree`` is given, the Ulysses degree is the largest divisor of it that also
divides the attention heads left on each TP rank (when the model is known) and the rest goes to
ring attention: Z-Image-Turbo's 30 heads with ``--sp-degree 4`` run as Ulysses 2 x ring 2 (every
Ulysses rank attends as many heads). An explicit ``--ulysses-degree`` may be any number: heads it
does not divide are split unevenly over its ranks (``layers.attention``), so ``--ulysses-degree
4`` serves the same model at ``ceil(30 / 4) / (30 / 4)`` of the even attention time.
"""

from __future__ import annotations

import argparse
import os

from sglang.multimodal_gen.distributed.parallel_state import ParallelLayout
from sglang.multimodal_gen.layers.attention import ATTENTION_BACKENDS


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Register the layout flags (all default to ``None``: decided by :func:`resolve_layout`)."""
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tp-size", type=int, default=None, help="tensor-parallel size")
    g.add_argument(
        "--sp-degree",
        type=int,
        default=None,
        help="sequence-parallel size (= ulysses x ring degrees)",
    )
    g.add_argument(
        "--ulysses-degree", type=int, default=None, help="Ulysses (all-to-all) sequence parallelism"
    )
    g.add_argument(
        "--ring-degree", type=int, default=None, help="ring-attention sequence parallelism"
    )
    g.add_argument(
        "--enable-cfg-parallel",
        action="store_true",
        help="run the conditional and unconditional CFG branches on different GPUs (x2)",
    )
    g.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help="total processes = tp x sp x cfg; alone it is the tensor-parallel size",
    )


#: ``torch.set_float32_matmul_precision`` values (``--float32-matmul-precision``).
FLOAT32_MATMUL_PRECISIONS = ("highest", "high", "medium")


def check_float32_matmul_precision(value: str, name: str = "--float32-matmul-precision") -> str:
    """``value`` if it is one of :data:`FLOAT32_MATMUL_PRECISIONS`; else ``ValueError`` naming
    ``name`` (the flag, or the argument of the Python API)."""
    if value not in FLOAT32_MATMUL_PRECISIONS:
        raise ValueError(f"{name} must be one of {list(FLOAT32_MATMUL_PRECISIONS)}, got {value!r}")
    return value


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    """``--attention-backend``, ``--enable-torch-compile`` (SGLang's names),
    ``--float32-matmul-precision`` (``torch.set_float32_matmul_precision``'s values) and
    ``--cpu-gemm-backend`` (``layers.cpu_gemm``)."""
    from sglang.multimodal_gen.layers.cpu_gemm import CPU_GEMM_BACKENDS

    g = parser.add_argument_group("kernels")
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="SDPA kernel: auto (PyTorch picks), flash, efficient, cudnn, math (CPU: flash, math)",
    )
    g.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="torch.compile the DiT blocks (compile time on the first run of each shape)",
    )
    g.add_argument(
        "--float32-matmul-precision",
        default="highest",
        choices=FLOAT32_MATMUL_PRECISIONS,
        help="float32 GEMMs in every engine process: highest (full fp32, the default), high "
        "(TF32 where the hardware has it), medium (bfloat16 inputs, fp32 accumulation: AMX/"
        "AVX512-BF16 CPUs, GPUs); changes the numbers slightly (docs/benchmarks.md)",
    )
    g.add_argument(
        "--cpu-gemm-backend",
        default="auto",
        choices=CPU_GEMM_BACKENDS,
        help="fp32 linear layers on the CPU: onednn (oneDNN on the stored weights), "
        "onednn-packed (on a pre-packed copy: fastest, a second copy of the weights), blas "
        "(PyTorch's F.linear), auto (onednn on x86-64 where PyTorch has oneDNN, else blas); "
        "exact fp32 in every case",
    )


def layout_from_args(args: argparse.Namespace, heads: int | None = None) -> ParallelLayout:
    """:func:`resolve_layout` of a namespace filled by :func:`add_parallel_args`. Under
    ``torchrun`` (one process per rank) ``--num-gpus`` defaults to its ``WORLD_SIZE``."""
    from sglang.multimodal_gen.configs.launch_plan import running_under_torchrun

    num_gpus = args.num_gpus
    if num_gpus is None and running_under_torchrun():
        num_gpus = int(os.environ["WORLD_SIZE"])
    return resolve_layout(
        tp_size=args.tp_size,
        sp_degree=args.sp_degree,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        enable_cfg_parallel=bool(args.enable_cfg_parallel),
        num_gpus=num_gpus,
        heads=heads,
    )


def _check_positive(**values: int | None) -> None:
    for name, v in values.items():
        if v is not None and int(v) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def _largest_divisor(n: int, heads: int | None) -> int:
    """The largest divisor of ``n`` that also divides ``heads`` (``n`` when heads unknown)."""
    if heads is None:
        return n
    return max(d for d in range(1, n + 1) if n % d == 0 and heads % d == 0)


def resolve_layout(
    tp_size: int | None = None,
    sp_degree: int | None = None,
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    enable_cfg_parallel: bool = False,
    num_gpus: int | None = None,
    heads: int | None = None,
) -> ParallelLayout:
    """The layout the flags describe.

    Args:
        heads: the model's attention heads, when known: the automatic Ulysses degree divides the
            heads per TP rank (an explicit one need not).

    Returns:
        A :class:`ParallelLayout` whose ``world_size`` equals ``num_gpus`` when given.

    Raises:
        ValueError: a size below 1, ``ulysses x ring != sp``, ``tp x sp x cfg != num_gpus``, or a
            ``num_gpus`` that the given degrees do not divide; the message names the numbers.
    """
    _check_positive(
        tp_size=tp_size,
        sp_degree=sp_degree,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        num_gpus=num_gpus,
    )
    cfg = 2 if enable_cfg_parallel else 1
    if ulysses_degree is not None and ring_degree is not None:
        if sp_degree is not None and sp_degree != ulysses_degree * ring_degree:
            raise ValueError(
                f"--sp-degree {sp_degree} must equal --ulysses-degree {ulysses_degree} x "
                f"--ring-degree {ring_degree} = {ulysses_degree * ring_degree}"
            )
        sp_degree = ulysses_degree * ring_degree
    elif ulysses_degree is not None or ring_degree is not None:
        given = ulysses_degree or ring_degree
        if sp_degree is not None and sp_degree % given:
            name = "--ulysses-degree" if ulysses_degree is not None else "--ring-degree"
            raise ValueError(f"{name} {given} does not divide --sp-degree {sp_degree}")
        if sp_degree is None and num_gpus is None:
            sp_degree = given
    if num_gpus is not None:
        if tp_size is None and sp_degree is None:
            if (ulysses_degree, ring_degree) == (None, None) and cfg == 1:
                tp_size = num_gpus  # --num-gpus alone: the TP size (the historic meaning)
            else:
                sp_degree = _divide(num_gpus, cfg, "--num-gpus", "the CFG degree")
                tp_size = 1
        elif tp_size is None:
            tp_size = _divide(num_gpus, sp_degree * cfg, "--num-gpus", "sp x cfg")
        elif sp_degree is None:
            sp_degree = _divide(num_gpus, tp_size * cfg, "--num-gpus", "tp x cfg")
    tp_size = tp_size or 1
    sp_degree = sp_degree or 1
    if ulysses_degree is None and ring_degree is None:
        local = None if heads is None else heads // tp_size
        ulysses_degree = _largest_divisor(sp_degree, local)
    if ulysses_degree is None:
        ulysses_degree = _divide(sp_degree, ring_degree, "--sp-degree", "--ring-degree")
    if ring_degree is None:
        ring_degree = _divide(sp_degree, ulysses_degree, "--sp-degree", "--ulysses-degree")
    layout = ParallelLayout(tp_size, ulysses_degree, ring_degree, cfg)
    if num_gpus is not None and layout.world_size != num_gpus:
        raise ValueError(
            f"--num-gpus {num_gpus} must equal tp {tp_size} x sp {layout.sp_degree} x cfg {cfg} "
            f"= {layout.world_size}"
        )
    return layout


def _divide(total: int, part: int, total_name: str, part_name: str) -> int:
    if total % part:
        raise ValueError(f"{total_name} {total} is not divisible by {part_name} = {part}")
    return total // part
