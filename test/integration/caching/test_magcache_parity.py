"""MagCache: our pipelines with ``magcache`` equal diffusers' pipelines with diffusers'
``MagCacheConfig`` hooks (diffusers 0.42.1) on the tiny Flux.1 [dev] and Z-Image, given the same
ratios: the same steps skipped, the same image. Our calibration mode measures the ratios
diffusers' ``calibrate=True`` measures, ``sglang calibrate-cache`` writes them beside a model
where ``--cache-method magcache`` finds them, and a batch of requests equals each alone.

The ratios are diffusers' calibration of these tiny random models (fp32, CPU, 32x32, 8 steps;
ours measure the same to 1e-6), rounded; the thresholds make each case skip some steps and compute
others (retention: steps 0-1; the accumulated error ``sum |1 - prod ratios|`` against the
threshold, at least 0.014 from it at every step):

* Flux [dev], guidance 3.5: threshold 0.12 -> steps 2, 3, 5, 7 skipped (errors 0.053, 0.076,
  then 0.220 computes, 0.102 skipped, 0.151 computes, 0.041 skipped);
* Z-Image CFG (one batched forward for both branches, one state): threshold 0.08 -> steps 2, 3,
  6, 7 skipped (0.035, 0.065, then 0.141 and 0.094 compute, 0.011, 0.038 skipped).

Measured: identical pixels (inf dB) in both cases; the uncached images differ (below 60 dB). Bar:
70 dB.
"""

from __future__ import annotations

import json
import os

import pytest
from fixtures.step_cache_runs import run_requests
from fixtures.tiny_flux import reference_flux, reference_flux_images
from fixtures.tiny_models import psnr, reference_image, reference_pipeline
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.layers.step_cache.mag_ratios import RATIOS_FILE, MagRatios
from sglang.multimodal_gen.pipelines.flux import FluxPipeline
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

MIN_PSNR = 70.0
STEPS = 8
FLUX_KW = dict(height=32, width=32, num_inference_steps=STEPS, guidance_scale=3.5)
ZIMAGE_KW = dict(FLUX_KW, negative_prompt="blurry, low quality")
FLUX_RATIOS = [1.0, 0.947956, 1.053105, 0.927537, 1.170792, 0.897669, 1.059882, 0.959538]
ZIMAGE_RATIOS = [1.0, 0.903453, 1.035404, 0.993964, 1.046121, 0.905854, 1.010899, 1.016402]


@pytest.fixture
def diffusers_decisions(monkeypatch):
    """Every decision of diffusers' MagCache head hook (True: the blocks ran), and the ratios
    its calibration mode measures."""
    import diffusers.hooks.mag_cache as mc

    seen: dict[str, list] = {"compute": [], "ratios": []}
    forward, calibrate = (
        mc.MagCacheHeadHook.new_forward,
        mc.MagCacheBlockHook._perform_calibration_step,
    )

    def spy_forward(self, module, *args, **kwargs):
        out = forward(self, module, *args, **kwargs)
        seen["compute"].append(bool(self.state_manager.get_state().should_compute))
        return out

    def spy_calibrate(self, state, residual):
        calibrate(self, state, residual)
        seen["ratios"].append(state.calibration_ratios[-1])

    monkeypatch.setattr(mc.MagCacheHeadHook, "new_forward", spy_forward)
    monkeypatch.setattr(mc.MagCacheBlockHook, "_perform_calibration_step", spy_calibrate)
    return seen


def _ratios_file(path, key, ratios) -> str:
    MagRatios(STEPS, {key: tuple(ratios)}).save(str(path))
    return str(path)


def _generate(pipe, kw, requests=(("a small red fox", 42),), batched=False):
    rows = [dict(prompt=p, seed=s) for p, s in requests]
    out = run_requests(pipe, rows, batched, output_type="np", **kw)
    return [(px, cache.summary() if cache else None) for px, cache in out]


def _apply_magcache_to_zimage(transformer, config):
    """diffusers' MagCache on its Z-Image DiT: the block's metadata maps ``hidden_states`` to
    argument 0 (``ZImageTransformerBlock.forward`` calls it ``x``) and one context is set for the
    whole call (the pipeline runs cond and uncond in one forward; the model has no
    ``enable_cache``), as the FBCache parity test does."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.hooks.hooks import CacheContext, _set_cache_context
    from diffusers.hooks.mag_cache import apply_mag_cache
    from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

    meta = TransformerBlockMetadata(return_hidden_states_index=0)
    meta._cached_parameter_indices = {"hidden_states": 0}
    TransformerBlockRegistry.register(ZImageTransformerBlock, meta)
    apply_mag_cache(transformer, config)
    _set_cache_context(transformer, CacheContext("cond"))


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_dir):
    return FluxPipeline.from_pretrained(tiny_flux_dev_dir)


def test_flux_magcache_matches_diffusers(flux, tiny_flux_dev_dir, diffusers_decisions, tmp_path):
    from diffusers.hooks import MagCacheConfig

    ref = reference_flux(tiny_flux_dev_dir)
    ref.transformer.enable_cache(
        MagCacheConfig(threshold=0.12, num_inference_steps=STEPS, mag_ratios=FLUX_RATIOS)
    )
    expected = reference_flux_images(ref, "a small red fox", 42, **FLUX_KW)
    path = _ratios_file(tmp_path / "r.json", "blocks/0/cond", FLUX_RATIOS)
    flux.enable_step_cache(None)
    [(plain, _)] = _generate(flux, FLUX_KW)
    flux.enable_step_cache(StepCacheConfig.of("magcache", threshold=0.12, mag_ratios=path))
    [(got, summary)] = _generate(flux, FLUX_KW)
    ref_flags = diffusers_decisions["compute"]
    assert ref_flags == [True, True, False, False, True, False, True, False]
    assert (summary["steps_computed"], summary["steps_skipped"]) == (4, 4)
    assert psnr(got, expected) >= MIN_PSNR
    assert psnr(plain, expected) < MIN_PSNR  # the cache changed the image


def test_zimage_magcache_matches_diffusers(tiny_zimage_dir, diffusers_decisions, tmp_path):
    from diffusers.hooks import MagCacheConfig

    ref = reference_pipeline(tiny_zimage_dir)
    config = MagCacheConfig(threshold=0.08, num_inference_steps=STEPS, mag_ratios=ZIMAGE_RATIOS)
    _apply_magcache_to_zimage(ref.transformer, config)
    expected = reference_image(ref, "a small red fox", 42, **ZIMAGE_KW)
    ours = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    [(plain, _)] = _generate(ours, ZIMAGE_KW)
    path = _ratios_file(tmp_path / "r.json", "blocks/0/joint", ZIMAGE_RATIOS)
    ours.enable_step_cache(StepCacheConfig.of("magcache", threshold=0.08, mag_ratios=path))
    [(got, summary)] = _generate(ours, ZIMAGE_KW)
    assert diffusers_decisions["compute"] == [True, True, False, False, True, True, False, False]
    assert (summary["steps_computed"], summary["steps_skipped"]) == (4, 4)
    assert psnr(got[0], expected) >= MIN_PSNR
    assert psnr(plain[0], expected) < MIN_PSNR


def test_calibration_measures_diffusers_ratios(flux, tiny_flux_dev_dir, diffusers_decisions):
    from diffusers.hooks import MagCacheConfig

    ref = reference_flux(tiny_flux_dev_dir)
    ref.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
    reference_flux_images(ref, "a small red fox", 42, **FLUX_KW)
    flux.enable_step_cache(StepCacheConfig.of("magcache", calibrate=True))
    [(_, summary)] = _generate(flux, FLUX_KW)
    assert summary["steps_skipped"] == 0
    got = summary["mag_ratios"]["blocks/0/cond"]
    assert got == pytest.approx(diffusers_decisions["ratios"], abs=1e-5)
    assert got == pytest.approx(FLUX_RATIOS, abs=1e-5)  # the ratios the parity test uses


def test_batched_requests_equal_each_alone(flux, tmp_path):
    path = _ratios_file(tmp_path / "r.json", "blocks/0/cond", FLUX_RATIOS)
    flux.enable_step_cache(StepCacheConfig.of("magcache", threshold=0.12, mag_ratios=path))
    requests = [("a small red fox", 42), ("a lighthouse at dusk", 7)]
    kw = dict(FLUX_KW, guidance_scale=None)
    alone = _generate(flux, kw, requests)
    batch = _generate(flux, kw, requests, batched=True)
    for i, ((a, sa), (b, sb)) in enumerate(zip(alone, batch)):
        assert sa == sb and sa["steps_skipped"] == 4, f"request {i}: {sa} alone, {sb} batched"
        assert psnr(a, b) >= MIN_PSNR, f"request {i}: {psnr(a, b):.1f} dB"
    assert psnr(alone[0][0], alone[1][0]) < 35  # the requests really differ


def test_calibrate_command_writes_ratios_that_magcache_loads(tiny_zimage_dir, tmp_path, capsys):
    import shutil

    from sglang.cli.main import main

    model = str(tmp_path / "model")
    shutil.copytree(tiny_zimage_dir, model)
    ours = ZImagePipeline.from_pretrained(model)
    with pytest.raises(ValueError, match="--cache-mag-ratios FILE, or write magcache_ratios"):
        ours.enable_step_cache(StepCacheConfig.of("magcache"))  # no ratios yet
    ours.enable_step_cache(None)
    with pytest.raises(InvalidRequestError, match="'magcache' needs the model's calibrated") as e:
        ours.new_generation(ours.spec.params(prompt="a fox", cache="magcache"))
    assert e.value.param == "cache"
    argv = ["calibrate-cache", "--model-path", model, "--steps", str(STEPS), "--height", "32",
            "--width", "32", "--prompt", "a small red fox", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    path = os.path.join(model, RATIOS_FILE)
    assert capsys.readouterr().out.strip() == path
    data = json.load(open(path))
    assert data["num_inference_steps"] == STEPS
    [ratios] = data["ratios"].values()
    assert len(ratios) == STEPS and ratios[0] == 1.0 and len(set(ratios)) == STEPS
    ours.enable_step_cache(StepCacheConfig.of("magcache", threshold=0.5))  # found beside it
    [(_, summary)] = _generate(ours, dict(ZIMAGE_KW, guidance_scale=None))
    assert summary["steps_skipped"] > 0
