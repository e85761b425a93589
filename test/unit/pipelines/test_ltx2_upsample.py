"""pipelines/ltx2_upsample.py against diffusers' LTX2LatentUpsamplePipeline(output_type="latent"):
a tiny random LTX2LatentUpsamplerModel and a tiny AutoencoderKLLTX2Video (non-trivial latent
statistics), both saved with save_pretrained and loaded back, the same latents into both.

Measured (this machine): raw 5-D, packed + normalized, AdaIN + tone map: max |diff| 0 (float32);
the nearby wrong case (normalized latents not un-normalized) differs by 0.76.
"""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.pipelines.ltx2_upsample import (
    VideoLatentStats,
    unpack_video_latents,
    upsample_video_latents,
)

LATENT_C = 8
GRID = (2, 3, 4)  # latent frames, height, width


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from diffusers import AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    root = tmp_path_factory.mktemp("ltx2_upsample")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=LATENT_C, block_out_channels=(8,),
        decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), patch_size=1, patch_size_t=1,
        scaling_factor=0.8,
    )  # fmt: skip
    with torch.no_grad():
        vae.latents_mean.copy_(torch.rand(LATENT_C, generator=gen) - 0.5)
        vae.latents_std.copy_(torch.rand(LATENT_C, generator=gen) + 0.5)
    up = LTX2LatentUpsamplerModel(in_channels=LATENT_C, mid_channels=32, num_blocks_per_stage=1)
    with torch.no_grad():  # GroupNorm affine starts at 1 / 0: redraw so every parameter counts
        for p in up.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    vae.save_pretrained(root / "vae")
    up.save_pretrained(root / "latent_upsampler")
    vae = AutoencoderKLLTX2Video.from_pretrained(root / "vae").eval()
    up = LTX2LatentUpsamplerModel.from_pretrained(root / "latent_upsampler").eval()
    pipe = LTX2LatentUpsamplePipeline(vae=vae, latent_upsampler=up)
    pipe.set_progress_bar_config(disable=True)
    return pipe, up, VideoLatentStats.from_vae(vae)


def _latents(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LATENT_C, *GRID, generator=g) * 1.5 + 0.3


def _pack(x: torch.Tensor) -> torch.Tensor:  # [B, C, F, H, W] -> [B, F*H*W, C] (patch 1)
    return x.flatten(2).transpose(1, 2)


def test_raw_latents_match_diffusers(tiny):
    pipe, up, stats = tiny
    x = _latents(1)
    ref = pipe(latents=x, output_type="latent", return_dict=False)[0]
    ours = upsample_video_latents(x, up, stats, latents_normalized=False)
    assert ours.shape == (2, LATENT_C, GRID[0], 2 * GRID[1], 2 * GRID[2])
    assert (ours - ref).abs().max().item() <= 1e-6


def test_packed_normalized_latents_match_diffusers(tiny):
    pipe, up, stats = tiny
    x = _latents(2)
    ratio_s, ratio_t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
    ref = pipe(
        latents=_pack(x), latents_normalized=True, num_frames=(GRID[0] - 1) * ratio_t + 1,
        height=GRID[1] * ratio_s, width=GRID[2] * ratio_s, output_type="latent", return_dict=False,
    )[0]  # fmt: skip
    ours = upsample_video_latents(_pack(x), up, stats, latents_normalized=True, grid=GRID)
    assert (ours - ref).abs().max().item() <= 1e-6
    normed = upsample_video_latents(
        _pack(x), up, stats, latents_normalized=True, grid=GRID, normalize_output=True
    )
    assert (normed - stats.normalize(ref)).abs().max().item() <= 1e-6
    # nearby wrong case: the normalized latents go into the upsampler as they are
    wrong = upsample_video_latents(_pack(x), up, stats, latents_normalized=False, grid=GRID)
    assert (wrong - ref).abs().max().item() > 0.1


def test_adain_and_tone_map_match_diffusers(tiny):
    pipe, up, stats = tiny
    x = _latents(3)
    kw = dict(adain_factor=0.7, tone_map_compression_ratio=0.6)
    ref = pipe(latents=x, output_type="latent", return_dict=False, **kw)[0]
    ours = upsample_video_latents(x, up, stats, latents_normalized=False, **kw)
    assert (ours - ref).abs().max().item() <= 1e-5
    plain = pipe(latents=x, output_type="latent", return_dict=False)[0]
    assert (plain - ref).abs().max().item() > 0.05  # the options change the result


def test_unpack_matches_diffusers_with_patches():
    from diffusers.pipelines.ltx2 import LTX2Pipeline

    g = torch.Generator().manual_seed(4)
    packed = torch.randn(1, 2 * 3 * 2, 3 * 2 * 2 * 2, generator=g)
    ref = LTX2Pipeline._unpack_latents(packed, 2, 3, 2, patch_size=2, patch_size_t=2)
    ours = unpack_video_latents(packed, (2, 3, 2), patch_size=2, patch_size_t=2)
    assert torch.equal(ours, ref)


def test_bad_input_names_the_field(tiny):
    _, up, stats = tiny
    x = _latents(5)
    with pytest.raises(ValueError, match="^grid:"):
        upsample_video_latents(_pack(x), up, stats, latents_normalized=False)
    with pytest.raises(ValueError, match="^latents:"):
        upsample_video_latents(_pack(x), up, stats, latents_normalized=False, grid=(2, 3, 5))
    with pytest.raises(ValueError, match="^latents:"):
        upsample_video_latents(x[0], up, stats, latents_normalized=False)
    with pytest.raises(ValueError, match="^tone_map_compression_ratio:"):
        upsample_video_latents(
            x, up, stats, latents_normalized=False, tone_map_compression_ratio=1.5
        )
    with pytest.raises(ValueError, match="^latents:"):
        stats.normalize(torch.zeros(1, LATENT_C + 1, 1, 1, 1))
