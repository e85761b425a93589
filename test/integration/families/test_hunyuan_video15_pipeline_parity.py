"""Our HunyuanVideo 1.5 pipeline vs diffusers' ``HunyuanVideo15Pipeline``: same directory, same
seed, same frames.

The tiny directory (``models/families/tiny/hunyuan_video15.py``, random non-zero weights) at 2
steps, 5 frames of 32 x 32: a prompt with quoted (glyph) text, so that the ByT5 features enter,
and a negative prompt under classifier-free guidance at a weight other than the guider's (the
reference takes its weight from its guider, which the test replaces; the conformance suite runs
the guider's own weight). The text encodings are compared on their own too. Nearby wrong cases
fall outside the threshold: guidance off; the ByT5 features dropped (extended tier).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline, glyph_text

# Measured (fp32, CPU): identical frames (inf dB); guidance off 39.4 dB, no glyph features 37.6 dB.
MIN_PSNR = 45.0
KW = dict(height=32, width=32, num_frames=5, num_inference_steps=2, negative_prompt="blurry")
PROMPT = 'a shop sign reading "OPEN" at dusk'
WEIGHT = 8.0  # a guidance weight other than the tiny guider's 4.0


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    from diffusers import DiffusionPipeline
    from sglang.multimodal_gen.models.families.tiny.hunyuan_video15 import (
        build_hunyuan_video15_dir,
    )

    path = build_hunyuan_video15_dir(tmp_path_factory.mktemp("hv15") / "model")
    ref = DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return HunyuanVideo15Pipeline.from_pretrained(path), ref


def _reference(ref, prompt: str, seed: int, guidance_scale: float | None = None, **kw):
    guider = ref.guider
    if guidance_scale is not None:
        ref.guider = guider.new(guidance_scale=guidance_scale)
    try:
        out = ref(
            prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="np", **kw
        )
    finally:
        ref.guider = guider
    return (np.asarray(out.frames) * 255).round().astype("uint8")


def _ours(pipe, prompt: str, seed: int, **kw) -> np.ndarray:
    return pipe(prompt, seed=seed, output_type="np", **kw)


def _every_frame(got: np.ndarray, expected: np.ndarray) -> float:
    return min(psnr(got[:, f], expected[:, f]) for f in range(expected.shape[1]))


def test_defaults_follow_the_directory(pipes):
    ours, ref = pipes
    d = ours.spec.defaults
    assert d.guidance_scale == ref.guider.guidance_scale == 4.0  # the guider's weight
    # the 16:9 bucket of the DiT's target_size at the VAE's factor, as diffusers computes it
    assert (d.height, d.width) == ref.video_processor.calculate_default_height_width(9, 16, 64)
    assert (d.num_frames, d.num_inference_steps, d.fps, d.max_sequence_length) == (
        121,
        50,
        24,
        1000,
    )
    assert ours.spec.outputs == "video" and ours.spec.inputs == ("text",)
    assert ours.spec.frame_step == 4


def test_glyph_text_as_diffusers():
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import (
        extract_glyph_texts,
    )

    for p in ('a "cat"', 'say "hi" and “bye”, "hi"', 'one "a" "a"', "none", '""'):
        assert glyph_text(p) == extract_glyph_texts(p), p


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"use_original_formulation": True},
        {"guidance_rescale": 0.7},
        {"start": 0.25, "stop": 0.75},
        {"enabled": False},
    ],
    ids=["default", "original", "rescale", "window", "disabled"],
)
def test_guidance_as_the_guider(pipes, config):
    """Our CFG step and combination against diffusers' ``ClassifierFreeGuidance`` at each guider
    setting: which steps run CFG, and the prediction they make (random predictions)."""
    from diffusers import ClassifierFreeGuidance

    ours, _ = pipes
    guider = ClassifierFreeGuidance(guidance_scale=WEIGHT, **config)
    saved = ours.guider_config
    ours.guider_config = dict(guider.config)
    try:
        g = ours.new_generation(ours.spec.params(prompt="x", guidance_scale=WEIGHT, seed=1,
                                                 num_inference_steps=4))  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        pos, neg = (torch.randn(2, 4, 2, 4, 4, generator=gen) for _ in range(2))
        for i in range(4):
            guider.set_state(step=i, num_inference_steps=4, timestep=torch.tensor(1.0))
            assert ours.cfg_at(g, i) == (guider.num_conditions == 2), (config, i)
            if guider.num_conditions == 2:
                expected = guider.forward(pred_cond=pos, pred_uncond=neg).pred
                torch.testing.assert_close(ours.guide(g, pos, neg), expected)
    finally:
        ours.guider_config = saved


def test_encoding_matches_diffusers(pipes):
    ours, ref = pipes
    prompts = [PROMPT, "blurry", ""]
    got = ours.encode_prompt_list(prompts, 1000)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            e, m, e2, m2 = ref.encode_prompt(prompt=p, device="cpu", dtype=torch.float32)
        torch.testing.assert_close(got["embeds"][i : i + 1], e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["embeds_2"][i : i + 1], e2, rtol=1e-5, atol=1e-5)
        assert torch.equal(got["mask"][i : i + 1], m) and torch.equal(got["mask_2"][i : i + 1], m2)
    assert got["mask_2"][0].sum() > 0 and got["embeds_2"][0].abs().sum() > 0  # the glyphs
    assert got["mask_2"][1:].sum() == 0  # no quotes: no glyph tokens


def test_t2v_matches_diffusers_with_glyphs_and_cfg(pipes):
    ours, ref = pipes
    kw = dict(KW, guidance_scale=WEIGHT)  # not the guider's: the reference's guider replaced
    expected = _reference(ref, PROMPT, 7, **kw)
    got = _ours(ours, PROMPT, 7, **kw)
    assert got.shape == expected.shape == (1, 5, 32, 32, 3)
    assert expected.std() > 10
    assert _every_frame(got, expected) >= MIN_PSNR
    # guidance off (the conditional prediction alone) falls outside the threshold
    assert psnr(_ours(ours, PROMPT, 7, **dict(kw, guidance_scale=1.0)), expected) < MIN_PSNR


def test_without_glyph_features_differs(pipes):
    """Extended tier: the bug "no ByT5 glyph features" falls outside the threshold."""
    ours, ref = pipes
    kw = dict(KW, guidance_scale=WEIGHT)
    expected = _reference(ref, PROMPT, 7, **kw)
    encode = ours.encode_prompt_list

    def without_glyphs(prompts, max_len):
        out = encode(prompts, max_len)
        return dict(out, embeds_2=out["embeds_2"] * 0, mask_2=out["mask_2"] * 0)

    ours.encode_prompt_list = without_glyphs
    try:
        wrong = _ours(ours, PROMPT, 7, **kw)
    finally:
        del ours.encode_prompt_list
    assert psnr(wrong, expected) < MIN_PSNR


def test_an_image_is_refused_naming_it(pipes):
    from sglang.multimodal_gen.image_inputs import InputImage

    ours, _ = pipes
    image = InputImage(np.zeros((32, 32, 3), np.uint8), source="image")
    with pytest.raises(InvalidRequestError) as e:
        ours.spec.resolve(ours.spec.params(prompt="x", image=(image,)))
    assert e.value.param == "image"


# ------------------------------------------------------------------ image to video
def _image(flip: bool = False) -> np.ndarray:
    """A 64 x 48 (portrait) RGB input with structure (gradients and a rectangle)."""
    y, x = np.mgrid[0:64, 0:48]
    a = np.stack([x * 4, y * 4, (x + y) * 2], -1).astype(np.uint8)
    a[8:30, 20:40] = (230, 40, 90)
    return a[::-1].copy() if flip else a


@pytest.fixture(scope="module")
def i2v_pipes(tmp_path_factory):
    from diffusers import DiffusionPipeline
    from sglang.multimodal_gen.models.families.tiny.hunyuan_video15 import (
        build_hunyuan_video15_dir,
    )

    path = build_hunyuan_video15_dir(tmp_path_factory.mktemp("hv15_i2v") / "model", layout="i2v")
    ref = DiffusionPipeline.from_pretrained(path, torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return HunyuanVideo15Pipeline.from_pretrained(path), ref


def test_i2v_matches_diffusers(i2v_pipes):
    """SigLIP features, the first frame's latents and mask, MeanFlow's ``timestep_r``; the
    request asks for the size bucket diffusers picks for the image (32 x 24)."""
    from PIL import Image
    from sglang.multimodal_gen.image_inputs import InputImage

    ours, ref = i2v_pipes
    assert ours.spec.required_inputs == ("text", "image") and ours.transformer.cfg.use_meanflow
    kw = dict(negative_prompt="blurry", num_frames=5, num_inference_steps=2)
    image = Image.fromarray(_image())
    height, width = ref.video_processor.calculate_default_height_width(64, 48, 32)
    assert (height, width) == (32, 24)
    # the MeanFlow timestep_r of every DiT call, theirs and ours (its effect on this tiny
    # model's frames is small: compared as values)
    seen: dict[str, list[float]] = {"ref": [], "ours": []}

    def recorder(name):
        def hook(_module, _args, kwargs):
            seen[name].append(float(kwargs["timestep_r"].flatten()[0]))

        return hook

    handles = [
        ref.transformer.register_forward_pre_hook(recorder("ref"), with_kwargs=True),
        ours.transformer.register_forward_pre_hook(recorder("ours"), with_kwargs=True),
    ]
    try:
        gen = torch.Generator().manual_seed(7)
        out = ref(image=image, prompt=PROMPT, generator=gen, output_type="np", **kw)
        expected = (np.asarray(out.frames) * 255).round().astype("uint8")

        def ours_with(a):
            img = (InputImage(a, source="image"),)
            return _ours(ours, PROMPT, 7, image=img, height=height, width=width, **kw)

        got = ours_with(_image())
    finally:
        for h in handles:
            h.remove()
    # diffusers runs the two CFG branches as two calls, we run one
    assert seen["ref"][::2] == seen["ref"][1::2] == seen["ours"]
    assert seen["ours"][-1] == 0.0 and len(seen["ours"]) == 2
    assert got.shape == expected.shape == (1, 5, 32, 24, 3)
    assert _every_frame(got, expected) >= MIN_PSNR
    # the image upside down falls outside the threshold
    assert psnr(ours_with(_image(flip=True)), expected) < MIN_PSNR
    # an image-to-video request without its image is refused naming it
    with pytest.raises(InvalidRequestError) as e:
        ours.spec.resolve(ours.spec.params(prompt="x"))
    assert e.value.param == "image"
