"""2x2 latent patch packing shared by the MMDiT image pipelines (Flux.1, Qwen-Image), and the RoPE
positions of the packed patches.

Follows diffusers 0.42.1 ``FluxPipeline._pack_latents`` / ``_unpack_latents`` /
``_prepare_latent_image_ids`` (``pipelines/flux/pipeline_flux.py``); ``QwenImagePipeline``'s
``_pack_latents`` / ``_unpack_latents`` (``pipelines/qwenimage/pipeline_qwenimage.py``) are the same
packing of one frame. Here ``h`` and ``w`` are the latent height and width (even), not pixels.
"""

from __future__ import annotations

import torch

__all__ = ["image_ids", "pack_latents", "unpack_latents"]


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """Latents -> 2x2 patches, one token per patch (diffusers' ``_pack_latents``).

    Shapes: ``[B, C, h, w]`` -> ``[B, (h/2)(w/2), 4C]``, tokens in row-major patch order, the
    channels of a token in ``(C, 2, 2)`` order; dtype and device kept.
    """
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` (diffusers' ``_unpack_latents`` after its pixel-to-latent
    size conversion).

    Shapes: ``[B, (h/2)(w/2), 4C]`` and the latent size ``h``, ``w`` -> ``[B, C, h, w]``; dtype and
    device kept.
    """
    b, _, c4 = latents.shape
    x = latents.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, h, w)


def image_ids(h2: int, w2: int, device, dtype) -> torch.Tensor:
    """3-axis RoPE positions of the packed patches (diffusers' ``_prepare_latent_image_ids``).

    Shapes: ``h2 x w2`` patches -> ``[h2 * w2, 3]`` rows ``(0, row, col)`` in :func:`pack_latents`'
    token order, in ``dtype`` on ``device``.
    """
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] = torch.arange(h2)[:, None]
    ids[..., 2] = torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3).to(device=device, dtype=dtype)
