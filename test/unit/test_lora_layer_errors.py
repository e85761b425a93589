"""Clear errors from the LoRA layers: shapes (module and both shapes named), rank 0, NaN/Inf,
unknown shard ids, merge on a layer that cannot merge. Nothing is stored when ``add_adapter``
fails."""

from __future__ import annotations

import pytest
import torch
from fixtures.lora_layers import IN, build_layer, full_weights, load, random_adapter
from sglang.multimodal_gen.layers.lora import LoRAWeights, replace_submodule, wrap_with_lora


def _qkv():
    w, b = full_weights("qkv", 0)
    return wrap_with_lora(load(build_layer("qkv", prefix="layers.0.attention.to_qkv"), w, b))


def test_shape_errors_name_module_and_shapes():
    layer = _qkv()
    bad_b = LoRAWeights(torch.randn(4, IN), torch.randn(32, 4))  # q rows given for k
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.to_qkv.*\[32, 4\].*\[8, 4\]"):
        layer.add_adapter("bad", {"k": bad_b})
    bad_a = LoRAWeights(torch.randn(4, IN + 1), torch.randn(32, 4))
    with pytest.raises(ValueError, match=r"lora_A \[4, 49\].*expected lora_A \[4, 48\]"):
        layer.add_adapter("bad", {"q": bad_a})
    mismatch = LoRAWeights(torch.randn(4, IN), torch.randn(32, 3))
    with pytest.raises(ValueError, match=r"\[32, 3\]"):
        layer.add_adapter("bad", {"q": mismatch})
    with pytest.raises(ValueError, match="unknown shard_id 'x'"):
        layer.add_adapter("bad", {"x": LoRAWeights(torch.randn(4, IN), torch.randn(8, 4))})
    with pytest.raises(ValueError, match="offset"):
        layer.add_adapter(
            "bad", {"q": LoRAWeights(torch.randn(4, IN), torch.randn(32, 4), 1.0, torch.randn(8))}
        )
    assert layer.adapter_names == []


def test_rank_zero_and_non_finite():
    layer = _qkv()
    with pytest.raises(ValueError, match="rank 0"):
        layer.add_adapter("z", {"q": LoRAWeights(torch.randn(0, IN), torch.randn(32, 0))})
    good = random_adapter("qkv", 1)
    for field in ("lora_A", "lora_B"):
        bad = dict(good)
        t = getattr(good["v"], field).clone()
        t[0, 0] = float("nan") if field == "lora_A" else float("inf")
        bad["v"] = LoRAWeights(**{**good["v"].__dict__, field: t})
        with pytest.raises(ValueError, match=f"{field} for module .*NaN or Inf"):
            layer.add_adapter("nan", bad)
    with pytest.raises(ValueError, match="scale"):
        layer.add_adapter("s", {"q": LoRAWeights(good["q"].lora_A, good["q"].lora_B, float("inf"))})
    assert layer.adapter_names == []
    layer.add_adapter("ok", good)
    with pytest.raises(ValueError, match="not finite"):
        layer.set_active([("ok", float("nan"))])


def test_safe_merge_rejects_overflow_and_keeps_weight():
    w, b = full_weights("column", 0, torch.float16)
    layer = wrap_with_lora(load(build_layer("column", dtype=torch.float16), w, b))
    big = random_adapter("column", 2)  # accepted at load (scale x B fits float16)...
    layer.add_adapter("big", big)
    layer.set_active([("big", 1e5)])  # ... the strength makes the merged weight overflow
    before = layer.base_layer.weight.clone()
    with pytest.raises(ValueError, match="NaN or Inf; not merged"):
        layer.merge(safe=True)
    assert torch.equal(layer.base_layer.weight, before) and not layer.merged


def test_merge_on_layer_that_cannot():
    w, b = full_weights("row", 0)
    layer = wrap_with_lora(load(build_layer("row", prefix="layers.1.attention.to_out.0"), w, b))
    layer.base_layer.lora_merge_unsupported = True  # e.g. a quantized GEMM
    layer.add_adapter("a", random_adapter("row", 3))
    layer.set_active([("a", 1.0)])
    assert not layer.can_merge
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.to_out\.0.*cannot merge"):
        layer.merge()
    x = torch.randn(2, IN)
    assert not torch.equal(layer(x)[0], layer.base_layer(x)[0])  # dynamic still works
    with pytest.raises(ValueError, match="cached merged weight"):
        del layer.base_layer.lora_merge_unsupported
        layer.merge(cached=torch.zeros(3, 3))


def test_replace_submodule():
    model = torch.nn.Sequential(torch.nn.ModuleList([build_layer("column", prefix="0.0")]))
    new = wrap_with_lora(model[0][0])
    assert replace_submodule(model, "0.0", new) is new
    assert model[0][0] is new
    with pytest.raises(ValueError, match="no child"):
        replace_submodule(model, "0.5", new)
    with pytest.raises(ValueError):
        replace_submodule(model, "", new)
