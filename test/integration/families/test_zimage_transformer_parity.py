"""Our Z-Image DiT vs diffusers' ZImageTransformer2DModel on the same weights (fp32)."""

from __future__ import annotations

import os

import pytest
import torch
from fixtures.tiny_models import rel_err
from sglang.multimodal_gen.models.families.zimage import load_zimage_transformer

# Measured (fp32, CPU): max relative error 2.2e-7 .. 3.6e-7 over the cases below (our fused
# q/k/v and w1/w3 GEMMs sum in another order). Nearby wrong inputs measured: timestep + 1e-3 ->
# 7e-2 .. 1e-1, latents x 1.001 -> 4e-4 .. 5.3e-4, caption features + 1e-3 -> 4e-5 .. 8.4e-4.
MAX_REL_ERR = 1e-5


@pytest.fixture(scope="module")
def models(tiny_zimage_dir):
    from diffusers import ZImageTransformer2DModel

    tdir = os.path.join(tiny_zimage_dir, "transformer")
    ref = ZImageTransformer2DModel.from_pretrained(tdir).to(torch.float32).eval()
    ours = load_zimage_transformer(tdir, dtype=torch.float32)
    return ours, ref


# (latent sizes per item as (H, W), caption lengths per item): image token counts 16, 15, 48,
# 6 + 8 (need padding to 32) and 64 (no padding); captions 7, 33, 32 (exact multiple), 5/40
# (different padded lengths in one batch -> attention mask).
CASES = [
    pytest.param([(8, 8)], [7], id="square-16tok"),
    pytest.param([(6, 10)], [33], id="nonsquare-15tok"),
    pytest.param([(16, 12)], [32], id="nonsquare-48tok-cap32"),
    pytest.param([(16, 16)], [64], id="square-64tok-nopad"),
    pytest.param([(4, 6), (4, 6)], [5, 40], id="batch-capmask"),
    pytest.param([(4, 6), (8, 4)], [40, 9], id="batch-mixed-sizes"),
]


@pytest.mark.parametrize("sizes,cap_lens", CASES)
def test_transformer_matches_diffusers(models, sizes, cap_lens):
    ours, ref = models
    g = torch.Generator().manual_seed(len(cap_lens) * 100 + sum(cap_lens))
    x = [torch.randn(16, 1, h, w, generator=g) for h, w in sizes]
    caps = [torch.randn(n, 32, generator=g) for n in cap_lens]
    t = torch.rand(len(sizes), generator=g)
    with torch.no_grad():
        expected = ref(x, t, caps, return_dict=False)[0]
        got = ours(x, t, caps)
        near_t = ours(x, t + 1e-3, caps)
        near_x = ours([xi * 1.001 for xi in x], t, caps)
    assert len(got) == len(expected)
    for a, b, wt, wx in zip(got, expected, near_t, near_x):
        assert a.shape == b.shape
        assert b.abs().max() > 0.1  # a real signal, not a degenerate output
        assert rel_err(a, b) <= MAX_REL_ERR
        # nearby inputs fail the same bar
        assert rel_err(wt, b) > MAX_REL_ERR and rel_err(wx, b) > MAX_REL_ERR


def test_cached_caption_context_equals_full_forward(models):
    """The pipeline computes the caption refiner once per request; reusing it must not change
    the output at any timestep."""
    ours, _ = models
    g = torch.Generator().manual_seed(5)
    x = [torch.randn(16, 1, 6, 8, generator=g) for _ in range(2)]
    caps = [torch.randn(n, 32, generator=g) for n in (12, 45)]
    with torch.no_grad():
        ctx = ours.encode_captions(caps)
        for tv in (0.1, 0.9):
            t = torch.full((2,), tv)
            full = ours(x, t, caps)
            cached = ours(x, t, ctx)
            for a, b in zip(cached, full):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_transformer_depends_on_every_input(models):
    """Guard against a parity test that passes on a degenerate model: timestep, caption and
    pad tokens all change the output."""
    ours, _ = models
    g = torch.Generator().manual_seed(9)
    x = [torch.randn(16, 1, 6, 10, generator=g)]  # 15 tokens -> 17 pad tokens
    cap = [torch.randn(7, 32, generator=g)]
    with torch.no_grad():
        base = ours(x, torch.tensor([0.3]), cap)[0]
        other_t = ours(x, torch.tensor([0.7]), cap)[0]
        other_cap = ours(x, torch.tensor([0.3]), [cap[0] + 1.0])[0]
        saved = ours.x_pad_token.clone()
        ours.x_pad_token.add_(1.0)
        other_pad = ours(x, torch.tensor([0.3]), cap)[0]
        ours.x_pad_token.copy_(saved)
    for changed in (other_t, other_cap, other_pad):
        assert rel_err(changed, base) > 1e-3
