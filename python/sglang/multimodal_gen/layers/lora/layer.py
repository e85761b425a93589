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

Subclasses (``wrappers.py``) only say how a full ``A`` and ``B`` are cut to this rank; the
arithmetic (fused compose, chunked fp32 merge) is in ``compute.py``. Merge keeps the pre-merge
weight as a snapshot that unmerge puts back (never subtracts: bit-exact); the parameter is
re-pointed rather than written (``swap_storage``). A request overlay runs another composition on a
merged layer as ``merged + (request - merged)``. Rows of one batch with different compositions
run through the same forward with per-row coefficients (``rows.py``). LoRA: Hu et al. 2021, eq. 3.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from sglang.multimodal_gen.layers.batch_invariant import (
    addmm_rows_invariant_,
    linear_rows_invariant,
)
from sglang.multimodal_gen.layers.linear import ParallelLinear, ShardId
from sglang.multimodal_gen.layers.lora import compute as _compute
from sglang.multimodal_gen.layers.lora.compute import (
    Entry,
    LocalLoRA,
    compile_entries,
    get_runtime_lora_scale,
    merged_weight,
)
from sglang.multimodal_gen.layers.lora.rows import RowPlan, current_row_plan, row_delta
from sglang.multimodal_gen.layers.lora.weights import LoRAWeights, all_finite, check_weights, own

__all__ = ["BaseLayerWithLoRA"]


class BaseLayerWithLoRA(nn.Module):
    """A :class:`ParallelLinear` plus any number of LoRA adapters, merged or not.

    Args:
        base_layer: the layer to wrap; :meth:`merge` changes its ``weight``.
        snapshot_device: where :meth:`merge` keeps the pre-merge weight (default: the weight's
            device; ``"cpu"`` trades unmerge speed for accelerator memory).

    Attributes:
        base_layer: the wrapped layer.
        prefix: the module's dotted name (from the base layer), used in error messages.

    Forward: ``x`` ``[..., in]`` (``[..., in_local]`` row-parallel with ``input_is_parallel``) ->
    ``(output, output_bias)`` like the base layer; ``base_layer(x)`` itself (bit-identical) with
    nothing active, or everything merged without offsets at runtime scale 1.
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
        self._adapters: dict[str, dict[ShardId, LocalLoRA]] = {}
        self._composition: list[tuple[str, float]] = []
        # compiled active composition: built by the first unmerged forward (_ensure_compiled)
        self._any_active = False  # some active adapter has a non-zero strength here
        self._any_offset = False  # ... and one of them carries an output offset
        self._dirty = False
        self._a_cat: torch.Tensor | None = None  # [R, in_local], weight dtype
        self._b_cat: torch.Tensor | None = None  # [out_local, R], weight dtype, scales folded in
        self._offset: torch.Tensor | None = None  # [out_local], weight dtype, scales folded in
        self._snapshot: torch.Tensor | None = None  # pre-merge weight while merged
        self._merged = False
        self._overlay: list[tuple[str, float]] | None = None  # request composition (merged only)
        self._ov: tuple | None = (None, None, None)  # its compiled difference to the active one
        self._ov_entries: list = []  # that difference, compiled on first use (weights' device)
        # the union form of the last row plan (rows.py); dropped when the stored adapters change
        self._rows_cache = None  # rows._Union of the last mixed batch
        self.merges = 0  # merges done (computed or from a cached tensor); tests and stats
        # False: merge/unmerge copy into the parameter's storage instead of re-pointing it, for
        # owners that keep a reference to that storage (DiTOffloader)
        self.swap_storage = True

    # ------------------------------------------------------------------ slicing hooks
    def slice_lora_a_weights(self, lora_a: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
        """Full ``A`` ``[r, in]`` -> this rank's ``[r, in_local]``. Default: whole."""
        return lora_a

    def slice_lora_b_weights(self, lora_b: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
        """Full ``B`` ``[rows_of_shard, r]`` (or an offset) -> this rank's rows. Default: whole."""
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
        """Whether an adapter of the active composition contributes to the output (merged or
        not; a request overlay is not counted)."""
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
        check_weights(
            w, full_rows, self.base_layer.input_size, where, f"{module}[{shard_id!r}] of {name!r}"
        )

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
        local: dict[ShardId, LocalLoRA] = {}
        for shard_id, w in weights.items():
            _, start, rows = self._rows_of(shard_id)
            a = own(self.slice_lora_a_weights(w.lora_A, shard_id), device)
            b = own(self.slice_lora_b_weights(w.lora_B, shard_id), device)
            off = None
            if w.offset is not None:
                off = own(self.slice_lora_b_weights(w.offset, shard_id), device)
            local[shard_id] = LocalLoRA(
                a, b, float(w.scale), off, start, rows, w.effective_offset_scale
            )
        self._adapters[name] = local
        self._rows_cache = None
        if any(n == name for n, _ in self._composition):
            self._refresh()

    def remove_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (a no-op if absent); if it was active, it is deactivated."""
        if self._adapters.pop(name, None) is None:
            return
        self._rows_cache = None  # it holds a copy of the adapter's weights
        if self._overlay is not None and any(n == name for n, _ in self._overlay):
            self._drop_overlay()
        if any(n == name for n, _ in self._composition):
            self._composition = [(n, s) for n, s in self._composition if n != name]
            self._refresh()

    def set_active(
        self, composition: Sequence[tuple[str, float]], cached: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Make ``composition`` ``[(name, strength), ...]`` the active adapters (effective scale
        ``strength * LoRAWeights.scale``; names not stored here are ignored; empty: LoRA off).

        An unmerged layer stays unmerged; a merged one is re-merged from its snapshot (``cached``
        as for :meth:`merge`), or unmerged when the composition is empty. A request overlay is
        cleared.

        Returns:
            The new merged local weight when the layer was re-merged, else None.

        Raises:
            ValueError: a strength that is not finite (nothing changes); errors of :meth:`merge`.
        """
        comp = self._present(composition)
        self._drop_overlay()
        self._composition = comp
        return self._refresh(cached)

    def _present(self, composition: Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
        comp = []
        for name, strength in composition:
            strength = float(strength)
            if not math.isfinite(strength):
                raise ValueError(f"strength {strength} for adapter {name!r} is not finite")
            if name in self._adapters:
                comp.append((name, strength))
        return comp

    def _refresh(self, cached: torch.Tensor | None = None) -> torch.Tensor | None:
        self._rebuild()
        if self._merged:
            if not self._any_active:
                self.unmerge()
            else:
                return self.merge(cached=cached)
        return None

    def _entries(self, composition: Sequence[tuple[str, float]] | None = None) -> list[Entry]:
        """``(strength * scale, strength * offset_scale, local weights)`` of every shard of
        ``composition`` (default: the active one), strength 0 skipped."""
        out = []
        for name, strength in self._composition if composition is None else composition:
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
        self._a_cat, self._b_cat, self._offset = compile_entries(
            self._entries(), self.base_layer.weight
        )

    # ------------------------------------------------------------------ request overlay
    @property
    def overlay(self) -> list[tuple[str, float]] | None:
        """The request composition run on top of a merged layer (:meth:`set_overlay`), or None."""
        return None if self._overlay is None else list(self._overlay)

    def set_overlay(self, composition: Sequence[tuple[str, float]]) -> None:
        """Run ``composition`` for the next forwards without touching the (merged) weight.

        The forward adds the difference ``delta(composition) - delta(active)`` as one fused
        low-rank term (the active composition's adapters with negated strengths), so a
        per-request composition on a merged layer costs no merge and no weight copy;
        :meth:`clear_overlay` ends it. On an unmerged layer use :meth:`set_active` instead.

        Raises:
            ValueError: the layer is not merged, or a strength is not finite.
        """
        if not self._merged:
            raise ValueError(f"module {self.prefix!r}: an overlay needs a merged layer")
        comp = self._present(composition)
        diff: dict[str, float] = dict(comp)
        for name, strength in self._composition:
            diff[name] = diff.get(name, 0.0) - strength
        self._overlay = comp
        # compiled in the forward, where the weights are on the execution device (with DiT
        # offload the overlay is set while they are parked in host memory)
        self._ov_entries = self._entries([(n, s) for n, s in diff.items() if s != 0.0])
        self._ov = None

    def clear_overlay(self) -> None:
        """End the overlay of :meth:`set_overlay` (a no-op without one)."""
        self._drop_overlay()

    def _drop_overlay(self) -> None:
        self._overlay = None
        self._ov, self._ov_entries = (None, None, None), []

    # ------------------------------------------------------------------ merge
    def _can_swap(self, value: torch.Tensor) -> bool:
        """Whether the parameter can be pointed at ``value`` (same device and inference-ness)."""
        w = self.base_layer.weight
        same = value.device == w.device and value.is_inference() == w.is_inference()
        return self.swap_storage and same

    def _set_weight(self, value: torch.Tensor) -> None:
        """Point the parameter at ``value``'s storage when :meth:`_can_swap` (no copy; ``value``
        must not be written by anyone afterwards: merged weights are only ever swapped in), else
        copy ``value`` into the parameter's own storage."""
        if self._can_swap(value):
            with torch.no_grad():
                self.base_layer.weight.data = value
        else:
            with torch.inference_mode():  # in-place updates of inference and normal tensors
                self.base_layer.weight.copy_(value)

    def merge(self, cached: torch.Tensor | None = None, safe: bool = False) -> torch.Tensor:
        """Merge the active composition: ``W' = W + sum_i strength_i * scale_i * B_i @ A_i``.

        Computed in fp32 from the stored A/B, rounded once (:func:`compute.merged_weight`, chunked),
        or ``cached`` (a tensor this method returned for the same composition) is used as is. The
        parameter is pointed at the result (copied in instead when :meth:`_can_swap` says no); the
        pre-merge weight stays as the snapshot :meth:`unmerge` restores bit-exactly (the base's own
        storage on the weight's device, else a copy on ``snapshot_device``). Offsets are not
        merged; a request overlay is cleared. ``safe``: refuse a non-finite result.

        Returns:
            The merged local weight ``[out_local, in_local]`` (safe to cache, never to write into).

        Raises:
            ValueError: the layer cannot merge, ``cached`` does not match the weight, or ``safe``
                and the result is not finite (the weight is left unchanged).
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
        self._drop_overlay()
        if cached is None and not self._any_active:
            if self._merged:
                self.unmerge()
            with torch.inference_mode(False), torch.no_grad():
                return weight.detach().clone()
        with torch.inference_mode(False), torch.no_grad():
            if cached is None:
                # already merged: the snapshot is the base (no unmerge copy needed)
                base = self._snapshot.to(weight.device) if self._merged else weight.detach()
                merged = merged_weight(base, self._entries(), _compute.MERGE_CHUNK_BYTES)
                del base
            else:
                merged = cached.to(weight.device)
            if safe and not all_finite(merged):
                raise ValueError(
                    f"module {module!r}: merged weight contains NaN or Inf; not merged"
                )
            if not self._merged:
                device = self.snapshot_device or weight.device
                old = weight.detach()
                keep = old.device == device and self._can_swap(merged)
                self._snapshot = old if keep else old.to(device, copy=True)
        self._set_weight(merged)
        self._merged = True
        self.merges += 1
        return merged

    def unmerge(self) -> None:
        """Restore the pre-merge weight bit-exactly (its storage, or a copy from the snapshot
        device). No-op if not merged. A request overlay is cleared."""
        self._drop_overlay()
        if not self._merged:
            return
        weight = self.base_layer.weight
        snap = self._snapshot
        if snap.device != weight.device:
            with torch.inference_mode(False), torch.no_grad():
                snap = snap.to(weight.device)
        self._set_weight(snap)
        self._snapshot = None
        self._merged = False

    def commit_as_base(self) -> None:
        """Make the current composition part of the base weight: merge it if needed, drop the
        snapshot (the merged weight is the new base :meth:`unmerge` restores), clear the
        composition (adapters stay stored) and fold its offsets into the bias. No-op when nothing
        is active.

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
        weight = self.base_layer.weight
        if self._can_swap(weight):
            with torch.inference_mode(weight.is_inference()), torch.no_grad():
                # the merged tensor may be shared with the merge cache: the base owns a copy
                self._set_weight(weight.detach().clone())
        self._snapshot = None
        self._merged = False
        self._composition = []
        self._rebuild()

    # ------------------------------------------------------------------ forward
    def _adds_offset_here(self) -> bool:
        base = self.base_layer
        return base._bias_on_this_rank()  # Row: only the rank that adds the bias

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as ``base_layer.forward``: ``x`` -> ``(output, output_bias)``.

        Terms added to the base GEMM, with ``s`` the runtime scale: unmerged,
        ``s * delta(active)``; merged, ``(s - 1) * delta(active)``; with a request overlay also
        ``s * (delta(request) - delta(active))``; offsets at ``s`` (never merged).
        """
        plan = current_row_plan()
        if plan is not None and self._adapters and any(r is not None for r in plan.rows):
            return self._forward_rows(x, plan)
        overlay = self._overlay is not None
        if not self._any_active and not overlay:
            return self.base_layer(x)
        s = get_runtime_lora_scale()
        coef = s - 1.0 if self._merged else s
        if self._merged and coef == 0.0 and not self._any_offset and not overlay:
            return self.base_layer(x)
        self._ensure_compiled()
        base = self.base_layer
        x_local = base.parallel_input(x)
        y = base.apply_gemm(x_local, base.gemm_bias())
        y2 = y.view(-1, y.shape[-1])
        terms = [(self._a_cat, self._b_cat, coef)]
        if self._ov is None:
            self._ov = compile_entries(self._ov_entries, self.base_layer.weight)
        ov_a, ov_b, ov_offset = self._ov
        if overlay:
            terms.append((ov_a, ov_b, s))
        for a_cat, b_cat, c in terms:
            if a_cat is not None and c != 0.0:
                h = linear_rows_invariant(x_local, a_cat)  # [..., R]
                addmm_rows_invariant_(y2, h.view(-1, h.shape[-1]), b_cat.t(), alpha=c)
        if s != 0.0 and self._adds_offset_here():
            for off in (self._offset, ov_offset if overlay else None):
                if off is not None:
                    y.add_(off, alpha=s)
        return base.package_output(base.reduce_output(y))

    def _forward_rows(
        self, x: torch.Tensor, plan: RowPlan
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward with per-row compositions (:mod:`.rows`): one base GEMM, one LoRA GEMM
        pair over the union of the rows' adapters with per-row coefficients."""
        base = self.base_layer
        x_local = base.parallel_input(x)
        y = base.apply_gemm(x_local, base.gemm_bias())
        row_delta(self, plan, x_local, y, get_runtime_lora_scale())
        return base.package_output(base.reduce_output(y))

    def drop_row_cache(self) -> None:
        """Free the union form compiled for the last mixed-composition batch (``rows.py``); the
        next one compiles it again."""
        self._rows_cache = None

    def extra_repr(self) -> str:
        return (
            f"adapters={self.adapter_names}, active={self._composition}, merged={self._merged}, "
            f"overlay={self._overlay}"
        )
