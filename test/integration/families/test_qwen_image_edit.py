"""Qwen-Image-Edit and Qwen-Image-Edit-Plus vs diffusers' ``QwenImageEditPipeline`` /
``QwenImageEditPlusPipeline`` on tiny directories (``models/families/tiny/qwen_image_edit.py``):
same images, prompt, seed -> the same pixels, true CFG on. Another image, the images swapped, or
no image at all land far below the threshold; a request without an image is refused naming
``image``; a diffusers-format LoRA matches diffusers with the same file loaded through peft.

The reference is diffusers' own pipeline (``reference_pipeline``): its processor is loaded by our
``load_processor`` (transformers cannot build a ``Qwen2VLProcessor`` without torchvision) and the
tiny directory's small image areas replace 1024^2 / 384^2 in its ``calculate_dimensions``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.input_images import scene
from fixtures.tiny_models import output_pixels, psnr, random_peft_lora
from PIL import Image
from sglang.multimodal_gen.configs.qwen_image_edit import VAE_IMAGE_AREA, calculate_dimensions
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.models.families.tiny.qwen_image_edit import (
    build_qwen_image_edit_dir,
    build_qwen_image_edit_plus_dir,
    reference_pipeline,
)
from sglang.multimodal_gen.pipelines.qwen_image_edit import (
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
)

# Measured (fp32, CPU): identical pixels (inf dB) for Edit, Plus with two images and the LoRA.
# Test time about 100 s on 2 shared cores (two tiny directories built, six reference calls).
MIN_PSNR = 70.0
FAR = MIN_PSNR - 10  # a wrong input lands at least this far below (measured: see each test)
KW = dict(height=32, width=48, num_inference_steps=2, true_cfg_scale=4.0, negative_prompt="blur")
PROMPT = "make the square red"


@pytest.fixture(scope="module")
def edit_dir(tmp_path_factory) -> str:
    return build_qwen_image_edit_dir(str(tmp_path_factory.mktemp("qwen_image_edit")))


@pytest.fixture(scope="module")
def plus_dir(tmp_path_factory) -> str:
    return build_qwen_image_edit_plus_dir(str(tmp_path_factory.mktemp("qwen_image_edit_plus")))


def _ref(pipe, seed, image, **kw):
    pipe.set_progress_bar_config(disable=True)
    out = pipe(image=image, prompt=PROMPT, generator=torch.Generator().manual_seed(seed),
               output_type="np", **kw)  # fmt: skip
    return (out.images * 255).round().astype("uint8")


def _ours(pipe, seed, image, **kw):
    return pipe(PROMPT, image=image, generator=torch.Generator().manual_seed(seed),
                output_type="np", **kw)  # fmt: skip


def test_edit_matches_diffusers_and_needs_its_image(edit_dir):
    ours = QwenImageEditPipeline.from_pretrained(edit_dir)
    img = scene(64, 48, 1)
    expected = _ref(reference_pipeline(edit_dir), 5, img, **KW)
    got = _ours(ours, 5, img, **KW)
    assert got.shape == expected.shape == (1, 32, 48, 3)
    assert psnr(got, expected) >= MIN_PSNR, psnr(got, expected)
    # the image inverted (measured 46 dB): the image is not ignored
    other = _ours(ours, 5, Image.fromarray(255 - np.asarray(img)), **KW)
    assert psnr(other, expected) < FAR, psnr(other, expected)
    # the request is refused without an image (HTTP 400 naming it), with two, with strength
    for extra, field in ((dict(), "image"), (dict(image=[img, img]), "image"),
                         (dict(image=img, strength=0.5), "strength")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as e:
            ours(PROMPT, **dict(KW, **extra))
        assert e.value.param == field, (extra, e.value.message)


def test_plus_two_images_match_diffusers_in_their_order(plus_dir):
    ours = QwenImageEditPlusPipeline.from_pretrained(plus_dir)
    a, b = scene(64, 48, 3), scene(40, 56, 4)
    expected = _ref(reference_pipeline(plus_dir), 9, [a, b], **KW)
    got = _ours(ours, 9, [a, b], **KW)
    assert psnr(got, expected) >= MIN_PSNR, psnr(got, expected)
    # the images swapped (measured 53 dB) or only the first one: far off
    swapped = _ours(ours, 9, [b, a], **KW)
    assert psnr(swapped, expected) < FAR, psnr(swapped, expected)
    first_only = _ours(ours, 9, [a], **KW)
    assert psnr(first_only, expected) < FAR, psnr(first_only, expected)
    with pytest.raises(InvalidRequestError) as e:
        ours(PROMPT, **KW)
    assert e.value.param == "image"
    with pytest.raises(InvalidRequestError) as e:
        ours(PROMPT, image=[a] * 4, **KW)
    assert e.value.param == "image"


def test_output_size_follows_the_last_image_unless_given(plus_dir):
    """diffusers: ``calculate_dimensions(1024 * 1024, w / h)`` of the last image, rounded down to
    16; a given side is kept."""
    from sglang.multimodal_gen.models.registry import get_family

    fam = get_family("qwen-image-edit-plus")
    spec = QwenImageEditPlusPipeline.from_pretrained(plus_dir).spec
    assert fam.params_class() is spec.params_class
    for w, h in ((640, 480), (333, 1000)):
        p = spec.resolve(spec.params(prompt="x", image=[scene(64, 48, 1), scene(w, h, 2)]))
        cw, ch = calculate_dimensions(VAE_IMAGE_AREA, w / h)
        assert (p.width, p.height) == (cw // 16 * 16, ch // 16 * 16)
    p = spec.resolve(spec.params(prompt="x", image=[scene(640, 480, 1)], height=64))
    assert (p.width, p.height) == (1184, 64)


def test_diffusers_format_lora_matches_diffusers(edit_dir, tmp_path):
    """A peft-layout file (``transformer.transformer_blocks.N....lora_A/B``) at 0.8 on our
    engine at TP 2 (merged, unmerged and per request) against diffusers' ``load_lora_weights`` +
    ``set_adapters``; the base weights are back after ``unset_lora``."""
    from sglang.multimodal_gen.runtime import DiffusionEngine

    lora = random_peft_lora(edit_dir, str(tmp_path / "lora"), seed=5)
    img = scene(64, 48, 1)
    ref = reference_pipeline(edit_dir)
    base = _ref(ref, 3, img, **KW)
    ref.load_lora_weights(lora, adapter_name="a")
    ref.set_adapters(["a"], [0.8])
    expected = _ref(ref, 3, img, **KW)
    # at TP 2: merged, unmerged (dynamic), per request, and a request without it after
    with DiffusionEngine(edit_dir, device="cpu", tp_size=2) as eng:
        params = eng.spec.params(prompt=PROMPT, image=[img], seed=3, **KW)
        eng.set_lora("a", lora, strength=0.8, merge_mode="merge")
        merged = output_pixels(eng.generate(params))
        eng.set_lora("a", None, strength=0.8, merge_mode="dynamic")
        dynamic = output_pixels(eng.generate(params))
        eng.unset_lora()
        per_request = output_pixels(eng.generate(params.replace(lora=(("a", 0.8),))))
        plain = output_pixels(eng.generate(params))
    for got in (merged, dynamic, per_request):
        assert psnr(got, expected) >= MIN_PSNR, psnr(got, expected)
    assert psnr(plain, base) >= MIN_PSNR, psnr(plain, base)
    # the adapter matters (measured 32 dB without it)
    assert psnr(base, expected) < FAR, psnr(base, expected)
