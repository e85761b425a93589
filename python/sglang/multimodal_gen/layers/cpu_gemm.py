"""The kernel behind a linear layer's GEMM on the CPU: oneDNN or the BLAS (``--cpu-gemm-backend``).

PyTorch runs an fp32 ``F.linear`` on the CPU through its BLAS (MKL's ``sgemm`` in the x86
wheels); its oneDNN matmul is reached only for bf16/fp16 or when fp32 may be computed at reduced
precision. oneDNN's fp32 kernels (``torch.ops.mkldnn._linear_pointwise``, the operator Intel's
PyTorch extension and inductor's CPU weight prepacking use) keep fp32 inputs, products and
accumulation: the same exactness, a different summation order. Measured on a 2-core AMD EPYC
(Zen 4) VM with the Z-Image DiT's shapes (288 rows, 768-2304 columns): the BLAS 140-160 GFLOP/s,
oneDNN on the stored weight 190-195, oneDNN on a pre-packed (blocked) copy 205-220.

Backends (process-wide, :func:`set_cpu_gemm_backend`):

* ``onednn``: oneDNN on the stored weight. No extra memory, no state.
* ``onednn-packed``: oneDNN on a blocked copy of each weight, made on first use and remade when
  the weight changes (:class:`PackedWeight`): the fastest, at the cost of a second copy of every
  unquantized linear weight that runs on the CPU.
* ``blas``: ``F.linear`` (PyTorch's choice; the BLAS for fp32).
* ``auto``: ``onednn`` where PyTorch was built with oneDNN on an x86-64 CPU, else ``blas``.

Only fp32 GEMMs without autograd at ``torch.get_float32_matmul_precision() == "highest"``
change backend; other dtypes (bf16 already runs on oneDNN), reduced fp32 precision (PyTorch's
own oneDNN bf16/TF32 path), GEMMs that record gradients and other devices run ``F.linear``. Inside a ``torch.compile`` graph
the oneDNN call is the custom operator ``sglang::onednn_linear`` (inductor cannot lower
``mkldnn._linear_pointwise`` on an unpacked weight itself), so compiled blocks use the same
kernel as eager ones.

Row invariance (:mod:`~sglang.multimodal_gen.layers.batch_invariant`): oneDNN computes a row
identically whatever the GEMM's row count from 2 rows on (1 row takes a GEMV path: measured over
9 shapes, 1-260 rows, 1-16 threads, stored and packed weights); the BLAS only for multiples of 4
(:data:`ROW_RULES`).
"""

from __future__ import annotations

import platform
import weakref

import torch
import torch.nn.functional as F

__all__ = [
    "CPU_GEMM_BACKENDS",
    "ROW_RULES",
    "PackedWeight",
    "check_cpu_gemm_backend",
    "cpu_gemm_backend",
    "cpu_linear",
    "onednn_available",
    "row_rule",
    "set_cpu_gemm_backend",
]

CPU_GEMM_BACKENDS = ("auto", "onednn", "onednn-packed", "blas")

# (row block, minimum rows) under which a backend's GEMM rounds a row the same whatever the row
# count: an input of a multiple of `block` rows, at least `minimum`, is row-invariant
ROW_RULES = {"onednn": (1, 2), "onednn-packed": (1, 2), "blas": (4, 4)}


def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN (``torch.backends.mkldnn``) with its linear
    operators, on an x86-64 CPU."""
    machine = platform.machine().lower()
    return (
        torch.backends.mkldnn.is_available()
        and machine in ("x86_64", "amd64")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def check_cpu_gemm_backend(name: str) -> str:
    """The backend ``name`` resolves to on this machine (``auto``: ``onednn`` where
    :func:`onednn_available`, else ``blas``).

    Raises:
        ValueError: an unknown name, or a oneDNN backend without oneDNN (the message names
            ``--cpu-gemm-backend`` and the choices).
    """
    if name not in CPU_GEMM_BACKENDS:
        raise ValueError(
            f"--cpu-gemm-backend {name!r} is unknown; choose from {list(CPU_GEMM_BACKENDS)}"
        )
    if name == "auto":
        return "onednn" if onednn_available() else "blas"
    if name.startswith("onednn") and not onednn_available():
        raise ValueError(
            f"--cpu-gemm-backend {name!r} needs PyTorch built with oneDNN on an x86-64 CPU "
            f"(this is {platform.machine()}); choose 'blas' or 'auto'"
        )
    return name


_BACKEND = check_cpu_gemm_backend("auto")


def set_cpu_gemm_backend(name: str) -> str:
    """Choose the CPU GEMM backend of every linear layer in this process; returns the resolved
    name (``auto`` resolved). Raises ``ValueError`` as :func:`check_cpu_gemm_backend`."""
    global _BACKEND
    _BACKEND = check_cpu_gemm_backend(name)
    return _BACKEND


def cpu_gemm_backend() -> str:
    """The resolved backend in force: ``onednn``, ``onednn-packed`` or ``blas``."""
    return _BACKEND


def row_rule(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[int, int]:
    """``(block, minimum)`` rows (:data:`ROW_RULES`) of the kernel :func:`cpu_linear` runs for
    these tensors: the backend in force for fp32 without autograd, else the BLAS's."""
    return ROW_RULES[_BACKEND if _uses_onednn(x, weight, bias) else "blas"]


class PackedWeight:
    """A oneDNN-blocked copy of one weight (``--cpu-gemm-backend onednn-packed``), owned by the
    layer's weight method.

    The copy is made on first use and remade when the weight is another tensor, points at other
    storage, or was written in place (its version counter moved: ``copy_``, ``add_``);
    :meth:`clear` drops it. Writes and swaps through ``.data`` move no counter, and a swapped-in
    tensor may sit at the address of one freed just before, so whoever does them clears it: the
    loader, and a LoRA merge swapping its merged weight in
    (``ParallelLinear.weight_changed``). It is never saved, copied or pickled: a copy of the
    owner starts empty.
    """

    __slots__ = ("_packed", "_ref", "_source", "_key")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the packed copy (the next :meth:`get` packs again)."""
        self._packed: torch.Tensor | None = None
        self._ref = None
        self._source: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed form of ``weight`` (``[out, in]`` fp32 on the CPU), packing when stale;
        ``weight`` itself when it is an inference tensor (those keep no version counter, so a
        write could not be seen: they run unpacked)."""
        if weight.is_inference():
            self.clear()
            return weight
        key = (weight.data_ptr(), weight._version)
        if self._packed is None or self._ref() is not weight or self._key != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
            # the source storage is held until the next pack or clear: a tensor swapped in
            # unannounced can then never sit at its address and pass for it
            self._ref, self._source, self._key = weakref.ref(weight), weight.detach(), key
        return self._packed

    @property
    def packed(self) -> bool:
        """Whether a packed copy is held."""
        return self._packed is not None

    def __deepcopy__(self, memo) -> PackedWeight:
        return PackedWeight()

    def __reduce__(self):
        return (PackedWeight, ())


@torch.library.custom_op("sglang::onednn_linear", mutates_args=())
def _onednn_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN's fp32 ``x @ weight.T + bias`` for compiled graphs (``x`` ``[rows, in]``)."""
    return torch.ops.mkldnn._linear_pointwise(
        x.contiguous(), weight.contiguous(), bias, "none", [], ""
    )


@_onednn_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.compiler.assume_constant_result
def _full_fp32_precision() -> bool:
    """``torch.get_float32_matmul_precision() == "highest"`` (read when a graph is traced)."""
    return torch.get_float32_matmul_precision() == "highest"


def _uses_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        _BACKEND != "blas"
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.shape[0] > 0
        and x.shape[-1] > 0
        and (
            bias is None
            or (
                bias.dtype == torch.float32
                and bias.shape == weight.shape[:1]
                and bias.is_contiguous()
            )
        )
        and _full_fp32_precision()
        and not (
            torch.is_grad_enabled()
            and (
                x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
            )
        )
    )


def cpu_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the CPU GEMM backend in force.

    Args:
        x: ``[..., in]``; weight: ``[out, in]``; bias: ``[out]`` or ``None`` (same dtype).
        packed: the caller's :class:`PackedWeight` for ``weight`` (used under
            ``onednn-packed``; without one the stored weight is used).

    Returns:
        ``[..., out]``. fp32 CPU inputs without autograd run oneDNN (fp32 accumulation, within
        fp32 rounding of ``F.linear``); anything else is ``F.linear``.
    """
    if not _uses_onednn(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows == 0:
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if torch.compiler.is_compiling():
        y = _onednn_linear_op(x2, weight, bias)
    else:
        if _BACKEND == "onednn-packed" and packed is not None:
            w = packed.get(weight)
        else:
            w = weight if weight.is_contiguous() else weight.contiguous()
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, w, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])
