"""Z-Image under a per-row LoRA mapping: each item of a batch is one row of every LoRA layer.

The patch and caption embedders see the items' tokens stacked ``[B, N, in]`` (padded to the
longest, cut back), so the model calls no LoRA internals and a row mapping of the batch applies to
each item's own tokens. Checked on a small random DiT (fp32, CPU), bit for bit:

* the stacked embedders give the numbers the items concatenated gave (row-invariant GEMMs);
* in a batch whose items use different compositions, each item's output equals that item's output
  in a batch where every item uses its composition (attention never mixes items).
"""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.configs.zimage import ZImageArchConfig
from sglang.multimodal_gen.layers.lora import Composition, LoRAWeights, RowMapping
from sglang.multimodal_gen.lora.compose import wrap_layers
from sglang.multimodal_gen.models.dits import zimage


def _model(seed=0):
    cfg = ZImageArchConfig(
        in_channels=4,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        cap_feat_dim=32,
        axes_dims=(4, 6, 6),
        axes_lens=(128, 32, 32),
    )
    model = zimage.ZImageTransformer(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(4, 1, 8, 8, generator=g), torch.randn(4, 1, 4, 8, generator=g)]
    cap = [torch.randn(5, 32, generator=g), torch.randn(9, 32, generator=g)]
    return x, torch.tensor([0.3, 0.7]), cap


def _concatenated(layer, items):
    """The embedders as they were: every item's tokens concatenated along dim 0."""
    out = layer(torch.cat(items, 0))[0]
    return list(out.split([t.shape[0] for t in items], 0))


def test_stacked_embedders_give_the_concatenated_numbers(monkeypatch):
    model = _model()
    x, t, cap = _inputs()
    with torch.no_grad():
        now = model(x, t, cap)
        monkeypatch.setattr(zimage, "_per_item", _concatenated)
        before = model(x, t, cap)
    for a, b in zip(now, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("merged", [False, True])
def test_each_item_uses_its_own_composition(merged):
    model = _model()
    layers, ctx = wrap_layers("transformer", model)
    g = torch.Generator().manual_seed(5)
    for layer in layers.values():
        base = layer.base_layer
        for slot in (0, 1):
            w = LoRAWeights(
                torch.randn(3, base.input_size, generator=g) * 0.3,
                torch.randn(base.output_size, 3, generator=g) * 0.3,
                scale=0.5,
            )
            layer.add_adapter(f"a{slot}", {None: w}, slot=slot)
    c0, c1 = Composition([(0, 1.0)]), Composition([(1, -0.5), (0, 0.25)])
    if merged:  # c0 is the global composition, merged into every layer
        for layer in layers.values():
            layer.set_active(c0)
            layer.merge()
    x, t, cap = _inputs()
    with torch.no_grad():
        with ctx.rows(RowMapping.of([c0, c1])):
            mixed = model(x, t, cap)
        with ctx.rows(RowMapping.whole(c0)):
            all0 = model(x, t, cap)
        with ctx.rows(RowMapping.of([c1, c1])):
            all1 = model(x, t, cap)
        with ctx.rows(RowMapping.whole(Composition.EMPTY)):
            none = model(x, t, cap)
    assert torch.equal(mixed[0], all0[0]) and torch.equal(mixed[1], all1[1])
    assert not torch.equal(mixed[0], none[0]) and not torch.equal(mixed[1], all0[1])
    with ctx.rows(RowMapping.of([c0, c1, c0])), pytest.raises(ValueError, match="3 rows"):
        model(x, t, cap)
