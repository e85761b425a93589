"""``sglang generate``: one request from the command line, its images or videos written to files.

Same engine and defaults as the server, so the same arguments give the same pixels::

    sglang generate --model-path DIR --prompt "a cat" --seed 42 --num-inference-steps 8 \\
        --height 1024 --width 1024 --guidance-scale 0 --output-path cat.png \\
        [--lora-path A.safetensors B/ --lora-scale 0.7 1.3] [--tp-size 2]

A quantized transformer: ``--transformer-path DIR`` (a transformer folder with its own
``config.json``, e.g. a ModelOpt FP8 export, replacing ``transformer/``),
``--transformer-weights-path FILE|DIR`` (other weights for the model's ``transformer/``; a
``quantization_config`` may sit in the safetensors metadata) or ``--quantization fp8`` (quantized
while loading).

``--model-path`` and ``--lora-path`` may be Hugging Face Hub ids (``owner/name``): downloaded into
the HF cache by ``huggingface_hub`` when they are not there (``--revision`` for the model;
``--no-enable-hub-lora`` keeps LoRA ids to the cache; ``HF_HUB_OFFLINE=1``: no request at all).

Across nodes, the same command on each with ``--nnodes N --node-rank K --dist-init-addr
HOST:PORT`` (or under ``torchrun``): node 0 writes the output, the others exit 0 when it is done.

Without ``--model-path`` the embedded demo model is used (a tiny Z-Image trained on simple scenes:
"a red circle on a blue background, top left"; 64x64 by default; see docs/models.md). Exit code 0
on success, 2 for bad arguments or input, 1 for runtime
failures, 130 when interrupted; every error is one line ``sglang generate: error: ...`` (see
:mod:`sglang.cli.errors`, shared with ``sglang serve``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sglang.multimodal_gen.configs.parallel import (
    add_kernel_args,
    add_parallel_args,
    layout_from_args,
)
from sglang.multimodal_gen.configs.server_args import (
    add_cache_args,
    add_multinode_args,
    add_weight_args,
    check_weight_flags,
    default_lora_nickname,
    step_cache_config,
)
from sglang.multimodal_gen.lora.requests import MERGE_MODES


def lora_nicknames(paths: list[str]) -> list[str]:
    """The nickname of each ``--lora-path`` of ``sglang generate``: its base name as ``sglang
    serve`` names a startup adapter (``/loras/distilled.safetensors`` -> ``distilled``, so a
    request field or preset that names an adapter finds it); a name given twice gets ``_2``,
    ``_3``, ... in order of the paths."""
    names: list[str] = []
    for path in paths:
        base = name = default_lora_nickname(path)
        k = 1
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def add_generate_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the ``generate`` flags on ``parser`` and return it."""
    parser.add_argument(
        "--model-path",
        default=None,
        help="diffusers-format model directory or a Hugging Face Hub repo id (owner/name), "
        "downloaded into the HF cache when not there (HF_ENDPOINT, HF_TOKEN, HF_HOME, "
        "HF_HUB_OFFLINE apply; default: the embedded demo model, a tiny Z-Image trained on "
        "simple scenes)",
    )
    parser.add_argument(
        "--revision",
        default=None,
        help="Hub revision of --model-path: a branch, tag or commit (default: the repo's "
        "default branch)",
    )
    add_weight_args(parser)
    add_cache_args(parser)
    add_sampling_args(parser)
    parser.add_argument(
        "--image-path",
        nargs="+",
        default=None,
        metavar="IMG",
        help="input images (PNG, JPEG, WebP): the image to edit or re-noise (with --strength), "
        "or an edit model's reference images (models whose inputs include image)",
    )
    parser.add_argument(
        "--mask-path",
        default=None,
        metavar="MASK",
        help="inpainting mask, the size of the first --image-path: white is edited, black kept "
        "(or, in a mask with transparency, the transparent pixels are edited, as OpenAI's)",
    )
    parser.add_argument(
        "--output-path",
        default="output.png",
        help="images: .png, .jpg/.jpeg, .webp; videos: .mp4 (H.264), .webp, .gif; or a "
        "directory (a trailing slash or an existing one) for one PNG per image or frame "
        "(default: output.png)",
    )
    parser.add_argument(
        "--lora-path",
        nargs="+",
        action="extend",
        default=None,
        help="LoRA file(s)/folder(s) or Hub repo id(s) (owner/name)",
    )
    parser.add_argument(
        "--enable-hub-lora",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="download --lora-path Hub ids that are not in the local Hugging Face cache "
        "(default: on; --no-enable-hub-lora: cached ones only)",
    )
    parser.add_argument(
        "--lora-scale",
        nargs="+",
        action="extend",
        type=float,
        default=None,
        help="strength per --lora-path (one value applies to all; default 1.0)",
    )
    parser.add_argument(
        "--lora-target",
        nargs="+",
        action="extend",
        default=None,
        help="LoRA target per --lora-path (one value applies to all; default: all)",
    )
    parser.add_argument(
        "--lora-merge-mode",
        default=None,
        choices=MERGE_MODES,
        help="how adapters are applied (default: the LoRA manager's)",
    )
    add_parallel_args(parser)
    add_kernel_args(parser)
    add_multinode_args(parser.add_argument_group("multi-node"))
    parser.add_argument("--device", default=None, help="cpu, cuda (default: cuda if available)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("auto", "float32", "float16", "bfloat16"),
        help="parameter and compute dtype (default auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the step progress bar")
    return parser


def _flag(text: str) -> bool:
    """``--name true|false`` (also 1/0, yes/no)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _indices(text: str) -> list[int]:
    """``--name 27,28``: comma-separated integers (an empty string: none)."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


_KIND_TYPES = {
    "text": str, "size": int, "count": int, "seed": int, "scale": float, "fraction": float,
    "flag": _flag, "indices": _indices,
}  # fmt: skip


def sampling_flags() -> dict[str, tuple]:
    """``{field: (dataclass field, names of the families that declare it)}`` for every request
    field a CLI flag sets: the fields every model takes, then each registered family's own
    (the flags derive from the declarations; shared code names no family's field)."""
    from dataclasses import fields

    from sglang.multimodal_gen.configs.sampling_params import SamplingParams
    from sglang.multimodal_gen.models.registry import list_families

    out: dict[str, tuple] = {f.name: (f, ()) for f in fields(SamplingParams)}
    for fam in list_families():
        cls = fam.params_class()
        for name in cls.own_fields():
            f, owners = out.get(name, (cls.declared(name), ()))
            out[name] = (f, (*owners, fam.display_name))
    return {n: v for n, v in out.items() if v[0].metadata.get("cli", True)}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """One flag per request field (``--num-inference-steps``...), from the declarations."""
    group = parser.add_argument_group("request (unset: the model's defaults)")
    for name, (f, owners) in sampling_flags().items():
        flag = "--" + name.replace("_", "-")
        text = f.metadata["help"]
        if owners:
            text += f" (models: {', '.join(owners)})"
        if name == "prompt":
            group.add_argument(flag, required=True, help=text)
            continue
        group.add_argument(flag, type=_KIND_TYPES[f.metadata["kind"]], default=None, help=text)


def sampling_values(args: argparse.Namespace) -> dict:
    """The request fields given on the command line (unset flags left out)."""
    return {n: getattr(args, n) for n in sampling_flags() if getattr(args, n, None) is not None}


def image_values(args: argparse.Namespace) -> dict:
    """``image`` and ``mask_image`` decoded from ``--image-path`` / ``--mask-path`` (the limits
    of :class:`~sglang.multimodal_gen.image_inputs.ImageLimits`).

    Raises:
        InvalidRequestError: a file that is missing, too large or not a still PNG/JPEG/WebP.
    """
    from sglang.multimodal_gen.image_inputs import ImageBudget, ImageLimits, read_image_file

    out: dict = {}
    limits = ImageLimits()
    budget = ImageBudget(limits)
    paths = list(getattr(args, "image_path", None) or [])
    if paths:
        out["image"] = tuple(read_image_file(p, f"--image-path {p}", limits, budget) for p in paths)
    if getattr(args, "mask_path", None):
        out["mask_image"] = read_image_file(
            args.mask_path, f"--mask-path {args.mask_path}", limits, budget, mask=True
        )
    return out


def lora_pairs(paths: list[str] | None, scales: list[float] | None) -> list[tuple[str, float]]:
    """``[(path, scale), ...]`` from the flags.

    Raises:
        ValueError: ``--lora-scale`` without ``--lora-path``, or a count other than 1 or
            ``len(paths)``.
    """
    paths = list(paths or [])
    scales = list(scales or [])
    if scales and not paths:
        raise ValueError("--lora-scale given without --lora-path")
    if not scales:
        scales = [1.0] * len(paths)
    elif len(scales) == 1:
        scales = scales * len(paths)
    elif len(scales) != len(paths):
        raise ValueError(
            f"--lora-scale has {len(scales)} values for {len(paths)} --lora-path values; "
            "give one, or one per path"
        )
    return list(zip(paths, scales))


def check_output_dir(path: str) -> None:
    """Create the folder the images go to now, before the model loads, so a path that cannot be
    written fails at once.

    Raises:
        ValueError: the folder cannot be created or written (names ``--output-path``).
    """
    is_dir = path.endswith(("/", os.sep)) or os.path.isdir(path)
    folder = os.path.abspath(path if is_dir else os.path.dirname(os.path.abspath(path)))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"--output-path {path!r}: cannot create folder {folder!r} ({e.strerror or e})"
        ) from None
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--output-path {path!r}: folder {folder!r} is not writable")
    if not is_dir and os.path.isdir(path):
        raise ValueError(f"--output-path {path!r} is a directory")


def run_generate(args: argparse.Namespace) -> int:
    """Run ``sglang generate`` with parsed ``args``; returns the exit code.

    Any failure is one line ``sglang generate: error: ...`` on stderr with the exit code of
    :mod:`sglang.cli.errors` (2: bad arguments or input, 1: runtime failure), never a traceback.
    """
    from sglang.cli.errors import report

    try:
        return _run_generate(args)
    except (Exception, KeyboardInterrupt) as e:
        return report("generate", e)


def _check_output_target(path: str, count: int) -> None:
    """Before the model (and so its modality) is known: the extension must be an image or a
    video one (the exact check follows once the model is loaded)."""
    from sglang.multimodal_gen.outputs import output_targets

    try:
        output_targets(path, count, "image")
    except ValueError:
        try:
            output_targets(path, count, "video")
        except ValueError:
            pass
        else:
            return
        raise


def step_cache_line(outputs: list) -> str | None:
    """One line on the step caching the request ran with (the counts its first output carries
    under ``outputs.STEP_CACHE_INFO``), or ``None`` without step caching."""
    from sglang.multimodal_gen.outputs import STEP_CACHE_INFO

    s = getattr(outputs[0], "info", {}).get(STEP_CACHE_INFO) if outputs else None
    if not s:
        return None
    done, skipped = s["steps_computed"], s["steps_skipped"]
    return (
        f"step cache ({s['method']}): {done} of {done + skipped} DiT steps computed, {skipped} "
        f"skipped; {s['blocks_computed']} blocks computed, {s['blocks_skipped']} skipped"
    )


def _run_generate(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from sglang.multimodal_gen.runtime.worker import quiet_library_progress_bars

    quiet_library_progress_bars()
    check_weight_flags(args.transformer_path, args.transformer_weights_path, args.quantization)
    step_cache = step_cache_config(
        args.cache_method,
        args.cache_threshold,
        args.cache_fn,
        args.cache_bn,
        args.cache_warmup,
        interval=args.cache_interval,
        order=args.cache_order,
        stop=args.cache_stop,
        target=args.cache_taylor_target,
        max_cached_steps=args.cache_max_cached_steps,
        max_continuous_cached_steps=args.cache_max_continuous_cached_steps,
        max_skip_steps=args.cache_max_skip_steps,
        retention_ratio=args.cache_retention_ratio,
        mag_ratios=args.cache_mag_ratios,
    )  # a bad --cache-* value: one error before loading
    loras = lora_pairs(args.lora_path, args.lora_scale)
    layout = layout_from_args(args)  # contradictory degrees: one error before loading
    from sglang.multimodal_gen.runtime.nodes import multinode_kwargs, run_follower_node

    multinode = multinode_kwargs(args)
    job = dict(
        model_path=args.model_path,
        revision=args.revision,
        transformer_path=args.transformer_path,
        transformer_weights_path=args.transformer_weights_path,
        quantization=args.quantization,
        step_cache=step_cache,
        tp_size=layout.tp_size,
        sp_degree=layout.sp_degree,
        ulysses_degree=args.ulysses_degree,
        ring_degree=args.ring_degree,
        cfg_degree=layout.cfg_degree,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enable_torch_compile=args.enable_torch_compile,
        float32_matmul_precision=args.float32_matmul_precision,
        cpu_gemm_backend=args.cpu_gemm_backend,
    )
    if run_follower_node(**job, **multinode):
        return 0  # a node without rank 0: it followed node 0, which wrote the output

    from sglang.multimodal_gen.configs.sampling_params import RequestSpec
    from sglang.multimodal_gen.outputs import output_targets, write_output
    from sglang.multimodal_gen.runtime import DiffusionEngine
    from sglang.multimodal_gen.runtime.engine import check_device

    values = sampling_values(args)
    count = int(values.get("num_outputs_per_prompt") or 1)
    _check_output_target(args.output_path, count)
    # the value rules that do not need the model, before it loads (all of them, with the
    # model's defaults and limits, once it is loaded)
    RequestSpec.generic().check_values(values)
    values.update(image_values(args))
    check_device(args.device)
    check_output_dir(args.output_path)
    engine = None
    try:
        engine = DiffusionEngine(**job, **multinode, allow_hub_lora=args.enable_hub_lora)
        params = engine.spec.resolve(engine.spec.params(**values))
        for name, asked in values.items():
            if getattr(params, name) != asked:  # brought to what the model makes
                print(
                    f"note: {name} is {getattr(params, name)!r}, not {asked!r}: what this model "
                    "produces",
                    file=sys.stderr,
                )
        if args.seed is None:
            print(f"seed: {params.seed}", file=sys.stderr)
        if loras:
            engine.set_lora(
                lora_nicknames([p for p, _ in loras]),
                [p for p, _ in loras],
                target=args.lora_target or "all",
                strength=[s for _, s in loras],
                merge_mode=args.lora_merge_mode,
            )
        targets = output_targets(args.output_path, count, engine.modality)
        progress = False if args.no_progress else None
        outputs = engine.generate(params, progress=progress)
        for item, (path, fmt) in zip(outputs, targets):
            write_output(item, path, fmt)
        summary = step_cache_line(outputs)
        if summary:
            print(summary, file=sys.stderr)
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # the result (or the first error) is what the user needs
                logging.getLogger(__name__).warning("engine shutdown failed", exc_info=True)
    for path, _ in targets:
        print(os.path.abspath(path))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang.cli.generate ...`` (same flags as ``sglang generate``)."""
    parser = add_generate_args(argparse.ArgumentParser(prog="sglang generate"))
    return run_generate(parser.parse_args(argv))


if __name__ == "__main__":
    from sglang.multimodal_gen.runtime.compute_thread import exit_code_for_process

    sys.exit(exit_code_for_process(main()))
