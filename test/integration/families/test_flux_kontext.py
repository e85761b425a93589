"""FLUX.1 Kontext (image editing) vs diffusers' ``FluxKontextPipeline``: same directory, reference
image and seed -> the same pixels; in one process, in a batch of edits with different
references, and with a LoRA in the diffusers layout (merged, unmerged and per request). TP 2 is
in the family conformance suite, which runs every declared family.

The tiny model declares a 64 x 64 default size, so its reference images are brought to Kontext's
aspect ratios at that area (:func:`kontext_reference_size`); a 72 x 60 reference becomes 64 x 48,
which is also what diffusers makes of it with ``_auto_resize=False``. The one-megapixel path of
the real model (scale 1) is diffusers' own selection, checked below against its list.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from fixtures.tiny_models import output_pixels, psnr
from PIL import Image
from sglang.multimodal_gen.configs.flux import FluxSamplingParams
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.models.families.tiny.flux import build_flux_kontext_dir
from sglang.multimodal_gen.pipelines.flux_kontext import kontext_reference_size

# Measured (fp32, CPU): identical pixels (inf dB) in one process, batched and at TP 2, and with
# the one-megapixel reference of diffusers' default _auto_resize (that case takes 20 s a side
# and is not run here). The tiny random DiT attends weakly to the reference: another reference
# moves the final latents by 7.5e-4 (relative L2) and the pixels to 62-64 dB, against 1e-7 and
# inf for the same one; the wrong-reference checks compare latents (REL_FAR), the LoRA's
# effect pixels (FAR).
MIN_PSNR = 70.0
FAR = MIN_PSNR - 15
REL_SAME, REL_FAR = 1e-5, 2e-4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


KW = dict(height=48, width=64, num_inference_steps=2, guidance_scale=3.5)


def reference_image(seed: int, w: int = 72, h: int = 60) -> Image.Image:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h // 4, w // 4, 3)).astype(np.uint8)
    return Image.fromarray(a).resize((w, h), Image.NEAREST)


@pytest.fixture(scope="module")
def kontext_dir(tmp_path_factory) -> str:
    return build_flux_kontext_dir(tmp_path_factory.mktemp("kontext") / "model")


@pytest.fixture(scope="module")
def reference(kontext_dir):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(kontext_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ref(pipe, seed, image, prompt="make it red", output_type="np", **kw):
    kw = dict(KW, **kw)
    out = pipe(
        image=image, prompt=prompt, generator=torch.Generator().manual_seed(seed),
        output_type=output_type, max_area=kw["height"] * kw["width"], _auto_resize=False, **kw,
    )  # fmt: skip
    if output_type == "latent":
        return out.images
    return (out.images * 255).round().astype("uint8")


def test_reference_sizes_are_diffusers_selection_at_scale_1():
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    for w, h in [(1024, 1024), (1920, 1080), (1080, 1920), (800, 600), (640, 1600), (3000, 1000)]:
        ar = w / h
        _, ew, eh = min((abs(ar - a / b), a, b) for a, b in PREFERRED_KONTEXT_RESOLUTIONS)
        assert kontext_reference_size(w, h, 8) == (ew // 16 * 16, eh // 16 * 16)
    assert kontext_reference_size(72, 60, 8, scale=64 / 1024) == (64, 48)


def test_edit_matches_diffusers_and_needs_its_image(kontext_dir, reference):
    from sglang.multimodal_gen.pipelines.flux_kontext import FluxKontextPipeline

    ours = FluxKontextPipeline.from_pretrained(kontext_dir)
    assert ours.spec.inputs == ("text", "image")
    assert ours.spec.required_inputs == ("text", "image")
    img = reference_image(1)
    expected = _ref(reference, 3, img)

    def run(seed, output_type="np", **kw):
        kw = dict(KW, **kw)
        return ours("make it red", generator=torch.Generator().manual_seed(seed),
                    output_type=output_type, **kw)  # fmt: skip

    got = run(3, image=img)
    assert got.shape == expected.shape == (1, 48, 64, 3)
    assert psnr(got, expected) >= MIN_PSNR
    # the reference matters: another one is far from diffusers' latents, this one is not
    ref_latents = _ref(reference, 3, img, output_type="latent")
    assert rel(run(3, image=img, output_type="latent"), ref_latents) < REL_SAME
    assert rel(run(3, image=reference_image(2), output_type="latent"), ref_latents) > REL_FAR
    for extra, field in (
        ({}, "image"),  # an edit model needs its image
        (dict(image=img, strength=0.5), "strength"),  # not re-noised
        (dict(image=img, mask_image=Image.new("L", (72, 60))), "mask_image"),
        (dict(image=[img, img]), "image"),  # one reference
    ):
        with pytest.raises(InvalidRequestError) as e:
            run(3, **extra)
        assert e.value.param == field, (extra, e.value.message)


def _requests():
    return [
        FluxSamplingParams(prompt="make it red", image=reference_image(1), seed=3, **KW),
        FluxSamplingParams(prompt="make it blue", image=reference_image(2), seed=4, **KW),
        FluxSamplingParams(prompt="make it red", image=reference_image(5), seed=3, **KW),
    ]


def test_batched_edits_keep_their_own_reference(kontext_dir, reference):
    """Three edits in one loop (one DiT call per step), each equal to itself alone; the first
    and the third differ only in their reference image, so a row served with another row's
    reference would fail."""
    from fixtures.tiny_models import count_dit_calls
    from sglang.multimodal_gen.runtime.runner import ModelRunner

    runner = ModelRunner(kontext_dir)
    reqs = [runner.spec.resolve(r) for r in _requests()]
    single = [output_pixels(runner.cmd_generate(r)) for r in reqs]
    assert psnr(single[0], _ref(reference, 3, reference_image(1))) >= MIN_PSNR
    calls = count_dit_calls(runner)
    out = runner.cmd_generate_batch(reqs)
    assert calls[0] == KW["num_inference_steps"]  # one DiT call per step for the three
    for a, (ok, b) in zip(single, out):
        assert ok, b
        assert psnr(a, output_pixels(b)) >= MIN_PSNR
    # the same request but its reference: below the bar (measured 64 dB), so a row served with
    # another row's reference fails the check above
    assert psnr(single[0], single[2]) < MIN_PSNR - 3


def test_lora_matches_diffusers(kontext_dir, reference, tmp_path):
    """A diffusers-format LoRA (Kontext LoRAs are Flux LoRAs) gives diffusers' image merged,
    unmerged and per request (TP 2 and mixed-adapter batches: the family conformance suite)."""
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from sglang.multimodal_gen.runtime import DiffusionEngine

    dit = FluxTransformer2DModel.from_pretrained(os.path.join(kontext_dir, "transformer"))
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "proj_mlp"])
    dit.add_adapter(config, adapter_name="default")
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    lora_dir = str(tmp_path / "kontext_lora")
    FluxKontextPipeline.save_lora_weights(
        lora_dir, transformer_lora_layers=get_peft_model_state_dict(dit, adapter_name="default")
    )
    img = reference_image(1)
    base = _ref(reference, 3, img)
    reference.load_lora_weights(lora_dir, adapter_name="k")
    reference.set_adapters(["k"], [0.8])
    try:
        with_lora = _ref(reference, 3, img)
    finally:
        reference.unload_lora_weights()
    assert psnr(with_lora, base) < FAR  # the adapter changes the edit

    req = FluxSamplingParams(prompt="make it red", image=img, seed=3, **KW)
    with DiffusionEngine(kontext_dir, device="cpu") as eng:
        assert psnr(output_pixels(eng.generate(req)), base) >= MIN_PSNR
        eng.set_lora("k", lora_dir, strength=0.8, merge_mode="merge")
        assert psnr(output_pixels(eng.generate(req)), with_lora) >= MIN_PSNR
        eng.unset_lora()
        eng.set_lora("k", None, strength=0.8, merge_mode="dynamic")
        assert psnr(output_pixels(eng.generate(req)), with_lora) >= MIN_PSNR
        eng.unset_lora()
        # per request, next to a request without it
        per_request = req.replace(lora=(("k", 0.8),))
        assert psnr(output_pixels(eng.generate(per_request)), with_lora) >= MIN_PSNR
        assert psnr(output_pixels(eng.generate(req)), base) >= MIN_PSNR
