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

What this module leaves out of Lightricks' loop: its SDE noise injection (``eta = 0.5`` after
the substep and after the step, from generators seeded with fixed seeds) and the "bongmath"
anchor refinement, which is the identity when no noise is injected. At ``eta = 0`` their loop
is the deterministic step above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "RES2S_TERMINAL_SIGMA",
    "phi",
    "res2s_coefficients",
    "res2s_sample",
    "res2s_schedule",
    "res2s_step",
]

# The last non-zero noise level of Lightricks' res_2s loop before the final data prediction
# (ltx_pipelines/utils/samplers.py: a terminal 0 becomes 0.0011, 0).
RES2S_TERMINAL_SIGMA = 0.0011

# |z| below which phi_j is summed as its power series (the closed form cancels there).
_SERIES_BELOW = 1.0
_SERIES_TERMS = 30  # |z| <= 1: the tail after 30 terms is below 1/30!, far under float64's ulp

Denoiser = Callable[[torch.Tensor, float], torch.Tensor]


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


def res2s_step(
    x: torch.Tensor, sigma: float, sigma_next: float, denoise: Denoiser, c2: float = 0.5
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

    Returns:
        ``x_next``, shape and dtype of ``x``.

    Raises:
        ValueError: a noise level out of range or not decreasing.
    """
    sigma, sigma_next = float(sigma), float(sigma_next)
    if not (0.0 < sigma <= 1.0 and 0.0 <= sigma_next < sigma):
        raise ValueError(
            f"res_2s: sigmas must satisfy 0 <= sigma_next < sigma <= 1, got sigma={sigma}, "
            f"sigma_next={sigma_next}"
        )
    if sigma_next == 0.0:
        return denoise(x, sigma).to(x.dtype)
    hp = _compute_dtype(x)
    h = math.log(sigma / sigma_next)
    a21, b1, b2 = res2s_coefficients(h, c2)
    sigma_mid = sigma * math.exp(-c2 * h)
    x_hp = x.to(hp)
    eps1 = denoise(x, sigma).to(hp) - x_hp
    x_mid = x_hp + (h * a21) * eps1
    eps2 = denoise(x_mid.to(x.dtype), sigma_mid).to(hp) - x_hp
    x_next = x_hp + h * (b1 * eps1 + b2 * eps2)
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
) -> torch.Tensor:
    """Run res_2s over ``sigmas`` (through :func:`res2s_schedule`) from the latents ``x``.

    ``2 n + 1`` model evaluations for a schedule of ``n`` steps ending at 0 (``2 n`` otherwise).

    Args:
        x: latents at ``sigmas[0]``, any shape, floating dtype.
        sigmas: the requested schedule (see :func:`res2s_schedule`).
        denoise: ``(x, sigma) -> x0``.
        callback: called as ``callback(i, x)`` after step ``i`` of the expanded schedule.

    Returns:
        The latents at the last noise level, shape and dtype of ``x``.

    Raises:
        ValueError: an invalid schedule (naming ``sigmas``).
    """
    schedule = res2s_schedule(sigmas)
    for i, (sigma, sigma_next) in enumerate(zip(schedule, schedule[1:])):
        x = res2s_step(x, sigma, sigma_next, denoise)
        if callback is not None:
            callback(i, x)
    return x
