"""LoRA wrappers around the :mod:`~sglang.multimodal_gen.layers.linear` family.

One generic forward for every parallel layer (ARCHITECTURE.md section 3). The wrapper reuses the
base layer's forward hooks instead of re-implementing them, so the LoRA path sees exactly the input
the base GEMM sees, the delta is added before the base layer's collective, and the bias policy and
``(output, output_bias)`` packaging are the base layer's::

    x_local = base.parallel_input(x)                       # Row(input_is_parallel=False): slice
    y_local = base.apply_gemm(x_local, base.gemm_bias())   # bias added once (Row: on rank 0)
    y_local += (x_local @ A_cat^T) @ B_cat^T              # fused compose of every active adapter
    y_local += offset   (on the rank that adds the bias)   # optional per-adapter constant term
    return base.package_output(base.reduce_output(y_local))

Subclasses only say how a full ``A`` ``[r, in]`` and ``B`` ``[out_of_shard, r]`` are cut to this
rank (:meth:`BaseLayerWithLoRA.slice_lora_a_weights`, :meth:`~BaseLayerWithLoRA.slice_lora_b_weights`),
driven by the base layer's shard map.

Fused compose: the active adapters ``i`` (strength ``s_i``, scale ``c_i``) on shards ``k`` become
``A_cat = [A_1k; A_2k; ...]`` ``[R, in_local]`` (R = sum of ranks) and a block matrix
``B_cat`` ``[out_local, R]`` whose block for (adapter i, shard k) holds ``s_i c_i B_ik`` at the
shard's local rows and zeros elsewhere (q/k/v or gate/up sections of unequal height compose
block-diagonally). N adapters cost one pair of GEMMs of rank ``R``.

Merge: ``W' = W + sum_i s_i c_i B_i A_i`` in fp32, rounded once to the weight dtype; the pre-merge
weight is kept as a snapshot and :meth:`~BaseLayerWithLoRA.unmerge` copies it back (never
subtracts), so unmerging is bit-exact. LoRA itself: Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models", eq. 3.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardId,
)
from sglang.multimodal_gen.layers.lora.weights import LoRAWeights, all_finite

__all__ = [
    "BaseLayerWithLoRA",
    "ColumnParallelLinearWithLoRA",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "ReplicatedLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "get_runtime_lora_scale",
    "release_merge_workspace",
    "replace_submodule",
    "runtime_lora_scale",
    "wrap_with_lora",
]

# ---------------------------------------------------------------------------- runtime scale
_RUNTIME_SCALE: float = 1.0


def get_runtime_lora_scale() -> float:
    """The multiplier currently applied to every active adapter's scale in forwards (default 1)."""
    return _RUNTIME_SCALE


@contextlib.contextmanager
def runtime_lora_scale(scale: float) -> Iterator[None]:
    """Multiply every active adapter's scale by ``scale`` for the forwards inside the block.

    Stored state (weights, composition, merged weights) is not touched. Nested blocks multiply.
    On a merged layer the forward adds ``(scale - 1) * delta`` on top of the merged weight, so the
    result is the same as in unmerged mode.

    Raises:
        ValueError: ``scale`` is not finite.
    """
    global _RUNTIME_SCALE
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"runtime_lora_scale: scale must be finite, got {scale}")
    previous = _RUNTIME_SCALE
    _RUNTIME_SCALE = previous * scale
    try:
        yield
    finally:
        _RUNTIME_SCALE = previous


# ---------------------------------------------------------------------------- helpers
_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def _merge_workspace(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A reusable fp32 buffer of ``shape`` (grow-only, one per device).

    Merges run one layer at a time (not thread-safe: one merging thread per process); reusing
    one buffer avoids allocating (and, on the CPU,
    page-faulting in) a fresh ``[out, in]`` fp32 tensor for every layer of every switch.
    """
    numel = math.prod(shape)
    buf = _WORKSPACE.get(device)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=torch.float32, device=device)
        _WORKSPACE[device] = buf
    return buf[:numel].view(shape)


def release_merge_workspace() -> None:
    """Free the fp32 merge buffers (they are re-created by the next merge)."""
    _WORKSPACE.clear()


@dataclass
class _LocalLoRA:
    """This rank's slices of one shard of one adapter (dtype as given, device of the weight)."""

    lora_A: torch.Tensor  # [r, in_local]
    lora_B: torch.Tensor  # [rows_local, r]
    scale: float
    offset: torch.Tensor | None  # [rows_local]
    row_start: int  # first local row of the base weight this shard covers
    rows: int  # number of local rows
    offset_scale: float = 1.0  # the offset's multiplier besides the strength

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])

    @property
    def nbytes(self) -> int:
        n = self.lora_A.numel() * self.lora_A.element_size()
        n += self.lora_B.numel() * self.lora_B.element_size()
        if self.offset is not None:
            n += self.offset.numel() * self.offset.element_size()
        return n


def _own(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous normal (non-inference) tensor on ``device`` that owns its storage."""
    with torch.inference_mode(False), torch.no_grad():
        out = t.detach().to(device=device)
        if out.data_ptr() == t.data_ptr() or not out.is_contiguous() or out.is_inference():
            out = out.clone(memory_format=torch.contiguous_format)
        return out


def _check_finite(t: torch.Tensor, what: str, module: str) -> None:
    if not all_finite(t):
        raise ValueError(f"LoRA {what} for module {module!r} contains NaN or Inf")


# ---------------------------------------------------------------------------- base wrapper
class BaseLayerWithLoRA(nn.Module):
    """A :class:`ParallelLinear` plus any number of LoRA adapters, merged or not.

    Args:
        base_layer: the layer to wrap; its ``weight`` is modified in place by :meth:`merge`.
        snapshot_device: where :meth:`merge` keeps the pre-merge weight (default: the weight's
            device; ``"cpu"`` trades unmerge speed for accelerator memory).

    Attributes:
        base_layer: the wrapped layer.
        prefix: the module's dotted name (from the base layer), used in error messages.

    Forward: ``x`` ``[..., in]`` (``[..., in_local]`` for a row-parallel layer with
    ``input_is_parallel=True``) -> ``(output, output_bias)`` exactly like the base layer.
    With nothing active, or everything merged (and no offsets, runtime scale 1), the forward is
    ``base_layer(x)`` itself: bit-identical.
    """

    def __init__(
        self, base_layer: ParallelLinear, snapshot_device: torch.device | str | None = None
    ):
        super().__init__()
        if not isinstance(base_layer, ParallelLinear):
            raise TypeError(
                f"BaseLayerWithLoRA wraps a ParallelLinear, got {type(base_layer).__name__}"
            )
        self.base_layer = base_layer
        self.prefix = base_layer.prefix
        self.snapshot_device = None if snapshot_device is None else torch.device(snapshot_device)
        self._adapters: dict[str, dict[ShardId, _LocalLoRA]] = {}
        self._composition: list[tuple[str, float]] = []
        # compiled state of the active composition: built on first use by an unmerged forward
        # (_ensure_compiled), so switches in merge mode never pay for it
        self._any_active = False  # some active adapter has a non-zero strength here
        self._any_offset = False  # ... and one of them carries an output offset
        self._dirty = False
        self._a_cat: torch.Tensor | None = None  # [R, in_local], weight dtype
        self._b_cat: torch.Tensor | None = None  # [out_local, R], weight dtype, scales folded in
        self._offset: torch.Tensor | None = None  # [out_local], weight dtype, scales folded in
        self._snapshot: torch.Tensor | None = None  # pre-merge weight while merged
        self._merged = False

    # ------------------------------------------------------------------ slicing hooks
    def slice_lora_a_weights(self, lora_a: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
        """Full ``A`` ``[r, in]`` -> this rank's ``[r, in_local]``. Default: whole."""
        return lora_a

    def slice_lora_b_weights(self, lora_b: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
        """Full ``B`` ``[rows_of_shard, r]`` (or an offset ``[rows_of_shard]``) -> this rank's rows.

        Default: whole (the output dim is not split).
        """
        return lora_b

    def __getattr__(self, name: str):
        # attributes of the base layer (``q_size``, ``tp_rank``, ``shard_map``...) read through
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if modules is None or "base_layer" not in modules or name.startswith("_"):
                raise
            return getattr(modules["base_layer"], name)

    # ------------------------------------------------------------------ properties
    @property
    def weight(self) -> torch.Tensor:
        """The base layer's (possibly merged) local weight ``[out_local, in_local]``."""
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def adapter_names(self) -> list[str]:
        """Names of the adapters stored on this layer (active or not)."""
        return list(self._adapters)

    @property
    def active_composition(self) -> list[tuple[str, float]]:
        """``[(name, strength), ...]`` as last given to :meth:`set_active` (present names only)."""
        return list(self._composition)

    @property
    def active(self) -> bool:
        """Whether an adapter contributes to the output (in either mode)."""
        return self._any_active

    @property
    def merged(self) -> bool:
        """Whether the active composition is merged into ``base_layer.weight``."""
        return self._merged

    @property
    def can_merge(self) -> bool:
        """Whether :meth:`merge` is possible: a floating-point weight of a plain tensor type."""
        w = self.base_layer.weight
        return (
            w.dtype.is_floating_point
            and type(w) in (torch.Tensor, nn.Parameter)
            and not getattr(self.base_layer, "lora_merge_unsupported", False)
        )

    def has_offsets(self, names: Sequence[str]) -> bool:
        """Whether any of the stored adapters ``names`` carries an output offset on this layer."""
        return any(w.offset is not None for n in names for w in self._adapters.get(n, {}).values())

    def adapter_nbytes(self, name: str) -> int:
        """Bytes this rank stores for adapter ``name`` (0 if absent)."""
        return sum(w.nbytes for w in self._adapters.get(name, {}).values())

    # ------------------------------------------------------------------ adapters
    def _rows_of(self, shard_id: ShardId) -> tuple[int, int, int]:
        """``(full_rows, local_start, local_rows)`` a LoRA keyed by ``shard_id`` covers."""
        base = self.base_layer
        if shard_id is None and len(base.shard_map) > 1:
            return base.output_size, 0, base.output_size_per_partition
        spec = base.shard_spec(shard_id)
        return spec.full_size, spec.local_offset, spec.local_size

    def _validate(self, name: str, shard_id: ShardId, w: LoRAWeights) -> None:
        module = self.prefix or type(self.base_layer).__name__
        where = f"adapter {name!r}, module {module!r}, shard {shard_id!r}"
        try:
            full_rows, _, _ = self._rows_of(shard_id)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        a, b = w.lora_A, w.lora_B
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            raise ValueError(f"{where}: lora_A and lora_B must be tensors")
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(
                f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} must both be 2-D"
            )
        r = a.shape[0]
        if (r == 0 or b.shape[1] == 0) and w.offset is None:
            raise ValueError(f"{where}: rank 0 (lora_A {list(a.shape)}, lora_B {list(b.shape)})")
        expected_a = [r, self.base_layer.input_size]
        expected_b = [full_rows, r]
        if list(a.shape) != expected_a or list(b.shape) != expected_b:
            raise ValueError(
                f"{where}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the layer; "
                f"expected lora_A {expected_a} and lora_B {expected_b}"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise ValueError(
                f"{where}: lora_A/lora_B must be floating point ({a.dtype}, {b.dtype})"
            )
        for what, scale in (("scale", w.scale), ("offset_scale", w.effective_offset_scale)):
            if not math.isfinite(float(scale)):
                raise ValueError(f"{where}: {what} {float(scale)} is not finite")
        _check_finite(a, "lora_A", f"{module}[{shard_id!r}] of {name!r}")
        _check_finite(b, "lora_B", f"{module}[{shard_id!r}] of {name!r}")
        if w.offset is not None:
            if list(w.offset.shape) != [full_rows]:
                raise ValueError(
                    f"{where}: offset {list(w.offset.shape)} does not fit; expected [{full_rows}]"
                )
            _check_finite(w.offset, "offset", f"{module}[{shard_id!r}] of {name!r}")

    def add_adapter(self, name: str, weights: Mapping[ShardId, LoRAWeights]) -> None:
        """Store this rank's slices of adapter ``name`` (replacing one of the same name).

        Args:
            name: adapter name.
            weights: ``{shard_id: LoRAWeights}`` in the full logical layout: ``shard_id`` is
                ``None`` for the whole layer (for a fused layer: ``B`` covers the fused output,
                ``[q|k|v]`` or ``[gate|up]``), ``"q"|"k"|"v"`` for QKV, or ``0, 1, ...`` for merged
                columns. ``lora_A`` ``[r, in]``, ``lora_B`` ``[rows, r]``, ``offset`` ``[rows]``;
                any float dtype (kept as given; compute uses the weight's dtype).

        Raises:
            ValueError: empty ``weights``, unknown shard id, rank 0, shapes that do not fit (the
                message names the module and both shapes), NaN/Inf in ``A``, ``B`` or ``offset``.
                Nothing is stored on error.
        """
        if not weights:
            raise ValueError(f"adapter {name!r} has no weights for module {self.prefix!r}")
        for shard_id, w in weights.items():
            self._validate(name, shard_id, w)
        device = self.base_layer.weight.device
        local: dict[ShardId, _LocalLoRA] = {}
        for shard_id, w in weights.items():
            _, start, rows = self._rows_of(shard_id)
            a = _own(self.slice_lora_a_weights(w.lora_A, shard_id), device)
            b = _own(self.slice_lora_b_weights(w.lora_B, shard_id), device)
            off = None
            if w.offset is not None:
                off = _own(self.slice_lora_b_weights(w.offset, shard_id), device)
            local[shard_id] = _LocalLoRA(
                a, b, float(w.scale), off, start, rows, w.effective_offset_scale
            )
        self._adapters[name] = local
        if any(n == name for n, _ in self._composition):
            self._refresh()

    def remove_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (a no-op if absent); if it was active, it is deactivated."""
        if self._adapters.pop(name, None) is None:
            return
        if any(n == name for n, _ in self._composition):
            self._composition = [(n, s) for n, s in self._composition if n != name]
            self._refresh()

    def set_active(
        self, composition: Sequence[tuple[str, float]], cached: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Make ``composition`` ``[(name, strength), ...]`` the active adapters.

        Effective scale of adapter ``i`` = ``strength_i * LoRAWeights.scale``. Names not stored on
        this layer are ignored (an adapter need not touch every module). An empty composition
        disables LoRA. An unmerged layer stays unmerged; a merged layer is re-merged with the new
        composition from its snapshot (``cached``: the merged weight of the new composition, as
        for :meth:`merge`), or unmerged when the composition is empty.

        Returns:
            The new merged local weight when the layer was re-merged (as :meth:`merge`), else None.

        Raises:
            ValueError: a strength that is not finite (nothing changes); errors of :meth:`merge`.
        """
        comp = []
        for name, strength in composition:
            strength = float(strength)
            if not math.isfinite(strength):
                raise ValueError(f"strength {strength} for adapter {name!r} is not finite")
            if name in self._adapters:
                comp.append((name, strength))
        self._composition = comp
        return self._refresh(cached)

    def _refresh(self, cached: torch.Tensor | None = None) -> torch.Tensor | None:
        self._rebuild()
        if self._merged:
            if not self._any_active:
                self.unmerge()
            else:
                return self.merge(cached=cached)
        return None

    def _entries(self) -> list[tuple[float, float, _LocalLoRA]]:
        """``(strength * scale, strength * offset_scale, local weights)`` of every active shard,
        strength 0 skipped."""
        out = []
        for name, strength in self._composition:
            if strength == 0.0:
                continue
            for w in self._adapters[name].values():
                out.append((strength * w.scale, strength * w.offset_scale, w))
        return out

    def _rebuild(self) -> None:
        """Note that the active composition changed; the compiled form is rebuilt when needed."""
        entries = self._entries()
        self._any_active = bool(entries)
        self._any_offset = any(w.offset is not None for _, _, w in entries)
        self._a_cat = self._b_cat = self._offset = None
        self._dirty = self._any_active

    def compiled_lora(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The fused form of the active composition: ``(A_cat [R, in_local], B_cat [out_local, R]
        with strength * scale folded in, offset sum [out_local])``, weight dtype; ``None`` parts
        when nothing is active / no offsets. Built on first use after a change."""
        self._ensure_compiled()
        return self._a_cat, self._b_cat, self._offset

    def _ensure_compiled(self) -> None:
        """Compile the active composition into ``A_cat``, block ``B_cat`` and the offset sum."""
        if not self._dirty:
            return
        self._dirty = False
        entries = self._entries()
        weight = self.base_layer.weight
        dtype, device = weight.dtype, weight.device
        out_local, in_local = weight.shape
        if not entries:
            self._a_cat = self._b_cat = self._offset = None
            return
        with torch.inference_mode(False), torch.no_grad():
            total_r = sum(w.rank for _, _, w in entries)
            a_cat = torch.empty(total_r, in_local, dtype=dtype, device=device)
            b_cat = torch.zeros(out_local, total_r, dtype=dtype, device=device)
            offset = None
            col = 0
            for eff, eff_offset, w in entries:
                a_cat[col : col + w.rank].copy_(w.lora_A)
                b_cat[w.row_start : w.row_start + w.rows, col : col + w.rank].copy_(
                    w.lora_B.float() * eff
                )
                col += w.rank
                if w.offset is not None:
                    if offset is None:
                        offset = torch.zeros(out_local, dtype=torch.float32, device=device)
                    offset[w.row_start : w.row_start + w.rows] += w.offset.float() * eff_offset
        # bias deltas alone (rank 0) leave no GEMM to run
        self._a_cat, self._b_cat = (a_cat, b_cat) if total_r else (None, None)
        self._offset = None if offset is None else offset.to(dtype)

    # ------------------------------------------------------------------ merge
    def _merged_weight(self, base: torch.Tensor) -> torch.Tensor:
        """``base + sum_i s_i c_i B_i A_i`` accumulated in one fp32 buffer, rounded once.

        One fp32 ``[out_local, in_local]`` buffer and the rounded result are the only large
        allocations (the pairs are accumulated in place with ``addmm_``).
        """
        acc = _merge_workspace(base.shape, base.device)
        acc.copy_(base)
        for eff, _, w in self._entries():
            if not w.rank:
                continue
            rows = acc[w.row_start : w.row_start + w.rows]
            rows.addmm_(w.lora_B.float(), w.lora_A.float(), alpha=eff)
        return acc.to(base.dtype, copy=True)  # never hand out the workspace itself

    def _write_weight(self, value: torch.Tensor) -> None:
        # inference_mode allows in-place updates of both inference and normal tensors
        with torch.inference_mode():
            self.base_layer.weight.copy_(value)

    def merge(self, cached: torch.Tensor | None = None, safe: bool = False) -> torch.Tensor:
        """Merge the active composition into ``base_layer.weight``.

        ``W' = W + sum_i strength_i * scale_i * B_i @ A_i``, computed in fp32 from the stored
        (unrounded) A/B and rounded once to the weight dtype. The pre-merge weight is kept so
        :meth:`unmerge` restores it bit-exactly. Offsets are not merged (the forward adds them).

        Args:
            cached: a merged local weight ``[out_local, in_local]`` previously returned by this
                method for the same composition; it is copied in instead of recomputed.
            safe: check the merged weight for NaN/Inf before writing it.

        Returns:
            The merged local weight (a new tensor, not the parameter; safe to cache).

        Raises:
            ValueError: the layer cannot merge (names the module and the reason), ``cached`` has
                the wrong shape/dtype, or ``safe`` and the result is not finite (the weight is
                left unchanged).
        """
        module = self.prefix or type(self.base_layer).__name__
        if not self.can_merge:
            raise ValueError(
                f"module {module!r} cannot merge LoRA weights "
                f"(weight dtype {self.base_layer.weight.dtype}, type {type(self.base_layer.weight).__name__})"
            )
        weight = self.base_layer.weight
        if cached is not None and (cached.shape != weight.shape or cached.dtype != weight.dtype):
            raise ValueError(
                f"module {module!r}: cached merged weight {list(cached.shape)} {cached.dtype} does "
                f"not match the weight {list(weight.shape)} {weight.dtype}"
            )
        if cached is None and not self._any_active:
            if self._merged:
                self.unmerge()
            with torch.inference_mode(False), torch.no_grad():
                return weight.detach().clone()
        with torch.inference_mode(False), torch.no_grad():
            if cached is None:
                # already merged: the snapshot is the base (no unmerge copy needed)
                base = self._snapshot.to(weight.device) if self._merged else weight
                merged = self._merged_weight(base)
            else:
                merged = cached.to(weight.device)
            if safe and not all_finite(merged):
                raise ValueError(
                    f"module {module!r}: merged weight contains NaN or Inf; not merged"
                )
            if not self._merged:
                device = self.snapshot_device or weight.device
                self._snapshot = weight.detach().to(device, copy=True)
        self._write_weight(merged)
        self._merged = True
        return merged

    def unmerge(self) -> None:
        """Restore the pre-merge weight bit-exactly (copy of the snapshot). No-op if not merged."""
        if not self._merged:
            return
        self._write_weight(self._snapshot)
        self._snapshot = None
        self._merged = False

    def commit_as_base(self) -> None:
        """Make the current composition part of the base weight.

        Merges the active composition if it is not merged yet, then drops the snapshot: the merged
        weight is the new base that :meth:`unmerge` restores, and the composition is cleared (its
        delta is in the weight now; adapters stay stored). Offsets of the committed adapters are
        folded into the bias when the layer has one, else :class:`ValueError`.
        No-op when nothing is active.

        Raises:
            ValueError: as :meth:`merge`; or the composition has offsets and the layer no bias.
        """
        if not self.active:
            return
        self._ensure_compiled()
        if self._offset is not None and self.base_layer.bias is None:
            raise ValueError(
                f"module {self.prefix!r}: cannot commit LoRA output offsets to a layer without bias"
            )
        if not self._merged:
            self.merge()
        if self._offset is not None:
            bias = self.base_layer.bias
            with torch.inference_mode():
                # every rank keeps its rows; Row layers add the bias once, like the offset
                bias.copy_((bias.float() + self._offset.float()).to(bias.dtype))
        self._snapshot = None
        self._merged = False
        self._composition = []
        self._rebuild()

    # ------------------------------------------------------------------ forward
    def _adds_offset_here(self) -> bool:
        base = self.base_layer
        return base._bias_on_this_rank()  # Row: only the rank that adds the bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as ``base_layer.forward``: ``x`` -> ``(output, output_bias)``."""
        if not self._any_active:
            return self.base_layer(x)
        s = _RUNTIME_SCALE
        coef = s - 1.0 if self._merged else s
        if self._merged and coef == 0.0 and not self._any_offset:
            return self.base_layer(x)
        self._ensure_compiled()
        base = self.base_layer
        x_local = base.parallel_input(x)
        y = base.apply_gemm(x_local, base.gemm_bias())
        if self._a_cat is not None and coef != 0.0:
            h = F.linear(x_local, self._a_cat)  # [..., R]
            y2 = y.view(-1, y.shape[-1])
            y2.addmm_(h.view(-1, h.shape[-1]), self._b_cat.t(), alpha=coef)
        if self._offset is not None and s != 0.0 and self._adds_offset_here():
            y.add_(self._offset, alpha=s)
        return base.package_output(base.reduce_output(y))

    def extra_repr(self) -> str:
        return f"adapters={self.adapter_names}, active={self._composition}, merged={self._merged}"


# ---------------------------------------------------------------------------- subclasses
class ReplicatedLinearWithLoRA(BaseLayerWithLoRA):
    """Nothing is split: ``A`` and ``B`` are used whole."""


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):
    """The output dim is split: ``A`` whole, ``B`` cut to this rank's rows by the shard map."""

    def slice_lora_b_weights(self, lora_b, shard_id):
        return self.base_layer.shard_output_tensor(lora_b, shard_id)


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """gate/up sections: ``B`` of shard ``i`` (or of the fused ``[gate|up]``) cut per section."""


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """q/k/v sections (GQA aware through the shard map): ``B`` of ``"q"|"k"|"v"`` or fused."""


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):
    """The input dim is split: ``A`` cut to this rank's columns, ``B`` whole; the partial deltas
    are summed by the base layer's all-reduce together with the partial base outputs."""

    def slice_lora_a_weights(self, lora_a, shard_id):
        return self.base_layer.shard_input_tensor(lora_a, dim=-1)


# most specific first: the first isinstance match wins
_WRAPPER_TABLE: tuple[tuple[type[ParallelLinear], type[BaseLayerWithLoRA]], ...] = (
    (QKVParallelLinear, QKVParallelLinearWithLoRA),
    (MergedColumnParallelLinear, MergedColumnParallelLinearWithLoRA),
    (ColumnParallelLinear, ColumnParallelLinearWithLoRA),
    (RowParallelLinear, RowParallelLinearWithLoRA),
    (ReplicatedLinear, ReplicatedLinearWithLoRA),
)


def wrap_with_lora(layer: nn.Module, **kwargs) -> BaseLayerWithLoRA:
    """Wrap a parallel linear layer in its LoRA class (an already wrapped layer is returned as is).

    Args:
        layer: a :class:`ParallelLinear` subclass instance.
        kwargs: passed to the wrapper (``snapshot_device``).

    Raises:
        TypeError: ``layer`` is not a known :class:`ParallelLinear` type.
    """
    if isinstance(layer, BaseLayerWithLoRA):
        return layer
    for base_type, wrapper in _WRAPPER_TABLE:
        if isinstance(layer, base_type):
            return wrapper(layer, **kwargs)
    raise TypeError(f"no LoRA wrapper for {type(layer).__name__} ({getattr(layer, 'prefix', '')})")


def replace_submodule(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Replace the submodule at dotted ``name`` of ``model`` by ``new``; returns ``new``.

    Raises:
        ValueError: ``name`` is empty or does not name an existing submodule.
    """
    if not name:
        raise ValueError("replace_submodule: empty module name")
    parent_name, _, leaf = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
    except AttributeError as e:
        raise ValueError(f"replace_submodule: no submodule {parent_name!r} ({e})") from None
    if leaf not in parent._modules:
        raise ValueError(f"replace_submodule: {type(parent).__name__} has no child {leaf!r}")
    parent._modules[leaf] = new
    return new
