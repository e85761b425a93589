"""Wan2.2 image-to-video vs diffusers' ``WanImageToVideoPipeline``: same directory, image and seed
-> the same frames.

I2V-A14B (a tiny ``WanImageToVideoPipeline`` directory: two experts whose input is the noise
concatenated with a frame mask and the latents of ``[image, black frames]``) and TI2V-5B with an
image (the tiny ``expand_timesteps`` directory: the image's latents as the first latent frame,
timestep 0 on its tokens). Each case shows that another image lands far below the threshold, and
TI2V that the image is not ignored (text alone gives other frames). The refusals (an I2V request
without image, an image to a text-only Wan) are checked on the family's declarations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.input_images import scene
from fixtures.tiny_models import psnr
from fixtures.tiny_wan import build_tiny_wan, reference_wan_i2v
from PIL import Image
from sglang.multimodal_gen.configs.wan import WanArchConfig
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.image_inputs import InputImage
from sglang.multimodal_gen.models.registry import get_family
from sglang.multimodal_gen.pipelines.wan import WanPipeline

# Measured (fp32, CPU): identical frames (inf dB) in both cases.
MIN_PSNR = 70.0
# a wrong image lands at least 15 dB below (measured: I2V inverted image 49.6 dB; TI2V another
# scene 27.4 dB, text only 16.7 dB). The tiny random I2V experts weigh their image condition
# lightly: a nearby scene gives 55.8 dB, so the I2V case uses the inverted image.
FAR = MIN_PSNR - 15
# 3 steps: timesteps 999, 857, 600; the I2V boundary (0.9 x 1000) lies inside: both experts run
KW = dict(height=32, width=32, num_frames=5, num_inference_steps=3, negative_prompt="blurry")


def _ref(pipe, prompt, image, seed, **kw):
    out = pipe(
        prompt=prompt, image=image, generator=torch.Generator().manual_seed(seed),
        output_type="np", **kw,
    )  # fmt: skip
    return (np.asarray(out.frames) * 255).round().astype("uint8")


def _ours(pipe, prompt, seed, image=None, **kw):
    if image is not None:
        kw["image"] = InputImage.from_pil(image)
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw)


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    d = build_tiny_wan(str(tmp_path_factory.mktemp("tiny_wan_i2v")), layout="i2v", seed=2)
    return WanPipeline.from_pretrained(d), reference_wan_i2v(d)


def test_i2v_a14b_matches_diffusers(i2v):
    ours, ref = i2v
    assert ours.image_mode == "concat" and ours.transformer.cfg.in_channels == 36
    kw = dict(KW, guidance_scale=3.0, guidance_scale_2=2.0)
    img = scene(40, 48, 1)
    g = ours.new_generation(ours.spec.params(prompt="x", image=InputImage.from_pil(img), **kw))
    _, timesteps = ours.prepare_timesteps(g, None)
    assert len({id(ours.select_denoiser(i, t, g)) for i, t in enumerate(timesteps)}) == 2
    expected = _ref(ref, "a red fox", img, 3, **kw)
    got = _ours(ours, "a red fox", 3, img, **kw)
    assert got.shape == expected.shape == (1, 5, 32, 32, 3)
    assert expected.std() > 10
    assert psnr(got, expected) >= MIN_PSNR
    inverted = Image.fromarray(255 - np.asarray(img))
    assert psnr(_ours(ours, "a red fox", 3, inverted, **kw), expected) < FAR


def test_i2v_a14b_needs_an_image_and_takes_no_strength(i2v):
    ours, _ = i2v
    spec = ours.spec
    assert spec.inputs == ("text", "image") and "image" in spec.required_inputs
    assert spec.defaults.guidance_scale_2 == 3.5
    with pytest.raises(InvalidRequestError) as e:
        spec.resolve(spec.params(prompt="x", **KW))
    assert e.value.param == "image"
    img = InputImage.from_pil(scene(32, 32, 1))
    with pytest.raises(InvalidRequestError) as e:
        spec.resolve(spec.params(prompt="x", image=img, strength=0.5, **KW))
    assert e.value.param == "strength"


def test_ti2v_image_matches_diffusers(tiny_wan_ti2v_dir):
    ours, ref = WanPipeline.from_pretrained(tiny_wan_ti2v_dir), reference_wan_i2v(tiny_wan_ti2v_dir)
    assert ours.image_mode == "first_frame" and "image" in ours.spec.inputs
    # text-to-video stays (test_wan_pipeline_parity.py)
    assert "image" not in ours.spec.required_inputs
    kw = dict(KW, guidance_scale=4.0)
    img = scene(40, 48, 1)
    expected = _ref(ref, "a red fox", img, 7, **kw)
    got = _ours(ours, "a red fox", 7, img, **kw)
    assert got.shape == expected.shape == (1, 5, 32, 32, 3)
    assert psnr(got, expected) >= MIN_PSNR
    assert psnr(_ours(ours, "a red fox", 7, scene(40, 48, 2), **kw), expected) < FAR
    assert psnr(_ours(ours, "a red fox", 7, **kw), expected) < FAR  # the image ignored


@pytest.mark.parametrize(
    "channels, inputs, required",
    [
        ((16, 16), ("text",), ("text",)),  # T2V-A14B, Wan2.1 T2V
        ((36, 16), ("text", "image"), ("text", "image")),  # I2V-A14B
        ((48, 48), ("text", "image"), ("text",)),  # TI2V-5B
    ],
)
def test_declared_inputs_per_variant(channels, inputs, required):
    cfg = WanArchConfig(in_channels=channels[0], out_channels=channels[1], num_layers=0)
    d = get_family("wan").sampling_defaults(cfg)
    assert (d.inputs, d.required_inputs) == (inputs, required)
