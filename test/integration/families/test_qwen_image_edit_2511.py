"""Qwen-Image-Edit-2511 (a ``QwenImageEditPlusPipeline`` directory whose transformer has
``zero_cond_t: true``) vs diffusers' ``QwenImageEditPlusPipeline`` on the tiny 2511-style
directory (``build_qwen_image_edit_plus_dir(..., zero_cond_t=True)``), and the same request on a
TP 2 engine against one process.

Two condition images, true CFG on, 2 steps, 32 x 48 output. The wrong inputs that must land far
below the bar: the same weights served as 2509 (``zero_cond_t`` off: every image token modulated
with ``t``) and the two images swapped. The DiT-level parity (two condition images, padded
batch) is in ``test_qwen_image_transformer_parity.py``.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from fixtures.input_images import scene
from fixtures.tiny_models import output_pixels, psnr
from sglang.multimodal_gen.models.families.tiny.qwen_image_edit import (
    build_qwen_image_edit_plus_dir,
    reference_pipeline,
)
from sglang.multimodal_gen.pipelines.qwen_image_edit import QwenImageEditPlusPipeline

# Measured (fp32, CPU): ours vs diffusers inf dB (identical pixels); TP 2 vs one process inf dB.
# Wrong inputs: served as 2509 (zero_cond_t off) 37.7 dB, images swapped 54.7 dB.
MIN_PSNR = 70.0
FAR = MIN_PSNR - 10
KW = dict(height=32, width=48, num_inference_steps=2, true_cfg_scale=4.0, negative_prompt="blur")
PROMPT = "put the square of picture 2 into picture 1"
SEED = 9


IMAGES = (scene(64, 48, 3), scene(40, 56, 4))


@pytest.fixture(scope="module")
def dir_2511(tmp_path_factory) -> str:
    return build_qwen_image_edit_plus_dir(
        str(tmp_path_factory.mktemp("qwen_image_edit_2511")), zero_cond_t=True
    )


@pytest.fixture(scope="module")
def expected(dir_2511) -> np.ndarray:
    """diffusers' ``QwenImageEditPlusPipeline`` on the 2511-style directory."""
    pipe = reference_pipeline(dir_2511)
    assert pipe.transformer.zero_cond_t  # the reference really runs the 2511 path
    pipe.set_progress_bar_config(disable=True)
    out = pipe(image=list(IMAGES), prompt=PROMPT, generator=torch.Generator().manual_seed(SEED),
               output_type="np", **KW)  # fmt: skip
    return (out.images * 255).round().astype("uint8")


def _ours(pipe, images):
    return pipe(PROMPT, image=list(images), generator=torch.Generator().manual_seed(SEED),
                output_type="np", **KW)  # fmt: skip


@pytest.fixture(scope="module")
def ours(dir_2511):
    pipe = QwenImageEditPlusPipeline.from_pretrained(dir_2511)
    assert pipe.transformer.cfg.zero_cond_t
    return pipe


@pytest.fixture(scope="module")
def single(ours) -> np.ndarray:
    """Our pipeline in one process."""
    return _ours(ours, IMAGES)


def test_2511_matches_diffusers(ours, single, expected):
    got = single
    assert got.shape == expected.shape == (1, 32, 48, 3)
    print(f"qwen-image-edit-2511 vs diffusers: {psnr(got, expected):.1f} dB")
    assert psnr(got, expected) >= MIN_PSNR, psnr(got, expected)
    swapped = _ours(ours, IMAGES[::-1])
    print(f"images swapped: {psnr(swapped, expected):.1f} dB")
    assert psnr(swapped, expected) < FAR, psnr(swapped, expected)
    # the same weights without zero_cond_t (a 2509 reading of the directory): far off
    ours.transformer.cfg.zero_cond_t = False
    try:
        as_2509 = _ours(ours, IMAGES)
    finally:
        ours.transformer.cfg.zero_cond_t = True
    print(f"served as 2509: {psnr(as_2509, expected):.1f} dB")
    assert psnr(as_2509, expected) < FAR, psnr(as_2509, expected)


def test_2511_config_is_what_diffusers_reads(dir_2511):
    with open(os.path.join(dir_2511, "transformer", "config.json")) as f:
        assert json.load(f)["zero_cond_t"] is True


@pytest.mark.slow
def test_tp2_gives_the_single_process_pixels(dir_2511, single):
    """``DiffusionEngine(dir, tp_size=2)``: heads split over two gloo processes, the condition
    images' index replicated on both, against our pipeline in one process (which equals
    diffusers, above)."""
    from sglang.multimodal_gen.runtime import DiffusionEngine

    with DiffusionEngine(dir_2511, device="cpu", tp_size=2) as eng:
        params = eng.spec.params(prompt=PROMPT, image=list(IMAGES), seed=SEED, **KW)
        got = output_pixels(eng.generate(params))
    assert got.shape == single.shape
    print(f"qwen-image-edit-2511 TP 2 vs one process: {psnr(got, single):.1f} dB")
    assert psnr(got, single) >= MIN_PSNR, psnr(got, single)
