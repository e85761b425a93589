"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509, 2511): instruction-based image editing on the
Qwen-Image DiT, the stages.

Follows diffusers 0.42.1's ``QwenImageEditPipeline`` and ``QwenImageEditPlusPipeline``
(``pipelines/qwenimage/pipeline_qwenimage_edit.py``, ``..._edit_plus.py``) so that the same
weights, images and seed give the same image. The input image enters twice:

* as vision tokens of the prompt: the edit template (a system message asking to describe the
  input and apply the instruction) with ``<|vision_start|><|image_pad|><|vision_end|>`` before the
  instruction (Plus: ``"Picture N: "`` and that slot for each image), run through the directory's
  ``processor`` (a ``Qwen2VLProcessor``: it expands the image slot to one token per merged patch
  and makes ``pixel_values`` / ``image_grid_thw``) and Qwen2.5-VL with its vision tower; the last
  hidden state at the attention-masked tokens, the first 64 (template) tokens dropped; each prompt
  encoded on its own; the prompt is not cut to ``max_sequence_length``;
* as VAE latents: the image resized to about 1024 x 1024 pixels at its aspect ratio
  (``calculate_dimensions``, multiples of 32), ``VaeImageProcessor.preprocess``, the posterior's
  mode, ``(z - latents_mean) / latents_std``, packed into 2x2 patches and appended to the noisy
  latents along the sequence; the DiT's ``img_shapes`` lists the output first, then each image,
  so every image sits on its own RoPE frame index; only the output tokens of the prediction are
  kept.

Edit resizes its one image to that size for both paths (the vision encoder sees the ~1024^2
image); Plus gives the vision encoder a copy at about 384 x 384 and the VAE a copy at about
1024 x 1024 of each image. The output size defaults to ``calculate_dimensions(1024^2)`` of the
(last) image (:class:`~sglang.multimodal_gen.configs.qwen_image_edit.QwenImageEditSamplingParams`).
Noise, schedule (``mu`` from the output's token count only), true CFG with the norm rescale and
decoding are Qwen-Image's (:mod:`.qwen_image`).

A model directory may set the two pixel areas in ``model_index.json`` (``"sglang_image_areas":
{"vae": A, "condition": B}``; diffusers ignores the key): the tiny test models use small areas so
that a CPU test does not encode a 1024^2 image; real checkpoints have no such key.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.multimodal_gen.configs.qwen_image_edit import (
    CONDITION_IMAGE_AREA,
    VAE_IMAGE_AREA,
    calculate_dimensions,
)
from sglang.multimodal_gen.pipelines.base import Generation
from sglang.multimodal_gen.pipelines.latent_packing import pack_latents
from sglang.multimodal_gen.pipelines.qwen_image import QwenImagePipeline, _pad_rows

__all__ = ["QwenImageEditPipeline", "QwenImageEditPlusPipeline"]

SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should alter "
    "or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
)
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
EDIT_TEMPLATE = SYSTEM + "<|im_start|>user\n" + IMAGE_SLOT + "{}<|im_end|>\n<|im_start|>assistant\n"
PLUS_TEMPLATE = SYSTEM + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PICTURE = "Picture {}: " + IMAGE_SLOT
TEMPLATE_TOKENS = 64  # the reference's prompt_template_encode_start_idx
AREAS_KEY = "sglang_image_areas"


class QwenImageEditPipeline(QwenImagePipeline):
    """Qwen-Image-Edit (``QwenImageEditPipeline``): one input image."""

    family_name = "qwen-image-edit"
    text_components = ("text_encoder", "tokenizer", "processor")
    #: each image gets its own vision-encoder copy at CONDITION_IMAGE_AREA and "Picture N: "
    several_images = False

    # ------------------------------------------------------------------ images
    def image_areas(self) -> tuple[int, int]:
        """``(vae_area, condition_area)`` in pixels: 1024^2 and (Plus) 384^2 unless the model
        directory sets them (``sglang_image_areas``)."""
        own = self.pipeline_config.get(AREAS_KEY) or {}
        vae = int(own.get("vae", VAE_IMAGE_AREA))
        cond = int(own.get("condition", CONDITION_IMAGE_AREA if self.several_images else vae))
        return vae, cond

    def _image_processor(self):
        from diffusers.image_processor import VaeImageProcessor

        return VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def prompt_images(self, g: Generation) -> list:
        """The PIL images the vision encoder sees: each input image resized (Pillow, through
        ``VaeImageProcessor.resize``) to ``calculate_dimensions`` of the condition area."""
        proc, (_, area) = self._image_processor(), self.image_areas()
        out = []
        for image in g.params.image:
            pil = image.to_pil()
            w, h = calculate_dimensions(area, pil.width / pil.height)
            out.append(proc.resize(pil, h, w))
        return out

    def vae_inputs(self, g: Generation) -> list[torch.Tensor]:
        """``[1, 3, 1, H_i, W_i]`` in ``[-1, 1]`` per input image at ``calculate_dimensions`` of
        the VAE area (Edit: the resized image preprocessed again at that size, as the
        reference)."""
        proc, (area, _) = self._image_processor(), self.image_areas()
        out = []
        for image in g.params.image:
            pil = image.to_pil()
            w, h = calculate_dimensions(area, pil.width / pil.height)
            if not self.several_images:
                pil = proc.resize(pil, h, w)
            out.append(proc.preprocess(pil, h, w).unsqueeze(2))
        return out

    # ------------------------------------------------------------------ text + vision
    def encode_group_key(self, g: Generation) -> Any:
        """Every request is encoded alone: its prompt carries its own images."""
        return id(g)

    def _template(self, text: str, n_images: int) -> str:
        if self.several_images:
            return PLUS_TEMPLATE.format(
                "".join(PICTURE.format(i + 1) for i in range(n_images)) + text
            )
        return EDIT_TEMPLATE.format(text)

    def _encode_with_images(self, text: str, images: list) -> torch.Tensor:
        proc, enc = self.components["processor"], self.components["text_encoder"]
        inputs = proc(
            text=[self._template(text, len(images))],
            images=images if self.several_images else images[0],
            padding=True,
            return_tensors="pt",
        ).to(enc.device)
        hidden = enc(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            output_hidden_states=True,
        ).hidden_states[-1]
        row = hidden[0][inputs["attention_mask"][0].bool()][TEMPLATE_TOKENS:]
        return row.to(dtype=enc.dtype, device=self.device)

    @torch.no_grad()
    def encode_prompt(self, g: Generation) -> dict[str, Any]:
        """``{"rows": [L_i, D] per prompt}`` (prompt, and the negative prompt under true CFG),
        each with the request's images as vision tokens."""
        images = self.prompt_images(g)
        return {"rows": [self._encode_with_images(t, images) for t in self.prompt_list(g)]}

    def encode_prompt_list(self, prompts, max_sequence_length):
        raise TypeError("Qwen-Image edit prompts are encoded with their images (encode_prompt)")

    # ------------------------------------------------------------------ VAE
    @torch.no_grad()
    def encode_images(self, g: Generation) -> dict[str, Any]:
        """``image_latents``: per input image the normalised posterior mode ``[1, z, 1, h, w]``
        (``(mode - latents_mean) / latents_std``, no draw from the generator);
        ``image_shapes``: ``[k, 3]`` int64 ``(1, h / 2, w / 2)`` in packed tokens."""
        cfg = self.vae.config
        shape = (1, cfg.z_dim, 1, 1, 1)
        latents, shapes = [], []
        for x in self.vae_inputs(g):
            x = x.to(device=self.vae.device, dtype=self.vae.dtype)
            z = self.vae.encode(x).latent_dist.mode()
            mean = torch.tensor(cfg.latents_mean).view(shape).to(z.device, z.dtype)
            std = torch.tensor(cfg.latents_std).view(shape).to(z.device, z.dtype)
            z = (z - mean) / std
            latents.append(z.to(self.device))
            shapes.append([1, z.shape[-2] // 2, z.shape[-1] // 2])
        return {"image_latents": latents, "image_shapes": torch.tensor(shapes, dtype=torch.long)}

    def prepare_conditioning(self, g, cond):
        """Rows ``[pos x n, neg x n]`` padded to one length (key mask when they differ); the
        image latents packed and concatenated along the sequence (``image_tokens [n, S_c, 4z]``,
        in the text dtype as the reference) with their ``image_shapes``."""
        rows = [r for r in cond["rows"] for _ in range(g.num_outputs)]
        embeds, mask = _pad_rows(rows)
        tokens = torch.cat([pack_latents(z[:, :, 0]) for z in cond["image_latents"]], dim=1)
        tokens = tokens.to(self.device, embeds.dtype).repeat(g.num_outputs, 1, 1)
        shapes = [tuple(int(v) for v in s) for s in cond["image_shapes"].tolist()]
        return {"embeds": embeds, "mask": mask, "image_tokens": tokens, "image_shapes": shapes}

    def prepare_latents(self, g, cond):
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self._latent_hw(g)
        c = self.transformer.cfg.in_channels // 4
        noise = randn_tensor(
            (g.num_outputs, 1, c, h, w), generator=g.generator, device=self.device,
            dtype=cond["embeds"].dtype,
        )  # fmt: skip
        return pack_latents(noise[:, 0])

    def condition_latents(self, g, cond, latents, scheduler, timesteps):
        """Unchanged: the images condition every step (no re-noising, no ``strength``)."""
        return latents, timesteps

    def after_step(self, g, cond, latents, step_index, timesteps, scheduler):
        return latents

    # ------------------------------------------------------------------ denoise
    def predict(self, denoiser, latents, t, step_index, cond, g):
        """One DiT call on ``[noisy latents, image tokens]`` (both CFG branches batched); the
        output tokens of the prediction, combined under true CFG as ``neg + s (pos - neg)``
        rescaled to the conditional prediction's norm per token."""
        b, n_out = latents.shape[0], latents.shape[1]
        rows = cond["embeds"].shape[0] // b  # 2 under true CFG
        h, w = self._latent_hw(g)
        guidance = None
        if getattr(denoiser.cfg, "guidance_embeds", False):
            guidance = torch.full([b * rows], g.params.guidance_scale, device=self.device)
        x = torch.cat([latents, cond["image_tokens"]], dim=1).to(denoiser.dtype)
        x = x.repeat(rows, 1, 1)
        shapes = [(1, h // 2, w // 2), *cond["image_shapes"]]
        args = dict(
            hidden_states=x,
            encoder_hidden_states=cond["embeds"],
            encoder_hidden_states_mask=cond["mask"],
            timestep=t.expand(b * rows).to(latents.dtype) / 1000,
            img_shapes=[list(shapes)] * (b * rows),
            guidance=guidance,
        )
        batched = tuple(k for k, v in args.items() if v is not None)
        out = self.run_branches(denoiser, rows, args, batched, g)[:, :n_out]
        if rows == 1:
            return out
        pos, neg = out[:b], out[b:]
        comb = neg + g.params.true_cfg_scale * (pos - neg)
        cond_norm = torch.norm(pos, dim=-1, keepdim=True)
        return comb * (cond_norm / torch.norm(comb, dim=-1, keepdim=True))


class QwenImageEditPlusPipeline(QwenImageEditPipeline):
    """Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``: Qwen-Image-Edit-2509 / 2511): one or
    more input images, each named ``Picture N`` in the prompt; the output size follows the last."""

    family_name = "qwen-image-edit-plus"
    several_images = True
