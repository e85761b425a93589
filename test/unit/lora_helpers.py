"""Shared builders for the LoRA layer tests: small parallel layers, random adapters, dense references.

The reference for every check is a dense ``F.linear`` on the full (unsharded) weight:
``y = x (W + sum_i s_i c_i B_i A_i)^T + b + sum_i s_i c_i offset_i``, computed in fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.lora import LoRAWeights

IN = 48
# kind -> (constructor, full output size, shard ids of the fused layout)
KINDS = ("column", "merged", "qkv", "row", "row_full_input", "replicated")
MERGED_SIZES = (32, 16)
QKV = dict(head_size=4, total_num_heads=8, total_num_kv_heads=2)  # GQA: kv replicated at TP 4
QKV_SIZES = {"q": 32, "k": 8, "v": 8}


def out_size(kind: str) -> int:
    return {"merged": sum(MERGED_SIZES), "qkv": sum(QKV_SIZES.values())}.get(kind, 32)


def shard_layout(kind: str) -> dict:
    """``{shard_id: (full_offset, full_rows)}`` of the fused full weight."""
    if kind == "merged":
        return {0: (0, MERGED_SIZES[0]), 1: (MERGED_SIZES[0], MERGED_SIZES[1])}
    if kind == "qkv":
        return {"q": (0, 32), "k": (32, 8), "v": (40, 8)}
    return {None: (0, 32)}


def build_layer(
    kind, tp_rank=None, tp_size=None, dtype=torch.float32, bias=True, prefix=None, **kw
):
    """An empty layer of ``kind`` as rank ``tp_rank`` of ``tp_size`` (no process group needed)."""
    common = dict(
        bias=bias, params_dtype=dtype, prefix=prefix or kind, tp_rank=tp_rank, tp_size=tp_size
    )
    common.update(kw)
    if kind == "column":
        return ColumnParallelLinear(IN, 32, **common)
    if kind == "merged":
        return MergedColumnParallelLinear(IN, list(MERGED_SIZES), **common)
    if kind == "qkv":
        return QKVParallelLinear(IN, **QKV, **common)
    if kind == "row":
        return RowParallelLinear(IN, 32, input_is_parallel=True, **common)
    if kind == "row_full_input":
        return RowParallelLinear(IN, 32, input_is_parallel=False, **common)
    if kind == "replicated":
        return ReplicatedLinear(IN, 32, **common)
    raise ValueError(kind)


def full_weights(kind, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_size(kind), IN, generator=g) / IN**0.5
    b = torch.randn(out_size(kind), generator=g)
    return w.to(dtype), b.to(dtype)


def load(layer, w, b):
    layer.weight_loader(layer.weight, w)
    if b is not None and layer.bias is not None:
        layer.weight_loader(layer.bias, b)
    return layer


def random_adapter(kind, seed, ranks=(4,), fused=False, offset=False, scale=None, dtype=None):
    """``{shard_id: LoRAWeights}`` with random non-zero A/B (full layout).

    ``ranks`` gives one rank per shard (cycled) so q/k/v sections get unequal ranks; ``fused``
    keys one pair by ``None`` covering the whole fused output instead.
    """
    g = torch.Generator().manual_seed(seed)
    layout = {None: (0, out_size(kind))} if fused else shard_layout(kind)
    out = {}
    for i, (sid, (_, rows)) in enumerate(layout.items()):
        r = ranks[i % len(ranks)]
        a = torch.randn(r, IN, generator=g) / IN**0.5
        bm = torch.randn(rows, r, generator=g) / r**0.5
        off = torch.randn(rows, generator=g) if offset else None
        c = scale if scale is not None else float(1.0 + 0.25 * i + 0.1 * (seed % 5))
        if dtype is not None:
            a, bm = a.to(dtype), bm.to(dtype)
            off = off.to(dtype) if off is not None else None
        out[sid] = LoRAWeights(a, bm, c, off)
    return out


def dense_delta(kind, adapters):
    """``(delta_W [out, in], offset [out])`` in fp64 for ``[(weights, strength), ...]``."""
    layout = shard_layout(kind)
    dw = torch.zeros(out_size(kind), IN, dtype=torch.float64)
    off = torch.zeros(out_size(kind), dtype=torch.float64)
    for weights, strength in adapters:
        for sid, w in weights.items():
            start, rows = (0, out_size(kind)) if sid is None else layout[sid]
            c = strength * w.scale
            dw[start : start + rows] += c * (w.lora_B.double() @ w.lora_A.double())
            if w.offset is not None:
                off[start : start + rows] += c * w.offset.double()
    return dw, off


def dense_reference(kind, w, b, x, adapters):
    """Full output ``[..., out]`` in fp64."""
    dw, off = dense_delta(kind, adapters)
    y = F.linear(x.double(), w.double() + dw)
    if b is not None:
        y = y + b.double()
    return y + off


def rank_input(kind, x, tp_rank, tp_size):
    """What rank ``tp_rank`` is fed: the slice of ``x`` for a row layer with a parallel input."""
    if kind != "row":
        return x
    n = IN // tp_size
    return x[..., tp_rank * n : (tp_rank + 1) * n]


# QKV (8 query heads, 2 KV heads, head size 4): the KV heads rank r of n holds. At TP 4 each KV
# head is replicated on two ranks (GQA). Written out by hand, not taken from the shard map.
KV_HEADS_OF_RANK = {1: {0: (0, 1)}, 2: {0: (0,), 1: (1,)}, 4: {0: (0,), 1: (0,), 2: (1,), 3: (1,)}}


def rank_rows(kind, tp_rank, tp_size) -> list[int]:
    """Rows of the full (fused) output that rank ``tp_rank`` of ``tp_size`` computes, in the order
    of its local output, by hand: ``[q_r | k_r | v_r]`` and ``[gate_r | up_r]`` for fused layers."""
    r, n = tp_rank, tp_size
    if kind in ("row", "row_full_input", "replicated"):
        return list(range(out_size(kind)))
    if kind == "column":
        return list(range(r * 32 // n, (r + 1) * 32 // n))
    if kind == "merged":
        g, u = MERGED_SIZES[0] // n, MERGED_SIZES[1] // n
        return [*range(r * g, (r + 1) * g), *range(32 + r * u, 32 + (r + 1) * u)]
    if kind == "qkv":
        q = 32 // n
        kv = [h * 4 + i for h in KV_HEADS_OF_RANK[n][r] for i in range(4)]
        return [*range(r * q, (r + 1) * q), *(32 + i for i in kv), *(40 + i for i in kv)]
    raise ValueError(kind)


def assemble(kind, layers, outs):
    """Combine per-rank outputs ``[..., out_local]`` into the full ``[..., out]`` in fp64: the sum
    for row-parallel layers, else each rank's values at its rows from :func:`rank_rows` (ranks
    that hold the same replicated rows must agree)."""
    if kind in ("row", "row_full_input"):
        return sum(o.double() for o in outs)
    if kind == "replicated":
        for o in outs[1:]:
            assert torch.equal(o, outs[0])
        return outs[0].double()
    full = torch.full((*outs[0].shape[:-1], out_size(kind)), float("nan"), dtype=torch.float64)
    for r, o in enumerate(outs):
        rows = rank_rows(kind, r, len(outs))
        assert o.shape[-1] == len(rows), (kind, r, o.shape)
        before = full[..., rows]
        held = ~before.isnan()
        assert torch.equal(before[held], o.double()[held]), f"{kind}: replicas of rank {r} differ"
        full[..., rows] = o.double()
    assert not full.isnan().any(), f"{kind}: rows no rank computed"
    return full
