"""Z-Image text-to-image pipeline: prompt encoding -> flow-matching denoising -> VAE decode.

Follows diffusers' ``ZImagePipeline.__call__`` (diffusers 0.42.1,
``pipelines/z_image/pipeline_z_image.py``) step for step, so that the same weights and seed give
the same image:

* prompt: chat template (one user message, generation prompt, ``enable_thinking=True``), tokenized
  padded to ``max_sequence_length`` (512), text encoder ``hidden_states[-2]``, keeping the
  attention-masked tokens of each prompt;
* CFG is on when ``guidance_scale > 0``; the negative prompt defaults to ``""``; the prediction is
  ``pos + g * (pos - neg)`` (norm-capped at ``cfg_normalization`` times the conditional norm when
  that is > 0), and guidance is switched off on steps whose ``t_norm = (1000 - t) / 1000``
  exceeds ``cfg_truncation`` (both request fields of the family, ``ZImageSamplingParams``);
* latents ``[B, C, 2 * (H // 16), 2 * (W // 16)]`` fp32 from diffusers' ``randn_tensor`` with the
  caller's generator (drawn on the generator's device, moved to the execution device);
* schedule: sigmas ``linspace(1, 1/n, n)`` passed to the directory's scheduler through diffusers'
  ``retrieve_timesteps`` with ``mu`` from diffusers' ``calculate_shift`` of the image token count
  (used when the scheduler config turns dynamic shifting on); the transformer sees ``t = (1000 - timestep) / 1000`` and its output is
  negated before the Euler step;
* decode: ``latents / scaling_factor + shift_factor`` -> ``AutoencoderKL.decode`` -> diffusers'
  ``VaeImageProcessor.postprocess`` -> ``round(255 x)`` uint8.

With an input image it is ``ZImageImg2ImgPipeline`` (``pipeline_z_image_img2img.py``), and with
a mask ``ZImageInpaintPipeline`` (``pipeline_z_image_inpaint.py``): the image through
``VaeImageProcessor`` at the request's size, a sample of its VAE posterior drawn from the
request's generator before the noise, ``(z - shift_factor) * scaling_factor``; image latents and
noise in the text embeddings' dtype (the reference's ``prompt_embeds[0].dtype``); the same
schedule and ``mu`` as text-to-image, of which the last ``strength`` runs from
``scale_noise(image latents, t0, noise)``; an inpainting mask (binarised, nearest-neighbour on the
latent grid ``[1, 1, h, w]``, broadcast over the channels) keeps the unmasked region after every
step, re-noised to the next timestep (:mod:`.image_conditioning`). The reference also encodes the
masked image (one more posterior draw after the noise) but never uses it; nothing here depends on
that draw, so it is not made.

The caption side of the DiT (embedding + context refiner) does not depend on the timestep, so it
is computed once per call instead of once per step (same numbers).

The stages plug into :class:`~sglang.multimodal_gen.pipelines.base.StagedPipeline` (the loop,
rank-0 prompt encoding with broadcast, decoding on the VAE rank).
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

__all__ = ["ZImagePipeline", "default_sigmas"]


def default_sigmas(num_inference_steps: int) -> list[float]:
    """Z-Image's unshifted sigmas: ``n`` points evenly from 1 down to ``1/n`` (fp32 linspace)."""
    return torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps).tolist()


class ZImagePipeline(StagedPipeline):
    """Text-to-image with our Z-Image DiT and the reference text encoder / VAE / scheduler.

    Load with :meth:`StagedPipeline.from_pretrained` (``family=get_family("zimage")``).
    ``spatial_factor`` is ``vae_scale_factor * 2`` (16 for Z-Image).
    """

    family_name = "zimage"
    step_cache_joint_branches = True  # diffusers runs cond and uncond in one forward
    shifted_schedule = "diffusers.pipelines.z_image.pipeline_z_image"
    # texts are padded to a multiple of this many tokens (see encode_texts, encode_group_key)
    TEXT_PAD_MULTIPLE: int = 16

    # ------------------------------------------------------------------ text
    def prompt_list(self, g: Generation) -> list[str]:
        """The prompt, and the negative prompt (empty when not given) with CFG."""
        p = g.params
        neg = p.negative_prompt if p.negative_prompt is not None else ""
        return [p.prompt] + ([neg] if p.guidance_scale > 0 else [])

    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``{"embeds": [L_i, hidden] per prompt}``: the text encoder's second-to-last hidden
        layer at the unmasked tokens."""
        return {"embeds": self.encode_texts(prompts, max_sequence_length)}

    def _chat_texts(self, prompts: list[str]) -> list[str]:
        tokenizer = self.components["tokenizer"]
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=True,
            )
            for p in prompts
        ]

    def _token_ids(self, prompts: list[str], max_sequence_length: int) -> list[list[int]]:
        """Each prompt's chat-template token ids, truncated to ``max_sequence_length``."""
        tokenizer = self.components["tokenizer"]
        return tokenizer(
            self._chat_texts(prompts), max_length=max_sequence_length, truncation=True
        ).input_ids

    def _padded_length(self, ids: list[list[int]]) -> int:
        """The longest of ``ids`` rounded up to :attr:`TEXT_PAD_MULTIPLE` tokens."""
        m = self.TEXT_PAD_MULTIPLE
        return -(-max(len(t) for t in ids) // m) * m

    def encode_group_key(self, g: Generation) -> int:
        """The request's own padded length (its longest text in tokens, capped, rounded up to
        :attr:`TEXT_PAD_MULTIPLE`): a call pads its texts to that of its longest, so only
        requests of one padded length share a call (and each gets what it would alone)."""
        return self._padded_length(
            self._token_ids(self.prompt_list(g), g.params.max_sequence_length)
        )

    @torch.no_grad()
    def encode_texts(
        self, prompts: list[str], max_sequence_length: int = 512
    ) -> list[torch.Tensor]:
        """Encode prompts as the reference does: chat template, tokens truncated to
        ``max_sequence_length``, ``hidden[-2]`` at the unmasked tokens.

        The texts are padded to the longest one rounded up to :attr:`TEXT_PAD_MULTIPLE` tokens,
        not to ``max_sequence_length`` as the reference does: the encoder is causal and only the
        unmasked tokens are kept, so the pad tokens after them change nothing but the cost (a
        20-token prompt ran 512 tokens through the encoder) and the rounding; the multiple lets
        requests of similar length share one call in a batch without changing either one's
        padding. The padding is done here, not by the tokenizer, which refuses a
        ``max_length`` that is not a multiple of ``pad_to_multiple_of``.
        """
        tokenizer = self.components["tokenizer"]
        ids = self._token_ids(prompts, max_sequence_length)
        length = self._padded_length(ids)
        pad_id = tokenizer.pad_token_id
        left = tokenizer.padding_side == "left"
        rows, masks = [], []
        for t in ids:
            pad = length - len(t)
            rows.append([pad_id] * pad + t if left else t + [pad_id] * pad)
            masks.append(
                [False] * pad + [True] * len(t) if left else [True] * len(t) + [False] * pad
            )
        ids_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        mask = torch.tensor(masks, dtype=torch.bool, device=self.device)
        hidden = self.components["text_encoder"](
            input_ids=ids_t, attention_mask=mask, output_hidden_states=True
        ).hidden_states[-2]
        return [hidden[i][mask[i]] for i in range(len(prompts))]

    def prepare_conditioning(self, g, cond):
        """The caption side of the DiT (embedding + context refiner) once per request:
        ``ctx_full`` for ``[pos x n, neg x n]`` (CFG) and ``ctx_pos`` for ``pos x n``."""
        n = g.num_outputs
        embeds = cond["embeds"]
        do_cfg = len(embeds) > 1
        pos, neg = [embeds[0]] * n, ([embeds[1]] * n if do_cfg else [])
        # one caption refiner call for every request of a batch
        ctx_full = self.batch_call(
            self.transformer,
            lambda t, cap_feats: t.encode_captions(cap_feats),
            dict(cap_feats=pos + neg),
            ("cap_feats",),
            g,
        )
        ctx_pos = ctx_full.select(list(range(n))) if do_cfg else ctx_full
        images = {k: v for k, v in cond.items() if k != "embeds"}  # encode_images' tensors
        return dict(
            images, do_cfg=do_cfg, ctx_full=ctx_full, ctx_pos=ctx_pos, text_dtype=embeds[0].dtype
        )

    # ------------------------------------------------------------------ latents / schedule
    def latent_shape(self, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
        s = self.vae_scale_factor * 2
        return (batch, self.transformer.cfg.in_channels, 2 * (height // s), 2 * (width // s))

    def prepare_latents(self, g, cond):
        from diffusers.utils.torch_utils import randn_tensor

        shape = self.latent_shape(g.num_outputs, g.params.height, g.params.width)
        if "image_mean" not in cond:
            return randn_tensor(
                shape, generator=g.generator, device=self.device, dtype=torch.float32
            )
        # image-to-image: the posterior sample first, then the noise, in the text dtype
        dtype = cond["text_dtype"]
        z = sample_posterior(cond["image_mean"], cond["image_std"], g.generator, self.device)
        vae_cfg = self.configs.get("vae", {})
        z = (z - (vae_cfg.get("shift_factor") or 0.0)) * vae_cfg.get("scaling_factor", 1.0)
        cond[IMAGE_LATENTS] = torch.cat([z.to(dtype)] * g.num_outputs, dim=0)
        cond[NOISE] = randn_tensor(shape, generator=g.generator, device=self.device, dtype=dtype)
        if "mask_latent" in cond:
            cond[INPAINT_MASK] = cond["mask_latent"].to(self.device, dtype)
        return cond[NOISE]

    def prepare_timesteps(self, g, latents):
        image_seq_len = (latents.shape[2] // 2) * (latents.shape[3] // 2)
        n = g.params.num_inference_steps
        return self.shifted_timesteps(image_seq_len, n, default_sigmas(n))

    # ------------------------------------------------------------------ input images
    @torch.no_grad()
    def encode_images(self, g):
        """The input image's VAE posterior (``image_mean``, ``image_std``, ``[1, C, h, w]``) at
        the request's size and, with a mask, the binarised mask on the latent grid
        (``mask_latent``, ``[1, 1, h, w]``, 1 = edit)."""
        p = g.params
        factor = self.vae_scale_factor * 2
        mean, std = encode_image_posterior(self.vae, p.image[0], p.height, p.width, factor)
        out = {"image_mean": mean.to(self.device), "image_std": std.to(self.device)}
        if p.mask_image is not None:
            hw = self.latent_shape(1, p.height, p.width)[2:]
            out["mask_latent"] = encode_inpaint_mask(p.mask_image, p.height, p.width, factor, hw)
        return out

    # ------------------------------------------------------------------ denoise
    def predict(self, denoiser, latents, t, step_index, cond, g):
        """The negated DiT output (flow velocity), with CFG ``pos + w (pos - neg)`` on steps
        whose ``(1000 - t) / 1000`` is within ``cfg_truncation``."""
        p = g.params
        n = g.num_outputs
        tt = (1000 - t.expand(latents.shape[0])) / 1000
        w = p.guidance_scale
        if cond["do_cfg"] and float((1000 - t.float()) / 1000) > p.cfg_truncation:
            w = 0.0
        lat = latents.to(denoiser.dtype).unsqueeze(2)
        if cond["do_cfg"] and w > 0:
            args = dict(x=lat.repeat(2, 1, 1, 1, 1), t=tt.repeat(2), cap=cond["ctx_full"])
            out = self.run_branches(denoiser, 2, args, ("x", "t", "cap"), g)
            pos = torch.stack(out[:n]).float()
            neg = torch.stack(out[n:]).float()
            pred = pos + w * (pos - neg)
            if p.cfg_normalization > 0:
                for j in range(n):
                    cap = torch.linalg.vector_norm(pos[j]) * float(p.cfg_normalization)
                    norm = torch.linalg.vector_norm(pred[j])
                    if norm > cap:
                        pred[j] = pred[j] * (cap / norm)
        else:
            args = dict(x=lat, t=tt, cap=cond["ctx_pos"])
            pred = torch.stack(self.run_branches(denoiser, 1, args, ("x", "t", "cap"), g)).float()
        return -pred.squeeze(2)

    # ------------------------------------------------------------------ decode
    def decode(self, latents, g) -> np.ndarray:
        shift = self.vae.config.shift_factor or 0.0
        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor + shift
        return latents_to_uint8(self.vae.decode(z, return_dict=False)[0])
