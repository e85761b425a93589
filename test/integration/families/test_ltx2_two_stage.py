"""LTX-2 two-stage generation (pipelines/ltx2_two_stage.py) against diffusers' documented
composition on the tiny LTX-2.3 directory plus a tiny random latent upsampler
(``latent_upsampler`` in model_index.json): LTX2Pipeline(output_type="latent") at half size ->
LTX2LatentUpsamplePipeline(output_type="latent") -> LTX2Pipeline(latents, audio_latents, the
stage-2 sigmas, noise_scale = sigmas[0], no guidance) with the scheduler rebuilt without dynamic
shifting, one CPU generator through all three.

Measured (this machine, 64x64, 1 frame): frames equal to diffusers' (PSNR inf, max |diff| 0),
waveform SNR 106 dB after 16-bit quantization; the nearby wrong case (stage 2 re-noised at 0.5
instead of 0.909375) 18.6 dB. The res_2s sampler in the staged loop vs pipelines/res2s.py's loop
over the guided prediction: max |diff| 1.2e-6 at 2 steps (the Euler step taking it there rounds in fp32);
Euler instead: 0.88.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from fixtures.tiny_ltx2 import audio_snr, frame_psnrs

pytestmark = pytest.mark.filterwarnings("ignore")

REQ = dict(prompt="a lighthouse at dusk", negative_prompt="blurry", height=64, width=64,
           num_frames=1, num_inference_steps=2, max_sequence_length=32, seed=7,
           spatio_temporal_guidance_blocks=[1])  # fmt: skip
_RENAMED = {"fps": "frame_rate", "num_outputs_per_prompt": "num_videos_per_prompt"}
_NOT_PASSED = ("seed", "lora", "stage_2_lora", "image", "mask_image", "strength", "two_stage",
               "res2s_sampler")  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from sglang.multimodal_gen.models.families.tiny.ltx2 import build_ltx2_dir

    path = build_ltx2_dir(tmp_path_factory.mktemp("ltx2_two_stage") / "model")
    channels = json.load(open(os.path.join(path, "vae", "config.json")))["latent_channels"]
    torch.manual_seed(0)
    up = LTX2LatentUpsamplerModel(in_channels=channels, mid_channels=32, num_blocks_per_stage=1)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for prm in up.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen) * 0.2)
    up.save_pretrained(os.path.join(path, "latent_upsampler"))
    index_path = os.path.join(path, "model_index.json")
    index = json.load(open(index_path))
    index["latent_upsampler"] = ["ltx2", "LTX2LatentUpsamplerModel"]
    json.dump(index, open(index_path, "w"), indent=2)
    return path


def _diffusers_kwargs(params, **override):
    kw = {}
    for name, value in params.set_fields().items():
        if name not in _NOT_PASSED:
            kw[_RENAMED.get(name, name)] = value
    kw.update(override)
    kw["spatio_temporal_guidance_blocks"] = list(kw["spatio_temporal_guidance_blocks"])
    return kw


@pytest.fixture(scope="module")
def reference_pipe(model_dir):
    from diffusers.pipelines.ltx2 import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def ours(model_dir):
    from sglang.multimodal_gen.pipelines.ltx2_two_stage import LTX2TwoStagePipeline

    return LTX2TwoStagePipeline.from_pretrained(model_dir)


def _reference(pipe, model_dir, params, noise_scale, stage_2_lora=None):
    """diffusers' documented two-stage composition; ``stage_2_lora``: ``(name, strength)`` of a
    LoRA adapter loaded in ``pipe``, active in stage 2 only (stage 1 without adapter)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

    stage1_scheduler = pipe.scheduler
    if stage_2_lora is not None:
        pipe.set_adapters([stage_2_lora[0]], [0.0])
    gen = torch.Generator().manual_seed(params.seed)
    h, w = params.height, params.width
    video, audio = pipe(generator=gen, output_type="latent", return_dict=False,
                        **_diffusers_kwargs(params, height=h // 2, width=w // 2))  # fmt: skip
    up = LTX2LatentUpsamplerModel.from_pretrained(os.path.join(model_dir, "latent_upsampler"))
    upsample = LTX2LatentUpsamplePipeline(vae=pipe.vae, latent_upsampler=up)
    video = upsample(latents=video, output_type="latent", return_dict=False)[0]
    if stage_2_lora is not None:
        pipe.set_adapters([stage_2_lora[0]], [stage_2_lora[1]])
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        pipe.scheduler.config, use_dynamic_shifting=False, shift_terminal=None
    )
    stage2 = dict(
        guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
        modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
        audio_guidance_rescale=0.0, num_inference_steps=3,
    )  # fmt: skip
    out = pipe(latents=video, audio_latents=audio, sigmas=STAGE_2_DISTILLED_SIGMA_VALUES,
               noise_scale=noise_scale, generator=gen, output_type="np",
               **_diffusers_kwargs(params, **stage2))  # fmt: skip
    pipe.scheduler = stage1_scheduler
    frames = (np.asarray(out.frames) * 255).round().astype("uint8")
    return frames, out.audio.float().numpy()


def _without_upsampler(pipe):
    """``pipe`` on the same modules as a directory without a latent upsampler is served (its
    default ``two_stage`` false)."""
    bare = copy.copy(pipe)
    bare.components = {k: v for k, v in pipe.components.items() if k != "latent_upsampler"}
    bare.spec = dataclasses.replace(pipe.spec, defaults=pipe.spec.defaults.replace(two_stage=False))
    return bare


def test_two_stage_matches_diffusers_composition(model_dir, reference_pipe, ours):
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

    assert ours.two_stage
    params = ours.spec.resolve(ours.spec.params(**REQ))
    (video,) = ours(params, output_type="media", progress=False)
    frames = np.asarray(video.frames)[None]
    ref_frames, ref_audio = _reference(
        reference_pipe, model_dir, params, STAGE_2_DISTILLED_SIGMA_VALUES[0]
    )
    assert frames.shape == ref_frames.shape == (1, 1, 64, 64, 3)
    psnrs = frame_psnrs(frames, ref_frames)
    snr = audio_snr(video.audio.samples[None], ref_audio)
    assert min(psnrs) >= 45 and snr >= 40, (psnrs, snr)
    wrong_frames, _ = _reference(reference_pipe, model_dir, params, 0.5)
    assert max(frame_psnrs(frames, wrong_frames)) < 35

    from sglang.multimodal_gen.errors import InvalidRequestError

    sf = ours.spatial_factor  # stage 1 at half the size: a multiple of 2 sf
    with pytest.raises(InvalidRequestError, match=f"height must be a multiple of {2 * sf}"):
        ours(ours.spec.params(**{**REQ, "height": 3 * sf}), output_type="latent")


def test_res2s_sampler_is_res2s_over_the_guided_prediction(ours):
    """The HQ sampler inside the staged loop (one stage: the directory without its upsampler)
    equals pipelines/res2s.py's loop over the pipeline's guided data prediction, with Lightricks'
    noise (generators seeded -1 and 9999, video then audio, each standardized)."""
    from sglang.multimodal_gen.pipelines.ltx2 import LTX2Pipeline, LTX2Shapes
    from sglang.multimodal_gen.pipelines.res2s import (
        HQ_RES2S_OPTIONS,
        res2s_sample,
        standardized_noise,
    )

    ours = _without_upsampler(ours)  # the same modules, one stage, res_2s
    ours.default_sampler = "res2s"
    req = {**REQ, "height": 32, "width": 32, "num_inference_steps": 2}
    params = ours.spec.resolve(ours.spec.params(**req))
    got = ours(params, output_type="latent", progress=False)

    g = ours.new_generation(params)
    cond = ours.prepare_conditioning(g, ours._encode(g))
    x = ours.prepare_latents(g, cond)
    scheduler, timesteps = ours.prepare_timesteps(g, x)
    sigmas = g.sigmas.tolist()
    denoiser = ours.select_denoiser(0, timesteps[0], g)

    def guided_x0(z, sigma):
        import dataclasses

        gg = dataclasses.replace(g, sigmas=torch.tensor([sigma], dtype=torch.float32))
        t = torch.tensor(sigma * 1000.0, dtype=torch.float32)
        v = LTX2Pipeline.predict(ours, denoiser, z.float(), t, 0, cond, gg)
        return z.float() - gg.sigmas[0] * v

    gens = [torch.Generator().manual_seed(s) for s in (-1, 9999)]

    def noise(gen):
        def fn(like):
            video, audio = g.shapes.split(like)
            return LTX2Shapes.join(standardized_noise(video, gen), standardized_noise(audio, gen))

        return fn

    ref = res2s_sample(x, sigmas, guided_x0, step_noise=noise(gens[0]),
                       substep_noise=noise(gens[1]), **HQ_RES2S_OPTIONS)  # fmt: skip
    ref = LTX2Pipeline.after_step(ours, g, cond, ref, len(timesteps) - 1, timesteps, scheduler)
    err = (got - ref).abs().max().item()
    assert err < 1e-4, err
    ours.default_sampler = "euler"
    euler = ours(params, output_type="latent", progress=False)
    assert (euler - ref).abs().max().item() > 0.1  # the sampler changes the result


def test_request_flags_select_stages_and_sampler(model_dir, ours):
    """The family's pipeline is the two-stage one; two_stage=false runs one stage, true on a
    model without an upsampler is a 400 naming it, res2s_sampler=true runs res_2s; the model's
    default of two_stage is whether it has an upsampler, and a two-stage request's batch key is
    its own (the server never puts two of them in one loop)."""
    from sglang.multimodal_gen.errors import InvalidRequestError
    from sglang.multimodal_gen.models.registry import get_family

    assert get_family("ltx2").pipeline.endswith("ltx2_two_stage:LTX2TwoStagePipeline")
    req = {**REQ, "height": 32, "width": 32}
    one = ours.spec.resolve(ours.spec.params(**req, two_stage=False))
    assert ours(one, output_type="latent").shape[0] == 1  # one stage at 32x32: no size error
    # the model's default says how a request runs; two-stage requests never share a batch key
    assert ours.spec.defaults.two_stage is True
    two = [ours.spec.resolve(ours.spec.params(**{**req, "seed": s})) for s in (1, 2)]
    assert two[0].two_stage and two[0].batch_key() != two[1].batch_key()
    ones = [
        ours.spec.resolve(ours.spec.params(**{**req, "seed": s}, two_stage=False)) for s in (1, 2)
    ]
    assert ones[0].batch_key() == ones[1].batch_key()  # one-stage requests still batch
    bare = _without_upsampler(ours)
    with pytest.raises(InvalidRequestError, match="two_stage needs a latent upsampler"):
        bare(bare.spec.params(**req, two_stage=True), output_type="latent")
    euler = bare(bare.spec.params(**req), output_type="latent")
    res2s = bare(bare.spec.params(**req, res2s_sampler=True), output_type="latent")
    assert (euler - res2s).abs().max().item() > 0.1


# stage 1 with one model pass a step (the LoRA test: speed)
_NO_GUIDANCE = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0,
                    audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)  # fmt: skip


def test_stage_2_lora_composes_the_stages(model_dir, reference_pipe, tmp_path):
    """``stage_2_lora`` (runner -> LTX2TwoStagePipeline): lora=[] with stage_2_lora=[A] equals
    diffusers' two-stage composition with A loaded for stage 2 only (diffusers' documented
    recipe with the distilled LoRA) and is far from lora=[A] (both stages); an unknown or
    malformed adapter, or the field on a one-stage request, is refused naming stage_2_lora."""
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES
    from fixtures.tiny_models import random_peft_lora
    from sglang.multimodal_gen.errors import InvalidRequestError, NotFoundError
    from sglang.multimodal_gen.runtime.runner import ModelRunner

    STRENGTH = 4.0  # the adapter in stage 1 moves the frames ~46 dB at 1.0 (stage 2 re-noises)
    path = random_peft_lora(model_dir, str(tmp_path / "a"), seed=3)
    runner = ModelRunner(model_dir)
    runner.lora_manager.load_adapter("a", path)

    def run(**fields):
        params = runner.spec.resolve(runner.spec.params(**{**REQ, **_NO_GUIDANCE, **fields}))
        (video,) = runner.cmd_generate(**runner.prepare("generate", {"params": params}))
        return params, np.asarray(video.frames)[None], video.audio.samples[None]

    a = [("a", STRENGTH)]
    params, frames, audio = run(lora=[], stage_2_lora=a)
    _, both, _ = run(lora=a)
    _, first, _ = run(lora=a, stage_2_lora=[])  # stage 1 only
    reference_pipe.load_lora_weights(path, adapter_name="a")
    try:
        ref_frames, ref_audio = _reference(reference_pipe, model_dir, params,
                                           STAGE_2_DISTILLED_SIGMA_VALUES[0], stage_2_lora=("a", STRENGTH))  # fmt: skip
    finally:
        reference_pipe.unload_lora_weights()
    psnrs = frame_psnrs(frames, ref_frames)
    snr = audio_snr(audio, ref_audio)
    assert min(psnrs) >= 45 and snr >= 40, (psnrs, snr)
    far = [max(frame_psnrs(other, ref_frames)) for other in (both, first)]
    assert max(far) < 35, far  # the adapter in stage 1 too, or in stage 1 only

    with pytest.raises(NotFoundError) as e:  # as an unknown adapter in lora
        run(stage_2_lora=[("nope", 1.0)])
    assert e.value.param == "stage_2_lora"
    with pytest.raises(InvalidRequestError) as e:
        run(stage_2_lora=[("", 1.0)])
    assert e.value.param == "stage_2_lora" and e.value.status_code == 400
    with pytest.raises(InvalidRequestError) as e:
        run(stage_2_lora=[("a", 1.0)], two_stage=False, height=32, width=32)
    assert e.value.param == "stage_2_lora" and e.value.status_code == 400
