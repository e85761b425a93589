"""The manager's side of per-row LoRA: target-wide slots and a request's ``LoRASelection``.

* every layer of a target stores an adapter in the same slot (the store's slot table); layers it
  does not touch keep that slot empty; unloading frees the slot for the next adapter; a rolled
  back change gives the slots back;
* ``selection(None)`` is exactly the compositions the layers hold (merged layers then take the
  pass-through), a request's own selection lists per target only the adapters with modules there,
  changes no weight, merge state or composition, and refuses unknown adapters (``param="lora"``);
* an adapter file whose ``lora_A`` overflows float32 where it is used is refused at load
  (``param="lora_path"``), naming the tensor; nothing is loaded.

References: the fp64 dense forward of ``fixtures/lora_model.py`` (tolerance 1e-3, outputs ~1e2).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from fixtures import lora_model
from fixtures.lora_model import (
    ATOL,
    DIM,
    RTOL,
    assert_params_equal,
    build_model,
    make_manager,
    model_input,
    params,
    reference_output,
    run_model,
)
from safetensors.torch import save_file
from sglang.multimodal_gen.errors import InvalidRequestError, NotFoundError
from sglang.multimodal_gen.layers.lora import Composition, RowMapping
from sglang.multimodal_gen.lora import LoRAManager, LoRASelection
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP

files = lora_model.files  # the adapter files (a module-scoped fixture)


def _slots_agree(mgr, target="transformer"):
    """Every layer holds each installed adapter in the store's slot for it; no other slot."""
    layers = mgr.layers(target)
    table = mgr.store.slot_table(target)
    for name, layer in layers.items():
        for uid in layer.adapter_names:
            assert layer.slot_of(uid) == table[uid], (name, uid)
        assert layer.occupied_slots <= set(table.values()), name
    return table


def test_one_slot_per_adapter_across_a_target(files):
    model = build_model()
    mgr = make_manager(model, files)
    mgr.load_adapter("a", files["a"][0])
    mgr.load_adapter("attn", files["attn"][0])  # one layer only
    mgr.load_adapter("b", files["b"][0])
    table = _slots_agree(mgr)
    uid = {n: mgr.adapter(n).uid for n in ("a", "attn", "b")}
    assert [table[uid[n]] for n in ("a", "attn", "b")] == [0, 1, 2]
    layers = mgr.layers("transformer")
    qkv, other = layers["layers.0.attention.to_qkv"], layers["layers.1.attention.to_qkv"]
    assert qkv.occupied_slots == {0, 1, 2} and other.occupied_slots == {0, 2}
    assert other.slot_of(uid["attn"]) is None  # not touched: slot 1 stays empty there
    mgr.unload_adapter("attn")
    assert 1 not in _slots_agree(mgr).values()
    mgr.load_adapter("c", files["c"][0])  # the freed slot is reused
    assert _slots_agree(mgr)[mgr.adapter("c").uid] == 1
    # a change rolled back gives its slots back
    before = mgr.store.slot_table("transformer")
    mgr.begin_change()
    mgr.set_lora("d", files["a"][0])
    assert len(mgr.store.slot_table("transformer")) == 4
    mgr.rollback_change()
    assert mgr.store.slot_table("transformer") == before and _slots_agree(mgr) == before


def test_selection_values(files):
    m1, m2 = build_model(seed=0), build_model(seed=1)
    mgr = LoRAManager(
        {"transformer": m1, "transformer_2": m2}, ZIMAGE_NAME_MAP, allowed_roots=[files["root"]]
    )
    mgr.load_adapter("b", files["b"][0])
    mgr.set_lora("a", files["a"][0], targets="transformer", strengths=0.8, merge_mode="merge")
    glob = mgr.selection(None)
    assert isinstance(glob, LoRASelection) and glob.targets == ("transformer", "transformer_2")
    for t in glob.targets:
        for layer in mgr.layers(t).values():
            assert layer.active_composition == glob.for_target(t)
    assert glob.for_target("transformer_2") == Composition.EMPTY and not glob.empty
    slot = lambda n, t: mgr.store.slot_of(t, mgr.adapter(n).uid)  # noqa: E731
    sel = mgr.selection([("b", 0.5), {"name": "a", "scale": 2.0}])
    assert sel.for_target("transformer") == Composition(
        [(slot("b", "transformer"), 0.5), (slot("a", "transformer"), 2.0)]
    )
    # "a" was loaded for "transformer" only... it matches both, so it has a slot in both
    assert sel.for_target("transformer_2").slots == (
        slot("b", "transformer_2"),
        slot("a", "transformer_2"),
    )
    assert pickle.loads(pickle.dumps(sel)) == sel and hash(sel) == hash(mgr.selection(sel_args()))
    assert mgr.selection([]).empty and mgr.selection_is_current(sel)
    with pytest.raises(KeyError):
        sel.for_target("unet")
    mgr.unload_adapter("b")
    assert not mgr.selection_is_current(sel)  # slot freed: the selection is stale


def sel_args():
    return [("b", 0.5), ("a", 2.0)]


def test_selection_changes_nothing_and_runs_per_row(files):
    model = build_model()
    mgr = make_manager(model, files)
    mgr.load_adapter("b", files["b"][0])
    mgr.set_lora("a", files["a"][0], strengths=1e3, merge_mode="merge")  # large, accepted
    layers = list(mgr.layers("transformer").values())
    before, state = params(model), mgr.list_loras()
    merged = [layer.merged for layer in layers]
    x = model_input(7)
    sels = [mgr.selection([]), mgr.selection(None), mgr.selection([("b", 0.7)])]
    with mgr.context("transformer").rows(
        RowMapping.of([s.for_target("transformer") for s in (sels[0], sels[2])])
    ):
        got = run_model(model, x)
    # the rows without the merged composition: the exact base weights (nothing subtracted)
    torch.testing.assert_close(got[0], reference_output(x[:1], [])[0], atol=ATOL, rtol=RTOL)
    db = files["b"][1]
    torch.testing.assert_close(
        got[1], reference_output(x[1:], [(db, 0.7)])[0], atol=ATOL, rtol=RTOL
    )
    plain = build_model()  # no LoRA at all: the same bits for the row without adapters
    assert torch.equal(got[0], run_model(plain, x)[0])
    assert_params_equal(model, before)
    assert [layer.merged for layer in layers] == merged
    after = mgr.list_loras()  # the same, but "b" was touched in the LRU
    assert after["active"] == state["active"] and after["memory"] == state["memory"]
    assert [a["nickname"] for a in after["loaded"]] == ["a", "b"]
    with pytest.raises(NotFoundError) as e:
        mgr.selection([("b", 1.0), ("nope", 1.0)])
    assert e.value.param == "lora" and mgr.list_loras() == after


def test_overflowing_file_is_refused_naming_the_tensor(tmp_path):
    g = torch.Generator().manual_seed(0)
    key = "transformer.layers.0.attention.to_q"
    sd = {
        f"{key}.lora_A.weight": torch.full((2, DIM), 1.2e37),  # x 32 inputs = 3.8e38 > 3.4e38
        f"{key}.lora_B.weight": torch.randn(DIM, 2, generator=g) * 1e-37,
    }
    path = tmp_path / "huge.safetensors"
    save_file(sd, str(path))
    model = build_model()
    before = params(model)
    mgr = make_manager(model, {"root": str(tmp_path)})
    with pytest.raises(InvalidRequestError) as e:
        mgr.set_lora("huge", str(path))
    assert e.value.param == "lora_path" and "lora_A" in e.value.message
    assert "layers.0.attention.to_qkv" in e.value.message and "'q'" in e.value.message
    assert mgr.loaded_nicknames == [] and mgr.store.slot_table("transformer") == {}
    assert all(not layer.adapter_names for layer in mgr.layers("transformer").values())
    assert_params_equal(model, before)


def test_composition_entries_take_scale_or_strength():
    from sglang.multimodal_gen.lora.requests import validate_composition

    assert validate_composition([{"name": "a", "strength": 0.5}, {"name": "b"}]) == [
        ("a", 0.5),
        ("b", 1.0),
    ]
    with pytest.raises(InvalidRequestError, match="both scale and strength") as e:
        validate_composition([{"name": "a", "scale": 1.0, "strength": 2.0}])
    assert e.value.param == "lora"
