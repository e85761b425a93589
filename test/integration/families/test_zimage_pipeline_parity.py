"""Our Z-Image pipeline vs diffusers' ZImagePipeline: same weights, same seed, same image.

Each case also shows that a nearby but different input (one letter of the prompt, the guidance
scale, the shift schedule) lands outside the threshold, so the threshold discriminates.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from fixtures.tiny_models import (
    PARITY_MIN_PSNR,
    assert_same_image,
    psnr,
    reference_image,
    reference_pipeline,
)
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline


@pytest.fixture(scope="module")
def pipes(tiny_zimage_dir):
    return ZImagePipeline.from_pretrained(tiny_zimage_dir), reference_pipeline(tiny_zimage_dir)


PROMPT = "a small red fox in the snow"
NEAR_PROMPT = "a small red fox in the snaw"  # one letter changed

# (case, wrong guidance): the guidance scale x1.1, or 0.1 where the case runs without CFG
CASES = [
    pytest.param(
        dict(height=64, width=64, num_inference_steps=3, guidance_scale=0.0), 0.1, id="g0"
    ),
    pytest.param(
        dict(
            height=32,
            width=48,
            num_inference_steps=2,
            guidance_scale=3.5,
            negative_prompt="blurry, low quality",
        ),
        3.85,
        id="cfg-negative",
    ),
    pytest.param(
        dict(height=48, width=32, num_inference_steps=2, guidance_scale=1.5), 1.65, id="cfg"
    ),
]


def _ours(pipe, prompt, seed=42, **kw):
    return pipe(prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw)[0]


@pytest.mark.parametrize("kw,wrong_guidance", CASES)
def test_image_matches_diffusers(pipes, kw, wrong_guidance):
    ours, ref = pipes
    expected = reference_image(ref, PROMPT, seed=42, **kw)
    got = _ours(ours, PROMPT, **kw)
    assert got.shape == expected.shape == (kw["height"], kw["width"], 3)
    assert expected.std() > 10  # a varied image, not a saturated one
    assert_same_image(got, expected)
    # nearby inputs fail the same bar
    assert psnr(_ours(ours, NEAR_PROMPT, **kw), expected) < PARITY_MIN_PSNR
    near_guidance = _ours(ours, PROMPT, **dict(kw, guidance_scale=wrong_guidance))
    assert psnr(near_guidance, expected) < PARITY_MIN_PSNR


@pytest.fixture(scope="module")
def dynamic_shift_pipes(tiny_zimage_dir, tmp_path_factory):
    """The tiny directory with ``use_dynamic_shifting`` on: ``mu`` from the image size is used."""
    model_dir = tmp_path_factory.mktemp("zimage_dynamic_shift") / "model"
    shutil.copytree(tiny_zimage_dir, model_dir)
    cfg_path = model_dir / "scheduler" / "scheduler_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["use_dynamic_shifting"] = True
    cfg_path.write_text(json.dumps(cfg))
    return ZImagePipeline.from_pretrained(str(model_dir)), reference_pipeline(str(model_dir))


@pytest.mark.parametrize(
    "kw",
    [
        dict(height=64, width=64, num_inference_steps=3, guidance_scale=0.0),
        dict(height=32, width=48, num_inference_steps=2, guidance_scale=2.0),
    ],
    ids=["64x64", "32x48-cfg"],
)
def test_dynamic_shift_matches_diffusers(pipes, dynamic_shift_pipes, kw):
    ours, ref = dynamic_shift_pipes
    expected = reference_image(ref, PROMPT, seed=42, **kw)
    assert_same_image(_ours(ours, PROMPT, **kw), expected)
    # the static schedule (shift 3) of the same weights is a nearby wrong case
    assert psnr(_ours(pipes[0], PROMPT, **kw), expected) < PARITY_MIN_PSNR


@pytest.mark.parametrize("max_sequence_length", [17, 100])
def test_max_sequence_length_not_a_multiple_of_the_padding_matches_diffusers(
    pipes, max_sequence_length
):
    """Any ``max_sequence_length`` works (texts are padded to a multiple of 16 tokens, which the
    tokenizer refused for a ``max_length`` that is not one), and truncates as the reference:
    17 tokens cut the chat-templated prompt, 100 do not, and the two images differ."""
    ours, ref = pipes
    kw = dict(height=32, width=32, num_inference_steps=2, guidance_scale=2.0)
    kw["max_sequence_length"] = max_sequence_length
    expected = reference_image(ref, PROMPT, seed=7, **kw)
    assert_same_image(_ours(ours, PROMPT, seed=7, **kw), expected)
    other = 100 if max_sequence_length == 17 else 17
    assert psnr(_ours(ours, PROMPT, seed=7, **{**kw, "max_sequence_length": other}), expected) < 40


def test_batch_of_images_matches_diffusers(pipes):
    ours, ref = pipes
    kw = dict(height=32, width=32, num_inference_steps=2, guidance_scale=2.0)
    out = ref(
        "two images",
        generator=torch.Generator().manual_seed(3),
        num_images_per_prompt=2,
        output_type="np",
        **kw,
    ).images
    expected = (out * 255).round().astype("uint8")
    got = ours(
        "two images",
        generator=torch.Generator().manual_seed(3),
        num_outputs_per_prompt=2,
        output_type="np",
        **kw,
    )
    assert got.shape == expected.shape
    for a, b in zip(got, expected):
        assert_same_image(a, b)
    assert psnr(got[0], got[1]) < 35  # the two latents differ


def test_seed_prompt_and_guidance_change_the_image(pipes):
    """The parity tests would pass on a pipeline that ignores its inputs; make sure it does not."""
    ours, _ = pipes
    kw = dict(height=32, width=32, num_inference_steps=2, output_type="np")

    def run(prompt="a fox", seed=1, g=0.0):
        return ours(prompt, generator=torch.Generator().manual_seed(seed), guidance_scale=g, **kw)[
            0
        ]

    base = run()
    assert np.array_equal(base, run())  # deterministic
    assert psnr(base, run(seed=2)) < 35
    assert psnr(base, run(prompt="a cat")) < 50
    assert psnr(base, run(g=4.0)) < 40


def test_bad_sizes_raise(pipes):
    """The pipeline resolves a request against its spec: the one set of rules, the field named."""
    ours, _ = pipes
    with pytest.raises(InvalidRequestError, match="height must be a positive multiple of 16") as e:
        ours("x", height=40, width=32, num_inference_steps=1)
    assert e.value.param == "height"
    with pytest.raises(InvalidRequestError, match="num_inference_steps") as e:
        ours("x", height=32, width=32, num_inference_steps=0)
    assert e.value.param == "num_inference_steps"
    with pytest.raises(InvalidRequestError) as e:  # a field of another family
        ours("x", height=32, width=32, num_inference_steps=1, true_cfg_scale=2.0)
    assert e.value.param == "true_cfg_scale"
    with pytest.raises(TypeError):  # fields next to a request object
        ours(ours.spec.params(prompt="x"), height=32)


@pytest.mark.parametrize(
    "knobs",
    [dict(cfg_truncation=0.2), dict(cfg_normalization=1.0), dict(cfg_normalization=0.5,
                                                                   cfg_truncation=0.7)],
    ids=["truncation", "normalization", "both"],
)  # fmt: skip
def test_cfg_knobs_are_request_fields_matching_diffusers(pipes, knobs):
    """``cfg_normalization`` / ``cfg_truncation``: fields of the request (``ZImageSamplingParams``),
    diffusers' ``ZImagePipeline`` arguments of the same names; each changes the image."""
    ours, ref = pipes
    kw = dict(height=32, width=48, num_inference_steps=3, guidance_scale=3.5,
              negative_prompt="blurry")  # fmt: skip
    expected = reference_image(ref, PROMPT, seed=42, **kw, **knobs)
    assert_same_image(_ours(ours, PROMPT, **kw, **knobs), expected)
    params = ours.spec.params(prompt=PROMPT, seed=42, **kw, **knobs)
    got = ours(params, output_type="np")[0]
    assert_same_image(got, expected)
    assert (
        psnr(_ours(ours, PROMPT, **kw), expected) < PARITY_MIN_PSNR
    )  # the defaults: another image
    assert (ours.spec.defaults.cfg_normalization, ours.spec.defaults.cfg_truncation) == (0.0, 1.0)
