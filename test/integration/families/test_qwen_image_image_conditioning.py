"""Qwen-Image with an input image vs diffusers' ``QwenImageImg2ImgPipeline`` (image-to-image,
``strength``) and ``QwenImageInpaintPipeline`` (a mask): same directory, image, seed -> the same
pixels. The VAE is ``AutoencoderKLQwenImage`` (a frame axis, ``latents_mean`` / ``latents_std``
normalisation, packed latents). Each case also shows that the image, the strength and the mask
each matter far outside the threshold."""

from __future__ import annotations

import pytest
import torch
from fixtures.input_images import half_mask, scene
from fixtures.tiny_models import psnr
from PIL import Image, ImageOps
from sglang.multimodal_gen.image_inputs import InputImage
from sglang.multimodal_gen.pipelines.qwen_image import QwenImagePipeline

# Measured (fp32, CPU): identical pixels (inf dB) in every case below; the starting latents are
# bit-identical (the DiT's float order moves the latents by ~1e-7 per step against the
# reference, as in text-to-image, which on other inputs tips a few pixels by one level: 87.8 dB).
MIN_PSNR = 70.0
# A wrong input lands at least 15 dB below it (measured: text alone 30.9, strength 1.0 32.7; no
# mask 31.7, the mirrored mask 29.8 dB). The tiny random VAE barely sees its input: another image moves the final latents by
# only 1-4 % and the pixels to 48-56 dB, so the swapped image is the inverted one (53.0 dB).
FAR = MIN_PSNR - 15


@pytest.fixture(scope="module")
def qwen(tiny_qwen_image_dir):
    from diffusers import QwenImageImg2ImgPipeline, QwenImageInpaintPipeline

    i2i = QwenImageImg2ImgPipeline.from_pretrained(tiny_qwen_image_dir)
    inp = QwenImageInpaintPipeline(**i2i.components)
    for p in (i2i, inp):
        p.set_progress_bar_config(disable=True)
    return QwenImagePipeline.from_pretrained(tiny_qwen_image_dir), i2i, inp


def _ref(pipe, seed, **kw):
    out = pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **kw)
    return (out.images * 255).round().astype("uint8")


def _ours(pipe, seed, prompt, **kw):
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw)


KW = dict(prompt="a red fox", height=48, width=64, num_inference_steps=3, true_cfg_scale=1.0)


def test_image_to_image_matches_diffusers(qwen):
    ours, i2i, _ = qwen
    img = scene(80, 56, 1)  # resized to the request's 64x48 as the reference resizes it
    expected = _ref(i2i, 5, image=img, strength=0.6, **KW)
    got = _ours(ours, 5, image=InputImage.from_pil(img), strength=0.6, **KW)
    assert got.shape == expected.shape == (1, 48, 64, 3)
    assert expected.std() > 5
    assert psnr(got, expected) >= MIN_PSNR
    assert ours.spec.defaults.strength == 0.6  # the reference's default
    # text alone, the inverted image, another strength: far below
    assert psnr(_ours(ours, 5, **KW), expected) < FAR
    assert psnr(_ours(ours, 5, image=ImageOps.invert(img), strength=0.6, **KW), expected) < FAR
    assert psnr(_ours(ours, 5, image=img, strength=1.0, **KW), expected) < FAR


def test_inpainting_with_two_images_matches_diffusers(qwen):
    """Two images per prompt sharing the image's one posterior sample (the mask repeated over
    the channels and packed like the latents)."""
    ours, _, inp = qwen
    img, mask = scene(64, 48, 4), half_mask(64, 48)
    kw = KW
    expected = _ref(inp, 11, image=img, mask_image=mask, strength=0.9, num_images_per_prompt=2,
                    **kw)  # fmt: skip
    got = _ours(ours, 11, image=img, mask_image=mask, strength=0.9, num_outputs_per_prompt=2,
                **kw)  # fmt: skip
    assert got.shape == expected.shape == (2, 48, 64, 3)
    assert psnr(got, expected) >= MIN_PSNR
    one = dict(kw, image=img, strength=0.9, num_outputs_per_prompt=2)
    # without the mask (plain image-to-image) the kept half changes; a mirrored mask edits the
    # other half
    assert psnr(_ours(ours, 11, **one), expected) < FAR
    flipped = mask.transpose(Image.FLIP_LEFT_RIGHT)
    assert psnr(_ours(ours, 11, mask_image=flipped, **one), expected) < FAR
