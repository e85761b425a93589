"""LoRA wrappers around the :mod:`~sglang.multimodal_gen.layers.linear` family: one forward.

The wrapper reuses the base layer's forward hooks instead of re-implementing them, so the LoRA
path sees exactly the input the base GEMM sees, the delta is added before the base layer's
collective, and the bias policy and ``(output, output_bias)`` packaging are the base layer's::

    x_local = base.parallel_input(x)                         # Row(input_is_parallel=False): slice
    for each group of rows with one composition:
        y[rows] = base.apply_gemm(x_local[rows], base.gemm_bias(), W)
        y[rows] += delta(composition)                        # compute.add_lora_delta
    return base.package_output(base.reduce_output(y))        # ONE collective for every group

``W`` is the merged weight for the rows whose composition is the merged one (no LoRA term), and
the exact base weight (the pre-merge snapshot when merged: a merged delta is never subtracted
back) for every other row. Which composition each row uses comes from the target's
:class:`~sglang.multimodal_gen.layers.lora.composition.LoRAContext` (``layer.lora_context``):
``None`` means every row uses the layer's active (global) composition. A row never computes with
another row's adapters.

Adapters are stored in slot tensors (``slots.py``); subclasses (``wrappers.py``) only say how a
full ``A`` and ``B`` are cut to this rank. Merge keeps the pre-merge weight as a snapshot that
unmerge puts back (never subtracts: bit-exact); the parameter is re-pointed rather than written
(``swap_storage``). LoRA: Hu et al. 2021, eq. 3.

Under ``torch.compile`` the forward is another, traceable path (:meth:`BaseLayerWithLoRA.
_forward_traced`) that reads only tensors whose shapes do not depend on the compositions: the
context's :class:`~sglang.multimodal_gen.layers.lora.row_strengths.RowStrengths` (the mapping, one
row of slot strengths per input row) and the layer's own plan ``[3, S]`` (which slots hold an
adapter here, the active strengths, the merged strengths), both rewritten in place outside the
graph when they change. Every row runs the current weight (merged or not) plus the delta of
``row strengths - merged strengths`` over all ``S`` slots::

    y = x W^T + bias + delta(coef) + offsets(own)
    own[i, s] = strength(row i, s) * stored(s),    coef = own - merged(s)

so setting, unsetting or switching adapters, strengths, merges and per-row compositions change
tensor values only: a compiled block does not recompile. Its rows that do not use the merged
composition get the merged delta subtracted back (the eager path uses the pre-merge weight
instead): equal to the eager output to rounding, not bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

import sglang.multimodal_gen.layers.lora.compute as _compute
from sglang.multimodal_gen.layers.linear import ParallelLinear, ShardId
from sglang.multimodal_gen.layers.lora.composition import Composition, LoRAContext, RowMapping
from sglang.multimodal_gen.layers.lora.compute import (
    MergeTerm,
    add_lora_delta,
    add_lora_delta_rows,
    add_offset_delta,
    add_offset_delta_rows,
    merged_weight,
)
from sglang.multimodal_gen.layers.lora.slots import (
    LoRASlots,
    ShardPiece,
    entry_nbytes,
    scale_dtype,
)
from sglang.multimodal_gen.layers.lora.weights import (
    LoRAWeights,
    all_finite,
    check_range,
    check_weights,
)

__all__ = ["BaseLayerWithLoRA"]

#: Local views (:meth:`BaseLayerWithLoRA.local_composition`) a layer keeps.
_LOCAL_CACHE = 64

CompositionLike = Composition | Iterable[tuple[str | int, float]]
#: What :meth:`BaseLayerWithLoRA._plan` returns for a mapping of several compositions.
_GROUPS = object()


class BaseLayerWithLoRA(nn.Module):
    """A :class:`ParallelLinear` plus any number of LoRA adapters in slots, merged or not.

    Args:
        base_layer: the layer to wrap; :meth:`merge` changes its ``weight``.
        snapshot_device: where :meth:`merge` keeps the pre-merge weight (default: the weight's
            device; ``"cpu"`` trades unmerge speed, and the speed of rows that do not use the
            merged composition, for accelerator memory).
        lora_context: the target's shared :class:`LoRAContext` (default: one of its own).

    Attributes:
        base_layer: the wrapped layer.
        prefix: the module's dotted name (from the base layer), used in error messages.
        lora_context: the :class:`LoRAContext` whose row mapping the forward reads.
        slots: the :class:`~sglang.multimodal_gen.layers.lora.slots.LoRASlots` (``lora_a``,
            ``lora_b``, ``col_scale``, ``lora_offset``, ``offset_scale`` read through).

    Forward: ``x`` ``[rows, ..., in]`` (``[..., in_local]`` row-parallel with
    ``input_is_parallel``) -> ``(output, output_bias)`` like the base layer; ``base_layer(x)``
    itself (bit-identical) when the only composition is merged, or nothing is active.
    """

    def __init__(
        self,
        base_layer: ParallelLinear,
        snapshot_device: torch.device | str | None = None,
        lora_context: LoRAContext | None = None,
    ):
        super().__init__()
        if not isinstance(base_layer, ParallelLinear):
            raise TypeError(
                f"BaseLayerWithLoRA wraps a ParallelLinear, got {type(base_layer).__name__}"
            )
        self.base_layer = base_layer
        self.prefix = base_layer.prefix
        self.snapshot_device = None if snapshot_device is None else torch.device(snapshot_device)
        self._lora_plan: torch.Tensor | None = None  # [3, S] for the traced forward
        self.lora_context = lora_context or LoRAContext(self.prefix or type(base_layer).__name__)
        self.slots = LoRASlots(
            base_layer.input_size_per_partition, base_layer.output_size_per_partition
        )
        self._active = Composition.EMPTY  # as given (target-wide slots)
        self._active_local = Composition.EMPTY  # the part this layer computes
        self._merged_local: Composition | None = None  # what the weight holds while merged
        self._merged_offsets = False  # ... and whether its adapters add offsets in the forward
        self._local: dict[Composition, Composition] = {}
        self._snapshot: torch.Tensor | None = None  # pre-merge weight while merged
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
    def lora_a(self) -> torch.Tensor | None:
        """``[S, R, in_local]`` (``None`` while no adapter is stored)."""
        return self.slots.lora_a

    @property
    def lora_b(self) -> torch.Tensor | None:
        """``[S, R, out_local]``, ``B`` transposed per slot."""
        return self.slots.lora_b

    @property
    def col_scale(self) -> torch.Tensor | None:
        """``[S, R]``: each column's ``alpha / r`` (0 in padding columns)."""
        return self.slots.col_scale

    @property
    def lora_offset(self) -> torch.Tensor | None:
        """``[S, out_local]`` bias deltas (``None`` until an adapter has one)."""
        return self.slots.lora_offset

    @property
    def offset_scale(self) -> torch.Tensor | None:
        """``[S]``: 1 for a slot with a bias delta here, else 0."""
        return self.slots.offset_scale

    @property
    def adapter_names(self) -> list[str]:
        """Names of the adapters stored on this layer (active or not)."""
        return self.slots.names

    def slot_of(self, name: str) -> int | None:
        """The slot adapter ``name`` is stored in, or ``None``."""
        return self.slots.slot_of(name)

    @property
    def occupied_slots(self) -> frozenset[int]:
        """Slots that hold an adapter on this layer."""
        return self.slots.occupied

    @property
    def active_composition(self) -> Composition:
        """The active composition as last given to :meth:`set_active` (target-wide slots)."""
        return self._active

    @property
    def merged_composition(self) -> Composition | None:
        """The part of the active composition merged into the weight, or ``None``."""
        return self._merged_local

    @property
    def snapshot(self) -> torch.Tensor | None:
        """The pre-merge weight while merged (the base weight's own storage, or a copy on
        ``snapshot_device``), else ``None``."""
        return self._snapshot

    @property
    def active(self) -> bool:
        """Whether an adapter of the active composition contributes here (merged or not)."""
        return bool(self._active_local)

    @property
    def merged(self) -> bool:
        """Whether the active composition is merged into ``base_layer.weight``."""
        return self._merged_local is not None

    @property
    def can_merge(self) -> bool:
        """Whether :meth:`merge` is possible: a floating-point weight of a plain tensor type,
        stored unquantized (a quantized weight cannot hold ``W + delta`` at its scales: LoRA runs
        unmerged beside the quantized GEMM)."""
        w = self.base_layer.weight
        return (
            w.dtype.is_floating_point
            and type(w) in (torch.Tensor, nn.Parameter)
            and self.base_layer.quant_method.supports_lora_merge
            and not getattr(self.base_layer, "lora_merge_unsupported", False)
        )

    @property
    def merge_refusal(self) -> str | None:
        """Why :meth:`merge` is impossible here (``None``: it is possible)."""
        if self.can_merge:
            return None
        method = self.base_layer.quant_method
        if not method.supports_lora_merge:
            return f"its base weight is quantized ({method.describe()})"
        w = self.base_layer.weight
        return f"weight dtype {w.dtype}, type {type(w).__name__}"

    def _follow(self) -> None:
        """Bring the slot tensors to the layer's compute dtype and the weight's device."""
        self.slots.follow_dtype(self.base_layer.dtype, self.base_layer.weight.device)

    def has_offsets(self, names: Iterable[str]) -> bool:
        """Whether any of the stored adapters ``names`` carries an output offset on this layer."""
        for n in names:
            entry = self.slots.entry_of(n)
            if entry is not None and entry.has_offset:
                return True
        return False

    def adapter_nbytes(self, name: str) -> int:
        """Bytes this rank stores for adapter ``name``: its used columns (0 if absent)."""
        entry = self.slots.entry_of(name)
        return 0 if entry is None else entry.nbytes

    def slot_nbytes(self) -> int:
        """Bytes of the slot tensors, padding and free slots included."""
        return self.slots.allocated_bytes()

    # ------------------------------------------------------------------ compositions
    def composition(self, pairs: CompositionLike) -> Composition:
        """``pairs`` ``[(name or slot, strength), ...]`` as a :class:`Composition`: a name is
        replaced by its slot here (names not stored here are left out); a composition is
        returned as is.

        Raises:
            ValueError: a strength that is not finite, a slot given twice.
        """
        if isinstance(pairs, Composition):
            return pairs
        out = []
        for key, strength in pairs:
            if isinstance(key, str):
                slot = self.slots.slot_of(key)
                if slot is None:
                    continue
                key = slot
            out.append((key, strength))
        return Composition(out)

    def local_composition(self, composition: CompositionLike) -> Composition:
        """The part of ``composition`` this layer computes: its entries whose slot holds an
        adapter here, strength 0 left out (``composition`` itself when that is all of it)."""
        comp = self.composition(composition)
        hit = self._local.get(comp)
        if hit is None:
            entries = tuple((s, v) for s, v in comp if v != 0.0 and self.slots.entry(s) is not None)
            hit = comp if entries == comp.entries else Composition(entries)
            if len(self._local) >= _LOCAL_CACHE:
                self._local.clear()
            self._local[comp] = hit
        return hit

    # ------------------------------------------------------------------ adapters
    def _rows_of(self, shard_id: ShardId) -> tuple[int, int, int]:
        """``(full_rows, local_start, local_rows)`` a LoRA keyed by ``shard_id`` covers."""
        base = self.base_layer
        if shard_id is None and len(base.shard_map) > 1:
            return base.output_size, 0, base.output_size_per_partition
        spec = base.shard_spec(shard_id)
        return spec.full_size, spec.local_offset, spec.local_size

    def _module(self) -> str:
        return self.prefix or type(self.base_layer).__name__

    def _validate(self, name: str, shard_id: ShardId, w: LoRAWeights) -> None:
        module = self._module()
        where = f"adapter {name!r}, module {module!r}, shard {shard_id!r}"
        try:
            full_rows, _, _ = self._rows_of(shard_id)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        described = f"{module}[{shard_id!r}] of {name!r}"
        check_weights(w, full_rows, self.base_layer.input_size, where, described)
        dtype = self.base_layer.dtype
        check_range(w, dtype, self.base_layer.input_size, where, described)

    def nbytes_for(self, weights: Mapping[ShardId, LoRAWeights]) -> int:
        """Bytes :meth:`add_adapter` would store for ``weights`` on this rank (unchecked)."""
        rank = sum(int(w.lora_A.shape[0]) for w in weights.values())
        has_offset = any(w.offset is not None for w in weights.values())
        s = self.slots
        return entry_nbytes(rank, has_offset, s.in_local, s.out_local, self.base_layer.dtype)

    def add_adapter(
        self, name: str, weights: Mapping[ShardId, LoRAWeights], slot: int | None = None
    ) -> int:
        """Store this rank's slices of adapter ``name`` in a slot (replacing one of that name).

        Args:
            name: adapter name.
            weights: ``{shard_id: LoRAWeights}`` in the full logical layout: ``shard_id`` is
                ``None`` for the whole layer (for a fused layer: ``B`` covers the fused output,
                ``[q|k|v]`` or ``[gate|up]``), ``"q"|"k"|"v"`` for QKV, or ``0, 1, ...`` for merged
                columns. ``lora_A`` ``[r, in]``, ``lora_B`` ``[rows, r]``, ``offset`` ``[rows]``;
                any float dtype (stored in the weight's dtype).
            slot: the slot to use (the manager passes its target-wide slot, so every layer of a
                target uses one index per adapter); ``None``: the slot ``name`` has, else the
                lowest free slot.

        Returns:
            The slot.

        Raises:
            ValueError: empty ``weights``, unknown shard id, rank 0, shapes that do not fit (the
                message names the module and both shapes), NaN/Inf in ``A``, ``B`` or ``offset``,
                values that overflow the compute dtype (``weights.check_range``: names the
                module, the shard and ``lora_A``/``lora_B``/``alpha``/``offset``), a slot that
                holds another adapter. Nothing is stored on error.
        """
        if not weights:
            raise ValueError(f"adapter {name!r} has no weights for module {self.prefix!r}")
        for shard_id, w in weights.items():
            self._validate(name, shard_id, w)
        current = self.slots.slot_of(name)
        if slot is None:
            slot = current if current is not None else self.slots.free_slot()
        elif isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
            raise ValueError(f"module {self._module()!r}: slot must be an int >= 0, got {slot!r}")
        other = self.slots.entry(slot)
        if other is not None and other.name != name:
            raise ValueError(
                f"module {self._module()!r}: slot {slot} holds adapter {other.name!r}; "
                f"cannot store {name!r} there"
            )
        dtype, device = self.base_layer.dtype, self.base_layer.weight.device
        pieces = []
        with torch.inference_mode(False), torch.no_grad():
            for shard_id, w in weights.items():
                _, start, rows = self._rows_of(shard_id)
                a = self.slice_lora_a_weights(w.lora_A, shard_id).to(device=device, dtype=dtype)
                b = self.slice_lora_b_weights(w.lora_B, shard_id).to(device=device, dtype=dtype)
                off = None
                if w.offset is not None:
                    off = self.slice_lora_b_weights(w.offset, shard_id).to(
                        device=device, dtype=scale_dtype(dtype)
                    )
                pieces.append(
                    ShardPiece(
                        shard_id, a, b, float(w.scale), off, w.effective_offset_scale, start, rows
                    )
                )
        self.slots.put(name, slot, pieces, dtype, device)
        if current is not None and current != slot:
            self.slots.clear(current)  # moved: the old slot is emptied once the new one is written
        self._slots_changed({slot} | ({current} if current is not None else set()))
        return slot

    def remove_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (a no-op if absent); if it was active, it leaves the active
        composition (re-merged without it when merged)."""
        slot = self.slots.slot_of(name)
        if slot is None:
            return
        self.slots.clear(slot)
        if slot in self._active.slots:
            self._active = Composition((s, v) for s, v in self._active if s != slot)
        self._slots_changed({slot})

    def _slots_changed(self, slots: set[int]) -> None:
        """Slots ``slots`` were written or cleared: forget local views; bring the active
        composition (and a merged weight) up to date when it uses one of them."""
        self._local.clear()
        touched = slots & set(self._active.slots)
        if self._merged_local is not None:
            touched |= slots & set(self._merged_local.slots)
        self._active_local = self.local_composition(self._active)
        if touched:
            self._refresh()
        self._update_plan()

    def set_active(
        self, composition: CompositionLike, cached: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Make ``composition`` the active (global) composition: a :class:`Composition`, or
        ``[(name or slot, strength), ...]`` (names not stored here are left out; empty: LoRA
        off). Slots that hold nothing here compute nothing.

        An unmerged layer stays unmerged; a merged one is re-merged from its snapshot (``cached``
        as for :meth:`merge`) unless its part of the composition is the merged one already, or
        unmerged when nothing of the composition is stored here.

        Returns:
            The new merged local weight when the layer was re-merged, else None.

        Raises:
            ValueError: a strength that is not finite (nothing changes); errors of :meth:`merge`.
        """
        comp = self.composition(composition)
        self._active = comp
        self._active_local = self.local_composition(comp)
        if self._merged_local is not None and self._active_local == self._merged_local:
            self._update_plan()
            return None  # the weight holds this layer's part already
        out = self._refresh(cached)
        self._update_plan()
        return out

    def _refresh(self, cached: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.merged:
            if not self._active_local:
                self.unmerge()
            else:
                return self.merge(cached=cached)
        return None

    def _merge_terms(self, local: Composition) -> list[MergeTerm]:
        """``(strength x scale, A, B, first row)`` of every shard of ``local``."""
        s = self.slots
        terms = []
        for slot, strength in local:
            for c in s.entry(slot).shards:
                if not c.rank:
                    continue
                cols = slice(c.col, c.col + c.rank)
                a = s.lora_a[slot, cols]
                b = s.lora_b[slot, cols, c.row_start : c.row_start + c.rows].t()
                terms.append((strength * c.scale, a, b, c.row_start))
        return terms

    def offset_sum(self, composition: CompositionLike | None = None) -> torch.Tensor | None:
        """``sum strength x offset`` ``[out_local]`` (float32) of ``composition`` (default: the
        active one) on this layer, or ``None`` when none of its adapters has an offset here."""
        local = self._active_local if composition is None else self.local_composition(composition)
        s = self.slots
        if not self._has_offset(local):
            return None
        self._follow()
        dev = s.lora_offset.device
        out = torch.zeros(s.out_local, dtype=s.lora_offset.dtype, device=dev)
        add_offset_delta(
            out,
            s.lora_offset,
            s.offset_scale,
            local.slot_tensor(dev),
            local.strength_tensor(dev, s.lora_offset.dtype),
        )
        return out

    def _has_offset(self, local: Composition) -> bool:
        s = self.slots
        return s.lora_offset is not None and any(s.entry(k).has_offset for k in local.slots)

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
            self.base_layer.weight_changed()  # no version counter moved
        else:
            with torch.inference_mode():  # in-place updates of inference and normal tensors
                self.base_layer.weight.copy_(value)

    def merge(self, cached: torch.Tensor | None = None, safe: bool = False) -> torch.Tensor:
        """Merge the active composition: ``W' = W + sum_i strength_i * scale_i * B_i @ A_i``.

        Computed in fp32 from the used columns of the composition's slots, rounded once
        (:func:`compute.merged_weight`, chunked), or ``cached`` (a tensor this method returned
        for the same composition) is used as is. The parameter is pointed at the result (copied
        in instead when :meth:`_can_swap` says no); the pre-merge weight stays as the snapshot
        :meth:`unmerge` restores bit-exactly (the base's own storage on the weight's device, else
        a copy on ``snapshot_device``). Offsets are not merged. ``safe``: refuse a non-finite
        result.

        Returns:
            The merged local weight ``[out_local, in_local]`` (safe to cache, never to write into).

        Raises:
            ValueError: the layer cannot merge, ``cached`` does not match the weight, or ``safe``
                and the result is not finite (the weight is left unchanged).
        """
        module = self._module()
        if not self.can_merge:
            raise ValueError(f"module {module!r} cannot merge LoRA weights: {self.merge_refusal}")
        weight = self.base_layer.weight
        if cached is not None and (cached.shape != weight.shape or cached.dtype != weight.dtype):
            raise ValueError(
                f"module {module!r}: cached merged weight {list(cached.shape)} {cached.dtype} does "
                f"not match the weight {list(weight.shape)} {weight.dtype}"
            )
        local = self._active_local
        if cached is None and not local:
            if self.merged:
                self.unmerge()
            with torch.inference_mode(False), torch.no_grad():
                return weight.detach().clone()
        with torch.inference_mode(False), torch.no_grad():
            if cached is None:
                self.slots.follow(weight)
                # already merged: the snapshot is the base (no unmerge copy needed)
                base = self._snapshot.to(weight.device) if self.merged else weight.detach()
                merged = merged_weight(base, self._merge_terms(local), _compute.MERGE_CHUNK_BYTES)
                del base
            else:
                merged = cached.to(weight.device)
            if safe and not all_finite(merged):
                raise ValueError(
                    f"module {module!r}: merged weight contains NaN or Inf; not merged"
                )
            if not self.merged:
                device = self.snapshot_device or weight.device
                old = weight.detach()
                keep = old.device == device and self._can_swap(merged)
                self._snapshot = old if keep else old.to(device, copy=True)
        self._set_weight(merged)
        self._merged_local = local
        self._merged_offsets = self._has_offset(local)
        self.merges += 1
        self._update_plan()
        return merged

    def unmerge(self) -> None:
        """Restore the pre-merge weight bit-exactly (its storage, or a copy from the snapshot
        device). No-op if not merged."""
        if not self.merged:
            return
        weight = self.base_layer.weight
        snap = self._snapshot
        if snap.device != weight.device:
            with torch.inference_mode(False), torch.no_grad():
                snap = snap.to(weight.device)
        self._set_weight(snap)
        self._snapshot = None
        self._merged_local = None
        self._update_plan()

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
        offset = self.offset_sum()
        if offset is not None and self.base_layer.bias is None:
            raise ValueError(
                f"module {self.prefix!r}: cannot commit LoRA output offsets to a layer without bias"
            )
        if not self.merged:
            self.merge()
        if offset is not None:
            bias = self.base_layer.bias
            with torch.inference_mode():
                # every rank keeps its rows; Row layers add the bias once, like the offset
                bias.copy_((bias.to(offset.dtype) + offset.to(bias.device)).to(bias.dtype))
        weight = self.base_layer.weight
        if self._can_swap(weight):
            with torch.inference_mode(weight.is_inference()), torch.no_grad():
                # the merged tensor may be shared with the merge cache: the base owns a copy
                self._set_weight(weight.detach().clone())
        self._snapshot = None
        self._merged_local = None
        self._active = self._active_local = Composition.EMPTY
        self._update_plan()

    # ------------------------------------------------------------------ forward
    def _exact_weight(self) -> torch.Tensor:
        """The base weight without any merged delta: the snapshot while merged."""
        if not self.merged:
            return self.base_layer.weight
        weight = self.base_layer.weight
        snap = self._snapshot
        return snap if snap.device == weight.device else snap.to(weight.device)

    def _add_delta(self, x_local: torch.Tensor | None, y: torch.Tensor, local: Composition) -> None:
        """``y += delta(local)`` (``x_local=None``: its offsets alone), offsets on the rank that
        adds the bias."""
        self._follow()
        dev = y.device
        strengths = local.strength_tensor(dev, self.slots.col_scale.dtype)
        self._add_delta_tensors(x_local, y, local.slot_tensor(dev), strengths)

    def _rows_out(
        self, x_local: torch.Tensor, local: Composition, bias, weight: torch.Tensor | None
    ) -> torch.Tensor:
        """The local output of rows whose composition's part here is ``local``: the merged
        weight alone when ``local`` is what is merged, else the exact base weight plus its
        delta."""
        base = self.base_layer
        if self._merged_local is not None and local == self._merged_local:
            y = base.apply_gemm(x_local, bias)
            if self._merged_offsets:  # offsets are never merged into the weight
                self._add_delta(None, y, local)
            return y
        y = base.apply_gemm(x_local, bias, self._exact_weight() if weight is None else weight)
        if local:
            self._add_delta(x_local, y, local)
        return y

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same contract as ``base_layer.forward``: ``x`` -> ``(output, output_bias)``.

        Rows use the compositions of ``lora_context.mapping`` (``None``: the active one).

        Under ``torch.compile`` this is :meth:`_forward_traced` (tensors only: another adapter,
        strength, merge or mapping is another tensor value, not another graph).

        Raises:
            ValueError: the mapping has several compositions and the input's leading dimension
                is not its row count (the message names the module; eager only).
        """
        if torch.compiler.is_compiling():
            return self._forward_traced(x)
        if self.lora_context.mapping is None and self._passthrough:
            return self.base_layer(x)
        plan = self._plan()
        if plan is None:
            return self.base_layer(x)
        if plan is _GROUPS:
            return self._forward_groups(x, self.lora_context.mapping)
        weight, slots, strengths, offsets_only = plan
        base = self.base_layer
        x_local = base.parallel_input(x)
        y = base.apply_gemm(x_local, base.gemm_bias(), weight)
        if slots is not None:
            self._add_delta_tensors(None if offsets_only else x_local, y, slots, strengths)
        return base.package_output(base.reduce_output(y))

    @property
    def _passthrough(self) -> bool:
        """Whether the active composition needs nothing in the forward (none, or merged without
        offsets): the forward is then ``base_layer(x)``."""
        local = self._active_local
        if not local and not self.merged:
            return True
        return (
            self._merged_local is not None
            and local == self._merged_local
            and not (self._merged_offsets)
        )

    def _plan(self):
        """What the eager forward does for the current mapping:
        ``None`` (the base layer alone), :data:`_GROUPS` (several compositions: rows by group),
        or ``(weight, slots, strengths, offsets_only)`` for one composition: the weight the
        base GEMM uses (``None``: the current one) and the composition as tensors (``None``:
        no delta)."""
        mapping = self.lora_context.mapping
        if mapping is not None and not mapping.uniform:
            return _GROUPS
        local = (
            self._active_local
            if mapping is None
            else self.local_composition(mapping.groups[0].composition)
        )
        on_merged = self._merged_local is not None and local == self._merged_local
        if on_merged:
            if not self._merged_offsets:
                return None
            weight, offsets_only = None, True
        else:
            if not local and not self.merged:
                return None
            weight, offsets_only = (self._exact_weight() if self.merged else None), False
        if not local:
            return (weight, None, None, False)
        self._follow()
        dev = self.base_layer.weight.device
        return (
            weight,
            local.slot_tensor(dev),
            local.strength_tensor(dev, self.slots.col_scale.dtype),
            offsets_only,
        )

    def _add_delta_tensors(
        self,
        x_local: torch.Tensor | None,
        y: torch.Tensor,
        slots: torch.Tensor,
        strengths: torch.Tensor,
    ) -> None:
        """``y += delta`` of the adapters in ``slots`` at ``strengths`` (``x_local=None``: their
        offsets alone), offsets on the rank that adds the bias."""
        s = self.slots
        if x_local is not None and s.width:
            add_lora_delta(y, x_local, s.lora_a, s.lora_b, s.col_scale, slots, strengths)
        if s.lora_offset is not None and self.base_layer._bias_on_this_rank():
            add_offset_delta(y, s.lora_offset, s.offset_scale, slots, strengths)

    def _forward_groups(
        self, x: torch.Tensor, mapping: RowMapping
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of several compositions, one collective for all.

        When every row needs the same weight (the exact base weight; or the merged one, its
        composition being every group's part here) the base GEMM runs once over the batch and
        each group's delta is added on its rows; otherwise each group runs its own GEMM. A
        group's rows are a slice when consecutive, else ``index_select``-ed and written back
        with ``index_copy_``. The GEMMs are row-invariant, so a row's output is the row's output
        alone either way."""
        if x.dim() < 2 or x.shape[0] != mapping.rows:
            lead = x.shape[0] if x.dim() else 0
            raise ValueError(
                f"module {self._module()!r}: input with leading dimension {lead} does not match "
                f"the LoRA row mapping of {mapping.rows} rows (the leading dimension must be the "
                "row index)"
            )
        base = self.base_layer
        x_local = base.parallel_input(x)
        bias = base.gemm_bias()
        merged = self._merged_local
        groups = mapping.groups
        locals_ = [self.local_composition(g.composition) for g in groups]
        on_merged = [merged is not None and local == merged for local in locals_]
        if all(on_merged) or not any(on_merged):
            y = base.apply_gemm(x_local, bias, None if all(on_merged) else self._exact_weight())
            for group, local, m in zip(groups, locals_, on_merged):
                if local and (not m or self._merged_offsets):
                    self._delta_on_rows(None if m else x_local, y, group, local)
            return base.package_output(base.reduce_output(y))
        exact = self._exact_weight()
        y = None
        for group, local in zip(groups, locals_):
            if group.span is not None:
                xg = x_local[group.span[0] : group.span[1]]
            else:
                xg = x_local.index_select(0, group.index(x_local.device))
            yg = self._rows_out(xg, local, bias, exact)
            if y is None:
                y = yg.new_empty((x_local.shape[0], *yg.shape[1:]))
            if group.span is not None:
                y[group.span[0] : group.span[1]].copy_(yg)
            else:
                y.index_copy_(0, group.index(y.device), yg)
        return base.package_output(base.reduce_output(y))

    # ------------------------------------------------------------------ traced forward
    def _update_plan(self) -> None:
        """Rewrite the ``[3, S]`` plan the traced forward reads (outside any graph): row 0 is 1
        for each slot holding an adapter here, row 1 the active composition's strengths here,
        row 2 the merged composition's (0 when unmerged); in place unless ``S``, the dtype or the
        device changed. ``None`` while no adapter is stored. Reserves the context's row
        strengths for ``S`` slots."""
        s = self.slots
        if s.lora_a is None:
            self._lora_plan = None
            return
        self._follow()
        cap, dtype, device = s.capacity, s.col_scale.dtype, s.col_scale.device
        plan = self._lora_plan
        with torch.inference_mode(False), torch.no_grad():
            host = torch.zeros(3, cap, dtype=dtype)  # a normal tensor: written in place later
            for slot in s.occupied:
                host[0, slot] = 1.0
            for slot, v in self._active_local:
                host[1, slot] = v
            for slot, v in self._merged_local or ():
                host[2, slot] = v
            if plan is None or (plan.shape, plan.dtype, plan.device) != (
                host.shape,
                dtype,
                device,
            ):
                self._lora_plan = host.to(device)
            else:
                plan.copy_(host)
        self.lora_context.row_strengths.reserve(cap, device, dtype)

    def _row_coefficients(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(delta, offset)`` coefficients ``[n, S]``: each input row's strength of each slot
        stored here, minus the merged strength for the delta (the weight holds that part), as
        is for the offsets (never merged). ``n`` = ``rows`` when the context's row strengths
        hold that many rows, else 1 (a uniform mapping's row, for an input whose leading
        dimension is not the batch). Traced: reads tensors only; the branches depend on shapes
        alone."""
        present, active, merged = self._lora_plan.unbind(0)
        rs = self.lora_context.row_strengths
        if rs.strengths is None:
            own = (active * present)[None]
            return own - merged, own
        table = rs.strengths
        width = present.shape[0]
        if table.shape[1] >= width:
            table = table[:, :width]
        else:
            table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
        table = table[:rows] if rows <= table.shape[0] else table[:1]
        own = torch.where(rs.use_rows > 0, table.to(active.dtype), active[None]) * present
        return own - merged, own

    def _forward_traced(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward a compiled graph traces: the base GEMM with the current weight (merged or
        not) plus, when an adapter is stored here, the per-row delta of
        :meth:`_row_coefficients` over every slot (:func:`compute.add_lora_delta_rows`; offsets
        on the rank that adds the bias), then the base layer's collective.

        Reads no Python value that changes with adapters, strengths, merges or mappings: only
        tensors of fixed shapes. The row mapping's leading-dimension check of the eager forward
        is not repeated (a mixed mapping's rows are the input's leading dimension, as eager
        requires)."""
        base = self.base_layer
        x_local = base.parallel_input(x)
        y = base.apply_gemm(x_local, base.gemm_bias())
        s = self.slots
        if self._lora_plan is not None and s.lora_a is not None:
            rows = x_local.shape[0] if x_local.dim() >= 2 else 1
            coef, offset_coef = self._row_coefficients(rows)
            y = add_lora_delta_rows(y, x_local, s.lora_a, s.lora_b, s.col_scale, coef)
            if s.lora_offset is not None and base._bias_on_this_rank():
                y = add_offset_delta_rows(y, s.lora_offset, s.offset_scale, offset_coef)
        return base.package_output(base.reduce_output(y))

    def _delta_on_rows(
        self, x_local: torch.Tensor | None, y: torch.Tensor, group, local: Composition
    ) -> None:
        """``y[group's rows] += delta(local)`` (``x_local=None``: offsets alone)."""
        if group.span is not None:
            lo, hi = group.span
            self._add_delta(None if x_local is None else x_local[lo:hi], y[lo:hi], local)
            return
        idx = group.index(y.device)
        yg = y.index_select(0, idx)
        self._add_delta(None if x_local is None else x_local.index_select(0, idx), yg, local)
        y.index_copy_(0, idx, yg)

    def extra_repr(self) -> str:
        return (
            f"adapters={self.adapter_names}, active={self._active}, merged={self.merged}, "
            f"slots={self.slots.capacity}x{self.slots.width}"
        )
