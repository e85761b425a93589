"""ParallelLinear family against ``F.linear`` on the full weights.

Each layer is built "as rank r of n" in one process, loaded from the same full checkpoint, run on
its input, and the ranks' outputs are combined the way the collective would (sum for row-parallel,
concatenation for column-parallel). The expected per-rank rows are derived here from head/shard
arithmetic, independently of the layer's shard map. ``linear/test_gloo.py`` runs the same
comparison with real collectives.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import sglang.multimodal_gen.layers.linear as linear_mod
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

# fp32: the sum over ranks reorders the additions. bf16: each rank rounds its partial output
# (|partial| up to ~3*sqrt(in) ~ 18) once to 8 mantissa bits, so atol ~ n * 18 * 2**-9.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=6e-2, rtol=1.6e-2)}


@pytest.fixture(autouse=True)
def _fixed_seed(request):
    """Seed the global generator per test (from its id), so a failure reproduces exactly."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    return seed


def _rand(*shape, dtype=torch.float32):
    """Fresh normal values (global generator, seeded per test by ``_fixed_seed``), rounded to
    ``dtype`` and held in fp32 so the reference sees exactly the numbers the layer sees."""
    return torch.randn(*shape).to(dtype).float()


def _expected_rows_qkv(heads, kv_heads, head_size, n, r):
    """Row indices of the full q|k|v weight that rank r of n must hold (GQA replication)."""
    q = torch.arange(heads * head_size)
    qs = heads // n * head_size
    if n >= kv_heads:
        kv_rank, kvs = r // (n // kv_heads), head_size
    else:
        kv_rank, kvs = r, kv_heads // n * head_size
    q_off, k_off = heads * head_size, heads * head_size + kv_heads * head_size
    return torch.cat(
        [
            q[r * qs : (r + 1) * qs],
            q_off + torch.arange(kv_rank * kvs, (kv_rank + 1) * kvs),
            k_off + torch.arange(kv_rank * kvs, (kv_rank + 1) * kvs),
        ]
    )


def _expected_rows_merged(sizes, n, r):
    rows, off = [], 0
    for s in sizes:
        local = s // n
        rows.append(off + torch.arange(r * local, (r + 1) * local))
        off += s
    return torch.cat(rows)


def simulate_forward(layers, xs, monkeypatch):
    """Run the real ``forward`` of every rank's layer in one process.

    The collectives of ``layers.linear`` are replaced by an emulation: a first pass records what
    each rank hands to each collective call, a second pass answers call ``i`` of every rank with
    the sum (all-reduce) or the rank-ordered concatenation (all-gather) of the ranks' call ``i``.
    Returns each rank's ``(output, output_bias)``.
    """
    n = len(layers)
    seen = [[] for _ in range(n)]

    def record(r):
        def all_reduce(t):
            seen[r].append(t.clone())
            return t

        def all_gather(t, dim=-1):
            seen[r].append(t.clone())
            return torch.cat([t] * n, dim=dim)  # right shape; values unused

        return all_reduce, all_gather

    def answer(r):
        calls = iter(range(len(seen[r])))

        def all_reduce(t):
            i = next(calls)
            return sum(seen[q][i].float() for q in range(n)).to(t.dtype)

        def all_gather(t, dim=-1):
            i = next(calls)
            return torch.cat([seen[q][i] for q in range(n)], dim=dim)

        return all_reduce, all_gather

    outs = []
    for phase in (record, answer):
        outs = []
        for r, (layer, x) in enumerate(zip(layers, xs)):
            reduce_fn, gather_fn = phase(r)
            monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_reduce", reduce_fn)
            monkeypatch.setattr(linear_mod, "tensor_model_parallel_all_gather", gather_fn)
            outs.append(layer(x))
    monkeypatch.undo()
    return outs


def _load(layer, W, b, per_shard=None):
    """Load full weights; ``per_shard``: ``{shard_id: row slice}`` to load shard by shard."""
    for param, t in [(layer.weight, W)] + ([(layer.bias, b)] if layer.bias is not None else []):
        if per_shard:
            for sid, sl in per_shard.items():
                layer.weight_loader(param, t[sl], sid)
        else:
            layer.weight_loader(param, t)
    return layer


def _check_column_outputs(outs, ref, b, rows_of, bias, skip, gather, tol):
    """Column family: full output if gathered, else this rank's rows; the bias likewise."""
    for r, (y, ob) in enumerate(outs):
        rows = slice(None) if gather else rows_of(r)
        torch.testing.assert_close(y.float(), ref[:, rows], **tol)
        if bias and skip:
            torch.testing.assert_close(ob.float(), b[rows], **tol)
        else:
            assert ob is None


# ------------------------------------------------------------------ column family
COLUMN_CASES = list(itertools.product([1, 2, 3, 4], [True, False], [True, False], [True, False]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,bias,skip_bias_add,gather_output", COLUMN_CASES)
def test_column_parallel_matches_f_linear(
    n, bias, skip_bias_add, gather_output, dtype, monkeypatch
):
    in_f, out_f = 24, 36
    W, b, x = (
        _rand(out_f, in_f, dtype=dtype),
        _rand(out_f, dtype=dtype),
        _rand(5, in_f, dtype=dtype),
    )
    ref = F.linear(x, W, b if (bias and not skip_bias_add) else None)
    layers = [
        _load(
            ColumnParallelLinear(
                in_f,
                out_f,
                bias=bias,
                gather_output=gather_output,
                skip_bias_add=skip_bias_add,
                params_dtype=dtype,
                tp_rank=r,
                tp_size=n,
            ),
            W,
            b,
        )
        for r in range(n)
    ]
    outs = simulate_forward(layers, [x.to(dtype)] * n, monkeypatch)
    rows_of = lambda r: torch.arange(r * out_f // n, (r + 1) * out_f // n)  # noqa: E731
    _check_column_outputs(outs, ref, b, rows_of, bias, skip_bias_add, gather_output, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_shard", [True, False])
@pytest.mark.parametrize(
    "n,bias,skip_bias_add,gather_output",
    list(itertools.product([1, 2, 3, 4], [True, False], [True, False], [True, False])),
)
def test_merged_column_matches_f_linear(
    n, bias, skip_bias_add, gather_output, per_shard, dtype, monkeypatch
):
    in_f, sizes = 20, [24, 36]
    W, b, x = (
        _rand(sum(sizes), in_f, dtype=dtype),
        _rand(sum(sizes), dtype=dtype),
        _rand(4, in_f, dtype=dtype),
    )
    ref = F.linear(x, W, b if (bias and not skip_bias_add) else None)
    shards = {0: slice(0, sizes[0]), 1: slice(sizes[0], None)} if per_shard else None
    layers = [
        _load(
            MergedColumnParallelLinear(
                in_f,
                sizes,
                bias=bias,
                gather_output=gather_output,
                skip_bias_add=skip_bias_add,
                params_dtype=dtype,
                tp_rank=r,
                tp_size=n,
            ),
            W,
            b,
            shards,
        )
        for r in range(n)
    ]
    outs = simulate_forward(layers, [x.to(dtype)] * n, monkeypatch)
    rows_of = lambda r: _expected_rows_merged(sizes, n, r)  # noqa: E731
    _check_column_outputs(outs, ref, b, rows_of, bias, skip_bias_add, gather_output, TOL[dtype])


# (heads, kv_heads) with tp sizes both below and above the KV head count
QKV_CASES = [
    (n, h, kv, per_shard, bias, gather)
    for n in [1, 2, 3, 4]
    for h, kv in [(12, 12), (12, 4), (12, 2), (12, 1), (12, 3)]
    if h % n == 0 and ((kv % n == 0) or (n % kv == 0))
    for per_shard in [True, False]
    for bias in [True, False]
    for gather in [True, False]
]


@pytest.mark.parametrize("n,heads,kv_heads,per_shard,bias,gather_output", QKV_CASES)
def test_qkv_parallel_matches_f_linear(
    n, heads, kv_heads, per_shard, bias, gather_output, monkeypatch
):
    hs, hidden = 4, 16
    q_rows, kv_rows = heads * hs, kv_heads * hs
    W, b, x = _rand(q_rows + 2 * kv_rows, hidden), _rand(q_rows + 2 * kv_rows), _rand(3, hidden)
    ref = F.linear(x, W, b if bias else None)
    shards = (
        {
            "q": slice(0, q_rows),
            "k": slice(q_rows, q_rows + kv_rows),
            "v": slice(q_rows + kv_rows, None),
        }
        if per_shard
        else None
    )
    layers = [
        _load(
            QKVParallelLinear(
                hidden,
                hs,
                heads,
                kv_heads,
                bias=bias,
                gather_output=gather_output,
                tp_rank=r,
                tp_size=n,
            ),
            W,
            b,
            shards,
        )
        for r in range(n)
    ]
    for layer in layers:
        assert layer.num_heads == heads // n
        assert layer.num_kv_heads == max(1, kv_heads // n)
    outs = simulate_forward(layers, [x] * n, monkeypatch)
    rows_of = lambda r: _expected_rows_qkv(heads, kv_heads, hs, n, r)  # noqa: E731
    _check_column_outputs(outs, ref, b, rows_of, bias, False, gather_output, TOL[torch.float32])


# ------------------------------------------------------------------ row / replicated
ROW_CASES = [
    (n, bias, skip, iip, rr)
    for n, bias, skip, iip, rr in itertools.product(
        [1, 2, 3, 4], [True, False], [True, False], [True, False], [True, False]
    )
    if not (bias and not rr and not skip)  # that combination must raise (tested below)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,bias,skip_bias_add,input_is_parallel,reduce_results", ROW_CASES)
def test_row_parallel_matches_f_linear(
    n, bias, skip_bias_add, input_is_parallel, reduce_results, dtype, monkeypatch
):
    in_f, out_f = 36, 20
    W, b, x = (
        _rand(out_f, in_f, dtype=dtype),
        _rand(out_f, dtype=dtype),
        _rand(6, in_f, dtype=dtype),
    )
    ref = F.linear(x, W, b if (bias and not skip_bias_add) else None)
    layers = [
        _load(
            RowParallelLinear(
                in_f,
                out_f,
                bias=bias,
                skip_bias_add=skip_bias_add,
                input_is_parallel=input_is_parallel,
                reduce_results=reduce_results,
                params_dtype=dtype,
                tp_rank=r,
                tp_size=n,
            ),
            W,
            b,
        )
        for r in range(n)
    ]
    xs = [
        (x[:, r * in_f // n : (r + 1) * in_f // n] if input_is_parallel else x).to(dtype)
        for r in range(n)
    ]
    outs = simulate_forward(layers, xs, monkeypatch)
    if reduce_results:
        for y, _ in outs:
            torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    else:  # the caller reduces
        torch.testing.assert_close(sum(y.float() for y, _ in outs), ref, **TOL[dtype])
    for _, ob in outs:
        if bias and skip_bias_add:
            torch.testing.assert_close(ob.float(), b)
        else:
            assert ob is None


@pytest.mark.parametrize("bias,skip", [(True, True), (True, False), (False, False)])
def test_replicated_matches_f_linear(bias, skip):
    W, b, x = _rand(10, 12), _rand(10), _rand(2, 12)
    layer = ReplicatedLinear(12, 10, bias=bias, skip_bias_add=skip, tp_rank=1, tp_size=2)
    layer.weight_loader(layer.weight, W)
    if bias:
        layer.weight_loader(layer.bias, b)
    y, ob = layer(x)
    torch.testing.assert_close(y, F.linear(x, W, b if bias and not skip else None))
    assert (ob is b or ob is None) if not bias else (ob is not None) == skip


# ------------------------------------------------------------------ loading invariances
def test_presharded_load_equals_full_load():
    heads, kv, hs, hidden, n = 8, 2, 4, 16, 4
    W = _rand((heads + 2 * kv) * hs, hidden)
    q, k, v = W.split([heads * hs, kv * hs, kv * hs])
    for r in range(n):
        a = QKVParallelLinear(hidden, hs, heads, kv, bias=False, tp_rank=r, tp_size=n)
        a.weight_loader(a.weight, W)
        b = QKVParallelLinear(hidden, hs, heads, kv, bias=False, tp_rank=r, tp_size=n)
        # pre-sharded pieces cut here by torch.chunk (replicated kv heads: rank // 2)
        b.weight_loader(b.weight, q.chunk(n)[r], "q", pre_sharded=True)
        b.weight_loader(b.weight, k.chunk(kv)[r // (n // kv)], "k", pre_sharded=True)
        b.weight_loader(b.weight, v.chunk(kv)[r // (n // kv)], "v", pre_sharded=True)
        assert torch.equal(a.weight, b.weight)
    Wr = _rand(8, 32)
    for r in range(n):
        a = RowParallelLinear(32, 8, bias=False, tp_rank=r, tp_size=n)
        a.weight_loader(a.weight, Wr)
        b = RowParallelLinear(32, 8, bias=False, tp_rank=r, tp_size=n)
        b.weight_loader(b.weight, Wr.chunk(n, dim=1)[r], pre_sharded=True)
        assert torch.equal(a.weight, b.weight)


def test_lazy_safetensors_slice_load_equals_tensor_load(tmp_path):
    sizes, in_f, n = [16, 24], 12, 2
    W = _rand(sum(sizes), in_f)
    path = tmp_path / "w.safetensors"
    save_file({"w1": W[:16].clone(), "w3": W[16:].clone(), "fused": W.clone()}, path)
    with safe_open(path, "pt") as f:
        for r in range(n):
            ref = MergedColumnParallelLinear(in_f, sizes, bias=False, tp_rank=r, tp_size=n)
            ref.weight_loader(ref.weight, W)
            lazy = MergedColumnParallelLinear(in_f, sizes, bias=False, tp_rank=r, tp_size=n)
            lazy.weight_loader(lazy.weight, f.get_slice("w1"), 0)
            lazy.weight_loader(lazy.weight, f.get_slice("w3"), 1)
            assert torch.equal(ref.weight, lazy.weight)
            fused = MergedColumnParallelLinear(in_f, sizes, bias=False, tp_rank=r, tp_size=n)
            fused.weight_loader(fused.weight, f.get_slice("fused"))
            assert torch.equal(ref.weight, fused.weight)


def test_shard_output_and_input_tensor_follow_the_shard_map():
    layer = QKVParallelLinear(16, 4, 8, 2, bias=False, tp_rank=3, tp_size=4)
    full = _rand(layer.output_size, 5)
    rows = _expected_rows_qkv(8, 2, 4, 4, 3)
    assert torch.equal(layer.shard_output_tensor(full), full[rows])
    k_full = full[32:40]
    assert torch.equal(layer.shard_output_tensor(k_full, "k"), k_full[4:8])
    row = RowParallelLinear(32, 8, tp_rank=1, tp_size=4)
    A = _rand(3, 32)
    assert torch.equal(row.shard_input_tensor(A), A[:, 8:16])


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "build,message",
    [
        (
            lambda: ColumnParallelLinear(8, 30, tp_rank=0, tp_size=4, prefix="blk.proj"),
            "ColumnParallelLinear(blk.proj): output_size 30 is not divisible by tp_size 4",
        ),
        (
            lambda: RowParallelLinear(30, 8, tp_rank=0, tp_size=4, prefix="blk.w2"),
            "RowParallelLinear(blk.w2): input_size 30 is not divisible by tp_size 4",
        ),
        (
            lambda: MergedColumnParallelLinear(8, [16, 18], tp_rank=0, tp_size=4, prefix="ff.w13"),
            "MergedColumnParallelLinear(ff.w13): output_sizes[1] 18 is not divisible by tp_size 4",
        ),
        (
            lambda: QKVParallelLinear(16, 4, 6, 6, tp_rank=0, tp_size=4, prefix="attn.qkv"),
            "QKVParallelLinear(attn.qkv): total_num_heads 6 is not divisible by tp_size 4",
        ),
        (
            lambda: QKVParallelLinear(16, 4, 12, 3, tp_rank=0, tp_size=4, prefix="attn.qkv"),
            "QKVParallelLinear(attn.qkv): tp_size 4 is not a multiple of total_num_kv_heads 3",
        ),
        (
            lambda: QKVParallelLinear(16, 4, 12, 6, tp_rank=0, tp_size=4, prefix="attn.qkv"),
            "QKVParallelLinear(attn.qkv): total_num_kv_heads 6 is not divisible by tp_size 4",
        ),
        (
            lambda: RowParallelLinear(8, 8, reduce_results=False, tp_rank=0, tp_size=2, prefix="o"),
            "RowParallelLinear(o): reduce_results=False with a fused bias",
        ),
        (
            lambda: ColumnParallelLinear(8, 8, tp_rank=2, tp_size=2, prefix="c"),
            "ColumnParallelLinear(c): tp_rank 2 not in [0, 2)",
        ),
    ],
)
def test_constructor_errors_name_the_layer_and_numbers(build, message):
    with pytest.raises(ValueError) as e:
        build()
    assert message in str(e.value)


def test_weight_loader_errors():
    layer = QKVParallelLinear(16, 4, 8, 2, tp_rank=0, tp_size=2, prefix="attn.qkv")
    with pytest.raises(ValueError, match=r"shard 'k' has shape \[4, 16\], expected \[8, 16\]"):
        layer.weight_loader(layer.weight, torch.zeros(4, 16), "k")
    with pytest.raises(ValueError, match=r"unknown shard_id 'x'; valid: \['q', 'k', 'v'\]"):
        layer.weight_loader(layer.weight, torch.zeros(8, 16), "x")
    with pytest.raises(ValueError, match=r"has shape \[48, 15\], expected \[48, 16\]"):
        layer.weight_loader(layer.weight, torch.zeros(48, 15))
    layer.weight.data.normal_()
    before = layer.weight.clone()
    with pytest.raises(ValueError):
        layer.weight_loader(layer.weight, torch.zeros(4, 16), "q", pre_sharded=True)
    assert torch.equal(before, layer.weight)


def test_unsliced_forward_returns_output_and_bias_convention():
    W, b, x = _rand(6, 4), _rand(6), _rand(2, 4)
    layer = ColumnParallelLinear(4, 6, skip_bias_add=True)
    layer.weight_loader(layer.weight, W)
    layer.weight_loader(layer.bias, b)
    y, ob = layer(x)
    torch.testing.assert_close(y, F.linear(x, W))
    assert ob is layer.bias
    layer.skip_bias_add = False
    y, ob = layer(x)
    torch.testing.assert_close(y, F.linear(x, W, b))
    assert ob is None
