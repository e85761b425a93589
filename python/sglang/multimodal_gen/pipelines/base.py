"""The staged pipeline every family builds on: encode -> latents -> timesteps -> denoise -> decode.

:class:`StagedPipeline` owns the loop and the plumbing shared by every family (component loading
as diffusers resolves it, prompt encoding on one rank with the result broadcast, progress, step
timing, the denoiser switch hook, decoding through diffusers' ``VaeImageProcessor``). A family
subclass overrides stages, never the loop:

======================  ===========================================================================
``prompt_list``         the texts a request encodes (prompt; negative prompt under CFG)
``encode_prompt_list``  texts -> conditioning (a dict of tensors); runs on TP rank 0 only
``encode_images``       input images -> conditioning (VAE latent distributions...); rank 0 only
``prepare_latents``     initial noise in the family's latent layout (diffusers' ``randn_tensor``)
``prepare_timesteps``   a fresh scheduler from the directory's config + its timesteps
``condition_latents``   an input image enters the start (image-to-image: fewer steps, re-noised
                        image latents)
``select_denoiser``     which denoiser runs step ``i`` (Wan2.2 switches experts mid-loop)
``predict``             one model evaluation with the family's CFG policy -> scheduler input
``after_step``          latents after each scheduler step (inpainting keeps the unmasked part)
``decode``              latents -> uint8 pixels ``[B, H, W, 3]`` (VAE ranks only)
======================  ===========================================================================

Under tensor parallelism every rank runs the same loop on the same inputs; the text encoders
are loaded and run on rank 0 only, and their output is broadcast on the CPU control group, so
every rank sees bit-identical conditioning.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from sglang.multimodal_gen.configs.sampling_params import RequestSpec, SamplingParams
from sglang.multimodal_gen.distributed import broadcast_tensors_cpu
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.step_cache import CacheRow, RequestCache, StepCacheConfig
from sglang.multimodal_gen.layers.step_cache.mag_ratios import (
    RATIOS_FILE,
    MagRatios,
    calibration_command,
)
from sglang.multimodal_gen.models.components import load_component
from sglang.multimodal_gen.models.loader import WeightOptions, load_denoiser
from sglang.multimodal_gen.models.model_dir import ModelLoadError, read_json, read_model_index
from sglang.multimodal_gen.models.registry import ModelFamily, SamplingDefaults
from sglang.multimodal_gen.outputs import STEP_CACHE_INFO, Video
from sglang.multimodal_gen.pipelines.batching import StepBatcher
from sglang.multimodal_gen.pipelines.cfg_parallel import STEP_CACHE_ARG, cfg_parallel_call
from sglang.multimodal_gen.pipelines.common import (
    EncodingFailed,
    check_finite,
    check_schedule,
    flow_shift_helpers,
    latents_to_uint8,
)
from sglang.multimodal_gen.pipelines.image_conditioning import sdedit_after_step, sdedit_start
from sglang.multimodal_gen.pipelines.lora_rows import with_row_adapters

__all__ = ["Generation", "StagedPipeline", "check_finite", "latents_to_uint8"]

OUTPUT_TYPES = ("pil", "np", "latent", "media")


@dataclass
class Generation:
    """One call of a pipeline: its request and what the runtime gives it. Every stage receives
    it; nothing about a call is kept on the pipeline (the requests of a batch run concurrently).

    Attributes:
        params: the resolved request (every field set, a seed).
        generator: seeded from ``params.seed``; draws the initial noise.
        lora: the request's adapters, one composition per LoRA target (the LoRA manager's
            ``LoRASelection``); ``None``: the layers' own active compositions.
        batch: ``(batcher, index)`` when the call is request ``index`` of a batch whose module
            calls run together (:mod:`~sglang.multimodal_gen.pipelines.batching`).
        cache: the request's step cache (:class:`~sglang.multimodal_gen.layers.step_cache.
            RequestCache`: its states and skip counts), ``None`` when caching is off.
    """

    params: SamplingParams
    generator: torch.Generator
    lora: Any = None
    batch: tuple[StepBatcher, int] | None = None
    cache: RequestCache | None = None

    @property
    def num_outputs(self) -> int:
        """Images (or videos) of this call (``params.num_outputs_per_prompt``)."""
        return int(self.params.num_outputs_per_prompt)


class StagedPipeline:
    """Base of the family pipelines (see the module docstring for the stages).

    Args:
        family: the family declaration.
        components: ``{name: loaded component}``; denoisers are ours, the rest the libraries'.
            Text encoders/tokenizers are absent on TP ranks > 0, the VAE on ranks that do not
            decode.
        configs: ``{name: config dict}`` of every component (also those not loaded here).
        device: execution device. tp_rank, tp_size: this rank's TP coordinates.
        rank: this process's global rank (default ``tp_rank``); rank 0 encodes the prompt and
            broadcasts the conditioning to every rank (TP, sequence- and CFG-parallel alike).

    Attributes:
        spec: what a request to this model may ask for (its parameter class, defaults, limits;
            :class:`~sglang.multimodal_gen.configs.sampling_params.RequestSpec`).

    Class attributes for subclasses:
        text_components: components used only by :meth:`encode_prompt` (rank 0 loads them).
        spatial_factor: from :meth:`compute_spatial_factor` (VAE factor x patch size).
        shifted_schedule: the diffusers pipeline module whose ``calculate_shift`` and
            ``retrieve_timesteps`` the family's timesteps come from (:meth:`shifted_timesteps`;
            imported when the pipeline is built, not by a request), or ``None``.
    """

    text_components: tuple[str, ...] = ("text_encoder", "tokenizer")
    family_name: str = ""
    shifted_schedule: str | None = None
    # The model directory the pipeline was loaded from (``from_pretrained``; ``None`` for one
    # built from components): step caching looks for the MagCache ratios file beside it.
    model_path: str | None = None
    # Called with the denoiser about to run whenever the loop switches denoisers (two-expert
    # models): the runner's per-expert CPU offload keeps only that one on the accelerator.
    on_denoiser_change: Callable[[torch.nn.Module], None] | None = None
    # Step caching (``enable_step_cache``): the configuration every new request gets, and
    # whether a request's CFG branches share one cache state (one batched forward in the
    # reference pipeline, e.g. Z-Image) or each branch has its own (diffusers' Flux, Qwen-Image,
    # Wan: ``cache_context("cond")`` / ``("uncond")``).
    step_cache: StepCacheConfig | None = None
    step_cache_joint_branches: bool = False
    # The folder the pipeline was loaded from (``from_pretrained``; ``None``: built in memory)
    # and MagCache's calibrated ratios found for it (``enable_step_cache``; ``None``: none).
    model_path: str | None = None
    mag_ratios: MagRatios | None = None

    def __init__(
        self,
        family: ModelFamily,
        components: dict[str, Any],
        configs: dict[str, dict],
        device: torch.device | str = "cpu",
        tp_rank: int = 0,
        tp_size: int = 1,
        pipeline_config: dict | None = None,
        rank: int | None = None,
    ):
        self.family = family
        self.pipeline_config = dict(pipeline_config or {})
        self.components = components
        self.configs = configs
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.rank = tp_rank if rank is None else rank
        self.denoisers = {
            d.component: components[d.component]
            for d in family.denoisers
            if d.component in components
        }
        self.transformer = self.denoisers[family.denoisers[0].component]
        self.vae = components.get("vae")
        self.scheduler_config = dict(configs.get("scheduler", {}))
        self.vae_scale_factor = self.compute_vae_scale_factor()
        self.spatial_factor = self.compute_spatial_factor()
        d: SamplingDefaults = family.sampling_defaults(self.transformer.cfg)
        self.spec = RequestSpec(
            family=family.name,
            display_name=family.display_name,
            params_class=family.params_class(),
            defaults=d.params,
            limits=d.limits,
            spatial_factor=self.spatial_factor,
            outputs=d.outputs,
            inputs=tuple(d.inputs),
            required_inputs=tuple(d.required_inputs),
            cache_blocks=self._cache_blocks(),
        )
        self._set_default_cache(None)
        # where the initial noise is drawn (diffusers' examples seed a generator of the
        # execution device); the runner may set "cpu" to reproduce a CPU-seeded run
        self.generator_device = str(self.device) if self.device.type == "cuda" else self.device.type
        if self.shifted_schedule:
            flow_shift_helpers(self.shifted_schedule)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        family: ModelFamily | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        load_vae: bool = True,
        load_text: bool = True,
        rank: int | None = None,
        weights: WeightOptions | None = None,
    ) -> StagedPipeline:
        """Load a diffusers directory of ``family``: our denoisers, the rest as diffusers would.

        Args:
            family: the family (default: the subclass's ``family_name``).
            load_vae: load the VAE (``False`` on TP ranks that do not decode).
            load_text: load text encoders and tokenizers (``False`` on ranks > 0, which
                receive the conditioning from rank 0).
            rank: global rank (default ``tp_rank``).
            weights: another transformer folder or weights file, or online quantization, for
                the primary denoiser (:class:`~sglang.multimodal_gen.models.loader.WeightOptions`).

        Raises:
            FileNotFoundError / ValueError (``ModelLoadError``): messages name file and tensor.
        """
        from sglang.multimodal_gen.models.registry import get_family

        family = family or get_family(cls.family_name)
        index = read_model_index(model_path)
        if index.pipeline_class not in family.pipeline_classes:
            raise ModelLoadError(
                f"{index.path}: pipeline _class_name {index.pipeline_class!r} is not a "
                f"{family.display_name} pipeline ({', '.join(family.pipeline_classes)})"
            )
        names = {d.component for d in family.denoisers}
        comps: dict[str, Any] = {}
        configs: dict[str, dict] = {}
        for name, (lib, cls_name) in index.components.items():
            folder = os.path.join(model_path, name)
            for cfg_file in ("config.json", "scheduler_config.json"):
                if os.path.isfile(os.path.join(folder, cfg_file)):
                    configs[name] = read_json(os.path.join(folder, cfg_file))
            if name in names:
                opts = weights if weights is not None and weights.component == name else None
                comps[name] = load_denoiser(
                    (opts.transformer_path if opts else None) or folder,
                    family.denoiser(name),
                    dtype=dtype,
                    device=device,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    weights_path=opts.transformer_weights_path if opts else None,
                    # online quantization: every denoiser (both experts of a two-expert model)
                    quantization=weights.quantization if weights is not None else None,
                )
            elif name in cls.text_components and not load_text:
                continue
            elif name == "vae" and not load_vae:
                continue
            else:
                comps[name] = load_component(model_path, name, lib, cls_name, dtype, device)
        required = {d.component for d in family.denoisers if not d.optional}
        missing = sorted(required - set(comps))
        if missing:
            raise FileNotFoundError(f"{index.path}: no component {missing[0]!r}")
        global_rank = rank
        rank = 0 if tp_rank is None else tp_rank
        size = 1 if tp_size is None else tp_size
        pipe = cls(
            family, comps, configs, device=device, tp_rank=rank, tp_size=size,
            pipeline_config=index.config, rank=rank if global_rank is None else global_rank,
        )  # fmt: skip
        pipe.model_path = model_path  # where step caching finds its calibration (MagCache)
        return pipe

    def enable_step_cache(self, config: StepCacheConfig | None) -> None:
        """Cache the denoisers' blocks across steps for every new request (``None`` or method
        ``"none"``: off).

        Raises:
            ValueError: a denoiser of this family does not declare its blocks
                (:class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence`) yet, or
                (``teacache``) their modulated input, or
                ``Fn + Bn`` leaves none of its blocks to cache, or ``magcache`` finds no
                calibrated ratios (``--cache-mag-ratios``, or the file
                ``sglang calibrate-cache`` writes beside the model).
        """
        magcache = config is not None and config.method == "magcache"
        try:  # also for a server of another method: its requests may ask for magcache
            self.mag_ratios = MagRatios.find(
                self.model_path, config.mag_ratios if config is not None else None
            )
        except ValueError:
            if magcache:
                raise
            self.mag_ratios = None  # a bad file beside the model: magcache requests are refused
        if magcache and not config.calibrate:
            if self.mag_ratios is None:
                raise ValueError(
                    "--cache-method magcache needs the model's calibrated magnitude ratios: "
                    f"pass --cache-mag-ratios FILE, or write {RATIOS_FILE} beside the model "
                    f"with `{calibration_command(self.model_path)}`"
                )
        if config is not None and config.enabled:
            for name, d in self.denoisers.items():
                if not hasattr(d, "block_sequence"):
                    raise ValueError(
                        f"--cache-method {config.method}: the {self.family.display_name} "
                        f"denoiser {name!r} does not support step caching yet"
                    )
                if config.method == "teacache" and d.block_sequence().modulated_input is None:
                    raise ValueError(
                        f"--cache-method teacache: the {self.family.display_name} denoiser "
                        f"{name!r} ({type(d).__name__}) declares no modulated input of its first "
                        "block (BlockSequence.modulated_input); choose another --cache-method"
                    )
                n = d.block_sequence().num_blocks
                fn = config.head_blocks(n)  # the dbcache preset's Fn scales with the blocks
                if fn + config.bn >= n:
                    raise ValueError(
                        f"--cache-fn {fn} + --cache-bn {config.bn} leave none of the "
                        f"{n} blocks of denoiser {name!r} to cache"
                    )
        self._set_default_cache(config)

    def _cache_blocks(self) -> int:
        """The blocks step caching may span: the fewest of the denoisers' block sequences (0
        when a denoiser does not declare its blocks)."""
        counts = [
            d.block_sequence().num_blocks if hasattr(d, "block_sequence") else 0
            for d in self.denoisers.values()
        ]
        return min(counts, default=0)

    def _set_default_cache(self, config: StepCacheConfig | None) -> None:
        """``config`` (``None`` or method ``"none"``: off) as :attr:`step_cache` and as the
        default ``cache`` of the requests :attr:`spec` resolves (a request may choose its own:
        :func:`~sglang.multimodal_gen.configs.sampling_params.step_cache_value`)."""
        self.step_cache = config if config is not None and config.enabled else None
        # off: no default (the resolved request's cache stays None, a field it does not set)
        self.spec = dataclasses.replace(
            self.spec, defaults=self.spec.defaults.replace(cache=self.step_cache)
        )

    # ------------------------------------------------------------------ geometry
    def compute_vae_scale_factor(self) -> int:
        """``2 ** (len(vae.block_out_channels) - 1)``, from the VAE config (present on every rank)."""
        blocks = self.configs.get("vae", {}).get("block_out_channels", [0] * 4)
        return 2 ** (len(blocks) - 1)

    def compute_spatial_factor(self) -> int:
        """Height and width must be multiples of this. Default: VAE factor x 2 (2x2 patches)."""
        return self.vae_scale_factor * 2

    # ------------------------------------------------------------------ stages
    def prompt_list(self, g: Generation) -> list[str]:
        """The texts a request encodes (its prompt, and its negative prompt under CFG)."""
        raise NotImplementedError

    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """Texts -> conditioning: each value holds one entry per prompt along dim 0 (a tensor
        ``[P, ...]`` or a list of ``P`` tensors). Rank 0 only; the result is broadcast."""
        raise NotImplementedError

    def encode_prompt(self, g: Generation) -> dict[str, Any]:
        """One request's conditioning: :meth:`encode_prompt_list` of its :meth:`prompt_list`."""
        return self.encode_prompt_list(self.prompt_list(g), g.params.max_sequence_length)

    def encode_group_key(self, g: Generation) -> Any:
        """Requests of a batch whose keys are equal share one encoder call (default: all of
        them). A family whose encoder pads a call's texts to the longest one returns the
        request's own padded length, so that sharing a call changes no request's conditioning
        (its image stays what it would be alone)."""
        return None

    def encode_prompts(self, gens: list[Generation]) -> list[dict[str, Any] | Exception]:
        """:meth:`encode_prompt` of several requests with one encoder call per group of
        requests (same ``max_sequence_length`` and :meth:`encode_group_key`): the group's texts
        concatenated, the result cut back per request. Every request of a group whose joint
        call fails is encoded alone, so that a failure is returned (not raised) for the
        requests it belongs to."""
        results: list[dict[str, Any] | Exception | None] = [None] * len(gens)
        groups: dict[Any, list[int]] = {}
        for i, g in enumerate(gens):
            try:
                key = (g.params.max_sequence_length, self.encode_group_key(g))
            except Exception as e:  # e.g. the tokenizer refuses the text: this request fails
                results[i] = e
                continue
            groups.setdefault(key, []).append(i)
        for (max_len, _), idx in groups.items():
            if len(idx) > 1:
                lists = [self.prompt_list(gens[i]) for i in idx]
                try:
                    out = self.encode_prompt_list([p for ps in lists for p in ps], max_len)
                except Exception:
                    pass  # find out whose texts fail
                else:
                    bounds = np.cumsum([0] + [len(ps) for ps in lists]).tolist()
                    for i, lo, hi in zip(idx, bounds, bounds[1:]):
                        results[i] = {k: v[lo:hi] for k, v in out.items()}
                    continue
            for i in idx:
                try:
                    results[i] = self.encode_prompt(gens[i])
                except Exception as e:
                    results[i] = e
        return results

    def _encode(self, g: Generation) -> dict[str, Any]:
        """:meth:`encode_prompt`; in a batch, one encoder call for every request of the batch
        (a rendezvous like the DiT calls, before the prologue turns)."""
        out = self.batch_call(
            self,
            lambda _pipe, gens, max_sequence_length: self.encode_prompts(gens),
            dict(gens=[g], max_sequence_length=g.params.max_sequence_length),
            ("gens",),
            g,
        )
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def encode_images(self, g: Generation) -> dict[str, Any]:
        """The request's input images (``g.params.image``, ``mask_image``) -> conditioning
        tensors, merged into the prompt conditioning and broadcast with it (rank 0 only, where
        the VAE is). Called only for a request that gives images (the model's spec admits them
        only where the family declares them). Default: nothing."""
        return {}

    def prepare_latents(self, g: Generation, cond: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def condition_latents(
        self,
        g: Generation,
        cond: dict[str, Any],
        latents: torch.Tensor,
        scheduler: Any,
        timesteps: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latents, timesteps)`` the loop starts from, after the input images entered them.
        Default: image-to-image when :meth:`prepare_latents` put the image's latents and the
        noise in ``cond`` (:func:`~.image_conditioning.sdedit_start`: the last ``strength`` of
        the schedule, from the re-noised image); else unchanged."""
        p = g.params
        return sdedit_start(cond, latents, scheduler, timesteps, p.num_inference_steps,
                            p.strength)  # fmt: skip

    def after_step(
        self,
        g: Generation,
        cond: dict[str, Any],
        latents: torch.Tensor,
        step_index: int,
        timesteps: torch.Tensor,
        scheduler: Any,
    ) -> torch.Tensor:
        """The latents after step ``step_index``'s scheduler step. Default: inpainting when
        ``cond`` holds a mask (:func:`~.image_conditioning.sdedit_after_step`: the kept region
        is the image re-noised to the next timestep); else unchanged."""
        return sdedit_after_step(cond, latents, step_index, timesteps, scheduler)

    def prepare_timesteps(self, g: Generation, latents: torch.Tensor):
        """``(scheduler, timesteps)``: a fresh scheduler (so concurrent state never leaks)."""
        raise NotImplementedError

    def prepare_conditioning(self, g: Generation, cond: dict[str, Any]) -> dict[str, Any]:
        """Per-request work on the broadcast conditioning before the loop (e.g. a caption
        refiner that does not depend on the timestep). Default: nothing. In a batch it runs in
        the request threads concurrently: a module call with collectives (TP layers) must go
        through :meth:`batch_call`, which runs it once for the batch in request order."""
        return cond

    def batch_call(
        self,
        module: Any,
        fn: Callable[..., Any],
        args: dict[str, Any],
        batched: tuple[str, ...],
        g: Generation,
    ) -> Any:
        """``fn(module, **args)``, with the request's adapters on the module's LoRA layers; inside
        a batch, one call for every request of the batch.

        The ``batched`` arguments (lists, tensors along dim 0, or objects with ``concat`` /
        ``select`` such as Z-Image's caption context) are concatenated in request order, the
        others must be equal (else the calls run one after the other, in request order); each
        request gets its own rows of the result, and each row runs with its own request's
        adapters. Like the DiT calls it is a rendezvous: every request of the batch must make
        the call.
        """

        def run(m, _rows, a, _batched, row_lora):
            return with_row_adapters(m, row_lora, lambda: fn(m, **a))

        if g.batch is None:
            n = _rows_of(args[batched[0]]) if batched else 0
            return run(module, 1, args, batched, [g.lora] * n)
        batcher, index = g.batch
        return batcher.submit(index, run, module, 1, args, batched, g.lora)

    def select_denoiser(self, step_index: int, t: torch.Tensor, g: Generation):
        """The denoiser of step ``step_index`` (default: the first one)."""
        return self.transformer

    def predict(
        self,
        denoiser: torch.nn.Module,
        latents: torch.Tensor,
        t: torch.Tensor,
        step_index: int,
        cond: dict[str, Any],
        g: Generation,
    ) -> torch.Tensor:
        """The scheduler's ``model_output`` for step ``step_index`` (CFG policy included)."""
        raise NotImplementedError

    def scheduler_step(self, scheduler, pred: torch.Tensor, t, latents: torch.Tensor):
        return scheduler.step(pred, t, latents, return_dict=False)[0]

    def decode(self, latents: torch.Tensor, g: Generation) -> np.ndarray:
        """Latents -> uint8 ``[B, H, W, 3]`` (ranks with a VAE)."""
        raise NotImplementedError

    def decode_each(self, latents: torch.Tensor, g: Generation) -> list[np.ndarray]:
        """:meth:`decode` one image (or video) at a time: the VAE's convolutions round
        differently at other batch sizes (oneDNN picks its kernels by shape; measured: one level
        off in a few pixels), so this keeps an image bit-identical whether its request ran alone
        or in a batch. The price: a batch's decode no longer shares its calls (measured about
        3 ms per 64x64 image with the demo VAE on 2 CPU cores; less, relatively, at larger
        sizes, where one image keeps the device busy)."""
        return [x for i in range(latents.shape[0]) for x in self.decode(latents[i : i + 1], g)]

    def to_media(self, pixels: np.ndarray, g: Generation) -> list:
        """Decoded pixels -> the typed outputs: PIL images (uint8 ``[B, H, W, 3]``) or
        :class:`~sglang.multimodal_gen.outputs.Video` objects (``[B, F, H, W, 3]``, at the
        request's ``fps``). A family whose model makes sound overrides it to attach the audio."""
        if pixels.ndim == 5:
            fps = int(getattr(g.params, "fps", None) or 16)
            return [Video(frames=v, fps=fps) for v in pixels]
        from PIL import Image

        return [Image.fromarray(a) for a in pixels]

    # ------------------------------------------------------------------ helpers
    def shifted_timesteps(self, image_seq_len: int, num_steps: int, sigmas=None):
        """``(scheduler, timesteps)`` of a flow-matching schedule shifted by resolution, as
        diffusers' Flux, Z-Image and Qwen-Image pipelines make it: ``mu = calculate_shift(
        image_seq_len, base/max_image_seq_len, base/max_shift of the scheduler config)``, then
        ``retrieve_timesteps(scheduler, num_steps, sigmas=sigmas, mu=mu)`` on a fresh scheduler
        (``sigmas`` ``None``: the scheduler's own).

        Args:
            image_seq_len: image tokens of one item (latent patches).
            sigmas: a sequence of ``num_steps`` floats or ``None``.
        """
        calculate_shift, retrieve_timesteps = flow_shift_helpers(self.shifted_schedule)
        sc = self.scheduler_config
        mu = calculate_shift(
            image_seq_len,
            sc.get("base_image_seq_len", 256),
            sc.get("max_image_seq_len", 4096),
            sc.get("base_shift", 0.5),
            sc.get("max_shift", 1.15),
        )
        scheduler = self.new_scheduler()
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def new_scheduler(self):
        """A fresh scheduler of the directory's class and config."""
        sched = self.components.get("scheduler")
        if sched is None:
            raise ValueError("the model directory has no scheduler")
        return type(sched).from_config(copy.deepcopy(dict(sched.config)))

    def encode_for_join(self, params: SamplingParams, lora: Any = None) -> Any:
        """Rank 0: the conditioning of a request that joins a running batch of several ranks
        (its prompt encoding and input images, as :meth:`__call__` makes them, outside the
        batch's rendezvous), or :class:`EncodingFailed`. Sent to every rank with the request
        (``conditioning``), so joining costs no call on rank 0 alone inside the running loop:
        such a call would share a step with the others' DiT calls, whose collectives the other
        ranks could not run until they got the joining request's conditioning. Never raises:
        a failure (a bad field, a prompt the encoder rejects) is the :class:`EncodingFailed`
        every rank fails the request with (rank 0 with the exception itself)."""
        try:
            g = self.new_generation(params, None, lora, None)
            cond = self._encode(g)
            if g.params.image:
                cond = {**cond, **self.encode_images(g)}
            return cond
        except Exception as e:
            return EncodingFailed(f"{type(e).__name__}: {e}", error=e)

    def broadcast_conditioning(self, cond: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0's conditioning on every rank (on this rank's device; identity in one process)."""
        return broadcast_tensors_cpu(cond, src=0, device=self.device)

    def run_branches(
        self,
        denoiser: torch.nn.Module,
        rows: int,
        args: dict[str, Any],
        batched: tuple[str, ...],
        g: Generation,
    ) -> Any:
        """``denoiser(**args)`` where the ``batched`` arguments stack ``rows`` CFG branches along
        dim 0, branch-major (``[cond rows, uncond rows]``), every row with the request's adapters.

        Without CFG parallelism (or with one branch) it is that one call. With
        ``--enable-cfg-parallel`` each rank of the CFG group runs only its branch (the TP / SP
        groups inside it are that branch's) and one all-gather over the CFG group reassembles
        the output, so the caller sees the same ``[rows * b, ...]`` result. Inside a batch the
        call joins the other requests' calls of the same step (:mod:`.batching`).

        Args:
            rows: number of branches in the batched arguments (1 or 2).
            args: keyword arguments of the denoiser; a batched value is a tensor, a list, or an
                object with ``select(index)`` (Z-Image's caption context).

        Returns:
            The denoiser output: a tensor, or a list of per-item tensors (Z-Image).

        Raises:
            ValueError: ``rows`` differs from the CFG degree while CFG parallelism is on.
        """
        if g.cache is not None:  # each row's cache state travels with the row
            per_branch = _rows_of(args[batched[0]]) // rows
            contexts = ["joint"] * rows if self.step_cache_joint_branches else ["cond", "uncond"]
            joint = self.step_cache_joint_branches
            args = {**args, STEP_CACHE_ARG: [
                CacheRow(g.cache, contexts[r] if r < len(contexts) else f"branch{r}", joint)
                for r in range(rows) for _ in range(per_branch)
            ]}  # fmt: skip
            batched = (*batched, STEP_CACHE_ARG)
        if g.batch is not None:  # several requests in one loop: one DiT call per step for all
            batcher, index = g.batch
            return batcher.submit(index, cfg_parallel_call, denoiser, rows, args, batched, g.lora)
        n = _rows_of(args[batched[0]])
        return cfg_parallel_call(denoiser, rows, args, batched, [g.lora] * n)

    # ------------------------------------------------------------------ the loop
    def new_generation(
        self,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        lora: Any = None,
        batch: tuple[StepBatcher, int] | None = None,
    ) -> Generation:
        """The :class:`Generation` of one call: ``params`` resolved against :attr:`spec` (a
        resolved request is taken as is), a generator seeded from its seed (unless given)."""
        params = self.spec.resolve(params)
        if generator is None:
            generator = torch.Generator(self.generator_device).manual_seed(int(params.seed))
        cfg = params.cache  # resolved: the request's StepCacheConfig, the model's default, or None
        cache = None
        if cfg is not None and cfg.enabled:
            cache = RequestCache(cfg, num_steps=int(params.num_inference_steps))
            if cfg.method == "magcache":
                cache.calibration = self.mag_ratios
                if self.mag_ratios is None and not cfg.calibrate:
                    raise InvalidRequestError(
                        "cache.method 'magcache' needs the model's calibrated ratios, which "
                        "this server has not loaded (--cache-mag-ratios, or "
                        f"`{calibration_command()}`)",
                        param="cache",
                    )
        return Generation(params=params, generator=generator, lora=lora, batch=batch, cache=cache)

    @torch.no_grad()
    def __call__(
        self,
        params: SamplingParams | str,
        *,
        generator: torch.Generator | None = None,
        lora: Any = None,
        batch: tuple[StepBatcher, int] | None = None,
        output_type: str = "pil",
        progress: bool | None = None,
        step_callback: Callable[[int, float], None] | None = None,
        conditioning: dict[str, Any] | EncodingFailed | None = None,
        **fields: Any,
    ):
        """Generate ``num_outputs_per_prompt`` images (or videos) for one request.

        Args:
            params: the request (resolved here when it is not), or a prompt string with the
                other fields as keyword arguments (diffusers' calling convention).
            generator: draws the initial noise (default: seeded from the request's seed).
            lora: the request's adapters (the LoRA manager's selection); ``None``: the layers'
                active compositions.
            batch: ``(batcher, index)``: run as request ``index`` of a batch (the runner).
            output_type: ``"pil"`` (list of PIL images; videos as lists of frames),
                ``"np"`` (uint8 ``[B, H, W, 3]`` or ``[B, F, H, W, 3]``), ``"media"`` (PIL
                images or :class:`~sglang.multimodal_gen.outputs.Video` objects) or
                ``"latent"`` (the final latents). Ranks without a VAE return ``None`` for the
                pixel types.
            progress: tqdm bar over steps (default: when stderr is a terminal).
            step_callback: ``fn(step_index, seconds)`` after each step.
            conditioning: rank 0's :meth:`encode_for_join` of this request, already on every
                rank (a request joining a running batch of several ranks); ``None``: rank 0
                encodes here and broadcasts.
            fields: request fields when ``params`` is a prompt string.

        Raises:
            InvalidRequestError: a bad request field (``param`` names it).
            ValueError: a bad ``output_type``.
        """
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")
        if isinstance(params, str):
            params = self.spec.params(prompt=params, **fields)
        elif fields:
            raise TypeError(f"unexpected arguments next to a SamplingParams: {sorted(fields)}")
        g = self.new_generation(params, generator, lora, batch)
        p = g.params

        cond, failure = conditioning, None
        if self.rank == 0 and conditioning is None:
            try:
                cond = self._encode(g)
                if p.image:
                    cond = {**cond, **self.encode_images(g)}
            except Exception as e:  # the other ranks wait in the broadcast: send them the failure
                failure, cond = e, EncodingFailed(f"{type(e).__name__}: {e}")
        # in a batch the broadcasts (collectives) take turns in request order on every rank
        with g.batch[0].prologue(g.batch[1]) if g.batch else contextlib.nullcontext():
            if conditioning is None:
                cond = self.broadcast_conditioning(cond)
        if failure is not None:
            raise failure
        if isinstance(cond, EncodingFailed):
            if cond.error is not None:  # rank 0, a joining request: the encoder's own error
                raise cond.error
            raise RuntimeError(f"rank 0 could not encode the prompt: {cond.message}")
        cond = self.prepare_conditioning(g, cond)
        latents = self.prepare_latents(g, cond)
        scheduler, timesteps = self.prepare_timesteps(g, latents)
        check_schedule(scheduler, timesteps, p.num_inference_steps)
        latents, timesteps = self.condition_latents(g, cond, latents, scheduler, timesteps)
        if g.cache is not None:  # image-to-image at strength < 1 runs the last steps only
            g.cache.num_steps = len(timesteps)
        show = sys.stderr.isatty() if progress is None else progress
        plan = [self.select_denoiser(i, t, g) for i, t in enumerate(timesteps)]
        names = {id(m): n for n, m in self.denoisers.items()}
        bar, current = None, None
        for i, t in enumerate(timesteps):
            if plan[i] is not current:  # a new expert: its own progress bar (and placement)
                current = plan[i]
                if self.on_denoiser_change is not None:
                    self.on_denoiser_change(current)
                if bar is not None:
                    bar.close()
                steps = sum(1 for m in plan[i:] if m is current)  # its contiguous run
                desc = (
                    f"denoise ({names.get(id(current))})" if len(self.denoisers) > 1 else "denoise"
                )
                bar = tqdm(total=steps, disable=not show, desc=desc)
            t0 = time.perf_counter()
            pred = self.predict(current, latents, t, i, cond, g)
            latents = self.scheduler_step(scheduler, pred, t, latents)
            latents = self.after_step(g, cond, latents, i, timesteps, scheduler)
            bar.update()
            if step_callback is not None:
                step_callback(i, time.perf_counter() - t0)
        if bar is not None:
            bar.close()
        # non-finite latents would decode to a blank image: fail the request instead (one check)
        check_finite(latents, f"latents after {len(timesteps)} denoising steps", p)
        if output_type == "latent":
            return latents
        if self.vae is None:
            return None
        # in a batch, the latents of every request of one size meet in one call
        geom = (p.height, p.width, getattr(p, "num_frames", None))
        pixels = np.stack(
            self.batch_call(
                self.vae,
                lambda _vae, latents, geom: self.decode_each(latents, g),
                dict(latents=latents, geom=geom),
                ("latents",),
                g,
            )
        )
        if output_type == "np":
            return pixels
        media = self.to_media(pixels, g)
        if g.cache is not None:  # the request's counts travel with its outputs
            for item in media:
                item.info[STEP_CACHE_INFO] = g.cache.summary()
        if output_type == "pil" and pixels.ndim == 5:  # videos as lists of frames
            from PIL import Image

            return [[Image.fromarray(f) for f in v.frames] for v in media]
        return media


def _rows_of(value: Any) -> int:
    """Leading rows of a batched argument (a tensor, a list, or a sized object)."""
    return int(value.shape[0]) if isinstance(value, torch.Tensor) else len(value)
