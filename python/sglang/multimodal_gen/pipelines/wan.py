"""Wan2.x text-to-video: the stages, for one expert (Wan2.1, Wan2.2 TI2V-5B) or two (Wan2.2 A14B).

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
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from sglang.multimodal_gen.pipelines.base import Generation, StagedPipeline

__all__ = ["WanPipeline"]


class WanPipeline(StagedPipeline):
    """Wan2.x video generation on our DiT (``models/dits/wan.py``)."""

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
            self.spec, defaults=defaults, limits=limits, frame_step=self.temporal_factor
        )

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
        """Rows ``[pos x n, neg x n]``."""
        return dict(cond, embeds=cond["embeds"].repeat_interleave(g.num_outputs, dim=0))

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
            self.transformer.cfg.in_channels,
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
        x = latents.to(denoiser.dtype)
        if self.expand_timesteps:
            p = denoiser.cfg.patch_size
            tokens = (x.shape[2] // p[0]) * (x.shape[3] // p[1]) * (x.shape[4] // p[2])
            ones = torch.ones(tokens, dtype=torch.float32, device=self.device)
            timestep = (ones * t).unsqueeze(0).expand(b, -1)
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
