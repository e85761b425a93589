"""LTX-2 / LTX-2.3 text- and image-to-video with sound: the stages.

Follows diffusers' ``LTX2Pipeline.__call__`` (diffusers 0.42.1, ``pipelines/ltx2/pipeline_ltx2.py``)
so that the same weights and seed give the same frames and waveform:

* prompt: Gemma 3 (``text_encoder``) on the stripped prompt, left-padded to
  ``max_sequence_length`` with its attention mask; every hidden state (embeddings and each layer)
  stacked on the last axis and flattened, ``[P, L, D x (layers + 1)]``; then
  ``LTX2TextConnectors`` -> video and audio caption features and the connectors' mask. With
  classifier-free guidance the negative prompt (default ``""``) is encoded the same way. Rank 0
  runs both and broadcasts the result;
* the joint state: the base loop carries one tensor per video; here a row is the packed video
  latents ``[F h w, C]`` (patch size 1) and the packed audio latents ``[L, C_a M]`` flattened and
  concatenated, ``[n, F h w C + L C_a M]`` fp32. Both streams share one set of sigmas in
  diffusers (its audio scheduler is a copy of the video one), so one Euler step on the joint row
  is the reference's two steps;
* noise: ``randn_tensor`` video ``[n, C, (F - 1) / t + 1, H / s, W / s]`` then audio
  ``[n, C_a, L, M / 4]`` from the request's generator, in that order; ``L =
  round(F / fps x sample_rate / hop / 4)``;
* schedule: ``sigmas = linspace(1, 1 / N, N)``, ``mu = calculate_shift(video tokens, base 1024,
  max 4096, base shift 0.95, max shift 2.05)`` (the scheduler config's values where it has
  them), ``retrieve_timesteps`` of diffusers' LTX-2 module;
* guidance, in data (x0) space, ``x0 = x - sigma v`` (:meth:`LTX2Pipeline.predict`): the
  conditional prediction plus ``(g - 1)(cond - uncond)`` (CFG, cond and uncond rows in one DiT
  call), ``s (cond - stg)`` (STG: a pass with the self-attention of the STG blocks skipped) and
  ``(m - 1)(cond - isolated)`` (modality isolation: a pass without the audio-video
  cross-attention), each with its video and audio weight; then the guidance rescale toward the
  conditional prediction's standard deviation, per stream; then back to a velocity. As in
  diffusers, an audio weight of 0 takes the video's;
* the DiT gets ``fps / motion_speed`` as its frame rate (positions), the timestep as ``sigma``
  too, ``use_cross_timestep``;
* decode: with a timestep-conditioned video VAE, ``decode_noise_scale`` of fresh noise (drawn
  after the loop, ``[n, C, f, h, w]``) is mixed into the video latents and the VAE decodes at
  ``decode_timestep``; ``latents x std + mean`` (the VAE's statistics); ``VideoProcessor`` ->
  uint8 frames. The audio latents are de-normalised with the audio VAE's statistics, decoded to
  a mel spectrogram and turned into a waveform by the vocoder, at the vocoder's
  ``output_sampling_rate``: the :class:`~sglang.multimodal_gen.outputs.Audio` track of each
  :class:`~sglang.multimodal_gen.outputs.Video`.

An input image (the request's ``image``) follows diffusers' ``LTX2ImageToVideoPipeline``
(``pipelines/ltx2/pipeline_ltx2_image2video.py``): :meth:`LTX2Pipeline.encode_images` (rank 0),
its latents in place of the first latent frame's noise, timestep 0 on those tokens in every DiT
pass, and the first frame put back after every step (diffusers steps only the later frames).

The DiT returns a ``(video, audio)`` tuple; :class:`LTX2JointDenoiser` wraps it so that the base
plumbing (``run_branches``, request batching, CFG parallelism, per-row LoRA) sees one tensor in
and one tensor out per row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from sglang.multimodal_gen.outputs import Audio, Video
from sglang.multimodal_gen.pipelines.base import Generation, StagedPipeline

__all__ = ["LTX2Generation", "LTX2JointDenoiser", "LTX2Pipeline", "LTX2Shapes"]

_LTX2_MODULE = "diffusers.pipelines.ltx2.pipeline_ltx2"
#: Conditioning keys of an input image: its latents from rank 0, its first-frame tokens.
IMAGE_LATENTS = "ltx2_image_latents"
FIRST_FRAME = "ltx2_first_frame"


@dataclass(frozen=True)
class LTX2Shapes:
    """Latent geometry of one request.

    Attributes:
        frames, height, width: latent video grid (``f``, ``h``, ``w``).
        channels: video latent channels ``C`` (patch size 1: one token per latent pixel).
        audio_frames: latent audio length ``L``.
        audio_channels: packed audio token width ``C_a x M`` (channels x latent mel bins).
    """

    frames: int
    height: int
    width: int
    channels: int
    audio_frames: int
    audio_channels: int

    @property
    def video_tokens(self) -> int:
        return self.frames * self.height * self.width

    @property
    def video_numel(self) -> int:
        """Video values of one joint row (``f h w C``)."""
        return self.video_tokens * self.channels

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R, f h w C + L C_a M]`` -> packed video ``[R, f h w, C]``, audio ``[R, L, C_a M]``."""
        r = joint.shape[0]
        video = joint[:, : self.video_numel].reshape(r, self.video_tokens, self.channels)
        audio = joint[:, self.video_numel :].reshape(r, self.audio_frames, self.audio_channels)
        return video, audio

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """Packed video and audio ``[R, ...]`` -> one joint row each ``[R, numel]``."""
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


class LTX2JointDenoiser(torch.nn.Module):
    """The LTX-2 DiT as a one-tensor module: joint rows in, joint fp32 velocities out.

    Holds the DiT as its submodule ``dit`` (our ``LTX2Transformer``, or any module with the
    keywords of diffusers' ``LTX2VideoTransformer3DModel.forward`` returning ``(video, audio)``)
    and shares its LoRA context, so that the per-row adapters of a call reach the DiT's layers.

    Forward args:
        hidden_states: joint rows ``[R, f h w C + L C_a M]`` (see :class:`LTX2Shapes`).
        encoder_hidden_states, audio_encoder_hidden_states: caption features ``[R, T, D]``,
            ``[R, T, D_a]``.
        encoder_attention_mask: ``[R, T]`` (1 = token).
        timestep: ``[R]`` (``sigma x 1000``), or ``[R, f h w]`` per video token (image to video:
            0 on the first frame's tokens).
        audio_timestep: ``[R]`` (default ``timestep``); the DiT's ``sigma`` is the ``[R]`` one.
        shapes: the request's :class:`LTX2Shapes`; fps: the frame rate of the positions;
        isolate_modalities, spatio_temporal_guidance_blocks, use_cross_timestep: as the DiT.

    Returns:
        fp32 ``[R, f h w C + L C_a M]``: the video and audio velocity predictions.
    """

    def __init__(self, dit: torch.nn.Module):
        super().__init__()
        self.dit = dit

    @property
    def dtype(self) -> torch.dtype:
        return next(self.dit.parameters()).dtype

    def sync_lora_context(self) -> None:
        """Take the DiT's LoRA context (set when the LoRA manager wraps its layers)."""
        ctx = self.dit.__dict__.get("lora_context")
        if ctx is None:
            self.__dict__.pop("lora_context", None)
        else:
            self.__dict__["lora_context"] = ctx

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        timestep: torch.Tensor,
        audio_timestep: torch.Tensor | None = None,
        *,
        shapes: LTX2Shapes,
        fps: float,
        isolate_modalities: bool = False,
        spatio_temporal_guidance_blocks: tuple[int, ...] | None = None,
        use_cross_timestep: bool = True,
    ) -> torch.Tensor:
        video, audio = shapes.split(hidden_states)
        dtype = encoder_hidden_states.dtype
        out_video, out_audio = self.dit(
            hidden_states=video.to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=encoder_hidden_states,
            audio_encoder_hidden_states=audio_encoder_hidden_states,
            timestep=timestep,
            audio_timestep=audio_timestep,
            sigma=timestep if audio_timestep is None else audio_timestep,
            encoder_attention_mask=encoder_attention_mask,
            audio_encoder_attention_mask=encoder_attention_mask,
            num_frames=shapes.frames,
            height=shapes.height,
            width=shapes.width,
            fps=fps,
            audio_num_frames=shapes.audio_frames,
            video_coords=None,
            audio_coords=None,
            isolate_modalities=isolate_modalities,
            spatio_temporal_guidance_blocks=(
                list(spatio_temporal_guidance_blocks) if spatio_temporal_guidance_blocks else None
            ),
            perturbation_mask=None,
            use_cross_timestep=use_cross_timestep,
        )
        return LTX2Shapes.join(out_video.float(), out_audio.float())


@dataclass
class LTX2Generation(Generation):
    """One call of :class:`LTX2Pipeline`: :class:`Generation` plus what the later stages of the
    same call read (per call, never kept on the pipeline).

    Attributes:
        shapes: the latent geometry (set by ``prepare_latents``).
        sigmas: the schedule's sigmas, fp32 ``[N + 1]`` (set by ``prepare_timesteps``).
        audio_latents: the final packed audio latents ``[n, L, C_a M]`` fp32 (set after the last
            step; decoded by ``to_media``).
    """

    shapes: LTX2Shapes | None = None
    sigmas: torch.Tensor | None = None
    audio_latents: torch.Tensor | None = None


def _effective(audio_value: float, video_value: float) -> float:
    """diffusers' ``audio_x or x``: an audio weight of 0 takes the video's."""
    return audio_value or video_value


def _rescale(guided: torch.Tensor, cond: torch.Tensor, phi: float) -> torch.Tensor:
    """diffusers' ``rescale_noise_cfg``: ``guided`` scaled to ``cond``'s standard deviation (over
    every dim but the first), mixed by ``phi``."""
    dims = list(range(1, cond.ndim))
    rescaled = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return phi * rescaled + (1 - phi) * guided


class LTX2Pipeline(StagedPipeline):
    """LTX-2.x text-to-video with audio on our DiT (``models/dits/ltx2.py``); see the module
    docstring for the stages.

    Raises (at construction):
        ValueError: a DiT patch size other than 1 (the packing here is patch size 1, as every
            LTX-2 release).
    """

    family_name = "ltx2"
    # diffusers runs cond and uncond in one forward under one cache context ("cond_uncond"); its
    # STG and modality passes have their own, as the DiT's flag-named block sequences do here
    step_cache_joint_branches = True
    text_components = ("text_encoder", "tokenizer", "connectors")
    shifted_schedule = _LTX2_MODULE

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.transformer.cfg
        if getattr(cfg, "patch_size", 1) != 1 or getattr(cfg, "patch_size_t", 1) != 1:
            raise ValueError(
                f"LTX-2: patch_size={cfg.patch_size}, patch_size_t={cfg.patch_size_t}: only "
                "patch size 1 is implemented"
            )
        vae = self.configs.get("vae", {})
        self.temporal_factor = int(vae.get("temporal_compression_ratio") or _vae_temporal(vae))
        self.vae_timestep_conditioning = bool(vae.get("timestep_conditioning", False))
        audio = self.configs.get("audio_vae", {})
        self.audio_sample_rate = int(audio.get("sample_rate", 16000))
        self.audio_hop = int(audio.get("mel_hop_length", 160))
        self.audio_mel_bins = int(audio.get("mel_bins", 64))
        self.audio_latent_channels = int(audio.get("latent_channels", 8))
        self.audio_temporal_factor = 4  # LATENT_DOWNSAMPLE_FACTOR of AutoencoderKLLTX2Audio
        self.audio_mel_factor = 4  # its mel compression
        self.output_sample_rate = int(
            self.configs.get("vocoder", {}).get("output_sampling_rate", 24000)
        )
        self.num_layers = int(cfg.num_layers)
        self.joint = LTX2JointDenoiser(self.transformer)
        self.spec = replace(self.spec, frame_step=self.temporal_factor)

    def compute_vae_scale_factor(self) -> int:
        vae = self.configs.get("vae", {})
        return int(vae.get("spatial_compression_ratio") or _vae_spatial(vae))

    def compute_spatial_factor(self) -> int:
        # the VAE's factor (patch size 1): 32 for the LTX-2 VAE, as diffusers' size check
        return self.vae_scale_factor

    # ------------------------------------------------------------------ calls
    def new_generation(self, params, generator=None, lora=None, batch=None) -> LTX2Generation:
        g = super().new_generation(params, generator, lora, batch)
        return LTX2Generation(
            params=g.params, generator=g.generator, lora=g.lora, batch=g.batch, cache=g.cache
        )

    # ------------------------------------------------------------------ text
    @staticmethod
    def _do_cfg(g: Generation) -> bool:
        p = g.params
        return p.guidance_scale > 1.0 or _effective(p.audio_guidance_scale, p.guidance_scale) > 1.0

    def prompt_list(self, g: Generation) -> list[str]:
        """The prompt, and the negative prompt (empty when not given) with CFG."""
        p = g.params
        neg = p.negative_prompt if p.negative_prompt is not None else ""
        return [p.prompt] + ([neg] if self._do_cfg(g) else [])

    @torch.no_grad()
    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """``{"video": [P, T, D], "audio": [P, T, D_a], "mask": [P, T]}``: the connectors' caption
        features (DiT dtype) and mask (int64), ``T = max_sequence_length``."""
        tok, enc = self.components["tokenizer"], self.components["text_encoder"]
        connectors = self.components["connectors"]
        tok.padding_side = "left"  # Gemma is run left-padded, as diffusers does
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        inputs = tok(
            [p.strip() for p in prompts],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        ids = inputs.input_ids.to(enc.device)
        mask = inputs.attention_mask.to(enc.device)
        out = enc(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(enc.dtype)
        video, audio, cmask = connectors(hidden, mask, padding_side="left")
        dtype = self.transformer.dtype
        return {
            "video": video.to(self.device, dtype),
            "audio": audio.to(self.device, dtype),
            "mask": cmask.to(self.device),
        }

    def prepare_conditioning(self, g, cond):
        """Rows ``[pos x n, neg x n]`` (branch-major, as ``run_branches`` stacks them); with an
        input image, ``first_frame``: its latents as the first latent frame's tokens
        ``[n, h w, C]`` fp32."""
        n = g.num_outputs
        z = cond.pop(IMAGE_LATENTS, None)
        cond = {k: v.repeat_interleave(n, dim=0) for k, v in cond.items()}
        if z is not None:
            z = z.to(self.device, torch.float32)[:, :, 0]  # [1, C, h, w]
            cond[FIRST_FRAME] = z.permute(0, 2, 3, 1).flatten(1, 2).repeat(n, 1, 1)
        return cond

    # ------------------------------------------------------------------ input image
    @torch.no_grad()
    def encode_images(self, g):
        """``{IMAGE_LATENTS: [1, C, 1, h, w]}`` fp32: the request's image as diffusers'
        ``LTX2ImageToVideoPipeline`` conditions on it: re-compressed as one H.264 frame at the
        text encoder generation's CRF (33 for Gemma 3), resized (bilinear) by ``VideoProcessor``, encoded
        by the video VAE (its posterior's mode: nothing drawn) and normalised with the VAE's
        latent statistics."""
        from diffusers.pipelines.ltx2.utils import (
            apply_image_conditioning_crf,
            resolve_default_image_crf,
        )
        from diffusers.video_processor import VideoProcessor
        from PIL import Image

        p = g.params
        rgb = np.asarray(p.image[0].to_pil().convert("RGB"))
        crf = resolve_default_image_crf(self.components["text_encoder"])
        pil = Image.fromarray(apply_image_conditioning_crf(rgb, crf))
        proc = VideoProcessor(vae_scale_factor=self.vae_scale_factor, resample="bilinear")
        image = proc.preprocess(pil, height=p.height, width=p.width)
        vae = self.vae
        z = vae.encode(image.to(vae.device, vae.dtype).unsqueeze(2)).latent_dist.mode().float()
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return {IMAGE_LATENTS: (z - mean) / std}

    # ------------------------------------------------------------------ latents / schedule
    def shapes_of(self, g: Generation) -> LTX2Shapes:
        """The request's latent geometry (diffusers' frame and audio-length arithmetic)."""
        p = g.params
        s = self.vae_scale_factor
        seconds = p.num_frames / float(p.fps)
        per_second = self.audio_sample_rate / self.audio_hop / float(self.audio_temporal_factor)
        mel = self.audio_mel_bins // self.audio_mel_factor
        return LTX2Shapes(
            frames=(p.num_frames - 1) // self.temporal_factor + 1,
            height=p.height // s,
            width=p.width // s,
            channels=self.transformer.cfg.in_channels,
            audio_frames=round(seconds * per_second),
            audio_channels=self.audio_latent_channels * mel,
        )

    def prepare_latents(self, g, cond):
        """Joint rows ``[n, f h w C + L C_a M]`` fp32: video noise, then audio noise."""
        from diffusers.utils.torch_utils import randn_tensor

        sh = self.shapes_of(g)
        g.shapes = sh
        n = g.num_outputs
        video = randn_tensor(
            (n, sh.channels, sh.frames, sh.height, sh.width),
            generator=g.generator, device=self.device, dtype=torch.float32,
        )  # fmt: skip
        video = video.permute(0, 2, 3, 4, 1).reshape(n, sh.video_tokens, sh.channels)
        if FIRST_FRAME in cond:  # the image's latents replace the first frame's noise
            video = self._with_first_frame(video, cond)
        mel = self.audio_mel_bins // self.audio_mel_factor
        audio = randn_tensor(
            (n, self.audio_latent_channels, sh.audio_frames, mel),
            generator=g.generator, device=self.device, dtype=torch.float32,
        )  # fmt: skip
        audio = audio.transpose(1, 2).flatten(2, 3)  # [n, L, C_a M]
        return LTX2Shapes.join(video, audio)

    def prepare_timesteps(self, g, latents):
        """diffusers' LTX-2 schedule: ``linspace(1, 1/N, N)`` shifted by ``mu`` of the video
        token count."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

        n = g.params.num_inference_steps
        sc = self.scheduler_config
        mu = calculate_shift(
            g.shapes.video_tokens,
            sc.get("base_image_seq_len", 1024),
            sc.get("max_image_seq_len", 4096),
            sc.get("base_shift", 0.95),
            sc.get("max_shift", 2.05),
        )
        scheduler = self.new_scheduler()
        sigmas = np.linspace(1.0, 1 / n, n)
        timesteps, _ = retrieve_timesteps(scheduler, n, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        g.sigmas = scheduler.sigmas.to(torch.float32)
        return scheduler, timesteps

    @staticmethod
    def _with_first_frame(video: torch.Tensor, cond: dict[str, Any]) -> torch.Tensor:
        """Packed video ``[n, f h w, C]`` with the first latent frame's tokens the image's."""
        first = cond[FIRST_FRAME]
        return torch.cat([first.to(video.dtype), video[:, first.shape[1] :]], dim=1)

    # ------------------------------------------------------------------ denoise
    def _call(self, g, rows, x, t, cond, sel, **flags) -> torch.Tensor:
        """One DiT call on ``rows`` branches of the joint rows ``x`` (``sel`` picks the caption
        rows of ``cond``)."""
        p = g.params
        self.joint.sync_lora_context()
        r = x.shape[0] * rows
        args = dict(
            hidden_states=x.repeat(rows, 1) if rows > 1 else x,
            encoder_hidden_states=cond["video"][sel],
            audio_encoder_hidden_states=cond["audio"][sel],
            encoder_attention_mask=cond["mask"][sel],
            timestep=t.expand(r),
        )
        if FIRST_FRAME in cond:  # image to video: timestep 0 on the first frame's tokens
            per_token = torch.ones(g.shapes.video_tokens, device=x.device)
            per_token[: cond[FIRST_FRAME].shape[1]] = 0
            args.update(timestep=t * per_token.expand(r, -1), audio_timestep=t.expand(r))
        batched = tuple(args)
        args.update(
            shapes=g.shapes,
            fps=float(p.fps) / float(p.motion_speed),
            use_cross_timestep=bool(p.use_cross_timestep),
            **flags,
        )
        return self.run_branches(self.joint, rows, args, batched, g)

    def predict(self, denoiser, latents, t, step_index, cond, g):
        """The guided velocity of the joint rows (module docstring: CFG, STG, modality
        isolation and rescale, in x0 space, per stream)."""
        p = g.params
        b = latents.shape[0]
        sigma = g.sigmas[step_index].to(latents.device)
        cfg = self._do_cfg(g)
        stg_v, stg_a = p.stg_scale, _effective(p.audio_stg_scale, p.stg_scale)
        mod_v, mod_a = p.modality_scale, _effective(p.audio_modality_scale, p.modality_scale)
        do_stg = stg_v > 0 or stg_a > 0
        do_mod = mod_v > 1 or mod_a > 1
        sh = g.shapes

        def x0(v):  # velocity -> data prediction, per stream ([b, ...] each)
            return sh.split(latents - v * sigma)

        pos = slice(0, b)
        out = self._call(g, 2 if cfg else 1, latents, t, cond, slice(None))
        cond_v, cond_a = x0(out[:b])
        delta_v = torch.zeros_like(cond_v)
        delta_a = torch.zeros_like(cond_a)
        if cfg:
            unc_v, unc_a = x0(out[b:])
            delta_v = delta_v + (p.guidance_scale - 1) * (cond_v - unc_v)
            g_a = _effective(p.audio_guidance_scale, p.guidance_scale)
            delta_a = delta_a + (g_a - 1) * (cond_a - unc_a)
        # diffusers skips the blocks a DiT does not have (the 48-block default, 28, on a smaller
        # DiT): with none left the STG pass is the conditional one and adds nothing
        blocks = tuple(i for i in p.spatio_temporal_guidance_blocks if i < self.num_layers)
        if do_stg and blocks:
            o = self._call(g, 1, latents, t, cond, pos, spatio_temporal_guidance_blocks=blocks)
            s_v, s_a = x0(o)
            delta_v = delta_v + stg_v * (cond_v - s_v)
            delta_a = delta_a + stg_a * (cond_a - s_a)
        if do_mod:
            o = self._call(g, 1, latents, t, cond, pos, isolate_modalities=True)
            m_v, m_a = x0(o)
            delta_v = delta_v + (mod_v - 1) * (cond_v - m_v)
            delta_a = delta_a + (mod_a - 1) * (cond_a - m_a)
        guided_v, guided_a = cond_v + delta_v, cond_a + delta_a
        if p.guidance_rescale > 0:
            guided_v = _rescale(guided_v, cond_v, p.guidance_rescale)
        r_a = _effective(p.audio_guidance_rescale, p.guidance_rescale)
        if r_a > 0:
            guided_a = _rescale(guided_a, cond_a, r_a)
        return (latents - LTX2Shapes.join(guided_v, guided_a)) / sigma

    def after_step(self, g, cond, latents, step_index, timesteps, scheduler):
        """After every step, with an input image: the first latent frame is the image's again.
        After the last step: the audio latents are kept for :meth:`to_media`; with a
        timestep-conditioned video VAE, the decode noise (``decode_noise_scale``, drawn now from
        the request's generator, as diffusers draws it after the loop) enters the video part."""
        sh = g.shapes
        if FIRST_FRAME in cond:  # image to video: the first frame stays the image's
            video, audio = sh.split(latents)
            latents = LTX2Shapes.join(self._with_first_frame(video, cond), audio)
        if step_index != len(timesteps) - 1:
            return latents
        video, audio = sh.split(latents)
        g.audio_latents = audio.clone()
        if not self.vae_timestep_conditioning:
            return latents
        from diffusers.utils.torch_utils import randn_tensor

        n = latents.shape[0]
        shape = (n, sh.channels, sh.frames, sh.height, sh.width)
        noise = randn_tensor(shape, generator=g.generator, device=latents.device,
                             dtype=latents.dtype)  # fmt: skip
        noise = noise.permute(0, 2, 3, 4, 1).reshape(n, sh.video_tokens, sh.channels)
        p = g.params
        s = p.decode_noise_scale if p.decode_noise_scale is not None else p.decode_timestep
        return LTX2Shapes.join((1 - s) * video + s * noise, audio)

    # ------------------------------------------------------------------ decode
    def decode(self, latents, g) -> np.ndarray:
        """Joint rows -> uint8 frames ``[n, F, H, W, 3]`` (the video part; the audio is decoded
        by :meth:`to_media`)."""
        from diffusers.video_processor import VideoProcessor

        sh = g.shapes
        n = latents.shape[0]
        video, _ = sh.split(latents)
        z = video.reshape(n, sh.frames, sh.height, sh.width, sh.channels).permute(0, 4, 1, 2, 3)
        vae = self.vae
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        z = z * std / vae.config.scaling_factor + mean
        timestep = None
        if self.vae_timestep_conditioning:
            timestep = torch.full((n,), float(g.params.decode_timestep), device=z.device)
        frames = vae.decode(z.to(vae.dtype), timestep.to(vae.dtype) if timestep is not None
                            else None, return_dict=False)[0]  # fmt: skip
        frames = VideoProcessor(vae_scale_factor=self.vae_scale_factor).postprocess_video(
            frames, output_type="np"
        )
        return (np.asarray(frames) * 255).round().astype("uint8")

    def decode_audio(self, audio_latents: torch.Tensor) -> torch.Tensor:
        """Packed audio latents ``[n, L, C_a M]`` -> waveforms fp32 ``[n, channels, samples]`` at
        :attr:`output_sample_rate` (de-normalise, audio VAE -> mel, vocoder)."""
        avae, vocoder = self.components["audio_vae"], self.components["vocoder"]
        z = audio_latents.to(avae.latents_mean.device)
        z = z * avae.latents_std.to(z.dtype) + avae.latents_mean.to(z.dtype)
        mel = self.audio_mel_bins // self.audio_mel_factor
        z = z.unflatten(2, (-1, mel)).transpose(1, 2)  # [n, C_a, L, M]
        spec = avae.decode(z.to(avae.dtype), return_dict=False)[0]
        return vocoder(spec.to(next(vocoder.parameters()).dtype)).float()

    def to_media(self, pixels, g) -> list[Video]:
        """Each video with its sound track (:meth:`decode_audio`; one call for a batch)."""
        waves = self.batch_call(
            self.components["audio_vae"],
            lambda _m, latents: [w for w in self.decode_audio(latents)],
            dict(latents=g.audio_latents),
            ("latents",),
            g,
        )
        fps = int(g.params.fps)
        return [
            Video(frames=v, fps=fps, audio=Audio(w.cpu().numpy(), self.output_sample_rate))
            for v, w in zip(pixels, waves)
        ]


def _vae_spatial(cfg: dict) -> int:
    """diffusers' ``AutoencoderKLLTX2Video.spatial_compression_ratio`` from its config."""
    scaling = cfg.get("spatio_temporal_scaling", (True, True, True, True))
    return int(cfg.get("patch_size", 4)) * 2 ** sum(bool(x) for x in scaling)


def _vae_temporal(cfg: dict) -> int:
    """diffusers' ``AutoencoderKLLTX2Video.temporal_compression_ratio`` from its config."""
    scaling = cfg.get("spatio_temporal_scaling", (True, True, True, True))
    return int(cfg.get("patch_size_t", 1)) * 2 ** sum(bool(x) for x in scaling)
