"""Tensor-parallel linear layers: one base class, five sharding policies.

``y = x W^T + b`` with ``W`` of shape ``(output_size, input_size)``, split over the TP group
(Megatron-LM, Shoeybi et al. 2019, section 3: column-parallel then row-parallel so an MLP or an
attention block needs one all-reduce). Argument names follow vLLM/SGLang.

:class:`ParallelLinear` owns everything the layers share:

* the TP rank and size, read once at construction (or given explicitly, so that a test can build
  the layer "as rank r of n" in one process);
* the **shard map** (:class:`ShardSpec` per logical output shard), which drives weight creation,
  :meth:`ParallelLinear.weight_loader`, LoRA ``A``/``B`` slicing and merge-delta slicing;
* the forward as hooks: :meth:`parallel_input` -> :meth:`apply_gemm` with :meth:`gemm_bias`
  -> :meth:`reduce_output` -> :meth:`package_output`, returning ``(output, output_bias)``;
* the **quantization method** (:mod:`~sglang.multimodal_gen.layers.quantization`): how the weight
  is stored, loaded through the shard map and multiplied (unquantized is one method).

Subclasses override only the sharding hooks ``_output_sections`` / ``_input_sections`` and, for
the two that communicate, ``reduce_output``. Both sides of the map may have several sections:
a fused output ``[q | k | v]`` or a fused *input* ``[attn | mlp]`` (Flux's single-stream
``proj_out``), where each section is split over the ranks on its own, so a rank's columns are
not contiguous in the full tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sglang.multimodal_gen.distributed import (
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from sglang.multimodal_gen.layers.batch_invariant import linear_rows_invariant
from sglang.multimodal_gen.layers.quantization.base import (
    QuantizationMethod,
    UnquantizedLinearMethod,
)

ShardId = int | str | None

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "ShardSpec",
]


@dataclass(frozen=True)
class ShardSpec:
    """Where one logical output shard lives, for one TP rank.

    Rows ``[full_offset, full_offset + full_size)`` of the fused full weight belong to shard
    ``shard_id``; this rank stores rows ``[src_offset, src_offset + local_size)`` of that shard's
    full tensor at rows ``[local_offset, local_offset + local_size)`` of its local parameter.
    """

    shard_id: ShardId
    full_offset: int
    full_size: int
    local_offset: int
    local_size: int
    src_offset: int


def _shape(t: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors lazy slice (``PySafeSlice``)."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


def _read(t: Any, rows: slice, cols: Sequence[slice] | None) -> torch.Tensor:
    """``t[rows]``, or ``t[rows, c]`` for each column range ``c`` concatenated along dim 1, for a
    tensor or a lazy slice (reads only those bytes)."""
    if cols is None:
        return t[rows]
    pieces = [t[rows, c] for c in cols]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


class ParallelLinear(nn.Module):
    """Base class of the tensor-parallel linear layers.

    Args:
        input_size: full input features ``in``.
        output_size: full output features ``out`` (sum of all shards for fused layers).
        bias: whether the layer has a bias ``[out]``.
        skip_bias_add: return the bias as ``output_bias`` instead of adding it, so that the
            caller can fuse it into a later op.
        params_dtype: dtype of the parameters (default: ``torch.get_default_dtype()``).
        prefix: the module's dotted name in its model, used in error messages.
        tp_rank, tp_size: explicit TP coordinates; default: read from the TP group.
        device: where to allocate the parameters.
        quant_method: how the weight is stored and multiplied (default:
            :class:`~sglang.multimodal_gen.layers.quantization.UnquantizedLinearMethod`);
            :meth:`set_quant_method` changes it before loading.

    Parameters:
        ``weight`` ``[out_local, in_local]`` in ``params_dtype`` (quantized methods: their own
        storage and scales) and ``bias`` ``[out_local]`` (or ``None``), each with a
        ``weight_loader`` attribute.

    Raises:
        ValueError: a size does not divide by ``tp_size`` (names the layer and both numbers), or
            the flags contradict each other.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        tp_rank: int | None = None,
        tp_size: int | None = None,
        device: torch.device | str | None = None,
        quant_method: QuantizationMethod | None = None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.skip_bias_add = skip_bias_add
        self.prefix = prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_size = get_tp_world_size() if tp_size is None else tp_size
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"{self._name()}: tp_rank {self.tp_rank} not in [0, {self.tp_size})")
        self._check_flags(bias)

        self.shard_map: tuple[ShardSpec, ...] = self._build_shard_map(self.tp_rank)
        self.input_partitions: tuple[tuple[int, int], ...] = self._build_input_map(self.tp_rank)
        in_local = sum(size for _, size in self.input_partitions)
        self.input_size_per_partition = in_local
        self.output_size_per_partition = sum(s.local_size for s in self.shard_map)
        self.output_partition_sizes = [s.local_size for s in self.shard_map]

        self.quant_method: QuantizationMethod = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, device)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=self.params_dtype, device=device),
                requires_grad=False,
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._gather_index: torch.Tensor | None = None

    # ----------------------------------------------------------------- sharding hooks
    def _output_sections(self, tp_rank: int) -> list[tuple[ShardId, int, int, int]]:
        """``(shard_id, full_size, local_size, src_index)`` per output shard, for ``tp_rank``.

        The rank holds rows ``[src_index * local_size, (src_index + 1) * local_size)`` of the shard.
        Default: one unsplit shard.
        """
        return [(None, self.output_size, self.output_size, 0)]

    def _input_sections(self, tp_rank: int) -> list[tuple[int, int, int]]:
        """``(full_size, local_size, src_index)`` per input section, for ``tp_rank``.

        The sections lie one after another in the full input; the rank holds columns
        ``[src_index * local_size, (src_index + 1) * local_size)`` of each, concatenated in
        section order. Default: one unsplit section.
        """
        return [(self.input_size, self.input_size, 0)]

    def _check_flags(self, bias: bool) -> None:
        """Reject contradictory constructor flags. Default: nothing to check."""

    def _bias_on_this_rank(self) -> bool:
        """Whether this rank adds the bias in its GEMM (Row adds it on one rank only)."""
        return True

    @property
    def input_is_sliced(self) -> bool:
        """Whether :meth:`parallel_input` takes a slice of a full input."""
        return False

    # ----------------------------------------------------------------- shard map
    def _divide(self, numerator: int, what: str) -> int:
        if numerator % self.tp_size != 0:
            raise ValueError(
                f"{self._name()}: {what} {numerator} is not divisible by tp_size {self.tp_size}"
            )
        return numerator // self.tp_size

    def _name(self) -> str:
        return f"{type(self).__name__}({self.prefix or '<unnamed>'})"

    @property
    def display_name(self) -> str:
        """``ClassName(prefix)``, how errors name the layer."""
        return self._name()

    def _build_shard_map(self, tp_rank: int) -> tuple[ShardSpec, ...]:
        specs, full_off, local_off = [], 0, 0
        for shard_id, full_size, local_size, src_index in self._output_sections(tp_rank):
            specs.append(
                ShardSpec(
                    shard_id, full_off, full_size, local_off, local_size, src_index * local_size
                )
            )
            full_off += full_size
            local_off += local_size
        if full_off != self.output_size:
            raise ValueError(
                f"{self._name()}: shards cover {full_off} rows, output_size is {self.output_size}"
            )
        return tuple(specs)

    def _build_input_map(self, tp_rank: int) -> tuple[tuple[int, int], ...]:
        """``((full_start, local_size), ...)``: the input columns ``tp_rank`` holds, per section."""
        parts, full_off = [], 0
        for full_size, local_size, src_index in self._input_sections(tp_rank):
            parts.append((full_off + src_index * local_size, local_size))
            full_off += full_size
        if full_off != self.input_size:
            raise ValueError(
                f"{self._name()}: input sections cover {full_off} columns, input_size is "
                f"{self.input_size}"
            )
        return tuple(parts)

    def _input_col_slices(self) -> list[slice]:
        return [slice(start, start + size) for start, size in self.input_partitions]

    def _take_input(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's input columns of ``t`` along ``dim`` (a view when they are contiguous)."""
        if self.input_size_per_partition == self.input_size:
            return t
        pieces = [t.narrow(dim, start, size) for start, size in self.input_partitions]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    @property
    def output_shard_ids(self) -> tuple[ShardId, ...]:
        return tuple(s.shard_id for s in self.shard_map)

    def shard_spec(self, shard_id: ShardId) -> ShardSpec:
        """The :class:`ShardSpec` of ``shard_id``.

        Raises:
            ValueError: unknown shard id (the message lists the valid ones).
        """
        for s in self.shard_map:
            if s.shard_id == shard_id:
                return s
        if shard_id is None and len(self.shard_map) == 1:
            return self.shard_map[0]
        raise ValueError(
            f"{self._name()}: unknown shard_id {shard_id!r}; valid: {list(self.output_shard_ids)}"
        )

    def _local_rows(
        self, full: Any, shard_id: ShardId, cols: Sequence[slice] | None, what: str
    ) -> torch.Tensor:
        """This rank's rows of ``full`` (one shard's full tensor, or the fused one if ``None``).

        ``full`` is a tensor or a safetensors lazy slice; only the needed rows/cols are read.
        """
        shape = _shape(full)
        fused = shard_id is None and len(self.shard_map) > 1
        specs = self.shard_map if fused else (self.shard_spec(shard_id),)
        expected_rows = self.output_size if fused else specs[0].full_size
        if not shape or shape[0] != expected_rows:
            raise ValueError(
                f"{self._name()}: {what} for shard {shard_id!r} has shape {list(shape)}, "
                f"expected {expected_rows} rows"
            )
        pieces = []
        for s in specs:
            start = (s.full_offset if fused else 0) + s.src_offset
            pieces.append(_read(full, slice(start, start + s.local_size), cols))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def shard_output_tensor(self, full: Any, shard_id: ShardId = None) -> torch.Tensor:
        """Slice a full output-dim tensor (dim 0) to this rank's rows.

        Args:
            full: ``[full_size_of_shard, ...]`` for ``shard_id``, or ``[output_size, ...]`` with
                ``shard_id=None`` (the fused layout: q|k|v, gate|up). E.g. a LoRA ``B`` ``[out, r]``
                or a bias ``[out]``.

        Returns:
            ``[local_size, ...]`` (``[output_size_per_partition, ...]`` for the fused layout).
        """
        return self._local_rows(full, shard_id, None, "tensor")

    def shard_input_tensor(self, full: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Slice a full input-dim tensor to this rank's part (identity unless the input is split).

        E.g. a LoRA ``A`` ``[r, in]`` -> ``[r, in_local]`` for a row-parallel layer; with several
        input sections the rank's columns of each are concatenated in section order.
        """
        if full.shape[dim] != self.input_size:
            raise ValueError(
                f"{self._name()}: input dim of tensor {list(full.shape)} is not {self.input_size}"
            )
        return self._take_input(full, dim)

    # ----------------------------------------------------------------- quantization
    def set_quant_method(self, method: QuantizationMethod) -> None:
        """Replace the weight storage by ``method``'s (before loading: the old weight tensors are
        dropped, the bias kept). Tensors are created on the bias's or the old weight's device.

        Raises:
            ValueError: the method cannot shard this layer (e.g. NVFP4 blocks across ranks).
        """
        device = self.weight.device
        for name in [n for n, _ in self.named_parameters(recurse=False) if n != "bias"]:
            delattr(self, name)
        for name in [n for n, _ in self.named_buffers(recurse=False)]:
            delattr(self, name)
        self.quant_method = method
        method.create_weights(self, device)

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (``.to()``, ``.half()``, ``.cuda()``...) that only MOVES a
        quantized method's tensors: a dtype cast would turn an FP8 weight, its fp32 scales or a
        packed FP4 weight into something else (``float8_e4m3fn`` counts as floating point).
        A cast changes the compute dtype (``params_dtype``) and the bias instead; unquantized
        layers follow ``fn`` as usual."""
        if self.quant_method.name == "unquantized":
            out = super()._apply(fn, recurse)
            self.weight_changed()  # moved or cast through .data: nothing derived stays valid
            return out
        probe = fn(torch.empty(0, dtype=self.params_dtype, device=self.weight.device))
        stores = (self._parameters, self._buffers)
        orders = [list(store) for store in stores]
        kept = [
            {n: t for n, t in store.items() if t is not None and n != "bias"} for store in stores
        ]
        for store, held in zip(stores, kept):
            for name in held:
                del store[name]
        try:
            super()._apply(fn, recurse)
        finally:
            for store, held, order in zip(stores, kept, orders):
                for t in held.values():
                    if t.device != probe.device:
                        t.data = t.data.to(probe.device)
                rest = dict(store)
                store.clear()
                for name in order:  # the original order (state_dict, offloaders)
                    store[name] = held[name] if name in held else rest[name]
        self.params_dtype = probe.dtype  # the compute dtype follows a cast, the storage does not
        return self

    def process_weights_after_loading(self) -> None:
        """Let the quantization method finish its tensors once the checkpoint is loaded."""
        self.quant_method.process_weights_after_loading(self)

    def weight_changed(self) -> None:
        """Say that the weight was replaced or written outside the loaders (a LoRA merge
        swapping the merged weight in through ``.data``): the method drops what it derived from
        the old one (the CPU GEMM's packed copy). In-place writes need no call (the version
        counter tells), a ``.data`` swap does: it moves no counter, and the new storage may
        reuse the old one's address."""
        self.quant_method.weight_changed(self)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: activations, bias and LoRA weights (the weight's own dtype when
        unquantized)."""
        return self.quant_method.compute_dtype(self)

    @property
    def checkpoint_params(self) -> tuple[str, ...]:
        """Parameter names a checkpoint provides per output shard (``bias`` included if any)."""
        extra = ("bias",) if self.bias is not None else ()
        return self.quant_method.checkpoint_params + extra

    # ----------------------------------------------------------------- loading
    def _unit_col_slices(self, col_unit: int) -> list[slice]:
        """The input-partition column slices in units of ``col_unit`` columns (packed or
        blocked storage: 2 values per byte, 16 columns per block scale)."""
        out = []
        for start, size in self.input_partitions:
            if start % col_unit or size % col_unit:
                raise ValueError(
                    f"{self._name()}: input columns [{start}, {start + size}) do not fall on "
                    f"units of {col_unit}"
                )
            out.append(slice(start // col_unit, (start + size) // col_unit))
        return out

    def take_input_columns(self, t: torch.Tensor, col_unit: int = 1) -> torch.Tensor:
        """This rank's input columns of ``t`` ``[rows, input_size / col_unit]`` (dim 1)."""
        if self.input_size_per_partition == self.input_size:
            return t
        return _read(t, slice(None), self._unit_col_slices(col_unit))

    def output_rows_of(self, loaded: Any, shard_id: ShardId, what: str) -> torch.Tensor:
        """This rank's rows of shard ``shard_id`` of ``loaded``, every column (read from a lazy
        slice when given one)."""
        return self._local_rows(loaded, shard_id, None, what)

    def _rows_of_shard(self, shard_id: ShardId) -> tuple[int, int, int]:
        """``(local_start, local_rows, full_rows)`` of ``shard_id`` (``None`` on a fused layer:
        every shard)."""
        fused = shard_id is None and len(self.shard_map) > 1
        specs = self.shard_map if fused else (self.shard_spec(shard_id),)
        full = self.output_size if fused else specs[0].full_size
        return specs[0].local_offset, sum(s.local_size for s in specs), full

    @torch.no_grad()
    def load_output_rows(
        self,
        param: torch.Tensor,
        loaded: Any,
        shard_id: ShardId,
        pre_sharded: bool,
        col_unit: int | None,
        what: str,
    ) -> None:
        """Copy this rank's part of a ``[rows, ...]`` checkpoint tensor of shard ``shard_id``
        into the shard's rows of ``param``.

        Args:
            loaded: ``[full_rows]`` (``col_unit=None``: one value per output row, e.g. a bias or
                a per-row scale) or ``[full_rows, input_size / col_unit]`` (a weight;
                ``col_unit`` 2 for two values per byte, 16 for block scales), a tensor or a
                safetensors lazy slice (only this rank's rows and columns are read). With
                ``pre_sharded`` it is already this rank's piece.
            what: the tensor's name in errors.

        Raises:
            ValueError: unknown shard id, or a shape that does not fit (names the layer, the
                shard and both shapes).
        """
        local_start, local_rows, full_rows = self._rows_of_shard(shard_id)
        if col_unit is None:
            expected_full, cols = (full_rows,), None
            expected_local = (local_rows,)
        else:
            if self.input_size % col_unit:
                raise ValueError(
                    f"{self._name()}: input_size {self.input_size} is not a multiple of {col_unit}"
                )
            expected_full = (full_rows, self.input_size // col_unit)
            expected_local = (local_rows, self.input_size_per_partition // col_unit)
            cols = self._unit_col_slices(col_unit)
        if pre_sharded:
            data = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
            if tuple(data.shape) != expected_local:
                raise ValueError(
                    f"{self._name()}: pre-sharded {what} for shard {shard_id!r} has shape "
                    f"{list(data.shape)}, expected {list(expected_local)}"
                )
        else:
            if _shape(loaded) != expected_full:
                raise ValueError(
                    f"{self._name()}: {what} for shard {shard_id!r} has shape "
                    f"{list(_shape(loaded))}, expected {list(expected_full)}"
                )
            data = self._local_rows(loaded, shard_id, cols, what)
        param.data[local_start : local_start + local_rows].copy_(data)

    @torch.no_grad()
    def fill_shard_rows(self, param: torch.Tensor, value: torch.Tensor, shard_id: ShardId) -> None:
        """Set the rows of shard ``shard_id`` (every row for the fused ``None``) of ``param`` to
        ``value`` (e.g. a per-tensor scale of one source module)."""
        local_start, local_rows, _ = self._rows_of_shard(shard_id)
        param.data[local_start : local_start + local_rows] = value

    def _param_name(self, param: torch.Tensor) -> str | None:
        for name, p in self.named_parameters(recurse=False):
            if p is param:
                return name
        return None

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: Any,
        shard_id: ShardId = None,
        pre_sharded: bool = False,
    ) -> None:
        """Copy checkpoint data into this rank's part of ``param`` (``weight``, ``bias``, or a
        quantization scale).

        Args:
            param: ``self.bias``, ``self.weight`` or another tensor of the quantization method.
            loaded_weight: the full tensor of shard ``shard_id`` (``[full_size, in]`` or
                ``[full_size]``), or of the fused layer when ``shard_id`` is ``None``. A safetensors
                lazy slice is accepted, so only this rank's rows and columns are read. With
                ``pre_sharded=True`` it is already this rank's piece (``[local_size, in_local]``).
            shard_id: ``None``, an int (merged columns) or ``"q"|"k"|"v"`` (QKV).

        Raises:
            ValueError: unknown shard id, a parameter of another layer, or a shape or dtype that
                does not fit (names the layer, the shard and both shapes).
        """
        name = self._param_name(param)
        if name is None:
            raise ValueError(f"{self._name()}: param is not a parameter of this layer")
        if name == "bias":
            self.load_output_rows(param, loaded_weight, shard_id, pre_sharded, None, "bias")
            return
        try:
            self.quant_method.load(self, name, param, loaded_weight, shard_id, pre_sharded)
        except ValueError as e:
            msg = str(e)
            raise ValueError(
                msg if msg.startswith(self._name()) else f"{self._name()}: {msg}"
            ) from None

    # ----------------------------------------------------------------- forward hooks
    def parallel_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input this rank's GEMM consumes: ``x`` or, when the layer slices its input, the
        rank's part of the last dim (``[..., in]`` -> ``[..., in_local]``)."""
        if not self.input_is_sliced:
            return x
        return self._take_input(x, -1)

    def gemm_bias(self) -> torch.Tensor | None:
        """The bias this rank adds inside its GEMM (``None`` if skipped or added elsewhere)."""
        if self.bias is None or self.skip_bias_add or not self._bias_on_this_rank():
            return None
        return self.bias

    def apply_gemm(
        self, x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x W_local^T + bias``: ``[..., in_local]`` -> ``[..., out_local]``.

        ``weight``: a floating-point ``[out_local, in_local]`` weight to use instead of the
        stored one (a LoRA layer passes its pre-merge weight for rows that do not use the merged
        composition); ``None`` or ``self.weight`` itself: the quantization method's GEMM
        (:meth:`QuantizationMethod.apply`). On the CPU the GEMMs are
        :func:`linear_rows_invariant`: the BLAS rounds a row differently depending on how many
        rows share the GEMM, and conditioning vectors (one row per image: timestep embedding,
        adaLN modulation) would then differ between a request alone and in a batch.
        """
        if weight is None or weight is self.weight:
            return self.quant_method.apply(self, x, bias)
        return linear_rows_invariant(x, weight, bias)

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """Combine the ranks' partial outputs. Default: nothing to combine."""
        return y

    def package_output(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, output_bias)``: the bias is returned when ``skip_bias_add``, else ``None``."""
        return y, (self.bias if self.skip_bias_add else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` ``[..., in]`` (or ``[..., in_local]`` when the input is already parallel) ->
        ``(output, output_bias)``; see :meth:`package_output`."""
        y = self.apply_gemm(self.parallel_input(x), self.gemm_bias())
        return self.package_output(self.reduce_output(y))

    # ----------------------------------------------------------------- gather reorder
    def gathered_to_full(self, y_cat: torch.Tensor) -> torch.Tensor:
        """Reorder rank-ordered concatenated outputs ``[..., tp_size * out_local]`` into the full
        layout ``[..., output_size]`` (needed for fused shards and replicated KV heads)."""
        if len(self.shard_map) == 1 and self.output_size == y_cat.shape[-1]:
            return y_cat
        if self._gather_index is None or self._gather_index.device != y_cat.device:
            self._gather_index = self._build_gather_index().to(y_cat.device)
        return y_cat.index_select(-1, self._gather_index)

    def _build_gather_index(self) -> torch.Tensor:
        index = torch.empty(self.output_size, dtype=torch.long)
        filled = torch.zeros(self.output_size, dtype=torch.bool)
        for rank in range(self.tp_size):
            base = rank * self.output_size_per_partition
            for s in self._build_shard_map(rank):
                full = torch.arange(
                    s.full_offset + s.src_offset, s.full_offset + s.src_offset + s.local_size
                )
                new = ~filled[full]
                index[full[new]] = base + s.local_offset + torch.arange(s.local_size)[new]
                filled[full] = True
        return index

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, "
            f"local=({self.output_size_per_partition}, {self.input_size_per_partition}), "
            f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, prefix={self.prefix!r}"
            + (
                f", quant={self.quant_method.describe()}"
                if self.quant_method.name != "unquantized"
                else ""
            )
        )


class ReplicatedLinear(ParallelLinear):
    """Every rank holds the whole weight and computes the whole output; no communication."""


class ColumnParallelLinear(ParallelLinear):
    """Splits the output dim: rank ``r`` holds rows ``[r * out/tp, (r + 1) * out/tp)``.

    Args:
        gather_output: all-gather the outputs so every rank returns ``[..., out]``; otherwise
            each returns its ``[..., out/tp]``.
        (others as :class:`ParallelLinear`)
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        **kwargs,
    ):
        self.gather_output = gather_output
        super().__init__(input_size, output_size, bias=bias, **kwargs)

    def _output_sections(self, tp_rank):
        return [(None, self.output_size, self._divide(self.output_size, "output_size"), tp_rank)]

    def reduce_output(self, y):
        if not self.gather_output or self.tp_size == 1:
            return y
        return self.gathered_to_full(tensor_model_parallel_all_gather(y, dim=-1))

    def package_output(self, y):
        # a gathered output is full width, so the returned bias must be too
        if self.skip_bias_add and self.bias is not None and self.gather_output:
            return y, self.reduce_output(self.bias)
        return super().package_output(y)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused in one GEMM (e.g. gate/up).

    Args:
        output_sizes: full size of each shard; shard ids are ``0, 1, ...``. Each is split over
            the ranks separately, so rank ``r`` holds ``[gate_r | up_r]``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = True,
        gather_output: bool = False,
        **kwargs,
    ):
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size, sum(self.output_sizes), bias=bias, gather_output=gather_output, **kwargs
        )

    def _output_sections(self, tp_rank):
        return [
            (i, size, self._divide(size, f"output_sizes[{i}]"), tp_rank)
            for i, size in enumerate(self.output_sizes)
        ]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection with heads split over the ranks (shard ids ``"q"``, ``"k"``, ``"v"``).

    Grouped-query attention: with ``tp_size > total_num_kv_heads`` each KV head is replicated on
    ``tp_size / total_num_kv_heads`` ranks and rank ``r`` holds KV head ``r // replicas``.

    Args:
        hidden_size: input features.
        head_size: features per head.
        total_num_heads: query heads (must divide by ``tp_size``).
        total_num_kv_heads: key/value heads (default: ``total_num_heads``); must divide by
            ``tp_size`` or ``tp_size`` by it.

    Attributes (local): ``num_heads``, ``num_kv_heads``, ``q_size``, ``kv_size``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        gather_output: bool = False,
        **kwargs,
    ):
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        out = (self.total_num_heads + 2 * self.total_num_kv_heads) * head_size
        super().__init__(hidden_size, out, bias=bias, gather_output=gather_output, **kwargs)
        self.num_heads = self.total_num_heads // self.tp_size
        self.num_kv_heads, _ = self._kv_heads()
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    def _kv_heads(self) -> tuple[int, int]:
        """``(local kv heads, replicas per kv head)``."""
        if self.tp_size >= self.total_num_kv_heads:
            if self.tp_size % self.total_num_kv_heads != 0:
                raise ValueError(
                    f"{self._name()}: tp_size {self.tp_size} is not a multiple of "
                    f"total_num_kv_heads {self.total_num_kv_heads}"
                )
            return 1, self.tp_size // self.total_num_kv_heads
        return self._divide(self.total_num_kv_heads, "total_num_kv_heads"), 1

    def _output_sections(self, tp_rank):
        q_local = self._divide(self.total_num_heads, "total_num_heads") * self.head_size
        kv_heads, replicas = self._kv_heads()
        kv_full = self.total_num_kv_heads * self.head_size
        kv_local = kv_heads * self.head_size
        kv_src = tp_rank // replicas
        return [
            ("q", self.total_num_heads * self.head_size, q_local, tp_rank),
            ("k", kv_full, kv_local, kv_src),
            ("v", kv_full, kv_local, kv_src),
        ]


class RowParallelLinear(ParallelLinear):
    """Splits the input dim: rank ``r`` holds columns ``[r * in/tp, (r + 1) * in/tp)``.

    Each rank's GEMM gives a partial sum; the bias is added on rank 0 only, so the all-reduce
    adds it exactly once.

    Args:
        input_is_parallel: ``x`` is already this rank's ``[..., in/tp]`` (e.g. the output of a
            column-parallel layer); otherwise the layer slices the full ``[..., in]``.
        input_sizes: the full input as consecutive sections (e.g. ``[attn_dim, mlp_dim]`` for an
            input ``[attn | mlp]`` made of two column-parallel outputs), each split over the ranks
            on its own: rank ``r`` holds ``[attn_r | mlp_r]``. Default: one section.
        reduce_results: all-reduce the partial outputs; with ``False`` the caller reduces, which
            is only allowed without a fused bias (it would be added on every rank... and summed).

    Raises:
        ValueError: ``reduce_results=False`` with a bias that is not ``skip_bias_add``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        input_sizes: Sequence[int] | None = None,
        **kwargs,
    ):
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_sizes = [input_size] if input_sizes is None else [int(s) for s in input_sizes]
        super().__init__(input_size, output_size, bias=bias, **kwargs)

    def _check_flags(self, bias):
        if bias and not self.reduce_results and not self.skip_bias_add:
            raise ValueError(
                f"{self._name()}: reduce_results=False with a fused bias would add the bias "
                "on every rank; use skip_bias_add=True and add it after the reduce"
            )

    def _input_sections(self, tp_rank):
        return [
            (
                size,
                self._divide(
                    size, "input_size" if len(self.input_sizes) == 1 else f"input_sizes[{i}]"
                ),
                tp_rank,
            )
            for i, size in enumerate(self.input_sizes)
        ]

    def _bias_on_this_rank(self):
        return self.tp_rank == 0

    @property
    def input_is_sliced(self):
        return not self.input_is_parallel

    def reduce_output(self, y):
        if not self.reduce_results or self.tp_size == 1:
            return y
        return tensor_model_parallel_all_reduce(y)
