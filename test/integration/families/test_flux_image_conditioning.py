"""Flux.1 with an input image vs diffusers' ``FluxImg2ImgPipeline`` (image-to-image, ``strength``)
and ``FluxInpaintPipeline`` (a mask): same directory, image, seed -> the same pixels. Each case
also shows that the image, the strength and the mask each matter far outside the threshold."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.input_images import half_mask, scene
from fixtures.tiny_models import psnr
from PIL import Image
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.image_inputs import InputImage
from sglang.multimodal_gen.pipelines.flux import FluxPipeline

# Measured (fp32, CPU): identical pixels (inf dB) in every case below.
MIN_PSNR = 70.0
# a wrong input (another image, strength or mask) lands at least 15 dB below it (measured: <= 42)
FAR = MIN_PSNR - 15


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_dir):
    from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline

    i2i = FluxImg2ImgPipeline.from_pretrained(tiny_flux_dev_dir)
    inp = FluxInpaintPipeline(**i2i.components)
    for p in (i2i, inp):
        p.set_progress_bar_config(disable=True)
    return FluxPipeline.from_pretrained(tiny_flux_dev_dir), i2i, inp


def _ref(pipe, seed, **kw):
    out = pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **kw)
    return (out.images * 255).round().astype("uint8")


def _ours(pipe, seed, prompt, **kw):
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw)


KW = dict(prompt="a red fox", height=48, width=64, num_inference_steps=4, guidance_scale=3.5)


@pytest.mark.parametrize("strength", [0.6, 1.0])
def test_image_to_image_matches_diffusers(flux, strength):
    ours, i2i, _ = flux
    img = scene(80, 56, 1)  # resized to the request's 64x48 as diffusers resizes it
    expected = _ref(i2i, 5, image=img, strength=strength, **KW)
    got = _ours(ours, 5, image=InputImage.from_pil(img), strength=strength, **KW)
    assert got.shape == expected.shape == (1, 48, 64, 3)
    assert psnr(got, expected) >= MIN_PSNR
    # the image's posterior sample is drawn before the noise (also at strength 1, where the
    # image itself is noised away): text alone gives another image
    text_only = _ours(ours, 5, **KW)
    assert psnr(text_only, expected) < FAR
    if strength < 1:  # the image matters (another scene), and so does the strength
        other = _ours(ours, 5, image=scene(80, 56, 2), strength=strength, **KW)
        assert psnr(other, expected) < FAR
        weaker = _ours(ours, 5, image=img, strength=0.3, **KW)
        assert psnr(weaker, expected) < FAR


def test_two_images_per_prompt_share_the_image_sample(flux):
    ours, i2i, _ = flux
    img = scene(64, 48, 3)
    kw = dict(KW, num_inference_steps=3)
    expected = _ref(i2i, 9, image=img, strength=0.8, num_images_per_prompt=2, **kw)
    got = _ours(ours, 9, image=img, strength=0.8, num_outputs_per_prompt=2, **kw)
    assert got.shape == (2, 48, 64, 3)
    assert psnr(got, expected) >= MIN_PSNR


def test_inpainting_matches_diffusers(flux):
    ours, _, inp = flux
    img, mask = scene(64, 48, 4), half_mask(64, 48)
    expected = _ref(inp, 11, image=img, mask_image=mask, strength=0.9, **KW)
    got = _ours(ours, 11, image=img, mask_image=mask, strength=0.9, **KW)
    assert psnr(got, expected) >= MIN_PSNR
    # without the mask (plain image-to-image) the kept half changes
    unmasked = _ours(ours, 11, image=img, strength=0.9, **KW)
    assert psnr(unmasked, expected) < FAR
    # a mirrored mask edits the other half
    flipped = _ours(ours, 11, image=img, mask_image=mask.transpose(Image.FLIP_LEFT_RIGHT),
                    strength=0.9, **KW)  # fmt: skip
    assert psnr(flipped, expected) < FAR


def test_openai_transparent_mask_is_the_same_edit(flux):
    """OpenAI's convention (transparent = edit) and diffusers' (white = edit) give one image."""
    ours, _, _ = flux
    img = scene(64, 48, 4)
    white = half_mask(64, 48)
    rgba = np.full((48, 64, 4), 200, np.uint8)
    rgba[:, :, 3] = 255 - np.asarray(white)  # transparent where white
    import io

    from sglang.multimodal_gen.image_inputs import decode_mask

    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    openai_mask = decode_mask(buf.getvalue(), "mask")
    a = _ours(ours, 2, image=img, mask_image=white, strength=0.7, **KW)
    b = _ours(ours, 2, image=img, mask_image=openai_mask, strength=0.7, **KW)
    np.testing.assert_array_equal(a, b)


def test_bad_conditioning_is_refused_naming_the_field(flux):
    ours = flux[0]
    img = scene(64, 48, 1)
    cases = [
        (dict(strength=0.5), "strength"),  # no image
        (dict(image=img, strength=0.0), "strength"),
        (dict(image=img, strength=1.5), "strength"),
        (dict(mask_image=half_mask(64, 48)), "mask_image"),  # no image
        (dict(image=img, mask_image=half_mask(32, 48)), "mask_image"),  # another size
        (dict(image=[img, img]), "image"),  # one image at most
    ]
    for extra, field in cases:
        with pytest.raises(InvalidRequestError, match=".") as e:
            _ours(ours, 0, **dict(KW, **extra))
        assert e.value.param == field, (extra, e.value.message)


def test_batched_image_requests_keep_their_own_image(tiny_flux_dev_dir):
    """Image-to-image requests with different images (one with a mask) share one DiT call per
    step, in both orders, each equal to itself alone: a row never sees another row's image."""
    from fixtures.tiny_models import count_dit_calls, output_pixels
    from sglang.multimodal_gen.configs.flux import FluxSamplingParams
    from sglang.multimodal_gen.runtime.runner import ModelRunner

    kw = dict(height=32, width=32, num_inference_steps=3, guidance_scale=3.5, strength=0.5)
    runner = ModelRunner(tiny_flux_dev_dir)
    reqs = [
        runner.spec.resolve(FluxSamplingParams(prompt="a fox", image=scene(32, 32, s), seed=5,
                                               **kw))
        for s in (1, 2)
    ]  # fmt: skip
    single = [output_pixels(runner.cmd_generate(r)) for r in reqs]
    assert psnr(single[0], single[1]) < FAR  # the same request but its image
    for order in ([0, 1], [1, 0]):
        calls = count_dit_calls(runner)
        out = runner.cmd_generate_batch([reqs[i] for i in order])
        assert calls[0] == 2  # strength 0.5 of 3 steps runs the last 2, one DiT call each
        for i, (ok, got) in zip(order, out):
            assert ok, got
            assert psnr(output_pixels(got), single[i]) >= MIN_PSNR, (order, i)
