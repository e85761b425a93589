"""``RequestSpec.resolve`` and the conditioning a model declares: what it takes (``inputs``), what
it requires (``required_inputs``), the strength of an input image, the mask's size, the number
of images; each refusal names the field. And the batching key: requests whose input images
differ in size never share a denoising loop."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from sglang.multimodal_gen.configs.sampling_params import (
    RequestLimits,
    RequestSpec,
    SamplingParams,
)
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.image_inputs import InputImage

DEFAULTS = SamplingParams(prompt="", height=64, width=64, num_inference_steps=4,
                          guidance_scale=1.0, max_sequence_length=64)  # fmt: skip
TEXT_ONLY = RequestSpec("t", "Text", SamplingParams, DEFAULTS, RequestLimits())
IMG2IMG = RequestSpec(
    "i", "Img", SamplingParams, DEFAULTS.replace(strength=0.6),
    RequestLimits(max_input_images=1), inputs=("text", "image", "mask"),
)  # fmt: skip
EDIT = RequestSpec(
    "e", "Edit", SamplingParams, DEFAULTS, RequestLimits(max_input_images=3),
    inputs=("text", "image"), required_inputs=("text", "image"),
)  # fmt: skip


def img(w=40, h=30, seed=0) -> InputImage:
    rng = np.random.default_rng(seed)
    return InputImage(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), source="image")


def mask(w=40, h=30) -> InputImage:
    return InputImage(np.full((h, w), 255, np.uint8), source="mask_image")


def refused(spec, field, **values):
    with pytest.raises(InvalidRequestError) as e:
        spec.resolve(SamplingParams(prompt="p", **values))
    assert e.value.param == field and e.value.status_code == 400, e.value.message
    return e.value.message


def test_a_model_takes_only_what_it_declares():
    assert "take no input image" in refused(TEXT_ONLY, "image", image=(img(),))
    assert "take no mask" in refused(EDIT, "mask_image", image=(img(),), mask_image=mask())
    assert "need an input image" in refused(EDIT, "image")
    refused(EDIT, "image", image=())  # an empty list is no image
    assert "at most 3" in refused(EDIT, "image", image=(img(),) * 4)
    assert "at most 1" in refused(IMG2IMG, "image", image=(img(), img(seed=1)))
    # what it declares passes, and the request carries the same pixels
    r = EDIT.resolve(SamplingParams(prompt="p", image=(img(), img(seed=1))))
    assert [x.digest for x in r.image] == [img().digest, img(seed=1).digest]


def test_strength_belongs_to_an_image_that_is_renoised():
    assert "give image" in refused(IMG2IMG, "strength", strength=0.5)
    assert "does not apply" in refused(EDIT, "strength", image=(img(),), strength=0.5)
    refused(IMG2IMG, "strength", image=(img(),), strength=0.0)
    refused(IMG2IMG, "strength", image=(img(),), strength=1.01)
    # so small that no step is left: refused when resolved, not in the middle of the pipeline
    assert "no denoising step" in refused(IMG2IMG, "strength", image=(img(),), strength=1e-17)
    assert IMG2IMG.resolve(SamplingParams(prompt="p", image=(img(),))).strength == 0.6
    assert IMG2IMG.resolve(SamplingParams(prompt="p", image=(img(),), strength=1)).strength == 1
    # text alone: no strength is filled in (nothing is re-noised)
    assert IMG2IMG.resolve(SamplingParams(prompt="p")).strength is None


def test_the_mask_is_the_images_size_and_needs_it():
    assert "needs the image" in refused(IMG2IMG, "mask_image", mask_image=mask())
    assert "same size" in refused(IMG2IMG, "mask_image", image=(img(),), mask_image=mask(41, 30))
    refused(IMG2IMG, "mask_image", image=(img(),), mask_image=img())  # an RGB image: no mask
    refused(IMG2IMG, "image", image=(mask(),))  # a mask given as the image
    IMG2IMG.resolve(SamplingParams(prompt="p", image=(img(),), mask_image=mask()))


def test_python_api_spellings_become_input_images():
    pil = Image.fromarray(img().pixels)
    a = IMG2IMG.resolve(SamplingParams(prompt="p", image=pil))
    b = IMG2IMG.resolve(SamplingParams(prompt="p", image=[img()]))
    assert a.image[0].digest == b.image[0].digest == img().digest
    # a PIL mask: white is edited; with transparency, the transparent pixels
    m = np.zeros((30, 40), np.uint8)
    m[:, 20:] = 255
    rgba = np.zeros((30, 40, 4), np.uint8)
    rgba[:, :, 3] = 255 - m
    for pil_mask in (Image.fromarray(m, "L"), Image.fromarray(rgba, "RGBA")):
        r = IMG2IMG.resolve(SamplingParams(prompt="p", image=pil, mask_image=pil_mask))
        np.testing.assert_array_equal(r.mask_image.pixels, m)


def test_batch_key_separates_image_sizes_but_not_image_contents():
    base = dict(prompt="p", height=64, width=64, strength=0.6)
    k = SamplingParams(image=(img(),), **base).batch_key()
    assert SamplingParams(image=(img(seed=5),), **base).batch_key() == k  # per row
    assert SamplingParams(image=(img(41, 30),), **base).batch_key() != k
    assert SamplingParams(image=(img(),), mask_image=mask(), **base).batch_key() != k
    assert SamplingParams(**base).batch_key() != k
