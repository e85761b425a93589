"""FLUX.1 Kontext (image editing): the Flux.1 stages plus a reference image read as extra tokens.

Follows diffusers' ``FluxKontextPipeline`` (diffusers 0.42.1,
``pipelines/flux/pipeline_flux_kontext.py``), with the same weights and seed giving the same
image:

* the reference image (the request's ``image``, required) is brought to one of the resolutions
  Kontext was trained at, the one closest to its aspect ratio (:data:`KONTEXT_RESOLUTIONS`,
  about one megapixel each; :func:`kontext_reference_size`), each side floored to a multiple of
  the VAE factor x 2, resized and normalised by diffusers' ``VaeImageProcessor``;
* its latents are the VAE posterior's mode (no random draw), ``(z - shift_factor) *
  scaling_factor``, packed into 2x2 patches like the noise; their positions are ``(1, row,
  col)``: the same grid as the output's ``(0, row, col)`` on another first RoPE axis, so the
  DiT tells the two images apart;
* each step the DiT sees ``[noise tokens, reference tokens]`` and only the noise tokens'
  prediction is kept; the schedule's ``mu`` counts the noise tokens only;
* the output size is the request's ``height`` x ``width`` (default 1024 x 1024). diffusers
  rescales the requested size to ``max_area`` (default 1024^2) keeping its aspect ratio; a
  request of ``H x W`` here is diffusers' call with ``max_area=H*W``.

No image-to-image ``strength``: the reference conditions, it is not re-noised.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.multimodal_gen.pipelines.base import Generation
from sglang.multimodal_gen.pipelines.flux import FluxPipeline
from sglang.multimodal_gen.pipelines.latent_packing import image_ids, pack_latents

__all__ = ["KONTEXT_RESOLUTIONS", "FluxKontextPipeline", "kontext_reference_size"]

#: ``(width, height)`` pairs the Kontext model was trained at (the list in diffusers'
#: ``FluxKontextPipeline``, from Black Forest Labs' reference code).
KONTEXT_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248),
    (880, 1184), (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832),
    (1328, 800), (1392, 752), (1456, 720), (1504, 688), (1568, 672),
)  # fmt: skip


def kontext_reference_size(
    width: int, height: int, vae_scale_factor: int, scale: float = 1.0
) -> tuple[int, int]:
    """``(width, height)`` the reference image is resized to: the trained resolution with the
    closest aspect ratio (the first on a tie), times ``scale``, each side floored to
    ``2 * vae_scale_factor``.

    Args:
        width, height: the image's size after flooring to ``vae_scale_factor`` (diffusers'
            ``get_default_height_width``).
        scale: the model's default side over 1024 (1 for FLUX.1 Kontext, whose default output
            is 1024 x 1024: then this is diffusers' ``_auto_resize`` exactly; a model directory
            that declares a smaller default size, such as the tiny test models, gets the same
            aspect ratios at its own area).
    """
    aspect = width / height
    _, w, h = min((abs(aspect - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    m = 2 * vae_scale_factor
    w, h = round(w * scale), round(h * scale)
    return max(m, w // m * m), max(m, h // m * m)


class FluxKontextPipeline(FluxPipeline):
    """FLUX.1 Kontext on our Flux DiT (see the module docstring)."""

    family_name = "flux_kontext"

    @torch.no_grad()
    def encode_images(self, g: Generation) -> dict[str, Any]:
        """The reference's packed latents ``[1, L_ref, 4C]`` and positions ``[L_ref, 3]``."""
        image_proc = self._processors()
        img = g.params.image[0].to_pil()
        h, w = image_proc.get_default_height_width(img)
        d = self.spec.defaults
        scale = (d.height * d.width) ** 0.5 / 1024
        w, h = kontext_reference_size(w, h, self.vae_scale_factor, scale)
        x = image_proc.preprocess(image_proc.resize(img, h, w), h, w)
        x = x.to(device=self.vae.device, dtype=self.vae.dtype)
        z = self.vae.encode(x).latent_dist.mode()
        vae_cfg = self.configs.get("vae", {})
        z = (z - (vae_cfg.get("shift_factor") or 0.0)) * vae_cfg.get("scaling_factor", 1.0)
        ids = image_ids(z.shape[2] // 2, z.shape[3] // 2, self.device, torch.float32)
        ids[:, 0] = 1
        return {"ref_latents": pack_latents(z).to(self.device), "ref_ids": ids}

    def prepare_latents(self, g, cond):
        latents = super().prepare_latents(g, cond)
        dtype = cond["embeds"].dtype
        ref = cond["ref_latents"].to(dtype)
        cond["ref_latents"] = torch.cat([ref] * g.num_outputs, dim=0)
        cond["img_ids"] = torch.cat([cond["img_ids"], cond["ref_ids"].to(dtype)], dim=0)
        return latents

    def denoiser_input(self, latents, cond):
        return torch.cat([latents, cond["ref_latents"].to(latents.dtype)], dim=1)
