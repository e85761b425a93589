"""HunyuanVideo (1.0) text-to-video, and FastHunyuan (its consistency-distilled weights): the
stages.

Follows diffusers' ``HunyuanVideoPipeline.__call__`` (diffusers 0.42.1,
``pipelines/hunyuan_video/pipeline_hunyuan_video.py``) so that the same weights and seed give the
same frames:

* prompt, Llama (``text_encoder`` / ``tokenizer``): the prompt inside diffusers' video prompt
  template (``DEFAULT_PROMPT_TEMPLATE``), tokens padded to ``max_sequence_length + crop_start``
  (256 + 95) with the attention mask, the hidden state of layer ``-3`` (``hidden_states[-(2 + 1)]``:
  diffusers' ``num_hidden_layers_to_skip`` 2), then the template's first ``crop_start`` tokens cut
  from the states and the mask -> ``[P, max_sequence_length, D]`` and a mask ``[P, L]``;
* prompt, CLIP (``text_encoder_2`` / ``tokenizer_2``): tokens padded to 77, ``pooler_output``
  ``[P, D_pool]``;
* latents: ``randn_tensor`` fp32 ``[n, C, (F - 1) // t + 1, H / s, W / s]`` (``C`` the DiT's
  ``in_channels``, ``t`` / ``s`` the VAE's temporal / spatial compression);
* schedule: the directory's scheduler (``FlowMatchEulerDiscreteScheduler``; its ``shift`` from its
  config: 7 in HunyuanVideo's release) with diffusers' sigmas ``linspace(1, 0, n + 1)[:-1]``
  through diffusers' ``retrieve_timesteps``; the DiT sees ``t`` in ``[0, 1000]``;
* guidance: ``guidance_scale`` is the embedded guidance, given to the DiT as
  ``guidance_scale x 1000`` in the DiT's dtype (one forward per step); ``true_cfg_scale > 1`` with
  a negative prompt runs real CFG, ``neg + s (pos - neg)``, cond and uncond rows in ONE batched
  forward (the reference runs two);
* decode: ``latents / scaling_factor``, ``AutoencoderKLHunyuanVideo.decode``, diffusers'
  ``VideoProcessor.postprocess_video`` -> uint8 ``[n, F, H, W, 3]``.

FastHunyuan (``FastVideo/FastHunyuan-diffusers``) is the same pipeline on other DiT weights; its
model card asks for flow shift 17, 6 steps and embedded guidance 6. The shift is the scheduler
config's (``scheduler/scheduler_config.json`` ``shift``), never guessed from a repository name;
steps and guidance are request fields, whose per-model defaults a directory may set in its
``transformer/config.json`` ``_sglang_defaults`` (``docs/models.md``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from sglang.multimodal_gen.pipelines.base import Generation, StagedPipeline

__all__ = ["HIDDEN_STATE_INDEX", "HunyuanVideoPipeline"]

#: The Llama hidden state the DiT reads: ``hidden_states[-(num_hidden_layers_to_skip + 1)]``
#: with diffusers' ``num_hidden_layers_to_skip`` 2.
HIDDEN_STATE_INDEX = -3
#: Multiplier of the embedded guidance (diffusers: ``guidance_scale * 1000``).
GUIDANCE_MULTIPLIER = 1000.0
#: CLIP's token count (diffusers pads ``tokenizer_2`` to 77).
CLIP_MAX_LENGTH = 77


def _prompt_template() -> dict[str, Any]:
    """diffusers' HunyuanVideo prompt template: ``{"template": str with one "{}", "crop_start":
    95}`` (the model's input format; ``crop_start`` the template's tokens before the prompt)."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return DEFAULT_PROMPT_TEMPLATE


class HunyuanVideoPipeline(StagedPipeline):
    """HunyuanVideo on our DiT (``models/dits/hunyuan_video.py``) with the reference Llama / CLIP
    encoders, VAE and scheduler (see the module docstring for the stages)."""

    family_name = "hunyuan-video"
    text_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vae_cfg = self.configs.get("vae", {})
        self.temporal_factor = int(vae_cfg.get("temporal_compression_ratio") or 4)
        self.spec = replace(self.spec, frame_step=self.temporal_factor)

    def compute_vae_scale_factor(self) -> int:
        return int(self.configs.get("vae", {}).get("spatial_compression_ratio") or 8)

    def compute_spatial_factor(self) -> int:
        """VAE factor x the DiT's patch size (16 for HunyuanVideo, as diffusers checks)."""
        return self.vae_scale_factor * int(self.configs.get("transformer", {}).get("patch_size", 2))

    # ------------------------------------------------------------------ text
    def _llama(self, prompts: list[str], max_sequence_length: int):
        """``(embeds [P, L, D], mask [P, L] int64)``: layer :data:`HIDDEN_STATE_INDEX` of the
        templated prompts, the template's first ``crop_start`` tokens cut off."""
        tok, enc = self.components["tokenizer"], self.components["text_encoder"]
        template = _prompt_template()
        crop = int(template["crop_start"])
        inputs = tok(
            [template["template"].format(p) for p in prompts],
            max_length=max_sequence_length + crop,
            padding="max_length",
            truncation=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids, mask = inputs.input_ids.to(enc.device), inputs.attention_mask.to(enc.device)
        hidden = enc(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        embeds = hidden[HIDDEN_STATE_INDEX].to(dtype=enc.dtype, device=self.device)
        return embeds[:, crop:], mask[:, crop:].to(self.device)

    def _clip_pooled(self, prompts: list[str]) -> torch.Tensor:
        tok, enc = self.components["tokenizer_2"], self.components["text_encoder_2"]
        ids = tok(
            prompts,
            padding="max_length",
            max_length=CLIP_MAX_LENGTH,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        out = enc(ids.to(enc.device), output_hidden_states=False).pooler_output
        return out.to(dtype=enc.dtype, device=self.device)

    @staticmethod
    def _true_cfg(g: Generation) -> bool:
        return g.params.true_cfg_scale > 1 and g.params.negative_prompt is not None

    def prompt_list(self, g: Generation) -> list[str]:
        """The prompt, and the negative prompt when true CFG runs."""
        p = g.params
        return [p.prompt] + ([p.negative_prompt] if self._true_cfg(g) else [])

    @torch.no_grad()
    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``{"embeds": [P, L, D], "mask": [P, L], "pooled": [P, D_pool]}`` in the DiT's dtype
        (``L = max_sequence_length``; both encoders pad to fixed lengths, so prompts of several
        requests encode together exactly)."""
        dtype = self.transformer.dtype
        embeds, mask = self._llama(prompts, max_sequence_length)
        return {
            "embeds": embeds.to(dtype),
            "mask": mask.to(dtype),
            "pooled": self._clip_pooled(prompts).to(dtype),
        }

    def prepare_conditioning(self, g, cond):
        """Repeat each prompt's conditioning ``n`` times: rows ``[pos x n, neg x n]``."""
        n = g.num_outputs
        return {k: cond[k].repeat_interleave(n, dim=0) for k in ("embeds", "mask", "pooled")}

    # ------------------------------------------------------------------ latents / schedule
    def latent_frames(self, num_frames: int) -> int:
        """``(num_frames - 1) // t + 1``, as diffusers' ``prepare_latents``."""
        return (max(int(num_frames), 1) - 1) // self.temporal_factor + 1

    def prepare_latents(self, g, cond):
        from diffusers.utils.torch_utils import randn_tensor

        s, p = self.vae_scale_factor, g.params
        shape = (
            g.num_outputs,
            int(self.configs["transformer"].get("in_channels", 16)),
            self.latent_frames(p.num_frames),
            p.height // s,
            p.width // s,
        )
        return randn_tensor(shape, generator=g.generator, device=self.device, dtype=torch.float32)

    def prepare_timesteps(self, g, latents):
        """The directory's scheduler (its own ``shift``) at diffusers' sigmas
        ``linspace(1, 0, n + 1)[:-1]``."""
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import retrieve_timesteps

        n = g.params.num_inference_steps
        scheduler = self.new_scheduler()
        sigmas = np.linspace(1.0, 0.0, n + 1)[:-1]
        timesteps, _ = retrieve_timesteps(scheduler, n, self.device, sigmas=sigmas)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    # ------------------------------------------------------------------ denoise
    def predict(self, denoiser, latents, t, step_index, cond, g):
        """One DiT call with the embedded guidance (``guidance_scale x 1000``); under true CFG
        cond and uncond rows in one forward, combined as ``neg + s (pos - neg)``."""
        b = latents.shape[0]
        rows = cond["embeds"].shape[0] // b  # 2 under true CFG, else 1
        x = latents.to(denoiser.dtype)
        timestep = t.expand(b).to(latents.dtype)
        guidance = torch.tensor(
            [g.params.guidance_scale] * b, dtype=denoiser.dtype, device=self.device
        ) * GUIDANCE_MULTIPLIER  # fmt: skip
        if rows > 1:
            x = x.repeat(rows, 1, 1, 1, 1)
            timestep = timestep.repeat(rows)
            guidance = guidance.repeat(rows)
        args = dict(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=cond["embeds"],
            encoder_attention_mask=cond["mask"],
            pooled_projections=cond["pooled"],
            guidance=guidance,
        )
        out = self.run_branches(denoiser, rows, args, tuple(args), g)
        if rows == 1:
            return out
        pos, neg = out[:b], out[b:]
        return neg + g.params.true_cfg_scale * (pos - neg)

    # ------------------------------------------------------------------ decode
    def decode(self, latents, g) -> np.ndarray:
        from diffusers.video_processor import VideoProcessor

        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        video = self.vae.decode(z, return_dict=False)[0]
        frames = VideoProcessor(vae_scale_factor=self.vae_scale_factor).postprocess_video(
            video, output_type="np"
        )
        return (np.asarray(frames) * 255).round().astype("uint8")
