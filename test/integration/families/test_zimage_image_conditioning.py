"""Z-Image with an input image vs diffusers' ``ZImageImg2ImgPipeline`` (image-to-image,
``strength``) and ``ZImageInpaintPipeline`` (a mask): same directory, image, seed -> the same
pixels. Each case also shows that the image, the strength and the mask each matter far outside
the threshold."""

from __future__ import annotations

import pytest
import torch
from fixtures.input_images import half_mask, scene
from fixtures.tiny_models import psnr
from PIL import Image
from sglang.multimodal_gen.image_inputs import InputImage
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

# Measured (fp32, CPU): image-to-image identical pixels with `--cpu-gemm-backend blas` (inf dB;
# 87.8 dB with the default oneDNN GEMM, which sums in another order); inpainting under CFG 84.8 dB
# (the starting latents are bit-identical; the DiT's float order under CFG moves the latents by
# ~1e-6 against the reference, as it does in image-to-image, and here tips a few pixels by one
# level; inpainting without CFG: inf dB).
MIN_PSNR = 70.0
# a wrong input (no image, another image, strength or mask) lands at least 15 dB below it
# (measured: text alone 13.9, another image 42.0, strength 1.0 28.5; no mask 17.5, the mirrored
# mask 13.8 dB)
FAR = MIN_PSNR - 15


@pytest.fixture(scope="module")
def zimage(tiny_zimage_dir):
    from diffusers import ZImageImg2ImgPipeline, ZImageInpaintPipeline

    i2i = ZImageImg2ImgPipeline.from_pretrained(tiny_zimage_dir)
    inp = ZImageInpaintPipeline(**i2i.components)
    for p in (i2i, inp):
        p.set_progress_bar_config(disable=True)
    return ZImagePipeline.from_pretrained(tiny_zimage_dir), i2i, inp


def _ref(pipe, seed, **kw):
    out = pipe(generator=torch.Generator().manual_seed(seed), output_type="np", **kw)
    return (out.images * 255).round().astype("uint8")


def _ours(pipe, seed, prompt, **kw):
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw)


# The reference takes the output size from the image (it does not resize it): the image is given
# at the request's size, as our pipeline resizes it to (height, width).
KW = dict(prompt="a red fox", height=48, width=64, num_inference_steps=3, guidance_scale=0.0)


def test_image_to_image_matches_diffusers(zimage):
    ours, i2i, _ = zimage
    img = scene(64, 48, 1)
    expected = _ref(i2i, 5, image=img, strength=0.6, **KW)
    got = _ours(ours, 5, image=InputImage.from_pil(img), strength=0.6, **KW)
    assert got.shape == expected.shape == (1, 48, 64, 3)
    assert expected.std() > 10
    assert psnr(got, expected) >= MIN_PSNR
    # the default strength is the reference's (0.6): the same pixels as strength=0.6
    assert ours.spec.defaults.strength == 0.6
    assert psnr(_ours(ours, 5, image=img, **KW), got) == float("inf")
    # text alone, another image, another strength: far below
    assert psnr(_ours(ours, 5, **KW), expected) < FAR
    assert psnr(_ours(ours, 5, image=scene(64, 48, 2), strength=0.6, **KW), expected) < FAR
    assert psnr(_ours(ours, 5, image=img, strength=1.0, **KW), expected) < FAR


def test_inpainting_with_cfg_and_two_images_matches_diffusers(zimage):
    """CFG on (a negative prompt), two images per prompt sharing the image's one sample."""
    ours, _, inp = zimage
    img, mask = scene(64, 48, 4), half_mask(64, 48)
    kw = dict(KW, guidance_scale=1.5, negative_prompt="blurry")
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
