"""ParallelLinear family with real collectives: 2 and 4 gloo processes on the CPU.

Every rank builds each layer from the same seeded full weights, runs the real ``forward`` (with
its all-reduce / all-gather), and returns the output; the parent compares with ``F.linear``.
All layers share one launch per TP size to keep process start-up cost low.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sglang.multimodal_gen.distributed import (
    broadcast_object,
    get_tp_rank,
    get_tp_world_size,
    launch_processes,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)


def _weights(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        "x": r(5, 48),
        "col_w": r(32, 48),
        "col_b": r(32),
        "merged_w": r(64, 48),
        "merged_b": r(64),
        "qkv_w": r((8 + 2 * 2) * 4, 48),
        "qkv_b": r((8 + 2 * 2) * 4),
        "row_w": r(24, 48),
        "row_b": r(24),
    }


def _rank_fn(rank, seed):
    w = _weights(seed)
    n = get_tp_world_size()
    assert get_tp_rank() == rank
    out = {}

    def load(layer, W, b):
        layer.weight_loader(layer.weight, W)
        if b is not None:
            layer.weight_loader(layer.bias, b)
        return layer

    col = load(
        ColumnParallelLinear(48, 32, gather_output=True, prefix="col"), w["col_w"], w["col_b"]
    )
    out["column_gather"] = col(w["x"])[0]
    col_local = load(ColumnParallelLinear(48, 32, gather_output=False), w["col_w"], w["col_b"])
    out["column_local"] = col_local(w["x"])[0]
    col_skip = load(
        ColumnParallelLinear(48, 32, gather_output=True, skip_bias_add=True), w["col_w"], w["col_b"]
    )
    y, ob = col_skip(w["x"])
    out["column_gather_skip_bias"] = y + ob
    merged = load(
        MergedColumnParallelLinear(48, [32, 32], gather_output=True), w["merged_w"], w["merged_b"]
    )
    out["merged_gather"] = merged(w["x"])[0]
    # GQA: 2 kv heads, so TP 4 replicates each kv head on 2 ranks
    qkv = load(QKVParallelLinear(48, 4, 8, 2, gather_output=True), w["qkv_w"], w["qkv_b"])
    out["qkv_gather"] = qkv(w["x"])[0]
    row_full = load(RowParallelLinear(48, 24, input_is_parallel=False), w["row_w"], w["row_b"])
    out["row_full_input"] = row_full(w["x"])[0]
    row_par = load(RowParallelLinear(48, 24, input_is_parallel=True), w["row_w"], w["row_b"])
    x_local = w["x"].chunk(n, dim=-1)[rank]
    out["row_parallel_input"] = row_par(x_local)[0]
    row_skip = load(
        RowParallelLinear(48, 24, input_is_parallel=False, skip_bias_add=True),
        w["row_w"],
        w["row_b"],
    )
    y, ob = row_skip(w["x"])
    out["row_skip_bias"] = y + ob
    row_noreduce = load(
        RowParallelLinear(48, 24, input_is_parallel=False, reduce_results=False, bias=False),
        w["row_w"],
        None,
    )
    out["row_no_reduce_then_reduce"] = tensor_model_parallel_all_reduce(row_noreduce(w["x"])[0])
    # a column -> row MLP: one all-reduce for the pair (Megatron pattern)
    up = load(ColumnParallelLinear(48, 32), w["col_w"], w["col_b"])
    down = load(RowParallelLinear(32, 24), w["row_w"][:, :32].contiguous(), w["row_b"])
    out["mlp"] = down(F.gelu(up(w["x"])[0]))[0]
    out["gather_rank_ids"] = tensor_model_parallel_all_gather(torch.tensor([[float(rank)]]))
    out["broadcast"] = broadcast_object({"rank0": rank} if rank == 0 else None)
    return out


def _reference(seed):
    w = _weights(seed)
    lin = F.linear
    row_ref = lin(w["x"], w["row_w"], w["row_b"])
    return {
        "column_gather": lin(w["x"], w["col_w"], w["col_b"]),
        "column_gather_skip_bias": lin(w["x"], w["col_w"], w["col_b"]),
        "merged_gather": lin(w["x"], w["merged_w"], w["merged_b"]),
        "qkv_gather": lin(w["x"], w["qkv_w"], w["qkv_b"]),
        "row_full_input": row_ref,
        "row_parallel_input": row_ref,
        "row_skip_bias": row_ref,
        "row_no_reduce_then_reduce": lin(w["x"], w["row_w"]),
        "mlp": lin(F.gelu(lin(w["x"], w["col_w"], w["col_b"])), w["row_w"][:, :32], w["row_b"]),
    }


@pytest.mark.parametrize("tp_size", [2, 4])
def test_real_collectives_match_f_linear(tp_size):
    seed = 1000 + tp_size  # fixed: a failure reproduces with the same numbers
    results = launch_processes(_rank_fn, tp_size, args=(seed,), backend="gloo")
    ref = _reference(seed)
    for rank, out in enumerate(results):
        for key, expected in ref.items():
            torch.testing.assert_close(
                out[key], expected, atol=1e-5, rtol=1e-5, msg=f"{key} rank {rank}"
            )
        # the un-gathered column output is this rank's rows
        rows = slice(rank * 32 // tp_size, (rank + 1) * 32 // tp_size)
        torch.testing.assert_close(
            out["column_local"], ref["column_gather"][:, rows], atol=1e-5, rtol=1e-5
        )
        assert out["gather_rank_ids"].flatten().tolist() == list(map(float, range(tp_size)))
        assert out["broadcast"] == {"rank0": 0}
