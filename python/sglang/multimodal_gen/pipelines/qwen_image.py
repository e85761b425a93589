"""Qwen-Image text-to-image: the stages.

Follows diffusers' ``QwenImagePipeline.__call__`` (diffusers 0.42.1,
``pipelines/qwenimage/pipeline_qwenimage.py``) so that the same weights and seed give the same
image:

* prompt: the reference's chat template (a system message describing the image, the prompt as the
  user message, the assistant header), Qwen2.5-VL's last hidden state at the attention-masked
  tokens, the first 34 (template) tokens dropped, cut to ``--max-sequence-length``; each prompt
  is encoded on its own, as the reference does;
* true CFG (``--true-cfg-scale > 1`` with a negative prompt): ``neg + s (pos - neg)`` rescaled to
  the conditional prediction's norm per token; here positive and negative rows run in ONE batched
  DiT call, padded to a common text length with a key mask (the reference runs two);
* latents: ``randn_tensor`` ``[n, 1, C, 2 * (H // 16), 2 * (W // 16)]`` in the text dtype, packed
  into 2x2 patches; the schedule as Flux's (``calculate_shift`` + ``retrieve_timesteps``, the
  directory's exponential dynamic shift); the DiT sees ``t / 1000``;
* decode: unpack to 5-D ``[n, C, 1, h, w]``, ``latents * latents_std + latents_mean``,
  ``AutoencoderKLQwenImage``, the single frame, ``VaeImageProcessor``.

With an input image it is ``QwenImageImg2ImgPipeline`` (``pipeline_qwenimage_img2img.py``), and
with a mask ``QwenImageInpaintPipeline`` (``pipeline_qwenimage_inpaint.py``): the image through
``VaeImageProcessor`` at the request's size, given the VAE's frame axis ``[1, 3, 1, H, W]``; a
sample of its posterior drawn from the request's generator before the noise, normalised as
``(z - latents_mean) * (1 / latents_std)`` and packed like the noise; the same schedule and
``mu`` as text-to-image, of which the last ``strength`` runs from
``scale_noise(image latents, t0, noise)``; an inpainting mask (binarised, nearest-neighbour on the
latent grid, repeated over the channels and packed) keeps the unmasked region after every step,
re-noised to the next timestep (:mod:`.image_conditioning`). The reference's encoding of the
masked image (a posterior draw after the noise) is never used and is not made here.
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
from sglang.multimodal_gen.pipelines.latent_packing import pack_latents, unpack_latents

__all__ = ["QwenImagePipeline"]

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_TOKENS = 34  # tokens of the template before the prompt, dropped from the embeddings
TOKENIZER_MAX_LENGTH = 1024


def _pad_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[L_i, D]`` rows -> zero-padded ``[B, L, D]`` and a ``[B, L]`` mask (``None`` when every
    row has the same length, as the reference passes no mask then)."""
    n = max(r.shape[0] for r in rows)
    if all(r.shape[0] == n for r in rows):
        return torch.stack(rows), None
    out = rows[0].new_zeros(len(rows), n, rows[0].shape[1])
    mask = torch.zeros(len(rows), n, dtype=torch.long, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = 1
    return out, mask


class QwenImagePipeline(StagedPipeline):
    """Qwen-Image on our DiT (``models/dits/qwen_image.py``)."""

    family_name = "qwen-image"
    shifted_schedule = "diffusers.pipelines.qwenimage.pipeline_qwenimage"
    text_components = ("text_encoder", "tokenizer")

    def compute_vae_scale_factor(self) -> int:
        return 2 ** len(self.configs.get("vae", {}).get("temperal_downsample", [0, 0, 0]))

    # ------------------------------------------------------------------ text
    def _encode_one(self, prompt: str, max_sequence_length: int) -> torch.Tensor:
        tok, enc = self.components["tokenizer"], self.components["text_encoder"]
        ids = tok(
            [PROMPT_TEMPLATE.format(prompt)],
            max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_TOKENS,
            padding=True,
            truncation=True,
            return_tensors="pt",
        ).to(enc.device)
        hidden = enc(
            input_ids=ids.input_ids, attention_mask=ids.attention_mask, output_hidden_states=True
        ).hidden_states[-1]
        row = hidden[0][ids.attention_mask[0].bool()][TEMPLATE_TOKENS:]
        return row[:max_sequence_length].to(dtype=enc.dtype, device=self.device)

    @staticmethod
    def _true_cfg(g: Generation) -> bool:
        return g.params.true_cfg_scale > 1 and g.params.negative_prompt is not None

    def prompt_list(self, g: Generation) -> list[str]:
        """The prompt, and the negative prompt under true CFG."""
        p = g.params
        return [p.prompt] + ([p.negative_prompt] if self._true_cfg(g) else [])

    @torch.no_grad()
    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``{"rows": [L_i, D] per prompt}``: one prompt per encoder call, as the reference
        (its template drop and unpadded length make a padded batch differ)."""
        return {"rows": [self._encode_one(p, max_sequence_length) for p in prompts]}

    def prepare_conditioning(self, g, cond):
        """Rows ``[pos x n, neg x n]`` padded to one length, with the key mask when they differ."""
        rows = [r for r in cond["rows"] for _ in range(g.num_outputs)]
        embeds, mask = _pad_rows(rows)
        images = {k: v for k, v in cond.items() if k != "rows"}  # encode_images' tensors
        return dict(images, embeds=embeds, mask=mask)

    # ------------------------------------------------------------------ latents / schedule
    def _latent_hw(self, g: Generation) -> tuple[int, int]:
        s = self.vae_scale_factor * 2
        return 2 * (g.params.height // s), 2 * (g.params.width // s)

    def prepare_latents(self, g, cond):
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self._latent_hw(g)
        c = self.transformer.cfg.in_channels // 4
        dtype = cond["embeds"].dtype
        image_latents = None
        if "image_mean" in cond:  # the posterior sample comes first from the generator
            z = sample_posterior(cond["image_mean"], cond["image_std"], g.generator, self.device)
            vae_cfg = self.configs.get("vae", {})
            shape = (1, z.shape[1], 1, 1, 1)
            mean = torch.tensor(vae_cfg["latents_mean"]).view(shape).to(z.device, z.dtype)
            inv_std = 1.0 / torch.tensor(vae_cfg["latents_std"]).view(shape).to(z.device, z.dtype)
            z = ((z - mean) * inv_std)[:, :, 0]  # [1, z, h, w]: the single frame
            image_latents = torch.cat([z.to(dtype)] * g.num_outputs, dim=0)
        noise = randn_tensor(
            (g.num_outputs, 1, c, h, w), generator=g.generator, device=self.device, dtype=dtype
        )
        latents = pack_latents(noise[:, 0])
        if image_latents is not None:
            cond[IMAGE_LATENTS] = pack_latents(image_latents)
            cond[NOISE] = latents
            if "mask_latent" in cond:
                m = cond["mask_latent"].to(self.device, dtype)
                cond[INPAINT_MASK] = pack_latents(m.repeat(g.num_outputs, c, 1, 1))
        return latents

    def prepare_timesteps(self, g, latents):
        n = g.params.num_inference_steps
        return self.shifted_timesteps(latents.shape[1], n, np.linspace(1.0, 1 / n, n))

    # ------------------------------------------------------------------ input images
    @torch.no_grad()
    def encode_images(self, g):
        """The input image's VAE posterior (``image_mean``, ``image_std``, ``[1, z, 1, h, w]``)
        at the request's size and, with a mask, the binarised mask on the latent grid
        (``mask_latent``, ``[1, 1, h, w]``, 1 = edit)."""
        p = g.params
        factor = self.vae_scale_factor * 2
        channels = self.configs.get("vae", {}).get("z_dim", 16)
        mean, std = encode_image_posterior(
            self.vae, p.image[0], p.height, p.width, factor, channels, frame_axis=True
        )
        out = {"image_mean": mean.to(self.device), "image_std": std.to(self.device)}
        if p.mask_image is not None:
            out["mask_latent"] = encode_inpaint_mask(
                p.mask_image, p.height, p.width, factor, self._latent_hw(g)
            )
        return out

    # ------------------------------------------------------------------ denoise
    def predict(self, denoiser, latents, t, step_index, cond, g):
        b = latents.shape[0]
        rows = cond["embeds"].shape[0] // b  # 2 under true CFG
        h, w = self._latent_hw(g)
        timestep = t.expand(b * rows).to(latents.dtype)
        guidance = None
        if getattr(denoiser.cfg, "guidance_embeds", False):
            guidance = torch.full([b * rows], g.params.guidance_scale, device=self.device)
        x = latents.to(denoiser.dtype).repeat(rows, 1, 1)
        args = dict(
            hidden_states=x,
            encoder_hidden_states=cond["embeds"],
            encoder_hidden_states_mask=cond["mask"],
            timestep=timestep / 1000,
            img_shapes=[[(1, h // 2, w // 2)]] * (b * rows),
            guidance=guidance,
        )
        batched = tuple(k for k, v in args.items() if v is not None)
        out = self.run_branches(denoiser, rows, args, batched, g)
        if rows == 1:
            return out
        pos, neg = out[:b], out[b:]
        comb = neg + g.params.true_cfg_scale * (pos - neg)
        cond_norm = torch.norm(pos, dim=-1, keepdim=True)
        return comb * (cond_norm / torch.norm(comb, dim=-1, keepdim=True))

    # ------------------------------------------------------------------ decode
    def decode(self, latents, g) -> np.ndarray:
        cfg = self.vae.config
        h, w = self._latent_hw(g)
        z = unpack_latents(latents, h, w).unsqueeze(2).to(self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        z = z / inv_std.to(z.device, z.dtype) + mean
        return latents_to_uint8(self.vae.decode(z, return_dict=False)[0][:, :, 0])
