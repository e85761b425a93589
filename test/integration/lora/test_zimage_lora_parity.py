"""LoRA on Z-Image end to end: our engine vs diffusers' ``load_lora_weights`` + ``set_adapters``
on the same weights and LoRA files (made with peft), in dynamic and merged modes.

Each composition also shows that a nearby strength (0.65 instead of 0.7, 1.4 instead of 1.3) lands
outside the threshold, so the threshold discriminates.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.tiny_models import (
    PARITY_MIN_PSNR,
    assert_same_image,
    psnr,
    reference_image,
    reference_pipeline,
)
from sglang.multimodal_gen.errors import NotFoundError
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

PROMPT = "a watercolor fox"
KW = dict(height=32, width=48, num_inference_steps=2, guidance_scale=0.0)
SEED = 4
MAX_PSNR_VS_BASE = 35.0

COMPOSITIONS = {
    "one": [("a", 0.7)],
    "two": [("a", 0.7), ("b", 1.3)],
}
# the same compositions at a nearby strength: must fail the parity bar
NEAR = {
    "one": [("a", 0.65)],
    "two": [("a", 0.7), ("b", 1.4)],
}


@pytest.fixture(scope="module")
def reference(tiny_zimage_dir, tiny_zimage_loras):
    """diffusers images: base, and one per composition (+ the per-request one)."""
    pipe = reference_pipeline(tiny_zimage_dir)
    out = {"base": reference_image(pipe, PROMPT, SEED, **KW)}
    pipe.load_lora_weights(tiny_zimage_loras[0], adapter_name="a")
    pipe.load_lora_weights(tiny_zimage_loras[1], adapter_name="b")
    near = {f"near_{k}": v for k, v in NEAR.items()}
    for key, comp in dict(COMPOSITIONS, b13=[("b", 1.3)], **near).items():
        pipe.set_adapters([n for n, _ in comp], [s for _, s in comp])
        out[key] = reference_image(pipe, PROMPT, SEED, **KW)
    return out


@pytest.fixture(scope="module")
def engine_and_base(tiny_zimage_dir):
    """The engine and its image before any adapter was ever set."""
    with DiffusionEngine(tiny_zimage_dir, device="cpu") as eng:
        yield eng, _generate(eng)


@pytest.fixture(scope="module")
def engine(engine_and_base):
    return engine_and_base[0]


@pytest.fixture(scope="module")
def base_image(engine_and_base, reference):
    image = engine_and_base[1]
    assert_same_image(image, reference["base"])
    return image


def _generate(engine, **kw):
    req = SamplingParams(prompt=PROMPT, seed=SEED, **KW, **kw)
    return np.asarray(engine.generate(req)[0])


@pytest.mark.parametrize("mode", ["dynamic", "merge"])
@pytest.mark.parametrize("which", list(COMPOSITIONS))
def test_lora_matches_diffusers(engine, base_image, tiny_zimage_loras, reference, which, mode):
    comp = COMPOSITIONS[which]
    paths = {"a": tiny_zimage_loras[0], "b": tiny_zimage_loras[1]}
    result = engine.set_lora(
        [n for n, _ in comp], [paths[n] for n, _ in comp], strength=[s for _, s in comp],
        merge_mode=mode,
    )  # fmt: skip
    active = result["active"]["transformer"]
    assert active["merge_mode"] == mode
    if mode == "merge":
        assert active["merged_layers"] > 0 and active["dynamic_layers"] == 0
    else:
        assert active["dynamic_layers"] > 0 and active["merged_layers"] == 0
    got = _generate(engine)
    assert_same_image(got, reference[which])
    assert psnr(got, reference["base"]) < MAX_PSNR_VS_BASE  # the adapter is not a no-op
    assert psnr(got, reference[f"near_{which}"]) < PARITY_MIN_PSNR  # nor is its strength
    engine.unset_lora()  # returns the base image of before any set_lora exactly
    assert np.array_equal(_generate(engine), base_image)


def test_per_request_composition(engine, tiny_zimage_loras, reference):
    engine.set_lora(["a", "b"], list(tiny_zimage_loras), strength=[0.7, 1.3], merge_mode="merge")
    got = _generate(engine, lora=[("b", 1.3)])  # overrides the global composition
    assert_same_image(got, reference["b13"])
    assert_same_image(_generate(engine), reference["two"])  # global one restored
    with pytest.raises(NotFoundError):
        _generate(engine, lora=[("nope", 1.0)])
    assert_same_image(_generate(engine, lora=[]), reference["base"])
    # a per-request strength is not served from the global merge
    assert_same_image(_generate(engine, lora=[("a", 0.65)]), reference["near_one"])
    engine.unset_lora()
    listed = engine.list_loras()
    assert {a["nickname"] for a in listed["loaded"]} == {"a", "b"}
    assert listed["active"]["transformer"]["adapters"] == []
