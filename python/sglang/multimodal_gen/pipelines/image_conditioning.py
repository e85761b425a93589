"""Image-to-image and inpainting as diffusers' flow-matching pipelines run them (SDEdit), shared by
the families whose request may carry an input image.

The parts every such pipeline repeats (diffusers 0.42.1: ``FluxImg2ImgPipeline``,
``FluxInpaintPipeline``, ``ZImageImg2ImgPipeline``, ``QwenImageImg2ImgPipeline``...):

* ``get_timesteps``: of the ``n`` scheduled steps the last ``int(n * strength)`` run
  (:func:`sdedit_timesteps`);
* the image's latents are a *sample* of the VAE's posterior drawn from the request's generator
  before the noise (``retrieve_latents(vae.encode(x), generator)``); rank 0 encodes the image
  and broadcasts the posterior's mean and standard deviation, and every rank draws the sample
  itself (:func:`sample_posterior`), so every rank's generator advances as diffusers' does;
* the start is ``scheduler.scale_noise(image_latents, t0, noise)``;
* inpainting: after every step the kept region is put back, re-noised to the next timestep
  (:func:`inpaint_blend`).

A family supplies only its layout (packing, VAE normalisation); see ``pipelines/flux.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.multimodal_gen.errors import InvalidRequestError

__all__ = ["inpaint_blend", "posterior_of", "sample_posterior", "sdedit_timesteps"]


def sdedit_timesteps(
    scheduler: Any, num_inference_steps: int, strength: float
) -> tuple[torch.Tensor, int]:
    """``(timesteps, steps)`` that run for ``strength``, as diffusers' ``get_timesteps``: the
    schedule's last ``n - int(max(n - min(n * strength, n), 0))`` steps; the scheduler's begin
    index is set to the first of them.

    Raises:
        InvalidRequestError: no step would run (``param="strength"``; diffusers raises a
            ``ValueError``).
    """
    n = int(num_inference_steps)
    init = min(n * strength, n)
    t_start = int(max(n - init, 0))
    order = getattr(scheduler, "order", 1)
    timesteps = scheduler.timesteps[t_start * order :]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(t_start * order)
    steps = n - t_start
    if steps < 1:
        raise InvalidRequestError(
            f"strength {strength:g} x num_inference_steps {n} leaves no denoising step; raise "
            "strength or num_inference_steps",
            param="strength",
        )
    return timesteps, steps


def posterior_of(encoder_output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` of a diffusers VAE's ``encode`` output (its ``latent_dist``, a
    ``DiagonalGaussianDistribution``)."""
    dist = encoder_output.latent_dist
    return dist.mean, dist.std


def sample_posterior(
    mean: torch.Tensor, std: torch.Tensor, generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One sample of the posterior, as ``DiagonalGaussianDistribution.sample(generator)`` draws
    it: ``mean + std * randn_tensor(mean.shape, generator)`` in ``mean``'s dtype."""
    from diffusers.utils.torch_utils import randn_tensor

    eps = randn_tensor(mean.shape, generator=generator, device=device, dtype=mean.dtype)
    return mean.to(device) + std.to(device) * eps


def inpaint_blend(
    latents: torch.Tensor,
    image_latents: torch.Tensor,
    mask: torch.Tensor,
    noise: torch.Tensor,
    scheduler: Any,
    timesteps: torch.Tensor,
    step_index: int,
) -> torch.Tensor:
    """``(1 - mask) * kept + mask * latents`` after step ``step_index``, where ``kept`` is the
    image's latents re-noised to the next timestep (the image itself after the last step), as
    diffusers' flow-matching inpainting pipelines do.

    Args:
        latents, image_latents, noise: the same layout; mask: broadcastable to it, 1 = edit.
    """
    kept = image_latents
    if step_index < len(timesteps) - 1:
        kept = scheduler.scale_noise(image_latents, timesteps[step_index + 1 : step_index + 2],
                                     noise)  # fmt: skip
    return (1 - mask) * kept + mask * latents
