"""LoRAManager on a small model built from our parallel layers (Z-Image module names).

Adapters are real safetensors files in diffusers format (``transformer.<diffusers name>.lora_A``)
and kohya format (with ``.alpha``), read through the loader and format adapter. The reference is a
dense fp64 forward written with ``F.linear`` (no layer of ours) on full weights that get
``W + sum_i strength_i * scale_i * B_i @ A_i`` added by hand (fused q/k/v and w1/w3 rows placed by
a hand-written table). The model, the files and the reference: ``fixtures/lora_model.py``.
fp32; tolerance atol 1e-3 / rtol 1e-3 (outputs ~1e2).

Also adapter identity (merge cache, reuse) follows the content, and ``commit_as_base`` is atomic.
Regressions from review: the identity used to be ``path:size:mtime``, so a file rewritten with
the same size and mtime hit a stale cached merge, and a PEFT folder whose ``adapter_config.json``
changed (alpha) kept the old adapter; ``commit_as_base`` used to commit some layers before
failing on a layer without a bias for an adapter's output offset.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from fixtures import lora_model
from fixtures.lora_model import (
    ATOL,
    BLOCKS,
    RTOL,
    assert_params_equal,
    build_model,
    make_manager,
    model_input,
    params,
    reference_output,
    run_model,
    write_lora,
)
from safetensors.torch import save_file
from sglang.multimodal_gen.distributed import launch_processes
from sglang.multimodal_gen.errors import InvalidRequestError, LoRAFormatError, NotFoundError
from sglang.multimodal_gen.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from sglang.multimodal_gen.layers.lora import RowMapping, lora_context_of
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP
from torch import nn

files = lora_model.files  # the adapter files (a module-scoped fixture)


@pytest.mark.parametrize("mode", ["merge", "dynamic", "auto"])
def test_set_switch_switch_back_unset(files, mode):
    model = build_model()
    start = params(model)
    x = model_input()
    y0 = run_model(model, x)
    mgr = make_manager(model, files)
    assert torch.equal(run_model(model, x), y0)  # wrapping alone changes nothing

    pa, da = files["a"]
    pb, db = files["b"]
    pc, dc = files["c"]
    mgr.set_lora("a", pa, strengths=0.8, merge_mode=mode)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(da, 0.8)]), atol=ATOL, rtol=RTOL
    )
    merged = mode != "dynamic"
    assert mgr.list_loras()["active"]["transformer"]["merged_layers"] == (8 if merged else 0)
    weights_a = params(model)

    mgr.set_lora(["b", "c"], [pb, pc], strengths=[1.0, -0.5], merge_mode=mode)
    want = reference_output(x, [(db, 1.0), (dc, -0.5)])
    torch.testing.assert_close(run_model(model, x), want, atol=ATOL, rtol=RTOL)

    hits = mgr.cache.hits
    mgr.set_lora("a", None, strengths=0.8, merge_mode=mode)  # loaded: no path needed
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(da, 0.8)]), atol=ATOL, rtol=RTOL
    )
    assert_params_equal(model, weights_a)  # bit-identical to the first time
    if merged:
        assert mgr.cache.hits - hits == 8  # every merged layer came from the cache

    mgr.unset_lora()
    assert_params_equal(model, start)
    assert torch.equal(run_model(model, x), y0)
    assert mgr.loaded_nicknames == ["a", "b", "c"] or set(mgr.loaded_nicknames) == {"a", "b", "c"}


def test_list_loras_is_plain_json(files):
    model = build_model()
    mgr = make_manager(model, files)
    mgr.set_lora(
        ["a", "c"], [files["a"][0], files["c"][0]], strengths=[1.0, 0.5], merge_mode="auto"
    )
    info = json.loads(json.dumps(mgr.list_loras()))
    assert info["targets"] == ["all", "transformer"]
    assert [a["nickname"] for a in info["loaded"]] == ["a", "c"]
    a = info["loaded"][0]
    assert a["targets"]["transformer"]["matched_modules"] == 7 * BLOCKS
    assert a["targets"]["transformer"]["target_layers"] == 4 * BLOCKS
    assert a["pinned"] and a["active_on"] == ["transformer"] and a["bytes"] > 0
    act = info["active"]["transformer"]
    assert act["adapters"] == [
        {"nickname": "a", "strength": 1.0},
        {"nickname": "c", "strength": 0.5},
    ]
    assert act["merge_mode"] == "auto" and act["merged_layers"] == 4 * BLOCKS
    assert info["memory"]["loaded_bytes"] == sum(x["bytes"] for x in info["loaded"])
    assert info["merge_cache"]["entries"] == 4 * BLOCKS


def test_target_validation(files):
    model = build_model()
    mgr = make_manager(model, files)
    for bad in ("transformer_2", "unet", 3):
        with pytest.raises(InvalidRequestError) as e:
            mgr.set_lora("a", files["a"][0], targets=bad)
        assert e.value.param == "target"
        with pytest.raises(InvalidRequestError):
            mgr.unset_lora(bad)
    assert mgr.loaded_nicknames == []

    # a two-expert model: each target independently
    m1, m2 = build_model(seed=0), build_model(seed=1)
    start2 = params(m2)
    two = LoRAManager(
        {"transformer": m1, "transformer_2": m2}, ZIMAGE_NAME_MAP, allowed_roots=[files["root"]]
    )
    assert two.target_names == ("all", "transformer", "transformer_2")
    two.set_lora("a", files["a"][0], targets="transformer", merge_mode="merge")
    assert_params_equal(m2, start2)
    x = model_input(1)
    torch.testing.assert_close(
        run_model(m1, x), reference_output(x, [(files["a"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
    two.set_lora(["a", "b"], [None, files["b"][0]], targets=["transformer", "transformer_2"])
    torch.testing.assert_close(
        run_model(m2, x), reference_output(x, [(files["b"][1], 1.0)], seed=1), atol=ATOL, rtol=RTOL
    )
    two.unset_lora("transformer_2")
    assert_params_equal(m2, start2)
    assert two.list_loras()["active"]["transformer"]["adapters"][0]["nickname"] == "a"


@pytest.mark.parametrize("bad", ["nan", "junk", "outside", "missing"])
def test_atomic_on_bad_file_in_the_middle_of_a_list(files, bad, tmp_path):
    model = build_model()
    mgr = make_manager(model, files)
    mgr.set_lora(["a"], [files["a"][0]], strengths=[0.7], merge_mode="merge")
    mgr.set_lora(["c"], [files["c"][0]], strengths=[0.3], targets="all", merge_mode="merge")
    before, state = params(model), json.dumps(mgr.list_loras()["active"])
    loaded = mgr.loaded_nicknames
    if bad == "outside":
        path = str(tmp_path / "elsewhere.safetensors")
        write_lora(path, 9)
    elif bad == "missing":
        path = files["root"] + "/nope.safetensors"
    else:
        path = files[bad][0]
    with pytest.raises(InvalidRequestError) as e:  # LoRAFormatError is one
        mgr.set_lora(
            ["b", "bad", "a"],
            [files["b"][0], path, None],
            strengths=[1.0, 1.0, 2.0],
            merge_mode="dynamic",
        )
    assert e.value.param == "lora_path"
    if bad in ("nan", "junk"):
        assert isinstance(e.value, LoRAFormatError)
    assert_params_equal(model, before)
    assert json.dumps(mgr.list_loras()["active"]) == state
    assert mgr.loaded_nicknames == loaded


def test_atomic_when_a_layer_fails_mid_switch(files, monkeypatch):
    model = build_model()
    mgr = make_manager(model, files)
    mgr.set_lora("a", files["a"][0], merge_mode="merge")
    before, state = params(model), json.dumps(mgr.list_loras()["active"])
    layer = mgr.layers("transformer")["layers.1.feed_forward.w13"]
    original_merge = type(layer).set_active

    def boom(self, composition, cached=None):
        if self is layer:
            raise RuntimeError("simulated out of memory")
        return original_merge(self, composition, cached)

    monkeypatch.setattr(type(layer), "set_active", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        mgr.set_lora(["a", "b"], [None, files["b"][0]], strengths=[0.5, 1.0], merge_mode="merge")
    monkeypatch.undo()
    assert_params_equal(model, before)
    assert json.dumps(mgr.list_loras()["active"]) == state
    assert mgr.loaded_nicknames == ["a"]  # the staged "b" was dropped again
    for lyr in mgr.layers("transformer").values():
        assert all(not n.startswith("b#") for n in lyr.adapter_names)


def test_request_validation_names_the_field(files):
    model = build_model()
    mgr = make_manager(model, files)
    pa = files["a"][0]
    cases = [
        (dict(nicknames=[]), "lora_nickname"),
        (dict(nicknames=[""]), "lora_nickname"),
        (dict(nicknames=["a", "b"], paths=[pa, pa, pa]), "lora_path"),
        (dict(nicknames=["a", "b"], paths=[pa, None], strengths=[1, 2, 3]), "strength"),
        (dict(nicknames="a", paths=pa, strengths=float("nan")), "strength"),
        (dict(nicknames="a", paths=pa, strengths="x"), "strength"),
        (dict(nicknames="a", paths=pa, merge_mode="fuse"), "merge_mode"),
        (dict(nicknames=["a", "a"], paths=[pa, pa]), "lora_nickname"),
        (dict(nicknames="a", paths=""), "lora_path"),
    ]
    for kwargs, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            mgr.set_lora(**kwargs)
        assert e.value.param == param, kwargs
    with pytest.raises(NotFoundError) as e:
        mgr.set_lora("never_loaded")
    assert e.value.param == "lora_nickname"
    with pytest.raises(NotFoundError):
        mgr.unload_adapter("never_loaded")
    # an adapter that only touches layer 0 attention is accepted; others run the base
    mgr.set_lora("attn", files["attn"][0])
    x = model_input(3)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(files["attn"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )


def _run(mgr, model, x, selections):
    """``model(x)`` with row ``i`` of ``x`` under ``selections[i]`` (one selection: every row)."""
    comps = [sel.for_target("transformer") for sel in selections]
    with mgr.context("transformer").rows(RowMapping.of(comps)):
        return run_model(model, x)


def test_selection_per_request(files):
    """A request's own composition runs in the forward (per row); nothing changes on the layers:
    no merge, no unmerge, no weight written, before or after."""
    model = build_model()
    mgr = make_manager(model, files)
    assert lora_context_of(model) is mgr.context("transformer")
    mgr.load_adapter("b", files["b"][0])
    mgr.load_adapter("attn", files["attn"][0])
    mgr.set_lora("a", files["a"][0], strengths=1.0, merge_mode="merge")
    layers = list(mgr.layers("transformer").values())
    before, ptrs = params(model), [la.base_layer.weight.data_ptr() for la in layers]
    merges, state = sum(la.merges for la in layers), mgr.list_loras()["active"]
    x = model_input(4)
    da, db, dattn = files["a"][1], files["b"][1], files["attn"][1]
    cases = [
        ([("b", 0.5), ("a", -1.0)], [(db, 0.5), (da, -1.0)]),
        ([("a", 1.0), ("attn", 2.0)], [(da, 1.0), (dattn, 2.0)]),
        ([{"name": "b", "strength": 0.25}], [(db, 0.25)]),
        ([], []),
    ]
    for comp, adapters in cases:
        sel = mgr.selection(comp)
        got = _run(mgr, model, x, [sel])
        torch.testing.assert_close(got, reference_output(x, adapters), atol=ATOL, rtol=RTOL)
    # the global composition: the same values the layers hold, served by the merged weights
    glob = mgr.selection(None)
    assert glob == mgr.selection([{"name": "a", "scale": 1.0}])
    assert glob.for_target("transformer") == layers[0].active_composition
    assert torch.equal(_run(mgr, model, x, [glob]), run_model(model, x))
    # two requests in one batch: each row its own composition
    sels = [mgr.selection([("b", 0.5)]), mgr.selection(None)]
    got = _run(mgr, model, x, sels)
    torch.testing.assert_close(
        got[0], reference_output(x[:1], [(db, 0.5)])[0], atol=ATOL, rtol=RTOL
    )
    torch.testing.assert_close(
        got[1], reference_output(x[1:], [(da, 1.0)])[0], atol=ATOL, rtol=RTOL
    )
    with pytest.raises(NotFoundError) as e:
        mgr.selection([("zzz", 1.0)])
    assert e.value.param == "lora"
    assert_params_equal(model, before)
    assert [la.base_layer.weight.data_ptr() for la in layers] == ptrs
    assert sum(la.merges for la in layers) == merges
    assert mgr.list_loras()["active"] == state


def test_lru_memory_bound_and_pinning(files):
    model = build_model()
    probe = make_manager(model, files)
    probe.load_adapter("a", files["a"][0])
    size_a = probe.loaded_bytes()
    probe.unload_adapter("a")
    mgr = make_manager(build_model(), files, max_loaded_bytes=int(2.2 * size_a))
    mgr.set_lora("a", files["a"][0])  # active: pinned
    mgr.load_adapter("a2", files["a"][0])
    mgr.load_adapter("a3", files["a"][0])  # evicts the LRU unpinned one: a2
    assert mgr.loaded_nicknames == ["a", "a3"]
    assert mgr.loaded_bytes() <= mgr.max_loaded_bytes
    mgr.set_lora(["a", "a3"], [None, None])
    with pytest.raises(InvalidRequestError, match="bound") as e:
        mgr.load_adapter("a4", files["a"][0])  # everything else is active
    assert e.value.param == "lora_path"
    assert mgr.loaded_nicknames == ["a", "a3"]


def test_unload_reload_and_commit(files):
    model = build_model()
    start = params(model)
    mgr = make_manager(model, files)
    x = model_input(5)
    mgr.set_lora(
        ["a", "b"], [files["a"][0], files["b"][0]], strengths=[1.0, 0.5], merge_mode="auto"
    )
    mgr.unload_adapter("b")  # active: deactivated first
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(files["a"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
    mgr.set_lora("a", files["c"][0])  # same nickname, different file: swapped atomically
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(files["c"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
    mgr.commit_as_base()
    assert mgr.list_loras()["active"]["transformer"]["adapters"] == []
    assert mgr.list_loras()["active"]["transformer"]["committed"][0]["nickname"] == "a"
    mgr.unset_lora()  # the committed weights are the base now
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(files["c"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
    mgr.set_lora("a", None, strengths=-1.0, merge_mode="merge")
    mgr.commit_as_base()
    for k, v in start.items():
        torch.testing.assert_close(params(model)[k], v, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- TP with gloo
def _tp_rank_fn(rank, files):
    model = build_model()  # rank and size from the TP group
    mgr = make_manager(model, files)
    x = model_input(6)
    out = {}
    mgr.set_lora(
        ["a", "c"], [files["a"][0], files["c"][0]], strengths=[0.9, -0.4], merge_mode="merge"
    )
    out["merge"] = run_model(model, x).numpy()
    mgr.unmerge()
    out["dynamic"] = run_model(model, x).numpy()
    mgr.unset_lora()
    out["unset"] = run_model(model, x).numpy()
    return out


def test_manager_under_tensor_parallel_gloo(files):
    picked = {k: files[k] for k in ("root", "a", "c")}
    results = launch_processes(_tp_rank_fn, 2, args=(picked,), backend="gloo")  # CPU model
    x = model_input(6)
    want = reference_output(x, [(files["a"][1], 0.9), (files["c"][1], -0.4)])
    base = reference_output(x, [])
    for res in results:
        for key in ("merge", "dynamic"):
            torch.testing.assert_close(torch.from_numpy(res[key]), want, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(torch.from_numpy(res["unset"]), base, atol=1e-5, rtol=1e-5)


def test_constructor_wraps_every_parallel_linear(files):
    model = build_model()
    plain = copy.deepcopy(model)
    mgr = make_manager(model, files)
    layers = mgr.layers("transformer")
    assert len(layers) == 5 * BLOCKS
    assert set(layers) == {n for n, m in plain.named_modules() if hasattr(m, "shard_map")}
    # constructing a second manager on the same model reuses the wrappers
    again = make_manager(model, files)
    assert (
        again.layers("transformer")["layers.0.attention.to_qkv"]
        is layers["layers.0.attention.to_qkv"]
    )
    with pytest.raises(ValueError):
        LoRAManager({"all": model})
    with pytest.raises(ValueError):
        LoRAManager({"transformer": nn.Sequential(nn.Linear(2, 2))})


def test_snapshot_and_cache_devices_are_configurable(files):
    model = build_model()
    start = params(model)
    mgr = make_manager(model, files, snapshot_device="cpu", merge_cache_device="cpu")
    mgr.set_lora("a", files["a"][0], merge_mode="merge")
    layer = mgr.layers("transformer")["layers.0.feed_forward.w13"]
    assert layer.merged and layer._snapshot.device.type == "cpu"
    mgr.unset_lora()
    assert_params_equal(model, start)


# ------------------------------------------------- adapter identity and an atomic commit_as_base


def _same_stat_rewrite(path, seed):
    """Rewrite ``path`` with other tensors of the same shapes, keeping size and mtime."""
    st = os.stat(path)
    deltas = write_lora(path, seed)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    return deltas


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_rewritten_file_with_same_size_and_mtime_is_a_new_adapter(tmp_path, mode):
    path = tmp_path / "x.safetensors"
    write_lora(path, 11)
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    x = model_input(1)
    mgr.set_lora("x", str(path), merge_mode=mode)
    mgr.unset_lora()
    new = _same_stat_rewrite(path, 12)
    # a new nickname on the rewritten file must not reuse the old file's cached merge
    mgr.set_lora("y", str(path), merge_mode=mode)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(new, 1.0)]), atol=1e-3, rtol=1e-3
    )
    # and re-setting the old nickname on the same path reloads it
    mgr.set_lora("x", str(path), merge_mode=mode)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(new, 1.0)]), atol=1e-3, rtol=1e-3
    )


def test_changed_adapter_config_is_reloaded(tmp_path):
    folder = tmp_path / "peft"
    folder.mkdir()
    deltas = write_lora(folder / "adapter_model.safetensors", 21, rank=4)
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"],
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    x = model_input(2)
    mgr.set_lora("p", str(folder), merge_mode="merge")
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(deltas, 1.0)]), atol=1e-3, rtol=1e-3
    )
    cfg["lora_alpha"] = 16  # scale alpha / r: 1 -> 4
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    mgr.set_lora("p", str(folder), merge_mode="merge")
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(deltas, 4.0)]), atol=1e-3, rtol=1e-3
    )


class _FeedForward(nn.Module):
    """A biased merged-column layer, then a row-parallel layer WITHOUT a bias."""

    def __init__(self):
        super().__init__()
        p = "layers.0.feed_forward"
        self.w13 = MergedColumnParallelLinear(8, [12, 12], prefix=f"{p}.w13")
        self.w2 = RowParallelLinear(12, 8, bias=False, prefix=f"{p}.w2")
        g = torch.Generator().manual_seed(3)
        for layer in (self.w13, self.w2):
            layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
            if layer.bias is not None:
                layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=g))

    def forward(self, x):
        gate, up = self.w13(x)[0].chunk(2, dim=-1)
        return self.w2(gate * up)[0]


class _NoBiasModel(nn.Module):
    """``layers.0.feed_forward.{w13, w2}`` with Z-Image names."""

    def __init__(self):
        super().__init__()
        block = nn.Module()
        block.feed_forward = _FeedForward()
        self.layers = nn.ModuleList([block])

    def forward(self, x):
        return self.layers[0].feed_forward(x)


def test_commit_as_base_refuses_offsets_without_bias_and_changes_nothing(tmp_path):
    g = torch.Generator().manual_seed(5)
    sd = {}
    for name, (o, i) in {"w1": (12, 8), "w3": (12, 8), "w2": (8, 12)}.items():
        key = f"transformer.layers.0.feed_forward.{name}"
        sd[f"{key}.lora_A.weight"] = torch.randn(2, i, generator=g)
        sd[f"{key}.lora_B.weight"] = torch.randn(o, 2, generator=g)
        sd[f"{key}.lora_B.bias"] = torch.randn(o, generator=g)  # peft lora_bias=True
    path = tmp_path / "biased.safetensors"
    save_file(sd, str(path))
    model = _NoBiasModel()
    start = params(model)
    mgr = LoRAManager({"transformer": model}, ZIMAGE_NAME_MAP, allowed_roots=[str(tmp_path)])
    mgr.set_lora("b", str(path), merge_mode="merge")
    x = torch.randn(3, 8)
    with_lora = run_model(model, x)
    merged = params(model)
    listed = mgr.list_loras()
    with pytest.raises(InvalidRequestError, match="no bias to fold it into"):
        mgr.commit_as_base()
    assert_params_equal(model, merged)
    assert mgr.list_loras() == listed
    torch.testing.assert_close(run_model(model, x), with_lora, atol=0, rtol=0)
    mgr.unset_lora()
    assert_params_equal(model, start)
