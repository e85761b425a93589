"""Every LoRA wrapper against the dense ``F.linear`` reference at TP 1, 2 and 4.

Two ways to run TP: a one-process simulation (each rank's layer built with explicit
``tp_rank``/``tp_size``; the test combines the partial outputs like the collective would), and real
gloo processes through ``launch_processes`` (the layer's own all-reduce / all-gather).
Modes: unmerged (two adapters, fused compose), merged, disabled, and with output offsets.
Includes the regression ``RowParallelLinear(input_is_parallel=False)`` at TP > 1 unmerged: the
LoRA ``A`` matmul must see the rank's input slice, not the full input.

Tolerances (fp32 layers vs fp64 reference): atol 2e-5, rtol 1e-5; measured at most 3.4e-6 absolute
(outputs up to ~10) over every kind, mode and TP size. The references place each rank's rows by a
hand-written table (``fixtures.lora_layers.rank_rows``), not by the layers' shard map. Also
``replace_submodule``, which puts a wrapper in a model.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.lora_layers import (
    IN,
    KINDS,
    assemble,
    build_layer,
    dense_reference,
    full_weights,
    load,
    random_adapter,
    rank_input,
)
from sglang.multimodal_gen.distributed import get_tp_rank, get_tp_world_size, launch_processes
from sglang.multimodal_gen.layers.lora import (
    BaseLayerWithLoRA,
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    ReplicatedLinearWithLoRA,
    RowParallelLinearWithLoRA,
    replace_submodule,
    wrap_with_lora,
)

ATOL, RTOL = 2e-5, 1e-5  # measured max abs error 3.4e-6 (see the docstring)
MODES = ("unmerged", "merged", "disabled", "offset_unmerged", "offset_merged")
STRENGTHS = (0.7, -1.3)


def _adapters(kind, seed, offset):
    a1 = random_adapter(kind, seed, ranks=(4, 2, 6), offset=offset)
    a2 = random_adapter(kind, seed + 1, ranks=(3,), fused=True, offset=offset)
    return [(a1, STRENGTHS[0]), (a2, STRENGTHS[1])]


def _run_rank(kind, mode, tp_rank, tp_size, seed, x):
    """Build, load and run rank ``tp_rank``'s LoRA layer; returns (layer, output)."""
    w, b = full_weights(kind, seed)
    base = load(build_layer(kind, tp_rank, tp_size), w, b)
    layer = wrap_with_lora(base)
    adapters = _adapters(kind, seed + 10, offset=mode.startswith("offset"))
    for i, (weights, _) in enumerate(adapters):
        layer.add_adapter(f"a{i}", weights)
    if mode != "disabled":
        layer.set_active([(f"a{i}", s) for i, (_, s) in enumerate(adapters)])
    if mode.endswith("merged") and not mode.endswith("unmerged"):
        layer.merge()
        assert layer.merged
    out, out_bias = layer(rank_input(kind, x, tp_rank, tp_size))
    assert out_bias is None
    return layer, out


def _expected(kind, mode, seed, x):
    w, b = full_weights(kind, seed)
    adapters = [] if mode == "disabled" else _adapters(kind, seed + 10, mode.startswith("offset"))
    return dense_reference(kind, w, b, x, adapters)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_simulated_tp_matches_dense(kind, mode, tp_size):
    seed = 100 + KINDS.index(kind) * 7 + tp_size
    x = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(seed))
    layers, outs = zip(*(_run_rank(kind, mode, r, tp_size, seed, x) for r in range(tp_size)))
    got = assemble(kind, layers, outs)
    torch.testing.assert_close(got, _expected(kind, mode, seed, x), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_row_full_input_regression_uses_rank_slice(tp_size):
    """Unmerged LoRA on RowParallelLinear(input_is_parallel=False): each rank's A sees x_local.

    Feeding the full input to the A matmul would count the delta ``tp_size`` times (or fail on
    shapes); compare against the reference and against a deliberately wrong "full input" sum.
    """
    seed = 7
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(seed))
    layers, outs = zip(
        *(_run_rank("row_full_input", "unmerged", r, tp_size, seed, x) for r in range(tp_size))
    )
    for layer in layers:
        assert layer.lora_a.shape[2] == IN // tp_size  # A holds the rank's input columns
    got = assemble("row_full_input", layers, outs)
    want = _expected("row_full_input", "unmerged", seed, x)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_wrapper_table_most_specific_first():
    expected = {
        "column": ColumnParallelLinearWithLoRA,
        "merged": MergedColumnParallelLinearWithLoRA,
        "qkv": QKVParallelLinearWithLoRA,
        "row": RowParallelLinearWithLoRA,
        "row_full_input": RowParallelLinearWithLoRA,
        "replicated": ReplicatedLinearWithLoRA,
    }
    for kind, cls in expected.items():
        layer = wrap_with_lora(build_layer(kind))
        assert type(layer) is cls
        assert wrap_with_lora(layer) is layer
    with pytest.raises(TypeError, match="no LoRA wrapper"):
        wrap_with_lora(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError):
        BaseLayerWithLoRA(torch.nn.Linear(2, 2))


def test_skip_bias_add_returns_bias_and_offsets_once():
    """skip_bias_add: output_bias is the base bias; LoRA offsets go into the output, once."""
    seed = 3
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(seed))
    w, b = full_weights("row", seed)
    adapters = [(random_adapter("row", seed + 1, offset=True), 0.5)]
    outs, layers = [], []
    for r in range(2):
        layer = wrap_with_lora(load(build_layer("row_full_input", r, 2, skip_bias_add=True), w, b))
        layer.add_adapter("a", adapters[0][0])
        layer.set_active([("a", 0.5)])
        out, out_bias = layer(x)
        torch.testing.assert_close(out_bias, b)
        outs.append(out)
        layers.append(layer)
    got = assemble("row_full_input", layers, outs)
    want = dense_reference("row", w, None, x, adapters)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- real gloo
def _gloo_rank_fn(rank, seed):
    """Every kind x mode on this rank, with the layer's real collectives; outputs to the parent."""
    n = get_tp_world_size()
    assert get_tp_rank() == rank
    x = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(seed))
    results = {}
    for kind in KINDS:
        for mode in MODES:
            w, b = full_weights(kind, seed)
            flags = (
                {} if kind in ("row", "row_full_input", "replicated") else {"gather_output": True}
            )
            base = load(build_layer(kind, **flags), w, b)  # rank/size read from the TP group
            assert (base.tp_rank, base.tp_size) == (rank, n)
            layer = wrap_with_lora(base)
            adapters = _adapters(kind, seed + 10, offset=mode.startswith("offset"))
            for i, (weights, _) in enumerate(adapters):
                layer.add_adapter(f"a{i}", weights)
            if mode != "disabled":
                layer.set_active([(f"a{i}", s) for i, (_, s) in enumerate(adapters)])
            if mode in ("merged", "offset_merged"):
                layer.merge()
            results[(kind, mode)] = layer(rank_input(kind, x, rank, n))[0].numpy()
    # numpy arrays travel by value; torch tensors would be shared through file descriptors that
    # die with the worker before the parent reads them all
    return results


@pytest.mark.parametrize("nprocs", [2, 4])
def test_gloo_tp_matches_dense(nprocs):
    seed = 11
    results = launch_processes(_gloo_rank_fn, nprocs, args=(seed,), backend="gloo")
    x = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(seed))
    for kind in KINDS:
        for mode in MODES:
            want = _expected(kind, mode, seed, x)
            for rank, res in enumerate(results):
                # after the all-reduce / all-gather every rank holds the full output
                torch.testing.assert_close(
                    torch.from_numpy(res[(kind, mode)]).double(),
                    want,
                    atol=ATOL,
                    rtol=RTOL,
                    msg=lambda m, k=kind, md=mode, r=rank: f"{k}/{md} rank {r}: {m}",
                )


def test_replace_submodule():
    model = torch.nn.Sequential(torch.nn.ModuleList([build_layer("column", prefix="0.0")]))
    new = wrap_with_lora(model[0][0])
    assert replace_submodule(model, "0.0", new) is new
    assert model[0][0] is new
    with pytest.raises(ValueError, match="no child"):
        replace_submodule(model, "0.5", new)
    with pytest.raises(ValueError):
        replace_submodule(model, "", new)
