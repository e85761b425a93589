"""LTX-2.3 with a LoRA, end to end: our engine vs diffusers' ``LTX2Pipeline`` with the same
adapter (``load_lora_weights`` + ``set_adapters(weights=...)``), frames and sound.

One random adapter on EVERY linear layer of the tiny LTX-2.3 DiT (both streams, the audio-video
cross-attentions, the gate logits, the embedders; peft on diffusers' ``LTX2VideoTransformer3DModel``,
r 4, alpha 8), written in two layouts holding the same numbers: diffusers/PEFT
(``LTX2Pipeline.save_lora_weights``, alpha in the header) and Lightricks' (``diffusion_model.``
+ the original module names, no alpha: the scale 2 folded into ``B``, exact). Checked:

* TP 1: each layout at strengths 0.5 and 1.3 (merged, dynamic) against diffusers with the
  diffusers/PEFT file at that strength;
* a mixed batch: a request with the adapter (per request, strength 1.3) and one without, in
  both orders, each equal to the request alone (which equals diffusers);
* TP 2 (gloo, one launch): the Lightricks file dynamic at 1.3 and the PEFT file merged at 0.5.

Measured (fp32, CPU), against diffusers: frames 83 dB to inf (a few values one step apart where
our fused q|k|v GEMM or merged weight rounds apart from diffusers' per-module LoRA path), audio
>= 114 dB, at TP 1 and TP 2, merged and dynamic; batch rows against the request alone >= 80 dB /
114 dB. Nearby wrong cases: the other strength's reference 25.4 dB (frames) / 29.2 dB (audio), no
LoRA 20.1-23.9 dB / 27.4-35.2 dB.
"""

from __future__ import annotations

import os

import pytest
import torch
from fixtures.ltx2_lora import original_name
from fixtures.tiny_ltx2 import audio_snr, frame_psnrs, reference_ltx2, reference_output
from safetensors.torch import save_file
from sglang.multimodal_gen.models.families.tiny.ltx2 import build_ltx2_dir
from sglang.multimodal_gen.runtime import DiffusionEngine

MIN_PSNR = 45.0  # every frame, against diffusers
MIN_SNR = 40.0  # the waveform, 16-bit quantized, against diffusers
STRENGTHS = (0.5, 1.3)
R, ALPHA = 4, 8.0
REQ = dict(prompt="a lighthouse at dusk", negative_prompt="blurry", height=32, width=32,
           num_frames=9, num_inference_steps=2, max_sequence_length=32, seed=7,
           spatio_temporal_guidance_blocks=[1])  # fmt: skip


def _lora_files(model_dir: str, out: str) -> tuple[str, str, int]:
    """``(diffusers/PEFT folder, Lightricks file, number of modules)`` of one random adapter."""
    import torch.nn as nn
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    dit = LTX2VideoTransformer3DModel.from_pretrained(os.path.join(model_dir, "transformer"))
    names = sorted(n for n, m in dit.named_modules() if isinstance(m, nn.Linear))
    config = LoraConfig(r=R, lora_alpha=ALPHA, target_modules=names, init_lora_weights=True)
    dit.add_adapter(config, adapter_name="default")
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    sd = get_peft_model_state_dict(dit, adapter_name="default")
    assert len(sd) == 2 * len(names)
    peft_dir = os.path.join(out, "peft")
    LTX2Pipeline.save_lora_weights(
        peft_dir, transformer_lora_layers=sd, transformer_lora_adapter_metadata=config.to_dict()
    )
    lightricks = {}
    for key, t in sd.items():
        module, _, leaf = key.rpartition(".lora_")
        scaled = t * (ALPHA / R) if leaf.startswith("B") else t  # power of two: exact
        lightricks[f"diffusion_model.{original_name(module)}.lora_{leaf}"] = scaled.contiguous()
    assert "diffusion_model.audio_adaln_single.linear.lora_A.weight" in lightricks
    path = os.path.join(out, "lightricks.safetensors")
    save_file(lightricks, path)
    return peft_dir, path, len(names)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(directory, PEFT folder, Lightricks file, modules, params, diffusers outputs without
    LoRA and at each strength)`` of the tiny LTX-2.3."""
    root = tmp_path_factory.mktemp("ltx2_lora")
    d = build_ltx2_dir(str(root / "model"))
    peft_dir, lightricks, n = _lora_files(d, str(root))
    pipe = reference_ltx2(d)
    with DiffusionEngine(d, device="cpu") as engine:
        params = engine.spec.resolve(engine.spec.params(**REQ))
        refs = {None: reference_output(pipe, params)}
        pipe.load_lora_weights(peft_dir, adapter_name="x")
        for s in STRENGTHS:
            pipe.set_adapters(["x"], [s])
            refs[s] = reference_output(pipe, params)
        yield d, peft_dir, lightricks, n, params, refs, engine


def _scores(video, expected) -> tuple[float, float]:
    frames, audio = expected
    return min(frame_psnrs(video.frames[None], frames)), audio_snr(video.audio.samples[None], audio)


def _assert_equal(video, expected, what) -> None:
    p, s = _scores(video, expected)
    print(f"ltx2 lora {what}: frames {p:.1f} dB, audio {s:.1f} dB")
    assert p >= MIN_PSNR and s >= MIN_SNR, (what, p, s)


def _assert_apart(video, expected, what) -> None:
    p, s = _scores(video, expected)
    print(f"ltx2 lora {what} (must be apart): frames {p:.1f} dB, audio {s:.1f} dB")
    assert p < MIN_PSNR and s < MIN_SNR, (what, p, s)


@pytest.mark.parametrize("layout", ["peft", "lightricks"])
def test_engine_with_lora_matches_diffusers(setup, layout):
    _, peft_dir, lightricks, n, params, refs, engine = setup
    path = peft_dir if layout == "peft" else lightricks
    for mode in ("dynamic", "merge"):
        for i, s in enumerate(STRENGTHS):
            engine.set_lora("a", path, strength=s, merge_mode=mode)
            listed = engine.list_loras()["loaded"][0]["targets"]["transformer"]
            assert listed["matched_modules"] == n and listed["ignored_keys"] == 0, listed
            (video,) = engine.generate(params)
            _assert_equal(video, refs[s], f"{layout} {mode} {s}")
            if mode == "dynamic":
                _assert_apart(video, refs[STRENGTHS[1 - i]], f"{layout} at {s} vs {1 - i}")
                _assert_apart(video, refs[None], f"{layout} at {s} vs no LoRA")
    engine.unset_lora()
    engine.unload_lora("a")


def test_mixed_lora_batch_equals_each_request_alone(setup):
    """A request with the adapter (per request, 1.3) and one without, batched in both orders."""
    _, _, lightricks, _, params, refs, engine = setup
    engine.set_lora("b", lightricks, strength=1.0)
    engine.unset_lora()  # loaded, not active: the global composition is no LoRA
    with_lora = params.replace(lora=[("b", 1.3)])
    alone = {}
    for name, req in (("lora", with_lora), ("none", params)):
        (alone[name],) = engine.generate(req)
    _assert_equal(alone["lora"], refs[1.3], "per-request 1.3 alone")
    _assert_equal(alone["none"], refs[None], "no LoRA alone")
    for order in (("lora", "none"), ("none", "lora")):
        reqs = [with_lora if o == "lora" else params for o in order]
        out = engine.generate_batch(reqs)
        for o, res in zip(order, out):
            assert isinstance(res, list), res
            (video,) = res
            _assert_equal(video, (alone[o].frames[None], alone[o].audio.samples[None]),
                          f"batch {order}, row {o} vs alone")  # fmt: skip
    engine.unload_lora("b")


def test_tp2_with_lora_matches_diffusers(setup):
    d, peft_dir, lightricks, _, params, refs, _ = setup
    with DiffusionEngine(d, tp_size=2, device="cpu") as tp:
        tp.set_lora("a", lightricks, strength=1.3, merge_mode="dynamic")
        (video,) = tp.generate(params)
        _assert_equal(video, refs[1.3], "TP 2 lightricks dynamic 1.3")
        tp.set_lora("p", peft_dir, strength=0.5, merge_mode="merge")
        (video,) = tp.generate(params)
        _assert_equal(video, refs[0.5], "TP 2 peft merge 0.5")
