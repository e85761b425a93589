"""Our Flux.1 pipeline vs diffusers' FluxPipeline: same directory, same seed, same image.

[dev] runs with dynamic shifting on (the scheduler config of FLUX.1-dev), so a wrong ``mu`` or a
wrong shift would show; [schnell] with its static schedule. Each case also shows that a nearby
but different input lands outside the threshold, so the threshold discriminates.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_flux import reference_flux, reference_flux_images
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.pipelines.flux import FluxPipeline

# Measured (fp32, CPU): identical pixels (inf dB) in every case below, also with the batched
# cond/uncond forward of true CFG. 70 dB allows a few off-by-one pixels from a GEMM blocking change.
MIN_PSNR = 70.0


@pytest.fixture(scope="module")
def dev(tiny_flux_dev_dir):
    return FluxPipeline.from_pretrained(tiny_flux_dev_dir), reference_flux(tiny_flux_dev_dir)


@pytest.fixture(scope="module")
def schnell(tiny_flux_schnell_dir):
    return (
        FluxPipeline.from_pretrained(tiny_flux_schnell_dir),
        reference_flux(tiny_flux_schnell_dir),
    )


def _ours(pipe, prompt, seed, **kw):
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw)


DEV_CASES = [
    pytest.param(
        dict(height=64, width=64, num_inference_steps=3, guidance_scale=3.5), "guidance_scale", 3.9,
        id="guidance",
    ),
    pytest.param(
        dict(height=32, width=48, num_inference_steps=2, guidance_scale=2.0, max_sequence_length=16),
        "guidance_scale", 2.2, id="short-t5",
    ),
    pytest.param(
        dict(
            height=48, width=32, num_inference_steps=2, guidance_scale=3.5,
            negative_prompt="blurry", true_cfg_scale=4.0,
        ),
        "true_cfg_scale", 4.4, id="true-cfg",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("kw", "knob", "wrong"), DEV_CASES)
def test_dev_matches_diffusers(dev, kw, knob, wrong):
    ours, ref = dev
    prompt = "a small red fox in the snow"
    expected = reference_flux_images(ref, prompt, seed=42, **kw)
    got = _ours(ours, prompt, 42, **kw)
    assert got.shape == expected.shape == (1, kw["height"], kw["width"], 3)
    assert expected.std() > 10
    assert psnr(got, expected) >= MIN_PSNR
    # a 10 % change of the case's guidance knob must fail the same threshold
    other = _ours(ours, prompt, 42, **dict(kw, **{knob: wrong}))
    assert psnr(other, expected) < MIN_PSNR


def test_dev_dynamic_shift_is_used(dev):
    """The [dev] scheduler shifts by the image size: 64x64 and 32x32 use different sigmas."""
    ours, _ = dev
    g = ours.new_generation(ours.spec.params(prompt="x", num_inference_steps=3))
    s64 = ours.prepare_timesteps(g, torch.zeros(1, 16, 64))[1]
    s16 = ours.prepare_timesteps(g, torch.zeros(1, 4, 64))[1]
    assert not torch.equal(s64, s16)


def test_dev_batch_and_prompt_sensitivity(dev):
    ours, ref = dev
    kw = dict(height=32, width=32, num_inference_steps=2, num_images_per_prompt=2)
    expected = reference_flux_images(ref, "two foxes", seed=3, **kw)
    got = _ours(ours, "two foxes", 3, height=32, width=32, num_inference_steps=2,
                num_outputs_per_prompt=2)  # fmt: skip
    assert psnr(got, expected) >= MIN_PSNR
    one_letter = _ours(ours, "two fixes", 3, height=32, width=32, num_inference_steps=2,
                       num_outputs_per_prompt=2)  # fmt: skip
    assert psnr(one_letter, expected) < MIN_PSNR


def test_schnell_matches_diffusers(schnell):
    ours, ref = schnell
    assert ours.spec.defaults.num_inference_steps == 4
    assert ours.spec.defaults.max_sequence_length == 256
    kw = dict(height=64, width=48, num_inference_steps=4, max_sequence_length=256)
    expected = reference_flux_images(ref, "a lighthouse at dusk", seed=7, **kw)
    got = _ours(ours, "a lighthouse at dusk", 7, **kw)
    assert psnr(got, expected) >= MIN_PSNR
    other_seed = _ours(ours, "a lighthouse at dusk", 8, **kw)
    assert psnr(other_seed, expected) < MIN_PSNR


def test_defaults_follow_the_variant(dev, schnell):
    assert dev[0].spec.defaults.num_inference_steps == 28
    assert dev[0].spec.defaults.guidance_scale == 3.5
    assert dev[0].spec.defaults.max_sequence_length == 512
    assert dev[0].spec.defaults.true_cfg_scale == 1.0
    assert schnell[0].spec.defaults.guidance_scale == 0.0
    assert schnell[0].spec.defaults.max_sequence_length == 256
    assert dev[0].spec.limits.max_sequence_length == schnell[0].spec.limits.max_sequence_length
    assert dev[0].spec.limits.max_sequence_length == 512


def test_bad_sizes(dev):
    ours, _ = dev
    with pytest.raises(InvalidRequestError, match="height must be a positive multiple of 16") as e:
        _ours(ours, "x", 0, height=40, width=32, num_inference_steps=1)
    assert e.value.param == "height"
    assert np.asarray(_ours(ours, "x", 0, height=16, width=16, num_inference_steps=1)).shape == (
        1, 16, 16, 3,
    )  # fmt: skip
