"""Flux.1 text-to-image ([dev] with a guidance embedding, [schnell] without): the stages.

Follows diffusers' ``FluxPipeline.__call__`` (diffusers 0.42.1, ``pipelines/flux/pipeline_flux.py``)
so that the same weights and seed give the same image:

* prompt: CLIP (``text_encoder``/``tokenizer``) padded to the tokenizer's ``model_max_length``
  (77) -> ``pooler_output`` ``[B, 768]``; T5 (``text_encoder_2``/``tokenizer_2``) padded to
  ``max_sequence_length`` (512 for [dev], 256 for [schnell]) -> last hidden state
  ``[B, L, 4096]``; text positions ``txt_ids`` all zero ``[L, 3]``;
* latents: ``randn_tensor`` ``[B, C, 2 * (H // 16), 2 * (W // 16)]`` (``C = in_channels / 4``) in
  the prompt embeddings' dtype, packed into 2x2 patches ``[B, (h/2)(w/2), 4C]``; image positions
  ``(0, row, col)`` per patch;
* schedule: sigmas ``linspace(1, 1/n, n)`` (float64, as numpy gives them), ``mu`` from diffusers'
  ``calculate_shift`` of the patch count (used when the scheduler config has dynamic shifting, as
  FLUX.1-dev's does), diffusers' ``retrieve_timesteps``; the DiT sees ``t / 1000``;
* guidance: ``--guidance-scale`` feeds the guidance embedding of [dev] (distilled guidance, one
  forward per step); ``--true-cfg-scale > 1`` with a negative prompt runs real CFG,
  ``neg + s (pos - neg)``, with cond and uncond in ONE batched forward (the reference runs two);
* decode: unpack -> ``latents / scaling_factor + shift_factor`` -> VAE -> diffusers'
  ``VaeImageProcessor.postprocess`` -> uint8.

With an input image it is ``FluxImg2ImgPipeline`` (and with a mask ``FluxInpaintPipeline``): the
image resized to the request's size by diffusers' ``VaeImageProcessor.preprocess``, a posterior
sample of its VAE latents ``(z - shift_factor) * scaling_factor`` drawn before the noise, the last
``strength`` of the schedule run from ``scale_noise(image latents, t0, noise)``; an inpainting mask
(binarised, resized to the latent grid by nearest neighbour) keeps the unmasked region after every
step (:mod:`.image_conditioning`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sglang.multimodal_gen.pipelines.base import Generation, StagedPipeline, latents_to_uint8
from sglang.multimodal_gen.pipelines.image_conditioning import (
    IMAGE_LATENTS,
    INPAINT_MASK,
    NOISE,
    encode_image_posterior,
    encode_inpaint_mask,
    sample_posterior,
)
from sglang.multimodal_gen.pipelines.latent_packing import image_ids, pack_latents, unpack_latents

__all__ = ["FluxPipeline"]


class FluxPipeline(StagedPipeline):
    """Flux.1 on our DiT (``models/dits/flux.py``) with the reference CLIP/T5/VAE/scheduler."""

    family_name = "flux"
    shifted_schedule = "diffusers.pipelines.flux.pipeline_flux"
    text_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

    # ------------------------------------------------------------------ text
    def _clip_pooled(self, prompts: list[str]) -> torch.Tensor:
        tok, enc = self.components["tokenizer"], self.components["text_encoder"]
        max_len = getattr(tok, "model_max_length", 77) or 77
        ids = tok(
            prompts,
            padding="max_length",
            max_length=max_len,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        out = enc(ids.to(enc.device), output_hidden_states=False).pooler_output
        return out.to(dtype=enc.dtype, device=self.device)

    def _t5_embeds(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        tok, enc = self.components["tokenizer_2"], self.components["text_encoder_2"]
        ids = tok(
            prompts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        out = enc(ids.to(enc.device), output_hidden_states=False)[0]
        return out.to(dtype=enc.dtype, device=self.device)

    def prompt_list(self, g: Generation) -> list[str]:
        """The prompt, and the negative prompt when true CFG runs."""
        p = g.params
        return [p.prompt] + ([p.negative_prompt] if self._true_cfg(g) else [])

    @torch.no_grad()
    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``{"embeds": [P, L, D], "pooled": [P, D_pool]}`` (both encoders pad to fixed
        lengths, so prompts of several requests encode together exactly)."""
        return {
            "pooled": self._clip_pooled(prompts),
            "embeds": self._t5_embeds(prompts, max_sequence_length),
        }

    @staticmethod
    def _true_cfg(g: Generation) -> bool:
        return g.params.true_cfg_scale > 1 and g.params.negative_prompt is not None

    def prepare_conditioning(self, g, cond):
        """Repeat each prompt's conditioning ``n`` times: rows ``[pos x n, neg x n]``."""
        n = g.num_outputs
        embeds = cond["embeds"].repeat_interleave(n, dim=0)
        pooled = cond["pooled"].repeat_interleave(n, dim=0)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=embeds.dtype)
        return dict(cond, embeds=embeds, pooled=pooled, txt_ids=txt_ids)

    # ------------------------------------------------------------------ latents / schedule
    def _latent_hw(self, g: Generation) -> tuple[int, int]:
        s = self.vae_scale_factor * 2
        return 2 * (g.params.height // s), 2 * (g.params.width // s)

    def prepare_latents(self, g, cond):
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self._latent_hw(g)
        dtype = cond["embeds"].dtype
        c = self.transformer.cfg.in_channels // 4
        image_latents = None
        if "image_mean" in cond:  # the posterior sample comes first from the generator
            z = sample_posterior(cond["image_mean"], cond["image_std"], g.generator, self.device)
            vae_cfg = self.configs.get("vae", {})
            z = (z - (vae_cfg.get("shift_factor") or 0.0)) * vae_cfg.get("scaling_factor", 1.0)
            image_latents = torch.cat([z.to(dtype)] * g.num_outputs, dim=0)
        noise = randn_tensor(
            (g.num_outputs, c, h, w), generator=g.generator, device=self.device, dtype=dtype
        )
        cond["img_ids"] = image_ids(h // 2, w // 2, self.device, dtype)
        if image_latents is not None:  # the SDEdit stages of the base class take it from here
            cond[IMAGE_LATENTS] = pack_latents(image_latents)
            cond[NOISE] = pack_latents(noise)
            if "mask_latent" in cond:
                m = cond["mask_latent"].to(self.device, dtype).repeat(g.num_outputs, c, 1, 1)
                cond[INPAINT_MASK] = pack_latents(m)
        return pack_latents(noise)

    def prepare_timesteps(self, g, latents):
        n = g.params.num_inference_steps
        use_own = self.scheduler_config.get("use_flow_sigmas")
        return self.shifted_timesteps(
            latents.shape[1], n, None if use_own else np.linspace(1.0, 1 / n, n)
        )

    # ------------------------------------------------------------------ input images
    def _processors(self):
        """diffusers' image processor of Flux pipelines (``vae_scale_factor * 2``)."""
        from diffusers.image_processor import VaeImageProcessor

        channels = self.configs.get("vae", {}).get("latent_channels", 16)
        return VaeImageProcessor(
            vae_scale_factor=self.vae_scale_factor * 2, vae_latent_channels=channels
        )

    @torch.no_grad()
    def encode_images(self, g):
        """The input image's VAE posterior (mean, std) at the request's size and, with a mask,
        the binarised mask on the latent grid ``[1, 1, h, w]`` (1 = edit)."""
        p = g.params
        factor = self.vae_scale_factor * 2
        channels = self.configs.get("vae", {}).get("latent_channels", 16)
        mean, std = encode_image_posterior(self.vae, p.image[0], p.height, p.width, factor,
                                           channels)  # fmt: skip
        out = {"image_mean": mean.to(self.device), "image_std": std.to(self.device)}
        if p.mask_image is not None:
            out["mask_latent"] = encode_inpaint_mask(
                p.mask_image, p.height, p.width, factor, self._latent_hw(g)
            )
        return out

    # ------------------------------------------------------------------ denoise
    def denoiser_input(self, latents: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        """The DiT's image tokens ``[B, L', C]`` for ``latents`` ``[B, L, C]``: the latents
        themselves (an edit model appends its reference tokens; ``img_ids`` then covers both)."""
        return latents

    def predict(self, denoiser, latents, t, step_index, cond, g):
        """One DiT call: the distilled guidance value for [dev]; cond and uncond batched in one
        forward under true CFG, combined as ``neg + s (pos - neg)``."""
        b = latents.shape[0]
        rows = cond["embeds"].shape[0] // b  # 2 under true CFG, else 1
        timestep = t.expand(b).to(latents.dtype)
        guidance = None
        if denoiser.cfg.guidance_embeds:
            guidance = torch.full(
                [b], g.params.guidance_scale, device=self.device, dtype=torch.float32
            )
        x = self.denoiser_input(latents, cond).to(denoiser.dtype)
        if rows > 1:
            x = x.repeat(rows, 1, 1)
            timestep = timestep.repeat(rows)
            guidance = None if guidance is None else guidance.repeat(rows)
        args = dict(
            hidden_states=x,
            encoder_hidden_states=cond["embeds"],
            pooled_projections=cond["pooled"],
            timestep=timestep / 1000,
            img_ids=cond["img_ids"],
            txt_ids=cond["txt_ids"],
            guidance=guidance,
        )
        batched = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")
        out = self.run_branches(
            denoiser, rows, args, batched + (() if guidance is None else ("guidance",)), g
        )
        out = out[:, : latents.shape[1]]  # the prediction of the latents' own tokens
        if rows == 1:
            return out
        pos, neg = out[:b], out[b:]
        return neg + g.params.true_cfg_scale * (pos - neg)

    # ------------------------------------------------------------------ decode
    def decode(self, latents, g) -> np.ndarray:
        h, w = self._latent_hw(g)
        z = unpack_latents(latents, h, w)
        z = z / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
        return latents_to_uint8(self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0])
