"""pipelines/res2s.py: the res_2s step against an independent implementation of the published
formulas (mpmath at 50 digits for the phi functions, the step written in its absolute form
``x_next = e^{-h} x + h (b1 D1 + b2 D2)`` instead of the module's increment form), and two exact
properties of the flow-matching ODE.

Measured (this machine): step vs reference max |diff| 1.8e-15 over the sigma pairs (float64);
phi_2 at z = -1e-8 within 1.1e-16 relative of mpmath where the float64 closed form is off by 0.108;
point-mass data sampled to 0: max |x - x0| 0.0; Gaussian data over [0.9, 0.1]: error 5.4e-3 at 4
steps, 1.37e-3 at 8 (ratio 3.95, second order); the first-order combination's ratio is 2.0.
Stochastic (HQ) step vs Lightricks' loop body written as published (alpha_ratio / sigma_down,
bongmath by 100 iterations), same noise: max |diff| <= 2.4e-15, except 1.2e-9 at h = 1e-7 (both
divide by sigma - sigma_next); bongmath off instead: 0.56 to 1.05 where it applies.
"""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from sglang.multimodal_gen.pipelines.res2s import (
    HQ_RES2S_OPTIONS,
    RES2S_TERMINAL_SIGMA,
    phi,
    res2s_coefficients,
    res2s_renoise,
    res2s_sample,
    res2s_schedule,
    res2s_step,
    standardized_noise,
)


def _phi_ref(j: int, z: float) -> float:
    """phi_j by its closed form in 50-digit arithmetic: (e^z - sum_{k<j} z^k/k!) / z^j."""
    if z == 0:
        return 1.0 / math.factorial(j)
    with mpmath.workdps(50):
        zm = mpmath.mpf(z)
        rest = sum(zm**k / mpmath.factorial(k) for k in range(j))
        return float((mpmath.exp(zm) - rest) / zm**j)


def _step_ref(x, sigma, sigma_next, denoise):
    """The published res_2s step (c2 = 1/2) in absolute form, float64, mpmath coefficients."""
    if sigma_next == 0:
        return denoise(x, sigma)
    c2 = 0.5
    with mpmath.workdps(50):
        h = float(mpmath.log(mpmath.mpf(sigma) / mpmath.mpf(sigma_next)))
        e_h, e_c2h = float(mpmath.exp(-h)), float(mpmath.exp(-c2 * h))
        sigma_mid = float(mpmath.sqrt(mpmath.mpf(sigma) * sigma_next))
    x = x.double()
    d1 = denoise(x, sigma).double()
    x_mid = e_c2h * x + c2 * h * _phi_ref(1, -c2 * h) * d1
    d2 = denoise(x_mid, sigma_mid).double()
    b2 = _phi_ref(2, -h) / c2
    b1 = _phi_ref(1, -h) - b2
    return e_h * x + h * (b1 * d1 + b2 * d2)


def _toy_denoiser(seed: int = 0, dim: int = 8):
    """A nonlinear, sigma-dependent x0 prediction (a random tanh layer), float64."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    b = torch.randn(dim, generator=g, dtype=torch.float64)

    def denoise(x: torch.Tensor, sigma: float) -> torch.Tensor:
        xd = x.double()
        return torch.tanh(xd @ w + b) * (1.0 + 2.0 * sigma) - 0.5 * sigma * xd

    return denoise


SIGMA_PAIRS = [
    (1.0, 0.99375),  # first distilled step
    (0.909375, 0.725),  # stage-2 distilled sigmas
    (0.725, 0.421875),
    (0.5, 0.05),  # large h (2.3)
    (0.3, 0.3 * (1 - 1e-7)),  # tiny h (1e-7): phi from its series
    (0.2, 0.2 * math.exp(-1e-10)),
    (0.421875, RES2S_TERMINAL_SIGMA),  # Lightricks' last res_2s step
    (0.421875, 0.0),  # to 0: the data prediction
]


@pytest.mark.parametrize("z", [0.0, -1e-12, -1e-8, -1e-4, -0.3, -0.999, -1.0, -1.5, -8.0, 0.7])
@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_phi_matches_high_precision_closed_form(j, z):
    ref = _phi_ref(j, z)
    assert phi(j, z) == pytest.approx(ref, rel=1e-14, abs=0.0)


def test_phi_closed_form_in_float64_is_the_bug_the_series_avoids():
    z = -1e-8
    naive = (math.exp(z) - 1 - z) / z**2
    assert abs(naive - _phi_ref(2, z)) > 0.05  # the cancellation the module avoids
    assert abs(phi(2, z) - _phi_ref(2, z)) < 1e-15


def test_coefficients_limits():
    # h -> 0: a21 -> c2, b1 -> 0, b2 -> 1: h (b1 + b2) = h phi_1 -> h (the Euler step)
    a21, b1, b2 = res2s_coefficients(1e-12)
    assert (a21, b1, b2) == pytest.approx((0.5, 0.0, 1.0), abs=1e-12)
    a21, b1, b2 = res2s_coefficients(0.4)
    assert b1 + b2 == pytest.approx(_phi_ref(1, -0.4), rel=1e-15)
    with pytest.raises(ValueError, match="log step h"):
        res2s_coefficients(-0.1)


@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMA_PAIRS)
def test_step_matches_independent_reference(sigma, sigma_next):
    denoise = _toy_denoiser()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, generator=g, dtype=torch.float64)
    calls = []

    def counted(x_, s):
        calls.append(s)
        return denoise(x_, s)

    ours = res2s_step(x, sigma, sigma_next, counted)
    ref = _step_ref(x, sigma, sigma_next, denoise)
    err = (ours - ref).abs().max().item()
    assert err < 1e-12, err
    assert len(calls) == (1 if sigma_next == 0 else 2)
    if sigma_next > 0:
        assert calls[1] == pytest.approx(math.sqrt(sigma * sigma_next), rel=1e-14)
        # a nearby wrong step (D2 at the arithmetic midpoint) lands far outside the threshold
        wrong = _step_ref(
            x,
            sigma,
            sigma_next,
            lambda x_, s: denoise(x_, s if s == sigma else (sigma + sigma_next) / 2),
        )
        if math.log(sigma / sigma_next) > 0.1:
            assert (wrong - ref).abs().max().item() > 1e-6


def test_step_float32_latents_keep_dtype_and_compute_in_float64():
    denoise = _toy_denoiser()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    out = res2s_step(x, 0.725, 0.421875, denoise)
    assert out.dtype == torch.float32
    ref = _step_ref(x.double(), 0.725, 0.421875, lambda x_, s: denoise(x_.float(), s))
    assert (out.double() - ref).abs().max().item() < 1e-6


def test_schedule_terminal_zero_and_errors():
    assert res2s_schedule([0.909375, 0.725, 0.421875, 0.0]) == [
        0.909375,
        0.725,
        0.421875,
        0.0011,
        0.0,
    ]
    assert res2s_schedule(torch.tensor([1.0, 0.5])) == [1.0, 0.5]
    for bad, match in (
        ([0.5], "at least two"),
        ([0.5, 0.6], "strictly decrease"),
        ([1.2, 0.1], r"\[0, 1\]"),
    ):
        with pytest.raises(ValueError, match=f"sigmas: .*{match}"):
            res2s_schedule(bad)
    with pytest.raises(ValueError, match="sigmas: the last non-zero"):
        res2s_schedule([0.5, 0.001, 0.0])
    with pytest.raises(ValueError, match="sigma_next"):
        res2s_step(torch.zeros(2), 0.3, 0.4, _toy_denoiser())


def test_sample_matches_reference_loop_to_zero():
    denoise = _toy_denoiser(seed=3)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    sigmas = [1.0, 0.95, 0.8, 0.5, 0.2, 0.0]
    ref = x
    for s, s_next in zip([*sigmas[:-1], 0.0011], [*sigmas[1:-1], 0.0011, 0.0]):
        ref = _step_ref(ref, s, s_next, denoise)
    seen = []
    out = res2s_sample(x, sigmas, denoise, callback=lambda i, _: seen.append(i))
    assert seen == list(range(len(sigmas)))
    assert (out - ref).abs().max().item() < 1e-12


def test_point_mass_data_is_solved_exactly():
    """Data = one point x0: the true x0 prediction is x0 itself, and every step lands on the exact
    ODE solution (1 - sigma') x0 + sigma' eps; sampling to 0 returns x0."""
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(16, generator=g, dtype=torch.float64)
    eps = torch.randn(16, generator=g, dtype=torch.float64)
    for sigma, sigma_next in [(1.0, 0.6), (0.6, 0.05), (0.05, 1e-4)]:
        x = (1 - sigma) * x0 + sigma * eps
        out = res2s_step(x, sigma, sigma_next, lambda x_, s: x0)
        assert (out - ((1 - sigma_next) * x0 + sigma_next * eps)).abs().max().item() < 1e-13
    out = res2s_sample(eps, [1.0, 0.7, 0.3, 0.0], lambda x_, s: x0)
    assert (out - x0).abs().max().item() < 1e-13


def _gaussian_posterior_mean(mu: float, s0: float):
    """x0 ~ N(mu, s0^2) elementwise, x = (1 - sigma) x0 + sigma eps: E[x0 | x] (exact)."""

    def denoise(x: torch.Tensor, sigma: float) -> torch.Tensor:
        a = 1.0 - sigma
        return mu + a * s0**2 / (a * a * s0**2 + sigma**2) * (x.double() - a * mu)

    return denoise


def _gaussian_flow(x, sigma, sigma_next, mu, s0):
    """The exact probability-flow map for Gaussian data: the standardized value is conserved."""

    def std(s):
        return math.sqrt((1 - s) ** 2 * s0**2 + s**2)

    return (1 - sigma_next) * mu + (x - (1 - sigma) * mu) * std(sigma_next) / std(sigma)


def test_gaussian_data_converges_at_second_order():
    """True x0 prediction of a linear-Gaussian toy: res_2s over [0.9, 0.1] reaches the exact ODE
    solution with error ~ h^2 (halving the steps' size quarters the error); an Euler-like
    combination (b2 = 0, first order) only halves it."""
    mu, s0 = 0.7, 0.3
    denoise = _gaussian_posterior_mean(mu, s0)
    x = torch.linspace(-2.0, 2.0, 9, dtype=torch.float64)
    exact = _gaussian_flow(x, 0.9, 0.1, mu, s0)

    def run(n):
        sig = torch.exp(
            torch.linspace(math.log(0.9), math.log(0.1), n + 1, dtype=torch.float64)
        ).tolist()
        return (res2s_sample(x, sig, denoise) - exact).abs().max().item()

    def run_euler(n):
        sig = torch.exp(
            torch.linspace(math.log(0.9), math.log(0.1), n + 1, dtype=torch.float64)
        ).tolist()
        y = x
        for s, t in zip(sig, sig[1:]):
            y = (t / s) * y + (1 - t / s) * denoise(y, s)
        return (y - exact).abs().max().item()

    e4, e8 = run(4), run(8)
    assert e8 < 2e-3
    assert 3.5 < e4 / e8 < 4.5, (e4, e8)
    assert 1.7 < run_euler(4) / run_euler(8) < 2.3


# ---------------------------------------------------------------- the stochastic (HQ) variant
def _sde_ref(sample, x_det, sigma, sigma_next, eta, noise):
    """Lightricks' Res2sDiffusionStep.step written as published: alpha_ratio, sigma_down,
    sigma_up from get_sde_coeff(sigma_next, sigma_up=eta * sigma_next), sigma_max = 1."""
    s, sn = torch.tensor(sigma, dtype=torch.float64), torch.tensor(sigma_next, dtype=torch.float64)
    su = torch.clamp(sn * eta, max=sn * 0.9999)
    resid = torch.clamp(sn**2 - su**2, min=0) ** 0.5
    alpha_ratio = (1 - sn) + resid
    sd = resid / alpha_ratio
    if su == 0 or sn == 0:
        return x_det
    eps_next = (sample - x_det) / (s - sn)
    denoised_next = sample - s * eps_next
    return alpha_ratio * (denoised_next + sd * eps_next) + su * noise


def _hq_step_ref(x, sigma, sigma_next, denoise, n_sub, n_step, eta=0.5, sub_eta=0.5):
    """Lightricks' loop body for one step (c2 = 1/2, bongmath by 100 iterations), float64."""
    with mpmath.workdps(50):
        h = float(mpmath.log(mpmath.mpf(sigma) / mpmath.mpf(sigma_next)))
        sub = float(mpmath.sqrt(mpmath.mpf(sigma) * sigma_next))
    a21 = 0.5 * _phi_ref(1, -0.5 * h)
    b2 = _phi_ref(2, -h) / 0.5
    b1 = _phi_ref(1, -h) - b2
    anchor = x.double()
    d1 = denoise(anchor, sigma).double()
    eps1 = d1 - anchor
    x_mid = _sde_ref(anchor, anchor + h * a21 * eps1, sigma, sub, sub_eta, n_sub)
    if h < 0.5 and sigma > 0.03:
        for _ in range(100):
            anchor = x_mid - h * a21 * eps1
            eps1 = d1 - anchor
    eps2 = denoise(x_mid, sub).double() - anchor
    x_next = anchor + h * (b1 * eps1 + b2 * eps2)
    return _sde_ref(anchor, x_next, sigma, sigma_next, eta, n_step)


@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMA_PAIRS[:-1] + [(0.02, 0.01)])
def test_hq_step_matches_lightricks_loop_body(sigma, sigma_next):
    denoise = _toy_denoiser(seed=6)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    n_sub, n_step = (torch.randn(2, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ours = res2s_step(
        x, sigma, sigma_next, denoise, substep_noise=lambda _: n_sub, step_noise=lambda _: n_step,
        **HQ_RES2S_OPTIONS,
    )  # fmt: skip
    ref = _hq_step_ref(x, sigma, sigma_next, denoise, n_sub, n_step)
    # renoising divides by sigma - sigma_next: rounding grows as the step shrinks (both codes)
    tol = 1e-10 if sigma - sigma_next > 1e-6 else 1e-7
    assert (ours - ref).abs().max().item() < tol
    # nearby wrong case: the same noise, bongmath off (matters where it applies)
    if math.log(sigma / sigma_next) < 0.5 and sigma > 0.03 and sigma - sigma_next > 1e-3:
        off = res2s_step(
            x, sigma, sigma_next, denoise, eta=0.5, substep_eta=0.5, bongmath=False,
            substep_noise=lambda _: n_sub, step_noise=lambda _: n_step,
        )  # fmt: skip
        assert (off - ref).abs().max().item() > 1e-4


def test_renoise_keeps_the_flow_matching_marginal():
    """Point-mass data x0 and noise e: the renoised point is exactly
    (1 - s') x0 + sqrt(s'^2 - u^2) e + u n (total noise level s')."""
    g = torch.Generator().manual_seed(8)
    x0, e, n = (torch.randn(64, generator=g, dtype=torch.float64) for _ in range(3))
    s, sn, eta = 0.7, 0.4, 0.5
    x = (1 - s) * x0 + s * e
    x_det = (1 - sn) * x0 + sn * e
    out = res2s_renoise(x, x_det, s, sn, eta, n)
    u = eta * sn
    assert (out - ((1 - sn) * x0 + math.sqrt(sn**2 - u**2) * e + u * n)).abs().max() < 1e-14
    assert (out - _sde_ref(x, x_det, s, sn, eta, n)).abs().max() < 1e-14
    assert torch.equal(res2s_renoise(x, x_det, s, sn, 0.0, n), x_det)


def test_standardized_noise_and_hq_sample():
    like = torch.zeros(2, 30, 4)
    n = standardized_noise(like, torch.Generator().manual_seed(9))
    assert n.dtype == torch.float64 and n.shape == like.shape
    assert n.mean(dim=(-2, -1)).abs().max() < 1e-12
    assert (n.std(dim=(-2, -1)) - 1).abs().max() < 1e-12
    assert torch.equal(n, standardized_noise(like, torch.Generator().manual_seed(9)))
    denoise = _toy_denoiser(seed=10)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    gs, gsub = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    out = res2s_sample(
        x, [0.909375, 0.725, 0.421875, 0.0], denoise,
        step_noise=lambda t: standardized_noise(t, gs),
        substep_noise=lambda t: standardized_noise(t, gsub), **HQ_RES2S_OPTIONS,
    )  # fmt: skip
    det = res2s_sample(x, [0.909375, 0.725, 0.421875, 0.0], denoise)
    assert torch.isfinite(out).all() and (out - det).abs().max() > 1e-3
    with pytest.raises(ValueError, match="^eta: 0.5 > 0 needs its noise function"):
        res2s_step(x, 0.5, 0.4, denoise, eta=0.5)
    with pytest.raises(ValueError, match=r"^substep_eta: must lie in \[0, 1\]"):
        res2s_step(x, 0.5, 0.4, denoise, substep_eta=1.5, substep_noise=lambda t: t)
