"""The DMD sampler (``pipelines/dmd.py``) against the published formulas, written here from
FastVideo's description (``DmdDenoisingStage``: ``x0 = x_t - sigma v``; re-noise
``(1 - sigma') x0 + sigma' eps`` with fresh ``eps`` drawn ``[B, T, C, H, W]`` from the request's
generator; the last step returns ``x0``; ``sigma(t)`` the nearest entry of the shift-8
flow-matching table), never by calling the code under test for the expected values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.multimodal_gen.configs.sampling_params import RequestSpec
from sglang.multimodal_gen.configs.wan import WanArchConfig
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.models.model_dir import ModelLoadError
from sglang.multimodal_gen.models.registry import get_family
from sglang.multimodal_gen.pipelines.dmd import (
    DMD_TIMESTEPS,
    DMDScheduler,
    dmd_noise,
    dmd_request_spec,
    dmd_sigmas,
    dmd_step,
    dmd_timesteps,
)

SHAPE = (2, 3, 4, 5, 6)  # [B, C, T, H, W]


def _table_sigma(t: float) -> float:
    """FastVideo's lookup, from its description: float32 u_k = k / 1000 (k = 1000 .. 1),
    sigma_k = 8 u / (1 + 7 u), t_k = 1000 sigma_k; the sigma of the t_k nearest to t."""
    u = np.arange(1000, 0, -1).astype(np.float32) / np.float32(1000)
    sig = (np.float32(8) * u / (np.float32(1) + np.float32(7) * u)).astype(np.float32)
    k = int(np.argmin(np.abs(sig.astype(np.float64) * 1000 - t)))
    return float(sig[k])


def test_sigmas_of_the_published_timesteps():
    assert DMD_TIMESTEPS == (1000, 757, 522)
    got = dmd_sigmas(DMD_TIMESTEPS)
    assert got == [_table_sigma(t) for t in DMD_TIMESTEPS]
    # the table entries u = 1, 0.28, 0.12: 1, 28/37, 12/23 (not t / 1000)
    np.testing.assert_allclose(got, [1.0, 28 / 37, 12 / 23], rtol=0, atol=1e-7)
    assert abs(got[1] - 0.757) > 1e-4
    assert dmd_sigmas([500, 250, 10]) == [_table_sigma(t) for t in (500, 250, 10)]


def test_step_matches_the_formulas_and_the_last_step_returns_x0():
    g = torch.Generator().manual_seed(0)
    x, v, eps = (torch.randn(SHAPE, generator=g) for _ in range(3))
    x0 = x - 0.75 * v
    torch.testing.assert_close(dmd_step(x, v, 0.75, 0.5, eps), 0.5 * x0 + 0.5 * eps)
    torch.testing.assert_close(dmd_step(x, v, 0.75, None), x0)
    with pytest.raises(ValueError, match="noise"):
        dmd_step(x, v, 0.75, 0.5, None)


def test_noise_is_drawn_btchw_from_the_generator():
    got = dmd_noise(SHAPE, torch.Generator().manual_seed(5), "cpu")
    b, c, t, h, w = SHAPE
    ref = torch.randn(b, t, c, h, w, generator=torch.Generator().manual_seed(5))
    assert torch.equal(got, ref.permute(0, 2, 1, 3, 4))
    other = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    assert not torch.allclose(got, other)  # the draw order matters


def _velocity(x: torch.Tensor, t: float) -> torch.Tensor:
    """A stand-in for the DiT: depends on the input and the timestep."""
    return 0.3 * x + 0.001 * t + torch.sin(x)


def _reference_loop(x: torch.Tensor, timesteps, gen: torch.Generator) -> torch.Tensor:
    sig = [_table_sigma(t) for t in timesteps]
    b, c, t, h, w = x.shape
    for i, ti in enumerate(timesteps):
        x0 = x - sig[i] * _velocity(x, ti)
        if i == len(timesteps) - 1:
            return x0
        eps = torch.randn(b, t, c, h, w, generator=gen).permute(0, 2, 1, 3, 4)
        x = (1 - sig[i + 1]) * x0 + sig[i + 1] * eps
    raise AssertionError("no steps")


def _run(sched: DMDScheduler, x: torch.Tensor) -> torch.Tensor:
    sched.set_begin_index(0)
    for t in sched.timesteps:
        x = sched.step(_velocity(x, float(t)), t, x, return_dict=False)[0]
    return x


@pytest.mark.parametrize("steps", [3, 2, 1])
def test_scheduler_loop_matches_the_reference_loop(steps):
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    sched = DMDScheduler.for_request(DMD_TIMESTEPS, steps, torch.Generator().manual_seed(7), "cpu")
    assert sched.timesteps.tolist() == list(DMD_TIMESTEPS[:steps])
    got = _run(sched, x)
    expected = _reference_loop(x, DMD_TIMESTEPS[:steps], torch.Generator().manual_seed(7))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if steps == 3:
        # nearby wrong samplers land far away: Euler over the same sigmas, the same noise at
        # every re-noise, the last step returning the re-noised latents
        sig = [_table_sigma(t) for t in DMD_TIMESTEPS] + [0.0]
        e = x
        for i, t in enumerate(DMD_TIMESTEPS):
            e = e + (sig[i + 1] - sig[i]) * _velocity(e, t)
        gen = torch.Generator().manual_seed(7)
        eps = torch.randn(2, 4, 3, 5, 6, generator=gen).permute(0, 2, 1, 3, 4)
        same = x
        for i, t in enumerate(DMD_TIMESTEPS):
            x0 = same - sig[i] * _velocity(same, t)
            same = x0 if i == 2 else (1 - sig[i + 1]) * x0 + sig[i + 1] * eps
        for wrong in (e, same):
            assert (wrong - expected).abs().max() > 0.1


def test_each_renoise_draws_fresh_noise():
    x = torch.zeros(SHAPE)
    sched = DMDScheduler.for_request(DMD_TIMESTEPS, 3, torch.Generator().manual_seed(2), "cpu")
    zero = torch.zeros(SHAPE)
    a = sched.step(zero, sched.timesteps[0], x)[0]  # x0 = 0: the re-noised latents are noise
    b = sched.step(zero, sched.timesteps[1], zero)[0]
    assert not torch.allclose(a / sched.sigmas[1], b / sched.sigmas[2])
    assert torch.equal(sched.step(zero, sched.timesteps[2], x)[0], x)  # last: x0
    with pytest.raises(ValueError, match="step 3"):
        sched.step(zero, sched.timesteps[2], x)


def test_steps_out_of_range_are_refused():
    for n in (0, 4):
        with pytest.raises(InvalidRequestError) as e:
            DMDScheduler.for_request(DMD_TIMESTEPS, n, torch.Generator(), "cpu")
        assert e.value.param == "num_inference_steps"


def test_directory_timesteps():
    assert dmd_timesteps({}) == DMD_TIMESTEPS
    assert dmd_timesteps({"dmd_denoising_steps": [1000, 500]}) == (1000, 500)
    for bad in ([], [500, 1000], [1000, 1000], [1001], [0], [1000.0], "1000", [True]):
        with pytest.raises(ModelLoadError, match="dmd_denoising_steps"):
            dmd_timesteps({"dmd_denoising_steps": bad})


def _ti2v_spec() -> RequestSpec:
    fam = get_family("wan")
    cfg = WanArchConfig(in_channels=48, out_channels=48, num_layers=0)
    d = fam.sampling_defaults(cfg)
    spec = RequestSpec(
        family="wan", display_name="Wan2.x", params_class=fam.params_class(), defaults=d.params,
        limits=d.limits, spatial_factor=32, outputs="video", inputs=d.inputs, frame_step=4,
    )  # fmt: skip
    return dmd_request_spec(spec, len(DMD_TIMESTEPS))


def test_request_spec_defaults_and_guidance_refusal():
    spec = _ti2v_spec()
    d = spec.defaults
    assert (d.num_inference_steps, d.guidance_scale) == (3, 1.0)
    assert (d.height, d.width, d.num_frames, d.fps) == (704, 1280, 121, 24)  # TI2V-5B's
    assert spec.limits.max_inference_steps == 3
    assert (
        spec.limits.max_num_frames
        == get_family("wan")
        .sampling_defaults(WanArchConfig(in_channels=48, out_channels=48, num_layers=0))
        .limits.max_num_frames
    )  # the other bounds stay
    ok = spec.resolve(spec.params(prompt="x", height=64, width=64, num_frames=5, seed=1))
    assert (ok.num_inference_steps, ok.guidance_scale) == (3, 1.0)
    spec.resolve(spec.params(prompt="x", height=64, width=64, guidance_scale=0.0))
    with pytest.raises(InvalidRequestError) as e:
        spec.resolve(spec.params(prompt="x", height=64, width=64, guidance_scale=5.0))
    assert e.value.param == "guidance_scale"
    with pytest.raises(InvalidRequestError) as e:
        spec.resolve(spec.params(prompt="x", height=64, width=64, num_inference_steps=4))
    assert e.value.param == "num_inference_steps"
    # the server's bounds keep the refusal
    tighter = spec.with_limits(spec.limits)
    with pytest.raises(InvalidRequestError):
        tighter.resolve(tighter.params(prompt="x", height=64, width=64, guidance_scale=2.0))
