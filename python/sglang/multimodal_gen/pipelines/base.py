"""The staged pipeline every family builds on: encode -> latents -> timesteps -> denoise -> decode.

:class:`StagedPipeline` owns the loop and the plumbing shared by every family (component loading
as diffusers resolves it, prompt encoding on one rank with the result broadcast, progress, step
timing, the denoiser switch hook, decoding through diffusers' ``VaeImageProcessor``). A family
subclass overrides stages, never the loop:

======================  ===========================================================================
``prompt_list``         the texts a request encodes (prompt; negative prompt under CFG)
``encode_prompt_list``  texts -> conditioning (a dict of tensors); runs on TP rank 0 only
``prepare_latents``     initial noise in the family's latent layout (diffusers' ``randn_tensor``)
``prepare_timesteps``   a fresh scheduler from the directory's config + its timesteps
``select_denoiser``     which denoiser runs step ``i`` (Wan2.2 switches experts mid-loop)
``predict``             one model evaluation with the family's CFG policy -> scheduler input
``decode``              latents -> uint8 pixels ``[B, H, W, 3]`` (VAE ranks only)
======================  ===========================================================================

Under tensor parallelism every rank runs the same loop on the same inputs; the text encoders
are loaded and run on rank 0 only, and their output is broadcast on the CPU control group, so
every rank sees bit-identical conditioning.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from sglang.multimodal_gen.distributed import (
    broadcast_tensors_cpu,
)
from sglang.multimodal_gen.models.components import load_component, read_model_index
from sglang.multimodal_gen.models.loader import load_denoiser, read_json
from sglang.multimodal_gen.models.registry import ModelFamily, SamplingDefaults
from sglang.multimodal_gen.pipelines.batching import current_batcher
from sglang.multimodal_gen.pipelines.cfg_parallel import cfg_parallel_call
from sglang.multimodal_gen.pipelines.common import (
    EncodingFailed,
    GenerationInputs,
    check_finite,
    flow_shift_helpers,
    latents_to_uint8,
)

__all__ = ["GenerationInputs", "StagedPipeline", "check_finite", "latents_to_uint8"]


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

    Class attributes for subclasses:
        text_components: components used only by :meth:`encode_prompt` (rank 0 loads them).
        spatial_factor: from :meth:`compute_spatial_factor` (VAE factor x patch size).
        shifted_schedule: the family's timesteps come from :meth:`shifted_timesteps` (its
            diffusers helpers are then imported when the pipeline is built, not by a request).
    """

    text_components: tuple[str, ...] = ("text_encoder", "tokenizer")
    family_name: str = ""
    shifted_schedule: bool = False
    # Called with the denoiser about to run whenever the loop switches denoisers (two-expert
    # models): the runner's per-expert CPU offload keeps only that one on the accelerator.
    on_denoiser_change: Callable[[torch.nn.Module], None] | None = None

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
        self.defaults: SamplingDefaults = family.sampling_defaults(self.transformer.cfg)
        if self.shifted_schedule:
            flow_shift_helpers()

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
    ) -> StagedPipeline:
        """Load a diffusers directory of ``family``: our denoisers, the rest as diffusers would.

        Args:
            family: the family (default: the subclass's ``family_name``).
            load_vae: load the VAE (``False`` on TP ranks that do not decode).
            load_text: load text encoders and tokenizers (``False`` on ranks > 0, which
                receive the conditioning from rank 0).
            rank: global rank (default ``tp_rank``).

        Raises:
            FileNotFoundError / ValueError (``ModelLoadError``): messages name file and tensor.
        """
        from sglang.multimodal_gen.models.loader import ModelLoadError
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
                comps[name] = load_denoiser(
                    folder,
                    family.denoiser(name),
                    dtype=dtype,
                    device=device,
                    tp_rank=tp_rank,
                    tp_size=tp_size,
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
        return cls(
            family, comps, configs, device=device, tp_rank=rank, tp_size=size,
            pipeline_config=index.config, rank=rank if global_rank is None else global_rank,
        )  # fmt: skip

    # ------------------------------------------------------------------ geometry
    def compute_vae_scale_factor(self) -> int:
        """``2 ** (len(vae.block_out_channels) - 1)``, from the VAE config (present on every rank)."""
        blocks = self.configs.get("vae", {}).get("block_out_channels", [0] * 4)
        return 2 ** (len(blocks) - 1)

    def compute_spatial_factor(self) -> int:
        """Height and width must be multiples of this. Default: VAE factor x 2 (2x2 patches)."""
        return self.vae_scale_factor * 2

    def check_size(self, height: int, width: int) -> None:
        """Raises ``ValueError`` unless both are positive multiples of :attr:`spatial_factor` and
        at most the family's ``max_image_size``."""
        s = self.spatial_factor
        for name, v in (("height", height), ("width", width)):
            if v <= 0 or v % s:
                raise ValueError(f"{name} must be a positive multiple of {s}, got {v}")
            if v > self.defaults.max_image_size:
                raise ValueError(f"{name} must be <= {self.defaults.max_image_size}, got {v}")

    # ------------------------------------------------------------------ stages
    def prompt_list(self, inp: GenerationInputs) -> list[str]:
        """The texts a request encodes (its prompt, and its negative prompt under CFG)."""
        raise NotImplementedError

    def encode_prompt_list(self, prompts: list[str], max_sequence_length: int) -> dict[str, Any]:
        """Texts -> conditioning: each value holds one entry per prompt along dim 0 (a tensor
        ``[P, ...]`` or a list of ``P`` tensors). Rank 0 only; the result is broadcast."""
        raise NotImplementedError

    def encode_prompt(self, inp: GenerationInputs) -> dict[str, Any]:
        """One request's conditioning: :meth:`encode_prompt_list` of its :meth:`prompt_list`."""
        return self.encode_prompt_list(self.prompt_list(inp), inp.max_sequence_length)

    def encode_group_key(self, inp: GenerationInputs) -> Any:
        """Requests of a batch whose keys are equal share one encoder call (default: all of
        them). A family whose encoder pads a call's texts to the longest one returns the
        request's own padded length, so that sharing a call changes no request's conditioning
        (its image stays what it would be alone)."""
        return None

    def encode_prompts(self, inps: list[GenerationInputs]) -> list[dict[str, Any] | Exception]:
        """:meth:`encode_prompt` of several requests with one encoder call per group of
        requests (same ``max_sequence_length`` and :meth:`encode_group_key`): the group's texts
        concatenated, the result cut back per request. Every request of a group whose joint
        call fails is encoded alone, so that a failure is returned (not raised) for the
        requests it belongs to."""
        results: list[dict[str, Any] | Exception | None] = [None] * len(inps)
        groups: dict[Any, list[int]] = {}
        for i, inp in enumerate(inps):
            try:
                key = (inp.max_sequence_length, self.encode_group_key(inp))
            except Exception as e:  # e.g. the tokenizer refuses the text: this request fails
                results[i] = e
                continue
            groups.setdefault(key, []).append(i)
        for (max_len, _), idx in groups.items():
            if len(idx) > 1:
                lists = [self.prompt_list(inps[i]) for i in idx]
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
                    results[i] = self.encode_prompt(inps[i])
                except Exception as e:
                    results[i] = e
        return results

    def _encode(self, inp: GenerationInputs) -> dict[str, Any]:
        """:meth:`encode_prompt`; in a batch, one encoder call for every request of the batch
        (a rendezvous like the DiT calls, before the prologue turns)."""
        out = self.batch_call(
            self,
            lambda _pipe, inps, max_sequence_length: self.encode_prompts(inps),
            dict(inps=[inp], max_sequence_length=inp.max_sequence_length),
            ("inps",),
        )
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def prepare_latents(self, inp: GenerationInputs, cond: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def prepare_timesteps(self, inp: GenerationInputs, latents: torch.Tensor):
        """``(scheduler, timesteps)``: a fresh scheduler (so concurrent state never leaks)."""
        raise NotImplementedError

    def prepare_conditioning(self, inp: GenerationInputs, cond: dict[str, Any]) -> dict[str, Any]:
        """Per-request work on the broadcast conditioning before the loop (e.g. a caption
        refiner that does not depend on the timestep). Default: nothing. In a batch it runs in
        the request threads concurrently: a module call with collectives (TP layers) must go
        through :meth:`batch_call`, which runs it once for the batch in request order."""
        return cond

    def batch_call(
        self, module: Any, fn: Callable[..., Any], args: dict[str, Any], batched: tuple[str, ...]
    ) -> Any:
        """``fn(module, **args)``; inside a batch, one call for every request of the batch.

        The ``batched`` arguments (lists, tensors along dim 0, or objects with ``concat`` /
        ``select`` such as Z-Image's caption context) are concatenated in request order, the
        others must be equal (else the calls run one after the other, in request order); each
        request gets its own rows of the result. Like the DiT calls it is a rendezvous: every
        request of the batch must make the call.
        """
        member = current_batcher()
        if member is None:
            return fn(module, **args)
        run = lambda m, _rows, a, _batched: fn(m, **a)  # noqa: E731
        return member[0].submit(member[1], run, module, 1, args, batched)

    def select_denoiser(self, step_index: int, t: torch.Tensor, inp: GenerationInputs):
        """The denoiser of step ``step_index`` (default: the first one)."""
        return self.transformer

    def predict(
        self,
        denoiser: torch.nn.Module,
        latents: torch.Tensor,
        t: torch.Tensor,
        step_index: int,
        cond: dict[str, Any],
        inp: GenerationInputs,
    ) -> torch.Tensor:
        """The scheduler's ``model_output`` for step ``step_index`` (CFG policy included)."""
        raise NotImplementedError

    def scheduler_step(self, scheduler, pred: torch.Tensor, t, latents: torch.Tensor):
        return scheduler.step(pred, t, latents, return_dict=False)[0]

    def decode(self, latents: torch.Tensor, inp: GenerationInputs) -> np.ndarray:
        """Latents -> uint8 ``[B, H, W, 3]`` (ranks with a VAE)."""
        raise NotImplementedError

    def decode_each(self, latents: torch.Tensor, inp: GenerationInputs) -> list[np.ndarray]:
        """:meth:`decode` one image (or video) at a time: the VAE's convolutions round
        differently at other batch sizes (oneDNN picks its kernels by shape; measured: one level
        off in a few pixels), so this keeps an image bit-identical whether its request ran alone
        or in a batch. The price: a batch's decode no longer shares its calls (measured about
        3 ms per 64x64 image with the demo VAE on 2 CPU cores; less, relatively, at larger
        sizes, where one image keeps the device busy)."""
        return [x for i in range(latents.shape[0]) for x in self.decode(latents[i : i + 1], inp)]

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
        calculate_shift, retrieve_timesteps = flow_shift_helpers()
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

    def broadcast_conditioning(self, cond: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0's conditioning on every rank (on this rank's device; identity in one process)."""
        return broadcast_tensors_cpu(cond, src=0, device=self.device)

    def run_branches(
        self, denoiser: torch.nn.Module, rows: int, args: dict[str, Any], batched: tuple[str, ...]
    ) -> Any:
        """``denoiser(**args)`` where the ``batched`` arguments stack ``rows`` CFG branches along
        dim 0, branch-major (``[cond rows, uncond rows]``).

        Without CFG parallelism (or with one branch) it is that one call. With
        ``--enable-cfg-parallel`` each rank of the CFG group runs only its branch (the TP / SP
        groups inside it are that branch's) and one all-gather over the CFG group reassembles
        the output, so the caller sees the same ``[rows * b, ...]`` result.

        Args:
            rows: number of branches in the batched arguments (1 or 2).
            args: keyword arguments of the denoiser; a batched value is a tensor, a list, or an
                object with ``select(index)`` (Z-Image's caption context).

        Returns:
            The denoiser output: a tensor, or a list of per-item tensors (Z-Image).

        Raises:
            ValueError: ``rows`` differs from the CFG degree while CFG parallelism is on.
        """
        member = current_batcher()
        if member is not None:  # several requests in one loop: one DiT call per step for all
            batcher, index = member
            return batcher.submit(index, cfg_parallel_call, denoiser, rows, args, batched)
        return cfg_parallel_call(denoiser, rows, args, batched)

    def resolve_inputs(self, **kwargs) -> GenerationInputs:
        """:class:`GenerationInputs` from keyword arguments, unset ones from the defaults."""
        d = self.defaults
        base = dict(
            height=d.height,
            width=d.width,
            num_inference_steps=d.num_inference_steps,
            guidance_scale=d.guidance_scale,
            true_cfg_scale=d.true_cfg_scale,
            max_sequence_length=d.max_sequence_length,
            num_frames=d.num_frames,
            guidance_scale_2=d.guidance_scale_2,
        )
        names = {f.name for f in fields(GenerationInputs)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown generation argument(s): {unknown}")
        base.update({k: v for k, v in kwargs.items() if v is not None})
        return GenerationInputs(**base)

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def __call__(
        self,
        prompt: str,
        output_type: str = "pil",
        progress: bool | None = None,
        step_callback: Callable[[int, float], None] | None = None,
        **kwargs,
    ):
        """Generate ``num_images`` images for one prompt.

        Args:
            prompt: the text prompt.
            output_type: ``"np"`` (uint8 ``[B, H, W, 3]``), ``"pil"`` (list of PIL images) or
                ``"latent"`` (the final latents). Ranks without a VAE return ``None`` for the
                image types.
            progress: tqdm bar over steps (default: when stderr is a terminal).
            step_callback: ``fn(step_index, seconds)`` after each step.
            kwargs: the fields of :class:`GenerationInputs` (unset: the family's defaults).

        Raises:
            ValueError: bad size, step count, image count or output type.
        """
        inp = self.resolve_inputs(prompt=prompt, **kwargs)
        self.check_size(inp.height, inp.width)
        if inp.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {inp.num_inference_steps}")
        if inp.num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {inp.num_images}")
        if output_type not in ("pil", "np", "latent"):
            raise ValueError(f"output_type must be 'pil', 'np' or 'latent', got {output_type!r}")

        member = current_batcher()
        cond, failure = None, None
        if self.rank == 0:
            try:
                cond = self._encode(inp)
            except Exception as e:  # the other ranks wait in the broadcast: send them the failure
                failure, cond = e, EncodingFailed(f"{type(e).__name__}: {e}")
        # in a batch the broadcasts (collectives) take turns in request order on every rank
        with member[0].prologue(member[1]) if member else contextlib.nullcontext():
            cond = self.broadcast_conditioning(cond)
        if failure is not None:
            raise failure
        if isinstance(cond, EncodingFailed):
            raise RuntimeError(f"rank 0 could not encode the prompt: {cond.message}")
        cond = self.prepare_conditioning(inp, cond)
        latents = self.prepare_latents(inp, cond)
        scheduler, timesteps = self.prepare_timesteps(inp, latents)
        show = sys.stderr.isatty() if progress is None else progress
        plan = [self.select_denoiser(i, t, inp) for i, t in enumerate(timesteps)]
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
            pred = self.predict(current, latents, t, i, cond, inp)
            latents = self.scheduler_step(scheduler, pred, t, latents)
            bar.update()
            if step_callback is not None:
                step_callback(i, time.perf_counter() - t0)
        if bar is not None:
            bar.close()
        # non-finite latents would decode to a blank image: fail the request instead (one check)
        check_finite(latents, f"latents after {len(timesteps)} denoising steps", inp)
        if output_type == "latent":
            return latents
        if self.vae is None:
            return None
        # in a batch, the latents of every request of one size meet in one call
        images = np.stack(
            self.batch_call(
                self.vae,
                lambda _vae, latents, geom: self.decode_each(latents, inp),
                dict(latents=latents, geom=(inp.height, inp.width, inp.num_frames)),
                ("latents",),
            )
        )
        if output_type == "np" or images.ndim == 5:  # videos stay [B, F, H, W, 3] arrays
            return images
        from PIL import Image

        return [Image.fromarray(a) for a in images]
