"""HunyuanVideo 1.5 text-to-video: the stages.

Follows diffusers' ``HunyuanVideo15Pipeline.__call__`` (diffusers 0.42.1,
``pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py``) so that the same weights and seed
give the same frames:

* prompt (Qwen2.5-VL): each text (an empty one as ``" "``) as the user message after the
  pipeline's system message, through the tokenizer's chat template with the generation prompt,
  padded to ``max_sequence_length + 108`` tokens; the encoder's third hidden state from the end
  (two layers skipped); the first 108 positions (the template's prefix) cropped off, features
  and mask alike -> ``[P, max_sequence_length, D]`` and its 0/1 mask;
* glyphs (ByT5): the quoted spans of the prompt (``"..."`` or ``“...”``; duplicates dropped
  when there are several) joined as ``Text "a". Text "b". ``, tokenized to 256 bytes, the T5
  encoder's ``last_hidden_state`` and mask; a prompt without quotes gets zeros and a zero mask;
* guidance: the directory's ``ClassifierFreeGuidance`` guider (its ``guidance_scale`` is the
  model's default weight; ``guidance_rescale``, ``use_original_formulation``, ``start``/``stop``,
  ``enabled`` are honoured): CFG runs at step ``i`` when it is enabled, ``int(start n) <= i <
  int(stop n)`` and the weight is not 1 (0 with the original formulation); the negative prompt
  (default ``""``) is encoded when guidance can run; cond and uncond rows in ONE batched forward
  (the reference runs two);
* latents: ``randn_tensor`` in the DiT dtype ``[n, C, (F - 1) / 4 + 1, H / 16, W / 16]`` (the
  VAE's factors); the DiT's input is ``[latents, C zero condition channels, a zero mask
  channel]`` and ``image_embeds`` zeros ``[n, 729, image_embed_dim]`` (text-to-video);
* schedule: the directory's ``FlowMatchEulerDiscreteScheduler`` with ``sigmas = linspace(1, 0,
  steps + 1)[:-1]`` (shifted by the scheduler config's ``shift``);
* decode: ``latents / scaling_factor``, ``AutoencoderKLHunyuanVideo15.decode``, the video
  processor's ``postprocess_video`` -> uint8 ``[n, F, H, W, 3]``.

Image to video (a directory with a SigLIP ``image_encoder``, diffusers'
``HunyuanVideo15ImageToVideoPipeline``, ``pipeline_hunyuan_video1_5_image2video.py``; the
request's ``image`` is required): the image is resized to the request's size by the video
processor's ``resize(..., resize_mode="crop")`` (diffusers takes the size bucket of the image's
aspect ratio instead of a size argument: the two agree when the request asks for that bucket);
its SigLIP features (the feature extractor's preprocessing, ``last_hidden_state``) replace the
zero ``image_embeds`` in both CFG branches; its VAE latents (posterior mode, ``x scaling_factor``)
are the condition channels of the first latent frame (zeros after it) and the mask channel is 1
there (0 after); a MeanFlow DiT (``use_meanflow``) also gets ``timestep_r``, the next step's
timestep (0 at the last step).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from sglang.multimodal_gen.pipelines.base import Generation, StagedPipeline

__all__ = ["HunyuanVideo15Pipeline", "glyph_text"]

#: diffusers' ``HunyuanVideo15Pipeline.system_message`` (the whitespace of its source included).
SYSTEM_MESSAGE = (
    "You are a helpful assistant. Describe the video by detailing the following aspects: \
        1. The main content and theme of the video. \
        2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects. \
        3. Actions, events, behaviors temporal relationships, physical movement changes of the objects. \
        4. background environment, light, style and atmosphere. \
        5. camera angles, movements, and transitions used in the video."
)
#: Template positions before the user's text that are cropped off (``prompt_template_encode_start_idx``).
CROP_START = 108
#: Hidden layers skipped from the end of the Qwen2.5-VL encoder.
SKIP_LAYERS = 2
#: ByT5 tokens of the glyph text (``tokenizer_2_max_length``).
GLYPH_LENGTH = 256
#: SigLIP tokens of an image (``vision_num_semantic_tokens``); zeros for text-to-video.
IMAGE_TOKENS = 729
#: The default aspect ratio (width : height) of the default size.
DEFAULT_ASPECT = (16, 9)

_QUOTED = re.compile(r"\"(.*?)\"|“(.*?)”")


def glyph_text(prompt: str) -> str | None:
    """The ByT5 text of ``prompt``: its quoted spans (ASCII ``"..."`` or ``“...”``) as
    ``Text "a". Text "b". `` (duplicates dropped when there are several), or ``None`` without
    quotes. Follows diffusers' ``extract_glyph_texts`` (``pipeline_hunyuan_video1_5.py``)."""
    spans = [a or b for a, b in _QUOTED.findall(prompt)]
    if len(spans) > 1:
        spans = list(dict.fromkeys(spans))
    if not spans:
        return None
    return ". ".join(f'Text "{s}"' for s in spans) + ". "


class HunyuanVideo15Pipeline(StagedPipeline):
    """HunyuanVideo 1.5 text-to-video on our DiT (``models/dits/hunyuan_video15.py``).

    Attributes:
        temporal_factor: the VAE's temporal compression (frames per latent frame after the
            first).
        guider_config: the directory's guider settings (``guidance_scale``,
            ``guidance_rescale``, ``use_original_formulation``, ``start``, ``stop``,
            ``enabled``).
    """

    family_name = "hunyuan-video-1.5"
    # the image encoder runs with the text encoders, on rank 0 only
    text_components = (
        "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "image_encoder",
        "feature_extractor",
    )  # fmt: skip

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # an image-to-video directory has the SigLIP image encoder (its config is read on
        # every rank; the encoder itself is loaded on rank 0)
        self.image_to_video = "image_encoder" in self.configs
        vae_cfg = self.configs.get("vae", {})
        self.temporal_factor = int(vae_cfg.get("temporal_compression_ratio") or 4)
        self.latent_channels = int(vae_cfg.get("latent_channels") or 32)
        guider = self.components.get("guider")
        self.guider_config = dict(getattr(guider, "config", None) or {})
        defaults = self.spec.defaults
        changes: dict[str, Any] = {}
        if "guidance_scale" in self.guider_config:
            changes["guidance_scale"] = float(self.guider_config["guidance_scale"])
        target = getattr(self.transformer.cfg, "target_size", None)
        if target:
            changes["height"], changes["width"] = self.default_size(int(target))
        inputs, required = self.spec.inputs, self.spec.required_inputs
        if self.image_to_video:  # every request gives the first frame
            inputs = (*inputs, "image") if "image" not in inputs else inputs
            required = (*required, "image") if "image" not in required else required
        self.spec = replace(
            self.spec, defaults=defaults.replace(**changes), frame_step=self.temporal_factor,
            inputs=inputs, required_inputs=required,
        )  # fmt: skip

    def compute_vae_scale_factor(self) -> int:
        return int(self.configs.get("vae", {}).get("spatial_compression_ratio") or 16)

    def compute_spatial_factor(self) -> int:
        return self.vae_scale_factor * int(self.transformer.cfg.patch_size)

    def default_size(self, target_size: int) -> tuple[int, int]:
        """``(height, width)`` of the 16:9 bucket of ``target_size`` (diffusers'
        ``HunyuanVideo15ImageProcessor.calculate_default_height_width`` with the VAE factor)."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import (
            HunyuanVideo15ImageProcessor,
        )

        proc = HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae_scale_factor)
        w, h = DEFAULT_ASPECT
        height, width = proc.calculate_default_height_width(h, w, target_size)
        return int(height), int(width)

    # ------------------------------------------------------------------ guidance
    def cfg_at(self, g: Generation, step_index: int | None) -> bool:
        """Whether classifier-free guidance runs at ``step_index`` (``None``: at any step, i.e.
        whether the negative prompt is needed), as the guider decides it."""
        c = self.guider_config
        if not c.get("enabled", True):
            return False
        w = float(g.params.guidance_scale)
        if math.isclose(w, 0.0 if c.get("use_original_formulation", False) else 1.0):
            return False
        if step_index is None:
            return True
        n = int(g.params.num_inference_steps)
        lo, hi = int(c.get("start", 0.0) * n), int(c.get("stop", 1.0) * n)
        return lo <= step_index < hi

    def guide(self, g: Generation, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """The guider's combination of the conditional and unconditional predictions:
        ``neg + w (pos - neg)`` (``pos + w (pos - neg)`` with the original formulation), then
        diffusers' ``rescale_noise_cfg`` when ``guidance_rescale > 0``."""
        c = self.guider_config
        w = float(g.params.guidance_scale)
        base = pos if c.get("use_original_formulation", False) else neg
        pred = base + w * (pos - neg)
        rescale = float(c.get("guidance_rescale", 0.0) or 0.0)
        if rescale > 0.0:
            from diffusers.guiders.guider_utils import rescale_noise_cfg

            pred = rescale_noise_cfg(pred, pos, rescale)
        return pred

    # ------------------------------------------------------------------ text
    def prompt_list(self, g: Generation) -> list[str]:
        """The prompt, and the negative prompt (empty when not given) when guidance can run."""
        p = g.params
        neg = p.negative_prompt if p.negative_prompt is not None else ""
        return [p.prompt] + ([neg] if self.cfg_at(g, None) else [])

    def _qwen(self, prompts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        tok, enc = self.components["tokenizer"], self.components["text_encoder"]
        chats = [
            [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": p or " "}]
            for p in prompts
        ]
        inputs = tok.apply_chat_template(
            chats, add_generation_prompt=True, tokenize=True, return_dict=True,
            padding="max_length", max_length=max_len + CROP_START, truncation=True,
            return_tensors="pt",
        )  # fmt: skip
        ids = inputs["input_ids"].to(enc.device)
        mask = inputs["attention_mask"].to(enc.device)
        out = enc(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = out.hidden_states[-(SKIP_LAYERS + 1)]
        return hidden[:, CROP_START:], mask[:, CROP_START:]

    def _byt5(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tok, enc = self.components["tokenizer_2"], self.components["text_encoder_2"]
        embeds, masks = [], []
        for prompt in prompts:
            text = glyph_text(prompt)
            if text is None:
                embeds.append(
                    torch.zeros(1, GLYPH_LENGTH, enc.config.d_model, dtype=enc.dtype,
                                device=enc.device)
                )  # fmt: skip
                masks.append(torch.zeros(1, GLYPH_LENGTH, dtype=torch.int64, device=enc.device))
                continue
            t = tok(
                text, padding="max_length", max_length=GLYPH_LENGTH, truncation=True,
                add_special_tokens=True, return_tensors="pt",
            ).to(enc.device)  # fmt: skip
            embeds.append(enc(input_ids=t.input_ids, attention_mask=t.attention_mask.float())[0])
            masks.append(t.attention_mask)
        return torch.cat(embeds), torch.cat(masks)

    @torch.no_grad()
    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``embeds`` ``[P, max_sequence_length, D1]`` and ``mask`` (Qwen2.5-VL), ``embeds_2``
        ``[P, 256, D2]`` and ``mask_2`` (ByT5), all in the DiT dtype (masks 0/1, as diffusers
        passes them)."""
        dtype = self.transformer.dtype
        embeds, mask = self._qwen(prompts, max_sequence_length)
        embeds_2, mask_2 = self._byt5(prompts)
        out = dict(embeds=embeds, mask=mask, embeds_2=embeds_2, mask_2=mask_2)
        return {k: v.to(self.device, dtype) for k, v in out.items()}

    # ------------------------------------------------------------------ input image
    @torch.no_grad()
    def encode_images(self, g):
        """``image_embeds`` ``[1, N, D]`` (SigLIP ``last_hidden_state``, DiT dtype) and
        ``image_latents`` ``[1, C, 1, H / s, W / s]`` (VAE posterior mode x ``scaling_factor``,
        fp32) of the request's image, resized and cropped to the request's size."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import (
            HunyuanVideo15ImageProcessor,
        )

        p = g.params
        proc = HunyuanVideo15ImageProcessor(
            vae_scale_factor=self.vae_scale_factor, do_resize=False, do_convert_rgb=True
        )
        image = proc.resize(p.image[0].to_pil(), height=p.height, width=p.width,
                            resize_mode="crop")  # fmt: skip
        enc, fe = self.components["image_encoder"], self.components["feature_extractor"]
        pixels = fe.preprocess(images=image, do_resize=True, return_tensors="pt",
                               do_convert_rgb=True)  # fmt: skip
        dtype = next(enc.parameters()).dtype
        pixels = pixels.to(device=enc.device, dtype=dtype)
        embeds = enc(**pixels).last_hidden_state
        video = proc.preprocess(image, height=p.height, width=p.width)
        video = video.to(self.vae.device, self.vae.dtype).unsqueeze(2)  # [1, 3, 1, H, W]
        z = self.vae.encode(video).latent_dist.mode() * self.vae.config.scaling_factor
        return {
            "image_embeds": embeds.to(self.device, self.transformer.dtype),
            "image_latents": z.to(self.device, torch.float32),
        }

    def prepare_conditioning(self, g, cond):
        """Rows ``[pos x n, neg x n]`` of every text tensor; with an input image, its SigLIP
        features for the ``n`` videos and ``image_condition`` ``[n, C + 1, f, h, w]`` (the
        image's latents on the first latent frame, zeros after; then the mask channel, 1 on the
        first latent frame), in the DiT dtype."""
        n = g.num_outputs
        image_embeds = cond.pop("image_embeds", None)
        z = cond.pop("image_latents", None)
        out = {k: v.repeat_interleave(n, dim=0) for k, v in cond.items()}
        if z is None:
            return out
        f = self.latent_frames(g.params.num_frames)
        latents = torch.zeros(n, z.shape[1], f, *z.shape[3:], device=self.device)
        latents[:, :, :1] = z.to(self.device)
        mask = torch.zeros(n, 1, f, *z.shape[3:], device=self.device)
        mask[:, :, 0] = 1.0
        dtype = self.transformer.dtype
        out["image_condition"] = torch.cat([latents, mask], dim=1).to(dtype)
        out["image_embeds"] = image_embeds.to(self.device, dtype).repeat(n, 1, 1)
        return out

    # ------------------------------------------------------------------ latents / schedule
    def latent_frames(self, num_frames: int) -> int:
        """``(num_frames - 1) // t + 1`` (diffusers' ``prepare_latents``)."""
        return (max(int(num_frames), 1) - 1) // self.temporal_factor + 1

    def prepare_latents(self, g, cond):
        from diffusers.utils.torch_utils import randn_tensor

        s = self.vae_scale_factor
        p = g.params
        shape = (
            g.num_outputs,
            self.latent_channels,
            self.latent_frames(p.num_frames),
            p.height // s,
            p.width // s,
        )
        return randn_tensor(
            shape, generator=g.generator, device=self.device, dtype=self.transformer.dtype
        )

    def prepare_timesteps(self, g, latents):
        n = g.params.num_inference_steps
        scheduler = self.new_scheduler()
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, n + 1)[:-1], device=self.device)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    def _timesteps(self, g) -> torch.Tensor:
        """The request's timesteps (a fresh scheduler's; MeanFlow's ``timestep_r`` reads the
        next one)."""
        return self.prepare_timesteps(g, None)[1]

    # ------------------------------------------------------------------ denoise
    def model_input(self, latents: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        """``[n, 2 C + 1, f, h, w]``: the latents, the condition latents and the mask channel
        (zeros for text-to-video; the image's ``image_condition``), in the DiT dtype."""
        dtype = self.transformer.dtype
        if "image_condition" in cond:
            return torch.cat([latents.to(dtype), cond["image_condition"]], dim=1)
        b, c, f, h, w = latents.shape
        zeros = latents.new_zeros(b, c + 1, f, h, w)
        return torch.cat([latents, zeros], dim=1).to(dtype)

    def predict(self, denoiser, latents, t, step_index, cond, g):
        b = latents.shape[0]
        rows = 2 if self.cfg_at(g, step_index) else 1
        x = self.model_input(latents, cond).to(denoiser.dtype)
        timestep = t.expand(b).to(x.dtype)
        cfg = denoiser.cfg
        image_embeds = cond.get("image_embeds")
        if image_embeds is None:  # text to video: zero features
            image_embeds = torch.zeros(
                b, IMAGE_TOKENS, cfg.image_embed_dim, dtype=denoiser.dtype, device=self.device
            )
        args = dict(
            hidden_states=x.repeat(rows, 1, 1, 1, 1),
            timestep=timestep.repeat(rows),
            encoder_hidden_states=cond["embeds"][: rows * b],
            encoder_attention_mask=cond["mask"][: rows * b],
            encoder_hidden_states_2=cond["embeds_2"][: rows * b],
            encoder_attention_mask_2=cond["mask_2"][: rows * b],
            image_embeds=image_embeds.repeat(rows, 1, 1),
        )
        if self.image_to_video and cfg.use_meanflow:  # the next step's timestep (0 at the end)
            timesteps = self._timesteps(g)
            r = timesteps[step_index + 1] if step_index + 1 < len(timesteps) else t * 0
            args["timestep_r"] = r.reshape(()).expand(b).to(x.dtype).repeat(rows)
        out = self.run_branches(denoiser, rows, args, tuple(args), g)
        if rows == 1:
            return out
        return self.guide(g, out[:b], out[b:])

    # ------------------------------------------------------------------ decode
    def decode(self, latents, g) -> np.ndarray:
        from diffusers.pipelines.hunyuan_video1_5.image_processor import (
            HunyuanVideo15ImageProcessor,
        )

        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        video = self.vae.decode(z, return_dict=False)[0]
        proc = HunyuanVideo15ImageProcessor(vae_scale_factor=self.vae_scale_factor)
        frames = proc.postprocess_video(video, output_type="np")
        return (np.asarray(frames) * 255).round().astype("uint8")
