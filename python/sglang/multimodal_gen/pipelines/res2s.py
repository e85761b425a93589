"""The res_2s step: a two-stage exponential Runge-Kutta step in data-prediction (x0) form on a
flow-matching noise schedule, as in LTX-2's "HQ" two-stage recipe.

The ODE. A flow-matching latent at noise level ``sigma`` is ``x = (1 - sigma) x0 + sigma eps``;
the model's data prediction is ``D(x, sigma) ~ x0``, and the probability-flow ODE is
``dx/dsigma = (x - D) / sigma``. In the log-noise time ``t = -log(sigma)`` it reads
``dx/dt = -x + D(x, t)``: a linear part solved exactly plus the model's part. Over one step from
``sigma`` to ``sigma_next`` with ``h = log(sigma / sigma_next) > 0`` the exact solution is
``x(h) = e^{-h} x + integral_0^h e^{-(h - tau)} D(tau) dtau``, and the exponential integrators
approximate ``D`` inside the integral ("exponential integrators", Hochbruck & Ostermann 2010;
"Refined Exponential Solver", Zhang, Tao, Chen et al., arXiv 2308.02157, as ComfyUI's RES4LYF
``res_2s`` and Lightricks' LTX-2 ``ltx_pipelines/utils/res2s.py`` use it).

The phi functions. ``phi_0(z) = e^z``, ``phi_j(z) = (phi_{j-1}(z) - 1/(j-1)!) / z``; equivalently
``phi_j(z) = sum_{k >= 0} z^k / (k + j)!``, so ``phi_j(0) = 1/j!``. The closed forms
``phi_1(z) = (e^z - 1)/z`` and ``phi_2(z) = (e^z - 1 - z)/z^2`` lose every digit to cancellation
when ``|z|`` is small (at ``z = -1e-8`` the float64 closed form gives ``phi_2 = 0.61`` instead of
0.5 and ``phi_1`` only 8 correct digits),
so :func:`phi` sums the series there.

The step (``c2 = 1/2``, two model evaluations; ``eps_i = D_i - x``)::

    a21 = c2 phi_1(-c2 h)
    b2  = phi_2(-h) / c2
    b1  = phi_1(-h) - b2
    sigma_mid = sigma e^{-c2 h}              (= sqrt(sigma sigma_next) at c2 = 1/2)
    D1  = D(x, sigma)
    x_mid = x + h a21 (D1 - x)
    D2  = D(x_mid, sigma_mid)
    x_next = x + h (b1 (D1 - x) + b2 (D2 - x))

``x + h phi_1(-h) (D - x) = e^{-h} x + (1 - e^{-h}) D`` is the exact solution for a constant
``D``, which is also the flow-matching Euler / DDIM step ``(sigma_next / sigma) x +
(1 - sigma_next / sigma) D``; the second stage corrects for ``D`` changing over the step.

The last step to ``sigma_next = 0`` (``h`` infinite) is the data prediction itself,
``x_next = D(x, sigma)`` (one evaluation; the limit of the first-order step). Lightricks' loop
(``ltx_pipelines/utils/samplers.py``, ``res2s_audio_video_denoising_loop``) replaces a terminal
``0`` by ``0.0011`` followed by ``0``: the last res_2s step ends at ``0.0011`` and one more
evaluation returns ``D``; :func:`res2s_schedule` builds that schedule and :func:`res2s_sample`
runs it.

The stochastic variant (Lightricks' loop as its HQ pipelines call it: ``eta = 0.5`` and
``substep_eta = 0.5``, "bongmath" on). A deterministic move from ``x`` at ``sigma`` to ``x_det`` at
``s' < sigma`` implies a velocity ``v = (x - x_det) / (sigma - s')``, a data point
``x0 = x - sigma v`` and a noise ``e = x0 + v``; :func:`res2s_renoise` replaces part of that noise by
fresh noise ``n`` at the same level: ``u = min(eta s', 0.9999 s')``,
``x' = (1 - s') x0 + sqrt(s'^2 - u^2) e + u n`` (this is Lightricks' ``Res2sDiffusionStep.step``,
``alpha_ratio (x0 + sigma_down v) + sigma_up n``, with its terms collected). The step then reads::

    x_mid = renoise(x, x + h a21 (D1 - x), sigma, sigma_mid, substep_eta, n_sub)
    if bongmath and h < 0.5 and sigma > 0.03:     # the anchor that x_mid is the exact substep of
        x_a = (x_mid - h a21 D1) / (1 - h a21);  D1 - x_a replaces D1 - x
    x_next = renoise(x_a, x_a + h (b1 (D1 - x_a) + b2 (D2 - x_a)), sigma, sigma_next, eta, n)

(Lightricks iterate ``x_a = x_mid - h a21 (D1 - x_a)`` 100 times; its fixed point is the closed
form above.) Their noise is float64 normal noise standardized over the whole tensor, then over its
last two dimensions (:func:`standardized_noise`), from two generators seeded ``-1`` and ``9999``
whatever the request's seed; here the caller passes the noise functions. Without noise the
variant is the deterministic step (the anchor is then ``x`` itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "HQ_RES2S_OPTIONS",
    "RES2S_TERMINAL_SIGMA",
    "phi",
    "res2s_coefficients",
    "res2s_renoise",
    "res2s_sample",
    "res2s_schedule",
    "res2s_step",
    "standardized_noise",
]

# The last non-zero noise level of Lightricks' res_2s loop before the final data prediction
# (ltx_pipelines/utils/samplers.py: a terminal 0 becomes 0.0011, 0).
RES2S_TERMINAL_SIGMA = 0.0011

# |z| below which phi_j is summed as its power series (the closed form cancels there).
_SERIES_BELOW = 1.0
_SERIES_TERMS = 30  # |z| <= 1: the tail after 30 terms is below 1/30!, far under float64's ulp

# Lightricks' HQ pipelines run the loop with its defaults (ltx_pipelines/utils/samplers.py,
# res2s_audio_video_denoising_loop): step eta 0.5, substep eta 0.5, bongmath on.
HQ_RES2S_OPTIONS = {"eta": 0.5, "substep_eta": 0.5, "bongmath": True}

Denoiser = Callable[[torch.Tensor, float], torch.Tensor]
Noise = Callable[[torch.Tensor], torch.Tensor]


def phi(j: int, z: float) -> float:
    """``phi_j(z) = sum_{k >= 0} z^k / (k + j)!`` in float64, accurate for every ``z`` incl. 0.

    For ``|z| < 1`` the series (30 terms); otherwise the recursion ``phi_0 = e^z``,
    ``phi_i = (phi_{i-1} - 1/(i-1)!) / z`` (``phi_1 = expm1(z) / z``), which has no cancellation
    to speak of at ``|z| >= 1``.

    Args:
        j: order, ``j >= 0``.
        z: the argument (the step uses ``z = -h`` and ``z = -c2 h``, ``h >= 0``).

    Raises:
        ValueError: ``j`` negative, or ``z`` not finite.
    """
    if j < 0:
        raise ValueError(f"phi: order j must be >= 0, got {j}")
    z = float(z)
    if not math.isfinite(z):
        raise ValueError(f"phi: z must be finite, got {z}")
    if abs(z) < _SERIES_BELOW:
        total, term = 0.0, 1.0 / math.factorial(j)  # term k: z^k / (k + j)!
        for k in range(_SERIES_TERMS):
            total += term
            term *= z / (k + j + 1)
        return total
    if j == 0:
        return math.exp(z)
    value = math.expm1(z) / z
    for i in range(2, j + 1):
        value = (value - 1.0 / math.factorial(i - 1)) / z
    return value


def res2s_coefficients(h: float, c2: float = 0.5) -> tuple[float, float, float]:
    """The res_2s Butcher coefficients ``(a21, b1, b2)`` for a step of log-noise length ``h``.

    ``a21 = c2 phi_1(-c2 h)``, ``b2 = phi_2(-h) / c2``, ``b1 = phi_1(-h) - b2`` (Lightricks'
    ``get_res2s_coefficients``; RES4LYF ``res_2s``). The update uses them multiplied by ``h``.

    Args:
        h: ``log(sigma / sigma_next)``, finite and >= 0.
        c2: the substep's position in ``(0, 1]`` (LTX-2: 0.5).

    Raises:
        ValueError: ``h`` negative or not finite, ``c2`` outside ``(0, 1]``.
    """
    if not math.isfinite(h) or h < 0:
        raise ValueError(f"res_2s: the log step h must be finite and >= 0, got {h}")
    if not 0.0 < c2 <= 1.0:
        raise ValueError(f"res_2s: c2 must lie in (0, 1], got {c2}")
    a21 = c2 * phi(1, -c2 * h)
    b2 = phi(2, -h) / c2
    b1 = phi(1, -h) - b2
    return a21, b1, b2


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.device.type == "mps" else torch.float64


def res2s_renoise(
    x: torch.Tensor,
    x_det: torch.Tensor,
    sigma: float,
    sigma_next: float,
    eta: float,
    noise: torch.Tensor,
) -> torch.Tensor:
    """Swap part of the noise of a deterministic move ``x -> x_det`` for fresh ``noise``.

    ``v = (x - x_det) / (sigma - sigma_next)``, ``x0 = x - sigma v``, ``e = x0 + v``,
    ``u = min(eta sigma_next, 0.9999 sigma_next)``; returns
    ``(1 - sigma_next) x0 + sqrt(sigma_next^2 - u^2) e + u noise`` (Lightricks'
    ``Res2sDiffusionStep.step`` with ``sigma_max = 1``), or ``x_det`` when ``u`` or
    ``sigma_next`` is 0. Computed in the inputs' dtype.

    Args:
        x: the latents at ``sigma``; x_det: the deterministic result at ``sigma_next``.
        noise: standard normal noise, shape of ``x``.
        eta: the share of ``sigma_next`` that is fresh noise, ``[0, 1]``.
    """
    u = min(eta * sigma_next, 0.9999 * sigma_next)
    if u <= 0.0 or sigma_next == 0.0:
        return x_det
    v = (x - x_det) / (sigma - sigma_next)
    x0 = x - sigma * v
    kept = math.sqrt(max(sigma_next * sigma_next - u * u, 0.0))
    return (1.0 - sigma_next) * x0 + kept * (x0 + v) + u * noise.to(x.dtype)


def standardized_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Lightricks' res_2s noise: float64 normal noise of ``like``'s shape (on the generator's
    device), standardized over the whole tensor, then over its last two dimensions
    (``ltx_pipelines/utils/samplers.py``, ``_get_new_noise``; unbiased std)."""
    n = torch.randn(like.shape, generator=generator, dtype=torch.float64, device=generator.device)
    n = (n - n.mean()) / n.std()
    return (n - n.mean(dim=(-2, -1), keepdim=True)) / n.std(dim=(-2, -1), keepdim=True)


def res2s_step(
    x: torch.Tensor,
    sigma: float,
    sigma_next: float,
    denoise: Denoiser,
    c2: float = 0.5,
    *,
    eta: float = 0.0,
    substep_eta: float = 0.0,
    step_noise: Noise | None = None,
    substep_noise: Noise | None = None,
    bongmath: bool = True,
) -> torch.Tensor:
    """One res_2s step of the latents ``x`` from ``sigma`` to ``sigma_next`` (module docstring).

    The update is computed in float64 (float32 on MPS) and returned in ``x``'s dtype; ``denoise``
    gets its inputs in ``x``'s dtype, as a model in that dtype would, and its outputs are taken to
    float64 before the combination (as Lightricks' loop does). ``sigma_next == 0`` is the one-
    evaluation data prediction ``D(x, sigma)``.

    Args:
        x: latents, any shape, floating dtype.
        sigma: current noise level in ``(0, 1]``.
        sigma_next: next noise level, ``0 <= sigma_next < sigma``.
        denoise: ``(x, sigma) -> x0`` prediction, same shape as ``x``.
        c2: substep position (0.5: the geometric midpoint ``sqrt(sigma sigma_next)``).
        eta, substep_eta: fresh-noise shares after the step and after the substep (0: the
            deterministic step; Lightricks' HQ: 0.5 and 0.5, :data:`HQ_RES2S_OPTIONS`).
        step_noise, substep_noise: ``like -> standard normal noise`` of ``like``'s shape, drawn
            when the matching eta is > 0 (e.g. :func:`standardized_noise` with a generator).
        bongmath: re-anchor the step on the substep's injected noise (``h < 0.5``,
            ``sigma > 0.03``), as Lightricks' loop does.

    Returns:
        ``x_next``, shape and dtype of ``x``.

    Raises:
        ValueError: a noise level out of range or not decreasing, an eta outside ``[0, 1]``, an
            eta > 0 without its noise function.
    """
    sigma, sigma_next = float(sigma), float(sigma_next)
    if not (0.0 < sigma <= 1.0 and 0.0 <= sigma_next < sigma):
        raise ValueError(
            f"res_2s: sigmas must satisfy 0 <= sigma_next < sigma <= 1, got sigma={sigma}, "
            f"sigma_next={sigma_next}"
        )
    for name, value, fn in (("eta", eta, step_noise), ("substep_eta", substep_eta, substep_noise)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: must lie in [0, 1], got {value}")
        if value > 0.0 and fn is None:
            raise ValueError(f"{name}: {value} > 0 needs its noise function")
    if sigma_next == 0.0:
        return denoise(x, sigma).to(x.dtype)
    hp = _compute_dtype(x)
    h = math.log(sigma / sigma_next)
    a21, b1, b2 = res2s_coefficients(h, c2)
    sigma_mid = sigma * math.exp(-c2 * h)
    x_hp = x.to(hp)
    d1 = denoise(x, sigma).to(hp)
    eps1 = d1 - x_hp
    x_mid = x_hp + (h * a21) * eps1
    anchor = x_hp
    if substep_eta > 0.0:
        x_mid = res2s_renoise(x_hp, x_mid, sigma, sigma_mid, substep_eta, substep_noise(x))
        if bongmath and h < 0.5 and sigma > 0.03:
            k = h * a21
            anchor = (x_mid - k * d1) / (1.0 - k)
            eps1 = d1 - anchor
    eps2 = denoise(x_mid.to(x.dtype), sigma_mid).to(hp) - anchor
    x_next = anchor + h * (b1 * eps1 + b2 * eps2)
    if eta > 0.0:
        x_next = res2s_renoise(anchor, x_next, sigma, sigma_next, eta, step_noise(x))
    return x_next.to(x.dtype)


def res2s_schedule(sigmas: Sequence[float] | torch.Tensor) -> list[float]:
    """Lightricks' res_2s schedule: a terminal ``0`` becomes ``RES2S_TERMINAL_SIGMA, 0``.

    ``[s_0, ..., s_{n-1}, 0]`` -> ``[s_0, ..., s_{n-1}, 0.0011, 0]``: ``n`` res_2s steps, the last
    ending at 0.0011, then the data prediction (``ltx_pipelines/utils/samplers.py``). A schedule
    without a terminal 0 is returned unchanged.

    Args:
        sigmas: noise levels, 1-D, at least two, strictly decreasing, in ``[0, 1]``.

    Returns:
        The schedule as Python floats.

    Raises:
        ValueError: naming ``sigmas``: fewer than two values, out of ``[0, 1]``, not strictly
            decreasing, or a last non-zero level not above 0.0011 before a terminal 0.
    """
    values = [float(s) for s in (sigmas.tolist() if torch.is_tensor(sigmas) else sigmas)]
    if len(values) < 2:
        raise ValueError(f"sigmas: a schedule needs at least two noise levels, got {values}")
    if any(not (0.0 <= s <= 1.0) for s in values):
        raise ValueError(f"sigmas: every noise level must lie in [0, 1], got {values}")
    if any(b >= a for a, b in zip(values, values[1:])):
        raise ValueError(f"sigmas: the noise levels must strictly decrease, got {values}")
    if values[-1] != 0.0:
        return values
    if values[-2] <= RES2S_TERMINAL_SIGMA:
        raise ValueError(
            f"sigmas: the last non-zero noise level must exceed {RES2S_TERMINAL_SIGMA} (res_2s "
            f"ends its last step there before the final data prediction), got {values[-2]}"
        )
    return values[:-1] + [RES2S_TERMINAL_SIGMA, 0.0]


def res2s_sample(
    x: torch.Tensor,
    sigmas: Sequence[float] | torch.Tensor,
    denoise: Denoiser,
    callback: Callable[[int, torch.Tensor], None] | None = None,
    **step_options,
) -> torch.Tensor:
    """Run res_2s over ``sigmas`` (through :func:`res2s_schedule`) from the latents ``x``.

    ``2 n + 1`` model evaluations for a schedule of ``n`` steps ending at 0 (``2 n`` otherwise).

    Args:
        x: latents at ``sigmas[0]``, any shape, floating dtype.
        sigmas: the requested schedule (see :func:`res2s_schedule`).
        denoise: ``(x, sigma) -> x0``.
        callback: called as ``callback(i, x)`` after step ``i`` of the expanded schedule.
        step_options: :func:`res2s_step`'s keyword options (``eta``, ``substep_eta``, the noise
            functions, ``bongmath``), the same for every step.

    Returns:
        The latents at the last noise level, shape and dtype of ``x``.

    Raises:
        ValueError: an invalid schedule (naming ``sigmas``) or option.
    """
    schedule = res2s_schedule(sigmas)
    for i, (sigma, sigma_next) in enumerate(zip(schedule, schedule[1:])):
        x = res2s_step(x, sigma, sigma_next, denoise, **step_options)
        if callback is not None:
            callback(i, x)
    return x
