"""LTX-2's two-stage generation: stage 1 at half the requested height and width, the latent
upsampler (x2), stage 2 over the fixed distilled sigmas at the requested size.

The composition is the one diffusers documents for LTX-2 (diffusers 0.42.1,
docs/source/en/api/pipelines/ltx2.md, "Two-stages Generation"):

1. ``LTX2Pipeline(height / 2, width / 2, output_type="latent")`` -> raw video latents
   ``[n, C, F, h, w]`` and audio latents (no decode noise: that belongs to decoding);
2. ``LTX2LatentUpsamplePipeline(latents=..., output_type="latent")`` -> ``[n, C, F, 2h, 2w]``
   (:mod:`~sglang.multimodal_gen.pipelines.ltx2_upsample`);
3. ``LTX2Pipeline(latents=..., audio_latents=..., sigmas=STAGE_2_DISTILLED_SIGMA_VALUES,
   num_inference_steps=3, noise_scale=sigmas[0])`` with the scheduler rebuilt from its config with
   ``use_dynamic_shifting=False, shift_terminal=None``: both latents are normalized, packed and
   re-noised, ``noise_scale * noise + (1 - noise_scale) * latents`` (video noise ``[n, S, C]``
   drawn first, then audio noise ``[n, L, C_a M]``, from the same generator as stage 1), and
   the three steps run without guidance (guidance 1, STG 0, modality 1, rescale 0: the distilled
   stage, as Lightricks' ``SimpleDenoiser``).

Selected by the model directory: a ``latent_upsampler`` component in ``model_index.json``
(``["ltx2", "LTX2LatentUpsamplerModel"]``; diffusers' own ``LTX2Pipeline`` ignores the entry).
Without it :class:`LTX2TwoStagePipeline` is :class:`~sglang.multimodal_gen.pipelines.ltx2.
LTX2Pipeline` unchanged.

The res_2s sampler (``res2s_sampler``; :meth:`LTX2TwoStagePipeline.predict`) runs Lightricks'
HQ res_2s step (:mod:`~sglang.multimodal_gen.pipelines.res2s`, ``HQ_RES2S_OPTIONS``: renoising at
eta 0.5 from generators seeded -1 and 9999, bongmath) on the guided data prediction, in either
stage. Per request (where the family declares the flags): ``two_stage`` (default: the
directory decides) and ``res2s_sampler``.

Lightricks' recipes (github.com/Lightricks/LTX-2, ``ltx_pipelines/ti2vid_two_stages.py`` and
``ti2vid_two_stages_hq.py``) run the distilled LoRA (``ltx-2-19b-distilled-lora-384``; LTX-2.3:
``ltx-2.3-22b-distilled-lora-384-1.1``) at stage 2 (strength 1; HQ: 0.25 at stage 1 and 0.5 at
stage 2). A request composes that itself: stage 1 runs with its ``lora``, stage 2 with its
``stage_2_lora`` when given (``[]``: no adapter), else with ``lora``; the runner selects both
(``stage_2_lora``'s selection arrives as ``lora_fields["stage_2_lora"]``).

``two_stage_preset="hq"`` (``configs/ltx2_sampling.py`` ``LTX2_HQ_PRESET``) is Lightricks' HQ
pipeline: the request's unset fields take its values (res_2s in both stages, 15 steps,
1088 x 1920, its guidance, the adapter ``distilled`` at 0.25 / 0.5), and the output keeps stage
1's audio: stage 2 still re-noises and denoises the audio with the video (the video attends to
it), but its audio result is dropped and stage 1's normalized audio latents are decoded
(``ti2vid_two_stages_hq.py``: ``video_state, _ = self.stage_2(...)``, then
``audio_decoder(audio_state.latent)`` of stage 1). Without the preset the output keeps stage 2's
audio, as diffusers' documented composition does. (Lightricks' non-HQ two-stage pipeline keeps
stage 1's audio too since its 2026-07-07 release; the default here follows diffusers.)
"""

from __future__ import annotations

import contextvars
import dataclasses
from dataclasses import dataclass

import torch

from sglang.multimodal_gen.configs.ltx2_sampling import LTX2_HQ_PRESET
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.pipelines.ltx2 import LTX2Generation, LTX2Pipeline, LTX2Shapes
from sglang.multimodal_gen.pipelines.ltx2_upsample import VideoLatentStats, upsample_video_latents
from sglang.multimodal_gen.pipelines.res2s import (
    HQ_RES2S_OPTIONS,
    RES2S_TERMINAL_SIGMA,
    res2s_step,
    standardized_noise,
)

__all__ = [
    "LTX2_HQ_LORA_STRENGTHS",
    "LTX2_HQ_SETTINGS",
    "LTX2TwoStagePipeline",
    "STAGE_2_SIGMAS",
    "UPSAMPLER_COMPONENT",
]

UPSAMPLER_COMPONENT = "latent_upsampler"
# diffusers 0.42.1 pipelines/ltx2/utils.py STAGE_2_DISTILLED_SIGMA_VALUES (Lightricks'
# STAGE_2_DISTILLED_SIGMA_VALUES without its terminal 0, which the scheduler appends)
STAGE_2_SIGMAS = (0.909375, 0.725, 0.421875)

# Lightricks' HQ preset as request fields (configs/ltx2_sampling.py, where it is documented)
LTX2_HQ_SETTINGS = LTX2_HQ_PRESET
# the distilled LoRA's strengths of the HQ preset: (stage 1 = lora, stage 2 = stage_2_lora)
LTX2_HQ_LORA_STRENGTHS = (LTX2_HQ_PRESET["lora"][0][1], LTX2_HQ_PRESET["stage_2_lora"][0][1])
# the seeds of Lightricks' res_2s noise generators (noise_seed=-1, substep seed + 10000)
_RES2S_SEEDS = (-1, 9999)

# the stage-2 request: no guidance of any kind (the distilled stage)
_STAGE_2_FIELDS = dict(
    guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
    modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
    audio_guidance_rescale=0.0, num_inference_steps=len(STAGE_2_SIGMAS),
)  # fmt: skip


@dataclass
class _Stage2Start:
    """What stage 2 starts from: raw upsampled video latents ``[n, C, F, 2h, 2w]`` and stage 1's
    normalized packed audio latents ``[n, L, C_a M]`` (after diffusers' de-normalize /
    normalize round trip); ``kept_audio``: stage 1's audio latents as stage 1 ended (same
    layout), which replace stage 2's at its end (the HQ preset), or ``None`` (stage 2's are
    kept)."""

    video: torch.Tensor
    audio: torch.Tensor
    kept_audio: torch.Tensor | None = None


# the stage of the call being built (set around each stage's call; read by new_generation)
_STAGE: contextvars.ContextVar[tuple[int, _Stage2Start | None] | None] = contextvars.ContextVar(
    "ltx2_two_stage", default=None
)


@dataclass
class LTX2TwoStageGeneration(LTX2Generation):
    """:class:`LTX2Generation` plus the stage of the call (0: one-stage, 1, 2) and stage 2's
    starting latents."""

    stage: int = 0
    start: _Stage2Start | None = None
    res2s_noise: tuple[torch.Generator, torch.Generator] | None = None


class LTX2TwoStagePipeline(LTX2Pipeline):
    """:class:`LTX2Pipeline`, in two stages when the directory has a latent upsampler (module
    docstring).

    Raises (per call, two-stage directories):
        InvalidRequestError: ``height`` / ``width`` not a multiple of twice the spatial factor
            (stage 1 runs at half of each); ``two_stage_preset="hq"`` on a model without a
            latent upsampler (``param="two_stage_preset"``).
    """

    #: the sampler of both stages: "euler" (diffusers' scheduler step) or "res2s" (Lightricks' HQ
    #: res_2s, :mod:`~sglang.multimodal_gen.pipelines.res2s`); a request's ``res2s_sampler``
    #: flag, where the family declares one, takes precedence
    default_sampler = "euler"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the model's default of two_stage is whether it has an upsampler: a resolved request
        # then says how it runs (the server keeps two-stage requests out of batches by it)
        if "two_stage" in self.spec.params_class.field_names():
            defaults = self.spec.defaults.replace(two_stage=self.two_stage)
            self.spec = dataclasses.replace(self.spec, defaults=defaults)

    def sampler_of(self, g) -> str:
        """The sampler of the call ``g``: ``res2s`` when the request's ``res2s_sampler`` flag is
        set (where the family declares it), else :attr:`default_sampler`."""
        flag = getattr(g.params, "res2s_sampler", None)
        return "res2s" if flag else ("euler" if flag is False else self.default_sampler)

    def runs_two_stage(self, p) -> bool:
        """Whether the resolved request ``p`` runs in two stages: its ``two_stage`` flag where the
        family declares one and the request sets it, else whether the directory has a latent
        upsampler.

        Raises:
            InvalidRequestError: ``two_stage`` true, or ``two_stage_preset`` ``"hq"``, on a
                model without a latent upsampler (naming the field).
        """
        if getattr(p, "two_stage_preset", None) == "hq" and not self.two_stage:
            raise InvalidRequestError(
                "two_stage_preset 'hq' needs a latent upsampler (a latent_upsampler component "
                "in the model's model_index.json) and the distilled LoRA loaded as adapter "
                "'distilled'; this model has no latent upsampler",
                param="two_stage_preset",
            )
        flag = getattr(p, "two_stage", None)
        if flag is None:
            return self.two_stage
        if flag and not self.two_stage:
            raise InvalidRequestError(
                "two_stage needs a latent upsampler (a latent_upsampler component in the "
                "model's model_index.json); this model has none",
                param="two_stage",
            )
        return bool(flag)

    @property
    def two_stage(self) -> bool:
        """Whether this model runs in two stages (its directory has a latent upsampler)."""
        return UPSAMPLER_COMPONENT in self.components

    def new_generation(self, params, generator=None, lora=None, batch=None):
        g = super().new_generation(params, generator, lora, batch)
        stage, start = _STAGE.get() or (0, None)
        fields = {f.name: getattr(g, f.name) for f in dataclasses.fields(LTX2Generation)}
        return LTX2TwoStageGeneration(**fields, stage=stage, start=start)

    @torch.no_grad()
    def __call__(self, params, *, generator=None, lora=None, batch=None, output_type="pil",
                 progress=None, step_callback=None, lora_fields=None, **fields):  # fmt: skip
        """One request; two stages on a two-stage directory (same arguments and results as
        :meth:`StagedPipeline.__call__`; ``output_type="latent"`` gives stage 2's latents).

        Args:
            lora: the adapters of stage 1 (and of stage 2 without ``stage_2_lora``).
            lora_fields: ``{"stage_2_lora": selection}``: the LoRA manager's selection of the
                request's ``stage_2_lora`` (the runner's ``field_selections``); needed when the
                request sets it.

        Raises:
            InvalidRequestError: ``stage_2_lora`` on a request that runs one stage
                (``param="stage_2_lora"``); see the class.
            ValueError: ``stage_2_lora`` set without its selection in ``lora_fields``.
        """
        if isinstance(params, str):
            params = self.spec.params(prompt=params, **fields)
            fields = {}
        p = self.spec.resolve(params) if isinstance(params, type(self.spec.defaults)) else None
        two_stage = p is not None and self.runs_two_stage(p)
        if getattr(p, "stage_2_lora", None) is not None and not two_stage:
            raise InvalidRequestError(
                "stage_2_lora applies to two-stage generation only; this request runs one stage "
                "(two_stage false, or a model without a latent upsampler)",
                param="stage_2_lora",
            )
        if fields or not two_stage:
            return super().__call__(
                params, generator=generator, lora=lora, batch=batch, output_type=output_type,
                progress=progress, step_callback=step_callback, **fields,
            )  # fmt: skip
        if batch is not None:
            raise NotImplementedError("LTX-2 two-stage generation runs one request at a time")
        stage_2_lora = self._stage_2_selection(p, lora, lora_fields)
        self._check_two_stage_size(p)
        if generator is None:
            generator = torch.Generator(self.generator_device).manual_seed(int(p.seed))
        common = dict(generator=generator, progress=progress,
                      step_callback=step_callback)  # fmt: skip
        token = _STAGE.set((1, None))
        try:
            p1 = dataclasses.replace(p, height=p.height // 2, width=p.width // 2)
            joint = super().__call__(p1, output_type="latent", lora=lora, **common)
        finally:
            _STAGE.reset(token)
        start = self._upsample(joint, LTX2Generation(params=p1, generator=generator),
                               keep_audio=self.keeps_stage_1_audio(p))  # fmt: skip
        p2 = dataclasses.replace(p, **{k: v for k, v in _STAGE_2_FIELDS.items() if hasattr(p, k)})
        token = _STAGE.set((2, start))
        try:
            return super().__call__(p2, output_type=output_type, lora=stage_2_lora, **common)
        finally:
            _STAGE.reset(token)

    @staticmethod
    def _stage_2_selection(p, lora, lora_fields):
        """The adapters of stage 2 of the resolved two-stage request ``p``: the selection of its
        ``stage_2_lora`` when set, else ``lora`` (stage 1's).

        Raises:
            ValueError: ``stage_2_lora`` set and ``lora_fields`` without its selection.
        """
        if getattr(p, "stage_2_lora", None) is None:
            return lora
        if not lora_fields or "stage_2_lora" not in lora_fields:
            raise ValueError(
                "stage_2_lora is set but lora_fields has no selection of it (the runner makes it: "
                "runtime/runner_lora.py field_selections)"
            )
        return lora_fields["stage_2_lora"]

    @staticmethod
    def keeps_stage_1_audio(p) -> bool:
        """Whether the two-stage request ``p`` outputs stage 1's audio (the ``"hq"`` preset, as
        Lightricks' HQ pipeline) rather than stage 2's (diffusers' composition)."""
        return getattr(p, "two_stage_preset", None) == "hq"

    def _check_two_stage_size(self, p) -> None:
        step = 2 * self.spatial_factor
        for name in ("height", "width"):
            value = getattr(p, name)
            if value % step:
                raise InvalidRequestError(
                    f"{name} must be a multiple of {step} for this two-stage model (stage 1 runs "
                    f"at half the size, a multiple of {self.spatial_factor}), got {value}",
                    param=name,
                )

    def _upsample(self, joint: torch.Tensor, g1: LTX2Generation, keep_audio: bool = False
                  ) -> _Stage2Start:  # fmt: skip
        """Stage 1's joint rows -> stage 2's start (the upsampler on the raw video latents);
        ``keep_audio``: stage 1's audio latents are kept for the output."""
        sh = self.shapes_of(g1)
        video, audio = sh.split(joint)
        up = upsample_video_latents(
            video, self.components[UPSAMPLER_COMPONENT], VideoLatentStats.from_vae(self.vae),
            latents_normalized=True, grid=(sh.frames, sh.height, sh.width),
        )  # fmt: skip
        # diffusers hands stage 2 the de-normalized audio, which it normalizes again
        avae = self.components["audio_vae"]
        mean, std = avae.latents_mean.to(audio), avae.latents_std.to(audio)
        kept = audio.clone() if keep_audio else None
        audio = ((audio * std + mean) - mean) / std
        return _Stage2Start(video=up, audio=audio, kept_audio=kept)

    # ------------------------------------------------------------------ stages
    def prepare_latents(self, g, cond):
        """Stage 2: the upsampled video latents, normalized and packed, and stage 1's audio,
        each re-noised at the first stage-2 sigma (diffusers' ``_create_noised_state``)."""
        if getattr(g, "stage", 0) != 2:
            return super().prepare_latents(g, cond)
        from diffusers.utils.torch_utils import randn_tensor

        sh = self.shapes_of(g)
        g.shapes = sh
        start = g.start
        video = VideoLatentStats.from_vae(self.vae).normalize(start.video)
        n = video.shape[0]
        if tuple(video.shape[2:]) != (sh.frames, sh.height, sh.width):
            raise ValueError(
                f"latent_upsampler: upsampled latents {tuple(video.shape)} do not fit the "
                f"stage-2 grid {(sh.frames, sh.height, sh.width)}"
            )
        video = video.permute(0, 2, 3, 4, 1).reshape(n, sh.video_tokens, sh.channels)
        s = STAGE_2_SIGMAS[0]
        noise = randn_tensor(video.shape, generator=g.generator, device=video.device,
                             dtype=video.dtype)  # fmt: skip
        video = (s * noise + (1 - s) * video).to(self.device, torch.float32)
        audio = start.audio
        noise = randn_tensor(audio.shape, generator=g.generator, device=audio.device,
                             dtype=audio.dtype)  # fmt: skip
        audio = (s * noise + (1 - s) * audio).to(self.device, torch.float32)
        return LTX2Shapes.join(video, audio)

    def prepare_timesteps(self, g, latents):
        """Stage 2: the fixed distilled sigmas on a scheduler without dynamic shifting or
        terminal stretch (diffusers' documented stage-2 scheduler)."""
        if getattr(g, "stage", 0) != 2:
            return super().prepare_timesteps(g, latents)
        from diffusers.pipelines.ltx2.pipeline_ltx2 import retrieve_timesteps

        scheduler = self.new_scheduler()
        scheduler = type(scheduler).from_config(
            scheduler.config, use_dynamic_shifting=False, shift_terminal=None
        )
        timesteps, _ = retrieve_timesteps(
            scheduler, len(STAGE_2_SIGMAS), self.device, sigmas=list(STAGE_2_SIGMAS)
        )
        scheduler.set_begin_index(0)
        g.sigmas = scheduler.sigmas.to(torch.float32)
        return scheduler, timesteps

    def _res2s_noise(self, g, which: int):
        """Lightricks' res_2s noise for the joint rows: video then audio from one of the call's
        two generators (seeded -1 and 9999 on first use), each standardized by itself."""
        if g.res2s_noise is None:
            dev = self.generator_device
            g.res2s_noise = tuple(torch.Generator(dev).manual_seed(s) for s in _RES2S_SEEDS)
        gen = g.res2s_noise[which]

        def noise(like: torch.Tensor) -> torch.Tensor:
            video, audio = g.shapes.split(like)
            n_v = standardized_noise(video, gen).to(like.device)
            n_a = standardized_noise(audio, gen).to(like.device)
            return LTX2Shapes.join(n_v, n_a)

        return noise

    def predict(self, denoiser, latents, t, step_index, cond, g):
        """Euler: the guided velocity (:class:`LTX2Pipeline`). res_2s: one res_2s step of the
        guided data prediction ``D = x - sigma v`` (two guided evaluations; a last step to 0 ends
        at 0.0011 and takes ``D`` there, as Lightricks' loop), returned as the velocity that
        takes the scheduler's Euler step to the res_2s result."""
        if self.sampler_of(g) != "res2s":
            return super().predict(denoiser, latents, t, step_index, cond, g)
        s = float(g.sigmas[step_index])
        s_next = float(g.sigmas[step_index + 1])
        scale = float(t) / s if s > 0 else 1000.0  # timestep per unit sigma (the scheduler's)
        base = super()

        def denoise(x: torch.Tensor, sigma: float) -> torch.Tensor:
            if sigma == s:
                gg, tt, idx = g, t, step_index
            else:
                gg = dataclasses.replace(g, sigmas=torch.tensor([sigma], dtype=torch.float32))
                tt, idx = torch.tensor(sigma * scale, dtype=t.dtype, device=t.device), 0
            v = base.predict(denoiser, x.to(latents.dtype), tt, idx, cond, gg)
            return x.to(v.dtype) - float(gg.sigmas[idx]) * v

        opts = dict(HQ_RES2S_OPTIONS, step_noise=self._res2s_noise(g, 0),
                    substep_noise=self._res2s_noise(g, 1))  # fmt: skip
        if s_next == 0.0:
            x = res2s_step(latents, s, RES2S_TERMINAL_SIGMA, denoise, **opts)
            x_next = denoise(x, RES2S_TERMINAL_SIGMA).to(latents.dtype)
        else:
            x_next = res2s_step(latents, s, s_next, denoise, **opts)
        return (x_next - latents) / (s_next - s)

    def after_step(self, g, cond, latents, step_index, timesteps, scheduler):
        """Stage 1 ends without the decode noise (its latents are not decoded). Stage 2 of a
        request that keeps stage 1's audio (:meth:`keeps_stage_1_audio`) ends with stage 1's
        audio latents in place of its own (the decoded audio and ``output_type="latent"``)."""
        stage = getattr(g, "stage", 0)
        if stage == 1:
            return latents
        latents = super().after_step(g, cond, latents, step_index, timesteps, scheduler)
        kept = g.start.kept_audio if stage == 2 else None
        if kept is None or step_index != len(timesteps) - 1:
            return latents
        video, _ = g.shapes.split(latents)
        audio = kept.to(latents.device, latents.dtype)
        g.audio_latents = audio.clone()
        return LTX2Shapes.join(video, audio)
