"""LoRAManager on a small model built from our parallel layers (Z-Image module names).

Adapters are real safetensors files in diffusers format (``transformer.<diffusers name>.lora_A``)
and kohya format (with ``.alpha``), read through the loader and format adapter. The reference is a
dense fp64 forward written with ``F.linear`` (no layer of ours) on full weights that get
``W + sum_i strength_i * scale_i * B_i @ A_i`` added by hand (fused q/k/v and w1/w3 rows placed by
the test's own table). fp32; tolerance atol 1e-3 / rtol 1e-3 (outputs ~1e2).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from sglang.multimodal_gen.distributed import launch_processes
from sglang.multimodal_gen.errors import InvalidRequestError, LoRAFormatError, NotFoundError
from sglang.multimodal_gen.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.lora import RowMapping, lora_context_of
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP
from torch import nn

DIM, HEADS, HEAD, FFN, BLOCKS = 32, 4, 8, 48, 2
ATOL = RTOL = 1e-3  # outputs grow to ~1e2 through the residual blocks


class _Attention(nn.Module):
    def __init__(self, p, kw):
        super().__init__()
        self.to_qkv = QKVParallelLinear(DIM, HEAD, HEADS, prefix=f"{p}.to_qkv", **kw)
        self.to_out = nn.ModuleList([RowParallelLinear(DIM, DIM, prefix=f"{p}.to_out.0", **kw)])

    def forward(self, x):
        qkv = self.to_qkv(x)[0]
        n = self.to_qkv.q_size
        q, k, v = qkv[..., :n], qkv[..., n : 2 * n], qkv[..., 2 * n :]
        return self.to_out[0](q * torch.sigmoid(k) + v)[0]


class _FeedForward(nn.Module):
    def __init__(self, p, kw):
        super().__init__()
        self.w13 = MergedColumnParallelLinear(DIM, [FFN, FFN], prefix=f"{p}.w13", **kw)
        self.w2 = RowParallelLinear(FFN, DIM, prefix=f"{p}.w2", **kw)

    def forward(self, x):
        gate, up = self.w13(x)[0].chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)[0]


class _Block(nn.Module):
    def __init__(self, i, kw):
        super().__init__()
        self.attention = _Attention(f"layers.{i}.attention", kw)
        self.feed_forward = _FeedForward(f"layers.{i}.feed_forward", kw)
        self.adaLN_modulation = nn.ModuleList(
            [ReplicatedLinear(DIM, DIM, prefix=f"layers.{i}.adaLN_modulation.0", **kw)]
        )

    def forward(self, x):
        x = x + self.attention(x)
        x = x + self.feed_forward(x)
        return x + 0.1 * self.adaLN_modulation[0](x)[0]


class TinyDiT(nn.Module):
    """Two blocks with Z-Image names: to_qkv (QKV), to_out.0 / w2 (Row), w13 (MergedColumn)."""

    def __init__(self, tp_rank=None, tp_size=None):
        super().__init__()
        kw = dict(tp_rank=tp_rank, tp_size=tp_size)
        self.layers = nn.ModuleList([_Block(i, kw) for i in range(BLOCKS)])

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def full_model_weights(seed=0):
    """``{our_module: (W_full, b_full)}`` in our fused layout."""
    g = torch.Generator().manual_seed(seed)
    shapes = {}
    for i in range(BLOCKS):
        shapes[f"layers.{i}.attention.to_qkv"] = (3 * DIM, DIM)
        shapes[f"layers.{i}.attention.to_out.0"] = (DIM, DIM)
        shapes[f"layers.{i}.feed_forward.w13"] = (2 * FFN, DIM)
        shapes[f"layers.{i}.feed_forward.w2"] = (DIM, FFN)
        shapes[f"layers.{i}.adaLN_modulation.0"] = (DIM, DIM)
    return {
        n: (torch.randn(o, i, generator=g) / i**0.5, 0.1 * torch.randn(o, generator=g))
        for n, (o, i) in shapes.items()
    }


def build_model(tp_rank=None, tp_size=None, seed=0):
    model = TinyDiT(tp_rank, tp_size)
    for name, (w, b) in full_model_weights(seed).items():
        layer = model.get_submodule(name)
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
    return model


# diffusers module name -> (our module, row offset in our fused weight, rows, in)
def _diffusers_modules():
    out = {}
    for i in range(BLOCKS):
        a, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        for j, s in enumerate("qkv"):
            out[f"{a}.to_{s}"] = (f"{a}.to_qkv", j * DIM, DIM, DIM)
        out[f"{a}.to_out.0"] = (f"{a}.to_out.0", 0, DIM, DIM)
        out[f"{f}.w1"] = (f"{f}.w13", 0, FFN, DIM)
        out[f"{f}.w3"] = (f"{f}.w13", FFN, FFN, DIM)
        out[f"{f}.w2"] = (f"{f}.w2", 0, DIM, FFN)
    return out


def write_lora(path, seed, rank=4, kohya_alpha=None, nan=False, modules=None):
    """A LoRA file; returns ``{our_module: delta_full [out, in]}`` at strength 1 (fp64)."""
    g = torch.Generator().manual_seed(seed)
    sd, deltas = {}, {}
    for name, (our, off, rows, fan_in) in _diffusers_modules().items():
        if modules is not None and name not in modules:
            continue
        a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
        b = torch.randn(rows, rank, generator=g) / rank**0.5
        if kohya_alpha is None:
            sd[f"transformer.{name}.lora_A.weight"] = a
            sd[f"transformer.{name}.lora_B.weight"] = b
            scale = 1.0  # no alpha anywhere: alpha = r
        else:
            flat = "lora_unet_" + name.replace(".", "_")
            sd[f"{flat}.lora_down.weight"] = a
            sd[f"{flat}.lora_up.weight"] = b
            sd[f"{flat}.alpha"] = torch.tensor(float(kohya_alpha))
            scale = kohya_alpha / rank
        full_rows = {"to_qkv": 3 * DIM, "w13": 2 * FFN}.get(our.rsplit(".", 1)[-1], rows)
        d = deltas.setdefault(our, torch.zeros(full_rows, fan_in, dtype=torch.float64))
        d[off : off + rows] += scale * (b.double() @ a.double())
    if nan:
        key = next(iter(sd))
        sd[key][0, 0] = float("nan")
    save_file(sd, str(path))
    return deltas


def dense_forward(x, weights):
    """:class:`TinyDiT`'s forward written with ``F.linear`` on full fp64 weights (none of our
    layers): ``weights`` is ``{our_module: (W_full, b_full)}``; q|k|v and gate|up split by hand."""
    x = x.double()
    for i in range(BLOCKS):
        a, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        q, k, v = F.linear(x, *weights[f"{a}.to_qkv"]).split(DIM, dim=-1)
        x = x + F.linear(q * torch.sigmoid(k) + v, *weights[f"{a}.to_out.0"])
        gate, up = F.linear(x, *weights[f"{f}.w13"]).split(FFN, dim=-1)
        x = x + F.linear(F.silu(gate) * up, *weights[f"{f}.w2"])
        x = x + 0.1 * F.linear(x, *weights[f"layers.{i}.adaLN_modulation.0"])
    return x.float()


def reference_output(x, adapters, seed=0):
    """The dense fp64 forward of the full weights with ``W + sum strength * delta`` (deltas placed
    at the rows of the hand table ``_diffusers_modules``)."""
    weights = {n: (w.double(), b.double()) for n, (w, b) in full_model_weights(seed).items()}
    for deltas, strength in adapters:
        for our, d in deltas.items():
            w, b = weights[our]
            weights[our] = (w + strength * d, b)
    return dense_forward(x, weights)


def params(model):
    """Parameters by module name (the LoRA wrapper's ``.base_layer`` level removed)."""
    return {
        k.replace(".base_layer.", "."): v.detach().clone() for k, v in model.state_dict().items()
    }


def assert_params_equal(model, saved):
    now = params(model)
    assert now.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(now[k], v), f"{k} changed"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    out = {"root": str(root)}
    out["a"] = (str(root / "a.safetensors"), write_lora(root / "a.safetensors", 1))
    out["b"] = (str(root / "b.safetensors"), write_lora(root / "b.safetensors", 2, rank=3))
    out["c"] = (
        str(root / "c.safetensors"),
        write_lora(root / "c.safetensors", 3, rank=2, kohya_alpha=5.0),
    )
    out["attn"] = (
        str(root / "attn.safetensors"),
        write_lora(root / "attn.safetensors", 4, modules={"layers.0.attention.to_k"}),
    )
    out["nan"] = (str(root / "nan.safetensors"), write_lora(root / "nan.safetensors", 5, nan=True))
    (root / "junk.safetensors").write_bytes(b"not a safetensors file")
    out["junk"] = (str(root / "junk.safetensors"), None)
    return out


def _x(seed=0):
    return torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(100 + seed))


def _manager(model, files, **kw):
    return LoRAManager({"transformer": model}, ZIMAGE_NAME_MAP, allowed_roots=[files["root"]], **kw)


def _out(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("mode", ["merge", "dynamic", "auto"])
def test_set_switch_switch_back_unset(files, mode):
    model = build_model()
    start = params(model)
    x = _x()
    y0 = _out(model, x)
    mgr = _manager(model, files)
    assert torch.equal(_out(model, x), y0)  # wrapping alone changes nothing

    pa, da = files["a"]
    pb, db = files["b"]
    pc, dc = files["c"]
    mgr.set_lora("a", pa, strengths=0.8, merge_mode=mode)
    torch.testing.assert_close(
        _out(model, x), reference_output(x, [(da, 0.8)]), atol=ATOL, rtol=RTOL
    )
    merged = mode != "dynamic"
    assert mgr.list_loras()["active"]["transformer"]["merged_layers"] == (8 if merged else 0)
    weights_a = params(model)

    mgr.set_lora(["b", "c"], [pb, pc], strengths=[1.0, -0.5], merge_mode=mode)
    want = reference_output(x, [(db, 1.0), (dc, -0.5)])
    torch.testing.assert_close(_out(model, x), want, atol=ATOL, rtol=RTOL)

    hits = mgr.cache.hits
    mgr.set_lora("a", None, strengths=0.8, merge_mode=mode)  # loaded: no path needed
    torch.testing.assert_close(
        _out(model, x), reference_output(x, [(da, 0.8)]), atol=ATOL, rtol=RTOL
    )
    assert_params_equal(model, weights_a)  # bit-identical to the first time
    if merged:
        assert mgr.cache.hits - hits == 8  # every merged layer came from the cache

    mgr.unset_lora()
    assert_params_equal(model, start)
    assert torch.equal(_out(model, x), y0)
    assert mgr.loaded_nicknames == ["a", "b", "c"] or set(mgr.loaded_nicknames) == {"a", "b", "c"}


def test_list_loras_is_plain_json(files):
    model = build_model()
    mgr = _manager(model, files)
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
    mgr = _manager(model, files)
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
    x = _x(1)
    torch.testing.assert_close(
        _out(m1, x), reference_output(x, [(files["a"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
    two.set_lora(["a", "b"], [None, files["b"][0]], targets=["transformer", "transformer_2"])
    torch.testing.assert_close(
        _out(m2, x), reference_output(x, [(files["b"][1], 1.0)], seed=1), atol=ATOL, rtol=RTOL
    )
    two.unset_lora("transformer_2")
    assert_params_equal(m2, start2)
    assert two.list_loras()["active"]["transformer"]["adapters"][0]["nickname"] == "a"


@pytest.mark.parametrize("bad", ["nan", "junk", "outside", "missing"])
def test_atomic_on_bad_file_in_the_middle_of_a_list(files, bad, tmp_path):
    model = build_model()
    mgr = _manager(model, files)
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
    mgr = _manager(model, files)
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
    mgr = _manager(model, files)
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
    x = _x(3)
    torch.testing.assert_close(
        _out(model, x), reference_output(x, [(files["attn"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )


def _run(mgr, model, x, selections):
    """``model(x)`` with row ``i`` of ``x`` under ``selections[i]`` (one selection: every row)."""
    comps = [sel.for_target("transformer") for sel in selections]
    with mgr.context("transformer").rows(RowMapping.of(comps)):
        return _out(model, x)


def test_selection_per_request(files):
    """A request's own composition runs in the forward (per row); nothing changes on the layers:
    no merge, no unmerge, no weight written, before or after."""
    model = build_model()
    mgr = _manager(model, files)
    assert lora_context_of(model) is mgr.context("transformer")
    mgr.load_adapter("b", files["b"][0])
    mgr.load_adapter("attn", files["attn"][0])
    mgr.set_lora("a", files["a"][0], strengths=1.0, merge_mode="merge")
    layers = list(mgr.layers("transformer").values())
    before, ptrs = params(model), [la.base_layer.weight.data_ptr() for la in layers]
    merges, state = sum(la.merges for la in layers), mgr.list_loras()["active"]
    x = _x(4)
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
    assert torch.equal(_run(mgr, model, x, [glob]), _out(model, x))
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
    probe = _manager(model, files)
    probe.load_adapter("a", files["a"][0])
    size_a = probe.loaded_bytes()
    probe.unload_adapter("a")
    mgr = _manager(build_model(), files, max_loaded_bytes=int(2.2 * size_a))
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
    mgr = _manager(model, files)
    x = _x(5)
    mgr.set_lora(
        ["a", "b"], [files["a"][0], files["b"][0]], strengths=[1.0, 0.5], merge_mode="auto"
    )
    mgr.unload_adapter("b")  # active: deactivated first
    torch.testing.assert_close(
        _out(model, x), reference_output(x, [(files["a"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
    mgr.set_lora("a", files["c"][0])  # same nickname, different file: swapped atomically
    torch.testing.assert_close(
        _out(model, x), reference_output(x, [(files["c"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
    mgr.commit_as_base()
    assert mgr.list_loras()["active"]["transformer"]["adapters"] == []
    assert mgr.list_loras()["active"]["transformer"]["committed"][0]["nickname"] == "a"
    mgr.unset_lora()  # the committed weights are the base now
    torch.testing.assert_close(
        _out(model, x), reference_output(x, [(files["c"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
    mgr.set_lora("a", None, strengths=-1.0, merge_mode="merge")
    mgr.commit_as_base()
    for k, v in start.items():
        torch.testing.assert_close(params(model)[k], v, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- TP with gloo
def _tp_rank_fn(rank, files):
    model = build_model()  # rank and size from the TP group
    mgr = _manager(model, files)
    x = _x(6)
    out = {}
    mgr.set_lora(
        ["a", "c"], [files["a"][0], files["c"][0]], strengths=[0.9, -0.4], merge_mode="merge"
    )
    out["merge"] = _out(model, x).numpy()
    mgr.unmerge()
    out["dynamic"] = _out(model, x).numpy()
    mgr.unset_lora()
    out["unset"] = _out(model, x).numpy()
    return out


def test_manager_under_tensor_parallel_gloo(files):
    picked = {k: files[k] for k in ("root", "a", "c")}
    results = launch_processes(_tp_rank_fn, 2, args=(picked,), backend="gloo")  # CPU model
    x = _x(6)
    want = reference_output(x, [(files["a"][1], 0.9), (files["c"][1], -0.4)])
    base = reference_output(x, [])
    for res in results:
        for key in ("merge", "dynamic"):
            torch.testing.assert_close(torch.from_numpy(res[key]), want, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(torch.from_numpy(res["unset"]), base, atol=1e-5, rtol=1e-5)


def test_constructor_wraps_every_parallel_linear(files):
    model = build_model()
    plain = copy.deepcopy(model)
    mgr = _manager(model, files)
    layers = mgr.layers("transformer")
    assert len(layers) == 5 * BLOCKS
    assert set(layers) == {n for n, m in plain.named_modules() if hasattr(m, "shard_map")}
    # constructing a second manager on the same model reuses the wrappers
    again = _manager(model, files)
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
    mgr = _manager(model, files, snapshot_device="cpu", merge_cache_device="cpu")
    mgr.set_lora("a", files["a"][0], merge_mode="merge")
    layer = mgr.layers("transformer")["layers.0.feed_forward.w13"]
    assert layer.merged and layer._snapshot.device.type == "cpu"
    mgr.unset_lora()
    assert_params_equal(model, start)
