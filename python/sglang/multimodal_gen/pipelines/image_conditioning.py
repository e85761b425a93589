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

:func:`encode_image_posterior` and :func:`encode_inpaint_mask` are the rank-0 half (diffusers'
``VaeImageProcessor`` preprocessing, the VAE's posterior, the binarised mask on the latent grid);
:func:`sdedit_start` and :func:`sdedit_after_step` the per-rank half over the conditioning keys
:data:`IMAGE_LATENTS`, :data:`NOISE` and :data:`INPAINT_MASK`. A family supplies only its layout
(packing, VAE normalisation, the frame axis of a video VAE); see ``pipelines/flux.py``,
``pipelines/zimage.py`` and ``pipelines/qwen_image.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.multimodal_gen.errors import InvalidRequestError

__all__ = [
    "encode_image_posterior",
    "encode_inpaint_mask",
    "inpaint_blend",
    "posterior_of",
    "sample_posterior",
    "sdedit_after_step",
    "sdedit_start",
    "sdedit_timesteps",
]

#: The conditioning keys :func:`sdedit_start` and :func:`sdedit_after_step` read: the input
#: image's normalised latents and the noise (both in the loop's latent layout) and the inpainting
#: mask (broadcastable to them, 1 = edit).
#: Named for SDEdit alone: the default stages of ``pipelines/base.py`` act when they are present,
#: so a family's own conditioning (an edit model's reference latents) never takes these names.
IMAGE_LATENTS, NOISE, INPAINT_MASK = "sdedit_image_latents", "sdedit_noise", "sdedit_mask"


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


def encode_image_posterior(
    vae: Any,
    image: Any,
    height: int,
    width: int,
    factor: int,
    latent_channels: int | None = None,
    frame_axis: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, std)`` of the VAE posterior of an input image resized to ``height x width``.

    The image goes through diffusers' ``VaeImageProcessor(vae_scale_factor=factor)``
    ``preprocess`` (Lanczos resize, ``[-1, 1]`` float32 ``[1, 3, H, W]``) as the img2img and
    inpainting pipelines do; ``frame_axis`` adds the frame axis a video VAE (Qwen-Image's
    ``AutoencoderKLQwenImage``) takes, ``[1, 3, 1, H, W]``. Both results are ``[1, z, (1,) h, w]``
    in the VAE's dtype, on its device.

    Args:
        vae: a diffusers VAE whose ``encode`` returns a ``latent_dist``.
        image: an :class:`~sglang.multimodal_gen.image_inputs.InputImage` (or a PIL image).
        factor: the pixel size of one latent patch (``vae_scale_factor * 2``).
        latent_channels: the processor's ``vae_latent_channels`` (what diffusers passes).
    """
    from diffusers.image_processor import VaeImageProcessor

    kw = {} if latent_channels is None else {"vae_latent_channels": latent_channels}
    proc = VaeImageProcessor(vae_scale_factor=factor, **kw)
    pil = image.to_pil() if hasattr(image, "to_pil") else image
    x = proc.preprocess(pil, height=height, width=width)
    if frame_axis:
        x = x.unsqueeze(2)
    return posterior_of(vae.encode(x.to(device=vae.device, dtype=vae.dtype)))


def encode_inpaint_mask(
    mask: Any, height: int, width: int, factor: int, latent_hw: tuple[int, int]
) -> torch.Tensor:
    """The inpainting mask on the latent grid, ``[1, 1, h, w]`` float32 of 0/1 (1 = edit).

    As diffusers' inpainting pipelines: ``VaeImageProcessor(do_normalize=False,
    do_binarize=True, do_convert_grayscale=True)`` at ``height x width`` (values >= 0.5 become
    1), then nearest-neighbour ``interpolate`` to ``latent_hw``.
    """
    from diffusers.image_processor import VaeImageProcessor

    proc = VaeImageProcessor(
        vae_scale_factor=factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    )
    pil = mask.to_pil() if hasattr(mask, "to_pil") else mask
    m = proc.preprocess(pil, height=height, width=width)
    return torch.nn.functional.interpolate(m, size=tuple(latent_hw), mode="nearest")


def sdedit_start(
    cond: dict[str, Any],
    latents: torch.Tensor,
    scheduler: Any,
    timesteps: torch.Tensor,
    num_inference_steps: int,
    strength: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``condition_latents`` stage of image-to-image: ``(latents, timesteps)`` unchanged
    without :data:`IMAGE_LATENTS` in ``cond``; else the last ``strength`` of the schedule
    (:func:`sdedit_timesteps`) and ``scheduler.scale_noise(image_latents, t0, noise)`` (the
    image re-noised to the first step that runs).

    Raises:
        InvalidRequestError: no step would run (``param="strength"``).
    """
    if IMAGE_LATENTS not in cond:
        return latents, timesteps
    timesteps, _ = sdedit_timesteps(scheduler, num_inference_steps, strength)
    t0 = timesteps[:1].repeat(latents.shape[0])
    return scheduler.scale_noise(cond[IMAGE_LATENTS], t0, cond[NOISE]), timesteps


def sdedit_after_step(
    cond: dict[str, Any],
    latents: torch.Tensor,
    step_index: int,
    timesteps: torch.Tensor,
    scheduler: Any,
) -> torch.Tensor:
    """The ``after_step`` stage of inpainting: :func:`inpaint_blend` with the conditioning's
    image latents, noise and :data:`INPAINT_MASK`; ``latents`` unchanged without a mask."""
    if INPAINT_MASK not in cond or IMAGE_LATENTS not in cond:
        return latents
    return inpaint_blend(
        latents, cond[IMAGE_LATENTS], cond[INPAINT_MASK], cond[NOISE], scheduler, timesteps,
        step_index,
    )  # fmt: skip
