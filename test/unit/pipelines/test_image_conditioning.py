"""``pipelines.image_conditioning`` against diffusers: the strength's schedule cut equals
``get_timesteps`` of diffusers' image-to-image pipelines, the posterior sample equals
``DiagonalGaussianDistribution.sample`` with the same generator, and the inpainting blend keeps
the unmasked part."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.pipelines.image_conditioning import (
    IMAGE_LATENTS,
    NOISE,
    encode_inpaint_mask,
    inpaint_blend,
    sample_posterior,
    sdedit_start,
    sdedit_timesteps,
)


def _scheduler(n):
    from diffusers import FlowMatchEulerDiscreteScheduler

    s = FlowMatchEulerDiscreteScheduler(shift=3.0)
    s.set_timesteps(n)
    return s


@pytest.mark.parametrize("n", [1, 4, 7, 28])
@pytest.mark.parametrize("strength", [0.05, 0.3, 0.6, 0.999, 1.0])
def test_sdedit_timesteps_are_diffusers_get_timesteps(n, strength):
    from diffusers import FluxImg2ImgPipeline

    ref_sched, ours_sched = _scheduler(n), _scheduler(n)
    holder = type("P", (), {"scheduler": ref_sched})()
    expected, steps = FluxImg2ImgPipeline.get_timesteps(holder, n, strength, "cpu")
    got, got_steps = sdedit_timesteps(ours_sched, n, strength)
    assert torch.equal(got, expected) and got_steps == steps >= 1
    assert ours_sched.begin_index == ref_sched.begin_index


def test_posterior_sample_is_diffusers_sample():
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    params = torch.randn(2, 8, 5, 6, generator=torch.Generator().manual_seed(0))
    dist = DiagonalGaussianDistribution(params)
    expected = dist.sample(torch.Generator().manual_seed(4))
    got = sample_posterior(dist.mean, dist.std, torch.Generator().manual_seed(4), "cpu")
    assert torch.equal(got, expected)


def test_inpaint_blend_keeps_the_unmasked_part():
    sched = _scheduler(4)
    steps = sched.timesteps
    lat, image, noise = (torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(i))
                         for i in range(3))  # fmt: skip
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])[None, :, None]
    sched._step_index = 1
    out = inpaint_blend(lat, image, mask, noise, sched, steps, 0)
    kept = sched.scale_noise(image, steps[1:2], noise)
    assert torch.equal(out[:, 1::2], kept[:, 1::2]) and torch.equal(out[:, ::2], lat[:, ::2])
    last = inpaint_blend(lat, image, mask, noise, sched, steps, len(steps) - 1)
    assert torch.equal(last[:, 1::2], image[:, 1::2])  # the image itself after the last step


def test_inpaint_mask_is_diffusers_binarised_mask_on_the_latent_grid():
    import numpy as np
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    grey = np.tile(np.linspace(0, 255, 64).astype(np.uint8), (48, 1))  # 0 .. 255 left to right
    mask = Image.fromarray(grey, "L")
    got = encode_inpaint_mask(mask, 48, 64, 16, (6, 8))
    proc = VaeImageProcessor(
        vae_scale_factor=16, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    )
    expected = torch.nn.functional.interpolate(proc.preprocess(mask, 48, 64), size=(6, 8))
    assert got.shape == (1, 1, 6, 8) and torch.equal(got, expected)
    assert set(got.unique().tolist()) == {0.0, 1.0}  # binarised: white half edited
    assert got[..., :3].sum() == 0 and got[..., 5:].min() == 1


def test_sdedit_start_renoises_the_image_at_the_first_kept_step():
    sched = _scheduler(4)
    lat, image, noise = (torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(i))
                         for i in range(3))  # fmt: skip
    # no image: the text-to-image start and schedule, unchanged
    same, steps = sdedit_start({}, lat, sched, sched.timesteps, 4, 0.5)
    assert same is lat and steps is sched.timesteps
    cond = {IMAGE_LATENTS: image, NOISE: noise}
    start, steps = sdedit_start(cond, lat, sched, sched.timesteps, 4, 0.5)
    assert torch.equal(steps, _scheduler(4).timesteps[2:])
    ref = _scheduler(4)
    ref.set_begin_index(2)
    assert torch.equal(start, ref.scale_noise(image, steps[:1].repeat(2), noise))
