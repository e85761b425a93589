"""Wan2.x text- and image-to-video: the stages, for one expert (Wan2.1, Wan2.2 TI2V-5B) or two
(Wan2.2 A14B).

Follows diffusers' ``WanPipeline.__call__`` (diffusers 0.42.1, ``pipelines/wan/pipeline_wan.py``)
so that the same weights and seed give the same frames:

* prompt: diffusers' ``prompt_clean``, UMT5 tokens padded to ``max_sequence_length`` (512) with
  the attention mask, ``last_hidden_state`` cut to each prompt's length and zero-padded back; CFG
  (``guidance_scale > 1``) encodes the negative prompt (default ``""``) the same way;
* latents: ``randn_tensor`` fp32 ``[n, C, (F - 1) / t + 1, H / s, W / s]`` (``t``, ``s`` the VAE's
  temporal and spatial factors); ``num_frames`` is rounded to ``t k + 1`` as diffusers does;
* schedule: the directory's scheduler (``UniPCMultistepScheduler`` with flow sigmas in Wan's
  releases) with ``set_timesteps(n)``;
* experts: with ``boundary_ratio`` in ``model_index.json`` (A14B), steps with
  ``t >= boundary_ratio * num_train_timesteps`` run ``transformer`` (high noise) with
  ``--guidance-scale``, later steps ``transformer_2`` (low noise) with ``--guidance-scale-2``
  (default: the same value);
* ``expand_timesteps`` (TI2V-5B): the DiT gets one timestep per latent patch token;
* CFG: ``uncond + g (cond - uncond)``, cond and uncond rows in ONE batched forward (the reference
  runs two);
* decode: ``latents * std + mean`` (the VAE config's ``latents_std`` / ``latents_mean``),
  ``AutoencoderKLWan.decode``, diffusers' ``VideoProcessor.postprocess_video`` -> uint8
  ``[n, F, H, W, 3]``.

An input image (the request's ``image``, the first frame) follows diffusers'
``WanImageToVideoPipeline.__call__`` (``pipelines/wan/pipeline_wan_i2v.py``). The image is resized
to the request's size by diffusers' ``VideoProcessor.preprocess`` and encoded by the VAE (its
posterior's mode, no draw from the generator), normalised as ``(z - mean) / std``; then

* I2V-A14B (the DiT's ``in_channels = 2 C + 4``): the VAE encodes the video ``[image, F - 1 black
  frames]``; every step the DiT gets ``[noise latents (C), frame mask (4), image video latents
  (C)]`` along channels, the mask 1 on the first latent frame and 0 elsewhere; the scheduler
  still steps the ``C`` noise channels only;
* TI2V-5B (``expand_timesteps``): the VAE encodes the image alone (one latent frame); the DiT's
  input has that latent frame in place of the first latent frame and its tokens get timestep 0
  (the others ``t``); the final latents get the image's latent frame back before decoding.

The image's latents are computed on rank 0 and broadcast with the prompt conditioning.

A directory whose ``model_index.json`` ``_class_name`` is ``WanDMDPipeline`` (FastVideo's
DMD-distilled FastWan2.1 / FastWan2.2-TI2V-5B) loads as :class:`WanDMDPipeline`: the same stages
with the DMD sampler (:mod:`~sglang.multimodal_gen.pipelines.dmd`: predict ``x0``, re-noise it
with fresh noise to the next of the fixed timesteps 1000, 757, 522; no CFG).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from sglang.multimodal_gen.models.families.wan import DMD_PIPELINE_CLASS, takes_image_condition
from sglang.multimodal_gen.models.model_dir import read_model_index
from sglang.multimodal_gen.pipelines.base import Generation, StagedPipeline
from sglang.multimodal_gen.pipelines.dmd import (
    DMDScheduler,
    dmd_request_spec,
    dmd_timesteps,
    refuse_guidance,
)

__all__ = ["WanDMDPipeline", "WanPipeline"]


class WanPipeline(StagedPipeline):
    """Wan2.x video generation on our DiT (``models/dits/wan.py``).

    Attributes:
        image_mode: how an input image enters: ``"concat"`` (I2V-A14B: channel concatenation,
            an image required), ``"first_frame"`` (``expand_timesteps``, TI2V-5B: the first
            latent frame, an image optional) or ``None`` (text only).
    """

    family_name = "wan"
    text_components = ("text_encoder", "tokenizer")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vae_cfg = self.configs.get("vae", {})
        self.temporal_factor = int(vae_cfg.get("scale_factor_temporal") or 4)
        self.boundary_ratio = self.pipeline_config.get("boundary_ratio")
        self.expand_timesteps = bool(self.pipeline_config.get("expand_timesteps", False))
        if self.boundary_ratio is not None and "transformer_2" not in self.denoisers:
            raise ValueError("model_index.json sets boundary_ratio but has no transformer_2")
        if takes_image_condition(self.transformer.cfg):
            self.image_mode = "concat"
        elif self.expand_timesteps:
            self.image_mode = "first_frame"
        else:
            self.image_mode = None
        inputs = self.spec.inputs
        if self.image_mode and "image" not in inputs:  # e.g. a narrower TI2V-like DiT
            inputs = (*inputs, "image")
        defaults = self.spec.defaults
        if self.boundary_ratio is None:  # one expert: no second guidance
            defaults = defaults.replace(guidance_scale_2=None)
        # what the rotary tables cover: rope_max_seq_len patches per axis
        cfg, limits = self.transformer.cfg, self.spec.limits
        side = cfg.rope_max_seq_len * self.spatial_factor
        frames = (cfg.rope_max_seq_len * cfg.patch_size[0] - 1) * self.temporal_factor + 1
        limits = replace(
            limits,
            max_image_size=min(limits.max_image_size or side, side),
            max_num_frames=min(limits.max_num_frames or frames, frames),
        )
        self.spec = replace(
            self.spec, defaults=defaults, limits=limits, frame_step=self.temporal_factor,
            inputs=inputs,
        )  # fmt: skip

    @classmethod
    def from_pretrained(cls, model_path: str, *args, **kwargs):
        """As :meth:`StagedPipeline.from_pretrained`; a ``WanDMDPipeline`` directory (its
        ``model_index.json`` ``_class_name``) loads as :class:`WanDMDPipeline`."""
        if cls is WanPipeline and read_model_index(model_path).pipeline_class == DMD_PIPELINE_CLASS:
            return WanDMDPipeline.from_pretrained(model_path, *args, **kwargs)
        return super().from_pretrained(model_path, *args, **kwargs)

    def compute_vae_scale_factor(self) -> int:
        return int(self.configs.get("vae", {}).get("scale_factor_spatial") or 8)

    def compute_spatial_factor(self) -> int:
        return self.vae_scale_factor * int(self.transformer.cfg.patch_size[1])

    # ------------------------------------------------------------------ text
    def _t5(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        tok, enc = self.components["tokenizer"], self.components["text_encoder"]
        inputs = tok(
            [prompt_clean(p) for p in prompts],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = inputs.input_ids, inputs.attention_mask
        lens = mask.gt(0).sum(dim=1).long()
        hidden = enc(ids.to(enc.device), mask.to(enc.device)).last_hidden_state
        hidden = hidden.to(dtype=enc.dtype, device=self.device)
        out = torch.zeros_like(hidden)
        for i, n in enumerate(lens.tolist()):
            out[i, :n] = hidden[i, :n]
        return out

    @staticmethod
    def _do_cfg(g: Generation) -> bool:
        return g.params.guidance_scale > 1.0

    def prompt_list(self, g: Generation) -> list[str]:
        """The prompt, and the negative prompt (empty when not given) with CFG."""
        p = g.params
        neg = p.negative_prompt if p.negative_prompt is not None else ""
        return [p.prompt] + ([neg] if self._do_cfg(g) else [])

    @torch.no_grad()
    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``{"embeds": [P, L, D]}`` in the DiT dtype (padded to ``max_sequence_length``)."""
        return {"embeds": self._t5(prompts, max_sequence_length).to(self.transformer.dtype)}

    def prepare_conditioning(self, g, cond):
        """Rows ``[pos x n, neg x n]``; with an input image, its condition for the ``n`` videos:
        ``image_condition`` ``[n, 4 + C, f, h, w]`` (frame mask, then the latents; I2V-A14B) or
        ``first_frame`` ``[n, C, 1, h, w]`` (TI2V-5B), fp32."""
        n = g.num_outputs
        cond = dict(cond, embeds=cond["embeds"].repeat_interleave(n, dim=0))
        z = cond.pop("image_latents", None)
        if z is None:
            return cond
        z = z.to(self.device, torch.float32).repeat(n, 1, 1, 1, 1)
        if self.image_mode == "concat":
            # diffusers' mask: 1 on each of the first latent frame's 4 frames, 0 after
            mask = torch.zeros(n, self.temporal_factor, *z.shape[2:], device=self.device)
            mask[:, :, 0] = 1
            cond["image_condition"] = torch.cat([mask, z], dim=1)
        else:
            cond["first_frame"] = z
        return cond

    # ------------------------------------------------------------------ latents / schedule
    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of ``num_frames`` frames. A resolved request already has the form
        ``t k + 1`` (``VideoSamplingParams.conform``); any other count is first rounded as
        diffusers' ``WanPipeline`` rounds it (``n // t * t + 1``), so a direct pipeline call agrees
        with diffusers too."""
        t = self.temporal_factor
        n = max(num_frames, 1)
        if n % t != 1:
            n = n // t * t + 1
        return (n - 1) // t + 1

    def prepare_latents(self, g, cond):
        from diffusers.utils.torch_utils import randn_tensor

        s = self.vae_scale_factor
        p = g.params
        shape = (
            g.num_outputs,
            self.transformer.cfg.out_channels,  # the VAE's channels (I2V: not the DiT's input)
            self.latent_frames(p.num_frames),
            p.height // s,
            p.width // s,
        )
        return randn_tensor(shape, generator=g.generator, device=self.device, dtype=torch.float32)

    def prepare_timesteps(self, g, latents):
        scheduler = self.new_scheduler()
        scheduler.set_timesteps(g.params.num_inference_steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler, scheduler.timesteps

    # ------------------------------------------------------------------ input image
    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, 1 / std)`` of the VAE config as ``[1, C, 1, 1, 1]`` tensors like ``like``."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        return mean.to(like.device, like.dtype), inv_std.to(like.device, like.dtype)

    @torch.no_grad()
    def encode_images(self, g):
        """``{"image_latents": [1, C, f, h, w]}`` fp32: the normalised VAE latents (posterior
        mode) of the request's image at its size, as the video ``[image, F - 1 black frames]``
        (I2V-A14B, ``f`` the request's latent frames) or the image alone (TI2V-5B, ``f = 1``)."""
        from diffusers.video_processor import VideoProcessor

        p = g.params
        proc = VideoProcessor(vae_scale_factor=self.vae_scale_factor)
        image = proc.preprocess(p.image[0].to_pil(), height=p.height, width=p.width)
        video = image.to(self.vae.device, torch.float32).unsqueeze(2)  # [1, 3, 1, H, W]
        if self.image_mode == "concat":
            frames = (self.latent_frames(p.num_frames) - 1) * self.temporal_factor + 1
            black = video.new_zeros(1, 3, frames - 1, p.height, p.width)
            video = torch.cat([video, black], dim=2)
        z = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode()
        z = z.to(self.device, torch.float32)
        mean, inv_std = self._latent_stats(z)
        return {"image_latents": (z - mean) * inv_std}

    @staticmethod
    def _first_frame_mask(latents: torch.Tensor) -> torch.Tensor:
        """``[1, 1, f, h, w]`` fp32: 0 on the first latent frame (the image's), 1 elsewhere."""
        mask = torch.ones(1, 1, *latents.shape[2:], device=latents.device)
        mask[:, :, 0] = 0
        return mask

    def _with_first_frame(self, latents: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        mask = self._first_frame_mask(latents)
        return (1 - mask) * cond["first_frame"] + mask * latents

    def after_step(self, g, cond, latents, step_index, timesteps, scheduler):
        """TI2V with an image: after the last step the first latent frame is the image's."""
        if "first_frame" in cond and step_index == len(timesteps) - 1:
            return self._with_first_frame(latents, cond)
        return latents

    # ------------------------------------------------------------------ denoise
    def _boundary(self) -> float | None:
        if self.boundary_ratio is None:
            return None
        return self.boundary_ratio * self.scheduler_config.get("num_train_timesteps", 1000)

    def _high_noise(self, t) -> bool:
        b = self._boundary()
        return b is None or bool(t >= b)

    def select_denoiser(self, step_index, t, g):
        """``transformer`` while ``t >= boundary`` (or always, for one expert), then
        ``transformer_2``."""
        return self.transformer if self._high_noise(t) else self.denoisers["transformer_2"]

    def predict(self, denoiser, latents, t, step_index, cond, g):
        b = latents.shape[0]
        w = g.params.guidance_scale
        if not self._high_noise(t) and g.params.guidance_scale_2 is not None:
            w = g.params.guidance_scale_2
        if "image_condition" in cond:
            x = torch.cat([latents, cond["image_condition"]], dim=1)
        elif "first_frame" in cond:
            x = self._with_first_frame(latents, cond)
        else:
            x = latents
        x = x.to(denoiser.dtype)
        if self.expand_timesteps:  # one timestep per patch token; 0 on the image's tokens
            p = denoiser.cfg.patch_size
            grid = (x.shape[2] // p[0], x.shape[3] // p[1], x.shape[4] // p[2])
            per_token = torch.ones(grid, dtype=torch.float32, device=self.device)
            if "first_frame" in cond:
                per_token[0] = 0
            timestep = (per_token * t).flatten().unsqueeze(0).expand(b, -1)
        else:
            timestep = t.expand(b)
        rows = cond["embeds"].shape[0] // b
        if rows > 1:
            x = x.repeat(rows, 1, 1, 1, 1)
            timestep = timestep.repeat(rows, *([1] * (timestep.dim() - 1)))
        args = dict(hidden_states=x, timestep=timestep, encoder_hidden_states=cond["embeds"])
        out = self.run_branches(denoiser, rows, args, tuple(args), g)
        if rows == 1:
            return out
        pos, neg = out[:b], out[b:]
        return neg + w * (pos - neg)

    # ------------------------------------------------------------------ decode
    def decode(self, latents, g) -> np.ndarray:
        from diffusers.video_processor import VideoProcessor

        cfg = self.vae.config
        z = latents.to(self.vae.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        z = z / inv_std.to(z.device, z.dtype) + mean
        video = self.vae.decode(z, return_dict=False)[0]
        frames = VideoProcessor(vae_scale_factor=self.vae_scale_factor).postprocess_video(
            video, output_type="np"
        )
        return (np.asarray(frames) * 255).round().astype("uint8")


class WanDMDPipeline(WanPipeline):
    """Wan with the DMD sampler (FastVideo's ``WanDMDPipeline``: FastWan2.1-T2V, FastWan2.2-TI2V-5B).

    The stages of :class:`WanPipeline` with :class:`~sglang.multimodal_gen.pipelines.dmd.
    DMDScheduler` as the scheduler: the timesteps of the directory (``model_index.json``
    ``dmd_denoising_steps``) or the published 1000, 757, 522; ``num_inference_steps`` defaults
    to their number (fewer run the first ones, more are refused); ``guidance_scale`` defaults
    to 1 and a value above 1 is refused (``param="guidance_scale"``); the other defaults are the
    variant's (TI2V-5B: 704x1280, 121 frames, 24 fps). With an input image (TI2V) the first
    latent frame is put back to the image's after every step, so what a re-noise writes there
    never reaches the DiT or the output (its tokens get timestep 0 as in :class:`WanPipeline`);
    the noise is drawn for the whole latent all the same, so a request's noise does not depend
    on whether it gives an image.

    Raises:
        ModelLoadError: a malformed ``dmd_denoising_steps``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dmd_timesteps = dmd_timesteps(self.pipeline_config)
        self.spec = dmd_request_spec(self.spec, len(self.dmd_timesteps))

    def new_generation(self, params, generator=None, lora=None, batch=None):
        g = super().new_generation(params, generator, lora, batch)
        refuse_guidance(g.params)
        return g

    def prepare_timesteps(self, g, latents):
        sched = DMDScheduler.for_request(
            self.dmd_timesteps, g.params.num_inference_steps, g.generator, self.device
        )
        return sched, sched.timesteps

    def after_step(self, g, cond, latents, step_index, timesteps, scheduler):
        """With an input image (TI2V): the image's latent frame back after every step."""
        if "first_frame" in cond:
            return self._with_first_frame(latents, cond)
        return latents
