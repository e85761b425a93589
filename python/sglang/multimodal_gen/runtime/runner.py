"""One TP rank's model: the family's pipeline plus its LoRA manager, driven by named commands.

The family is looked up in the model-family registry from the directory's ``model_index.json``;
nothing here knows a family.

The engine runs one :class:`ModelRunner` in-process (TP 1) or one per worker process (TP N). In
the latter case rank 0 receives every command, reads the LoRA files it names
(:meth:`ModelRunner.prepare`) and broadcasts the command with their contents, and every rank calls
:meth:`ModelRunner.execute` with the same command in the same order, so weights (base and LoRA)
stay identical across ranks. LoRA changes are all-or-nothing across ranks: each rank applies the
change under a savepoint, the ranks agree on the outcome, and when any rank failed every rank
rolls back (:meth:`ModelRunner.execute` with ``agree``). A generation changes no weights: its
adapters are chosen per row in the forward (the LoRA manager's selection), the same on every rank.
Which command needs what is the op table's (:mod:`sglang.multimodal_gen.engine_ops`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from sglang.multimodal_gen.configs.sampling_params import SamplingParams
from sglang.multimodal_gen.distributed.parallel_state import ParallelLayout
from sglang.multimodal_gen.engine_ops import LORA_CHANGE_OPS, get_op
from sglang.multimodal_gen.errors import SGLangError
from sglang.multimodal_gen.layers import cpu_gemm
from sglang.multimodal_gen.layers.attention import set_attention_backend
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.lora.staging import UNCHANGED
from sglang.multimodal_gen.lora.transactions import LoRAStateError
from sglang.multimodal_gen.models.loader import WeightOptions
from sglang.multimodal_gen.models.registry import family_for_model
from sglang.multimodal_gen.runtime.error_transport import pack_error
from sglang.multimodal_gen.runtime.placement import (
    DiTOffloader,
    compile_blocks,
    resolve_dtype,
)
from sglang.multimodal_gen.runtime.runner_lora import (
    blame_lora,
    build_lora_manager,
    field_selections,
)

logger = logging.getLogger(__name__)


class LoRAChangeAborted(SGLangError):
    """This rank's LoRA change succeeded but was undone because another TP rank failed."""


class LoRARollbackError(LoRAStateError):
    """Undoing a LoRA change failed: this rank's LoRA state may differ from the other ranks'."""


__all__ = [
    "LORA_CHANGE_OPS",
    "DiTOffloader",
    "LoRAChangeAborted",
    "LoRARollbackError",
    "ModelRunner",
    "StepCount",
    "build_lora_manager",
    "compile_blocks",
    "resolve_dtype",
]


class StepCount:
    """Denoising steps an engine has finished, all requests together (``value`` only grows).

    Read from other threads (the in-process engine) or, as a ``multiprocessing.Value("q")`` in
    its place, from the launcher's process (rank 0 of worker processes): the server's stall
    detector watches it, so a long generation that keeps stepping is not taken for a hung one.
    """

    def __init__(self) -> None:
        self.value = 0


class ModelRunner:
    """Pipeline + LoRA manager of one rank.

    Args:
        model_path: diffusers-format directory.
        device: this rank's device.
        dtype: parameter/compute dtype (``None``: see :func:`resolve_dtype`).
        tp_rank, tp_size: this rank's TP coordinates (ignored when ``layout`` is given).
        rank: this process's global rank (default ``tp_rank``): rank 0 loads the text encoder and
            the VAE, encodes and decodes.
        layout: the parallel layout (:class:`~sglang.multimodal_gen.distributed.ParallelLayout`);
            the TP coordinates are derived from it and ``rank``.
        lora_dirs: allowed roots for local LoRA paths (``None``: any local path; empty: none, only
            Hub ids and trusted startup adapters).
        allow_hub_lora: Hub LoRA ids missing from the local cache are downloaded (trusted
            startup adapters are in every case).
        generator_device: device of the seeded ``torch.Generator`` (default: the execution
            device's type, as in diffusers' examples; ``"cpu"`` reproduces a CPU-seeded run).
        attention_backend: the SDPA kernel (``layers.attention.set_attention_backend``).
        enable_torch_compile: compile every DiT block with ``torch.compile`` (inductor); the
            first generation of each shape (and after a LoRA change) pays the compile time.
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` for this process
            (``highest``, ``high``, ``medium``), set before the model is built.
        cpu_gemm_backend: the kernel of fp32 linear layers on the CPU for this process
            (``layers.cpu_gemm.set_cpu_gemm_backend``: ``auto``, ``onednn``,
            ``onednn-packed``, ``blas``).
        dit_cpu_offload: on CUDA, keep the DiT weights in pinned host memory between commands
            (:class:`DiTOffloader`); ignored on other devices.
        lora_merge_cache_gb, max_loaded_lora_gb: LoRA memory bounds (:func:`build_lora_manager`).
        weights: the primary transformer's other folder, weights file or online quantization
            (:class:`~sglang.multimodal_gen.models.loader.WeightOptions`).
        step_cache: step caching of the denoisers' blocks (``--cache-method``;
            :class:`~sglang.multimodal_gen.layers.step_cache.StepCacheConfig`), ``None``: off.
    """

    def __init__(
        self,
        model_path: str,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        lora_dirs: Sequence[str] | None = None,
        generator_device: str | None = None,
        dit_cpu_offload: bool = False,
        rank: int | None = None,
        attention_backend: str = "auto",
        enable_torch_compile: bool = False,
        float32_matmul_precision: str = "highest",
        cpu_gemm_backend: str = "auto",
        layout: ParallelLayout | None = None,
        lora_merge_cache_gb: float | None = None,
        max_loaded_lora_gb: float | None = None,
        allow_hub_lora: bool = False,
        weights: WeightOptions | None = None,
        step_cache: StepCacheConfig | None = None,
    ):
        from sglang.multimodal_gen.configs.parallel import check_float32_matmul_precision

        check_float32_matmul_precision(float32_matmul_precision, "float32_matmul_precision")
        # process-wide (torch has no narrower scope); worker processes each set their own
        torch.set_float32_matmul_precision(float32_matmul_precision)
        cpu_gemm.set_cpu_gemm_backend(cpu_gemm_backend)  # process-wide as well
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.rank = tp_rank if rank is None else rank
        self.layout = layout or ParallelLayout(tp_size=tp_size)
        if layout is not None:
            tp_rank, tp_size = layout.coords(self.rank)["tp"], layout.tp_size
        self.tp_rank = tp_rank
        self.family = family_for_model(model_path)
        arch = self.family.read_config(model_path)
        self.family.check_parallel_layout(arch, self.layout)
        self.pipeline = self.family.pipeline_class().from_pretrained(
            model_path,
            self.family,
            device=self.device,
            dtype=self.dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
            load_vae=(self.rank == 0),
            load_text=(self.rank == 0),
            rank=self.rank,
            weights=weights,
        )
        self.pipeline.enable_step_cache(step_cache)  # --cache-method (None: off)
        set_attention_backend(attention_backend, self.device)
        if enable_torch_compile:
            for denoiser in self.pipeline.denoisers.values():
                compile_blocks(denoiser)
        if generator_device is not None:
            self.pipeline.generator_device = generator_device
        offload = dit_cpu_offload and self.device.type == "cuda"
        self.lora_manager = build_lora_manager(
            self.pipeline.denoisers,
            self.family,
            lora_dirs,
            offload,
            merge_cache_gb=lora_merge_cache_gb,
            max_loaded_gb=max_loaded_lora_gb,
            allow_hub_download=allow_hub_lora,
        )
        # One offloader per denoiser; with several (two-expert models) a generation keeps only
        # the expert that runs on the accelerator, moved in when the loop switches to it.
        self.offloaders = (
            {n: DiTOffloader(m, self.device) for n, m in self.pipeline.denoisers.items()}
            if offload
            else {}
        )
        self.per_expert_offload = len(self.offloaders) > 1
        self._expert_lock = threading.Lock()
        self.steps = StepCount()  # a worker's launcher may put a shared counter in its place
        if self.per_expert_offload:
            self.pipeline.on_denoiser_change = self._activate_expert

    def _activate_expert(self, module: torch.nn.Module | None) -> None:
        """Only ``module`` on the accelerator (``None``: none). Generations never change the
        weights (a request's adapters are applied per row in the forward), so the host copies
        need no write-back."""
        with self._expert_lock:  # the requests of a batch switch experts at the same step
            for off in self.offloaders.values():
                if off.module is not module:
                    off.offload(dirty=False)
            for off in self.offloaders.values():
                if off.module is module:
                    off.onload()

    @property
    def spatial_factor(self) -> int:
        return self.pipeline.spatial_factor

    @property
    def spec(self):
        """What a request to this model may ask for (the pipeline's ``RequestSpec``)."""
        return self.pipeline.spec

    def info(self) -> dict:
        """What the engine and the server need to know of the model (picklable; every value
        but ``spec`` JSON-able)."""
        arch = self.pipeline.transformer.cfg
        return {
            "family": self.family.name,
            "family_display_name": self.family.display_name,
            "pipeline_class": self.family.pipeline_classes[0],
            "spatial_factor": self.spatial_factor,
            "spec": self.pipeline.spec,
            "defaults": self.pipeline.spec.as_dict(),
            "tp_sizes": self.family.valid_tp_sizes(arch),
            "parallel": {
                "tp_size": self.layout.tp_size,
                "ulysses_degree": self.layout.ulysses_degree,
                "ring_degree": self.layout.ring_degree,
                "cfg_degree": self.layout.cfg_degree,
            },
            "dtype": str(self.dtype),
            # how the primary transformer's weights are stored ("modelopt fp8", "online fp8"...)
            "quantization": getattr(self.pipeline.transformer, "quantization", None),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cpu_gemm_backend": cpu_gemm.cpu_gemm_backend(),
            # two experts offloaded one at a time: no continuous batching (engine)
            "per_expert_offload": bool(self.per_expert_offload),
            "lora_targets": list(self.lora_manager.target_names),
        }

    # ------------------------------------------------------------------ commands
    def prepare(self, op: str, kwargs: dict) -> dict:
        """Read from disk what command ``op`` needs, once, before it is broadcast (TP rank 0).

        ``set_lora``: every path is read here (:meth:`LoRAManager.read_source`) and the command
        carries the contents (``sources``) instead of the ``trusted`` flag, so every rank converts
        and applies the same tensors; a path whose loaded adapter's files are unchanged is not
        read (it is sent as ``"unchanged"``). ``generate`` / ``generate_batch``: the requests'
        adapters are selected here (``selection`` / ``selections``; ``generate`` also those of a
        family's own adapter fields, ``lora_fields``: :func:`field_selections`), so every rank
        runs the same rows with the same slots and a refused composition is answered before any
        rank starts.
        Other commands are returned unchanged.

        Raises:
            InvalidRequestError / LoRAFormatError: a path that cannot be read (``lora_path``).
            NotFoundError / InvalidRequestError: a request's adapters (``lora``, or the family's
                adapter field that names them).
        """
        if op == "generate" and "selection" not in kwargs:
            params = kwargs["params"]
            selection = self.lora_manager.selection(params.lora)
            lora_fields = field_selections(self.lora_manager, params)
            return dict(kwargs, selection=selection, lora_fields=lora_fields)
        if op == "generate_batch" and "selections" not in kwargs:
            return dict(kwargs, selections=self._selections(kwargs["reqs"]))
        if op != "set_lora" or "sources" in kwargs:
            return kwargs
        kwargs = dict(kwargs)
        trusted = bool(kwargs.pop("trusted", False))
        kwargs["sources"] = self._read_sources(
            kwargs["args"].nicknames, kwargs["args"].paths, trusted
        )
        return kwargs

    def _read_sources(
        self, nicknames: Sequence[str], paths: Sequence[str | None], trusted: bool
    ) -> dict[str, Any]:
        """``{path: (state_dict, metadata) or "unchanged"}``: each path read at most once, and
        not at all when every nickname given it holds its unchanged file."""
        manager = self.lora_manager
        users: dict[str, list[str]] = {}
        for name, path in zip(nicknames, paths):
            if path is not None:
                users.setdefault(path, []).append(name)
        return {
            p: UNCHANGED
            if all(manager.unchanged(n, p, trusted) for n in names)
            else manager.read_source(p, trusted)
            for p, names in users.items()
        }

    @contextlib.contextmanager
    def _weights_on_device(self, op: str) -> Iterator[None]:
        if not self.offloaders or not get_op(op).needs_weights:
            yield  # read-only commands (list_loras, the heartbeat) never move weights
            return
        if op in ("generate", "generate_batch") and self.per_expert_offload:
            try:  # the pipeline moves each expert in when it starts running
                yield
            finally:
                self._activate_expert(None)
            return
        for off in self.offloaders.values():
            off.onload()
        try:
            yield
        finally:
            for off in self.offloaders.values():
                off.offload(dirty=get_op(op).changes_lora)

    def execute(
        self,
        op: str,
        kwargs: dict,
        agree: Callable[[BaseException | None], bool] | None = None,
    ) -> Any:
        """Run command ``op`` (a method name below) with ``kwargs``.

        Args:
            agree: TP only. For LoRA-changing commands (:data:`LORA_CHANGE_OPS`) it is called on
                every rank, exactly once, with this rank's error (or ``None``) and returns whether
                every rank succeeded. The change is applied under a savepoint that is then
                committed, or rolled back on every rank when any rank failed.

        Raises:
            ValueError: unknown command; else whatever the command raises.
            LoRAChangeAborted: this rank's change was rolled back because another rank failed.
            LoRARollbackError: the rollback itself failed (this rank may now differ).
        """
        fn = getattr(self, f"cmd_{get_op(op).name}")
        if agree is None or op not in LORA_CHANGE_OPS:
            with self._weights_on_device(op):
                try:
                    return fn(**kwargs)
                except LoRAStateError as e:
                    if agree is None or isinstance(e, LoRARollbackError):
                        raise
                    raise LoRARollbackError(f"TP rank {self.tp_rank}: {e.message}") from e
        manager = self.lora_manager
        out, err, began = None, None, False
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self._weights_on_device(op))
                manager.begin_change()
                began = True
                out = fn(**kwargs)
            except BaseException as e:
                err = e
            all_ok = agree(err)  # a collective: reached on every rank whatever happened above
            if began and all_ok:
                manager.commit_change()
            elif began:
                try:
                    manager.rollback_change()
                except BaseException as e:  # the manager already reset its layers
                    raise LoRARollbackError(
                        f"TP rank {self.tp_rank}: undoing a failed LoRA change failed ({e}); the "
                        "ranks' LoRA states may differ"
                    ) from e
        if err is not None:
            raise err
        if not all_ok:
            raise LoRAChangeAborted(
                f"{op} was undone on TP rank {self.tp_rank}: another rank failed"
            )
        return out

    def cmd_generate(
        self,
        params: SamplingParams,
        progress: bool | None = None,
        selection: Any = None,
        lora_fields: dict | None = None,
    ):
        """One request: its outputs (PIL images or ``Video`` objects) on the rank that decodes,
        ``None`` on the others. The request's adapters (``params.lora``; ``None``: the active
        ones) are applied per row in the forward through the LoRA manager's selection; no weight
        changes.

        Args:
            selection: the selection rank 0 made (:meth:`prepare`); ``None``: made here.
            lora_fields: the selections of the family's own adapter fields rank 0 made
                (:func:`field_selections`); ``None``: made here. Handed to the pipeline as
                ``lora_fields`` when there are any.

        Raises:
            InvalidRequestError / NotFoundError: a bad field or an adapter that is not loaded.
        """
        lora = selection if selection is not None else self.lora_manager.selection(params.lora)
        if lora_fields is None:
            lora_fields = field_selections(self.lora_manager, params)
        extra = {"lora_fields": lora_fields} if lora_fields else {}
        with blame_lora(params.lora):
            return self.pipeline(params, lora=lora, **extra, **self._call_kwargs(progress))

    def _selections(self, reqs: list[SamplingParams]) -> list:
        """Each request's selection, or ``(False, packed error)`` for one that is refused."""

        out: list = []
        for params in reqs:
            try:
                out.append(self.lora_manager.selection(params.lora))
            except Exception as e:
                out.append((False, pack_error(e)))
        return out

    def cmd_generate_batch(
        self,
        reqs: list[SamplingParams],
        progress: bool | None = None,
        selections=None,
        admit: Callable[[int], Sequence[SamplingParams]] | None = None,
        on_done: Callable[[int, tuple], None] | None = None,
    ):
        """Several requests in one denoising loop (``pipelines.batching``): each keeps its own
        seed, prompts, guidance and adapters; their module calls are batched step by step, every
        row computed with its own request's adapters (nothing is applied to the layers, so no
        row sees another's adapters). A request whose adapters are refused fails alone.

        Args:
            selections: what rank 0 selected (:meth:`prepare`); ``None``: selected here.
            admit: continuous batching (a callable): asked at every step boundary with the
                number of requests running, returns the resolved requests that join the loop now
                (numbered after ``reqs``, in the order given), each a ``SamplingParams`` (its
                adapters selected here) or a ``(params, selection, conditioning)`` triple from
                rank 0 (a worker's :class:`~sglang.multimodal_gen.runtime.worker.ContinuousLink`:
                the adapters selected as :meth:`prepare` does, the prompt encoded by
                ``pipeline.encode_for_join``). With several ranks it is asked only at the
                boundaries every rank has (``StepBatcher(shared=...)``). Never
                asked while two experts are offloaded one at a time (``per_expert_offload``:
                requests at different steps would want different experts on the device at
                once); the waiting requests then run in the next batch.
            on_done: ``on_done(index, (ok, payload))`` as soon as request ``index`` (of ``reqs``
                and then of the admitted ones) has finished, from its request thread, while the
                others go on. The loop then keeps nothing of the request (a loop that others keep
                joining may run for as long as the server does).

        Returns one ``(True, outputs)`` or ``(False, packed error)`` per request, in order (the
        admitted ones after ``reqs``; with ``on_done``, ``(ok, None)``): one request's failure
        does not fail the others.
        """
        from sglang.multimodal_gen.pipelines.batching import StepBatcher

        if selections is None:
            selections = self._selections(reqs)
        reqs, selections = list(reqs), list(selections)
        out: list = [s if isinstance(s, tuple) else None for s in selections]

        def finish(i: int, result: tuple) -> None:
            out[i] = result
            if on_done is not None:
                out[i], reqs[i], selections[i] = (result[0], None), None, None
                on_done(i, result)

        for i, s in enumerate(out):
            if s is not None:
                finish(i, s)
        live = [i for i in range(len(reqs)) if out[i] is None]
        # with several ranks, joins happen at the boundaries every rank has (the DiT calls)
        shared = list(self.pipeline.denoisers.values()) if self.layout.world_size > 1 else None
        batcher = StepBatcher(len(live), shared=shared)
        conds: dict[int, Any] = {}  # joined requests' conditioning from rank 0

        def run(i: int, slot: int) -> None:
            try:
                with blame_lora(reqs[i].lora):
                    images = self.pipeline(
                        reqs[i],
                        lora=selections[i],
                        batch=(batcher, slot),
                        conditioning=conds.pop(i, None),
                        **self._call_kwargs(False),
                    )
                result = (True, images)
            except BaseException as e:  # reported per request
                result = (False, pack_error(e))
            finish(i, result)

        def joining(running: int) -> list:
            """The bodies of the requests ``admit`` gives now (a refused selection is answered
            at once and joins nothing)."""
            bodies = []
            for item in admit(running):
                if isinstance(item, tuple):  # from rank 0: selection (None: no adapters), cond
                    params, selection, cond = item
                else:
                    params, selection, cond = item, self._selections([item])[0], None
                i = len(reqs)
                reqs.append(params)
                selections.append(selection)
                if cond is not None:
                    conds[i] = cond
                out.append(None)
                if isinstance(selections[i], tuple):
                    finish(i, selections[i])
                else:
                    bodies.append(functools.partial(run, i))
            return bodies

        joins = admit is not None and not self.per_expert_offload
        batcher.run(
            [functools.partial(run, i, slot) for slot, i in enumerate(live)],
            admit=joining if joins else None,
        )
        return out

    def _call_kwargs(self, progress: bool | None) -> dict:
        return dict(
            output_type="media",
            progress=progress if self.rank == 0 else False,
            step_callback=self._count_step,
        )

    def _count_step(self, step_index: int, seconds: float) -> None:
        self.steps.value += 1  # unlocked: one writer process; a lost count in a batch is harmless

    def cmd_set_lora(self, args, sources=None, trusted=False):
        """``set_lora`` with normalised arguments (``SetLoRAArgs``); ``sources``: the files'
        contents read by rank 0 (:meth:`prepare`), else they are read here."""
        if sources is None:
            sources = self._read_sources(args.nicknames, args.paths, trusted)
        return self.lora_manager.apply_set_lora(args, sources=sources)

    def cmd_unset_lora(self, target="all"):
        return self.lora_manager.unset_lora(target)

    def cmd_unload_lora(self, nickname):
        return self.lora_manager.unload_adapter(nickname)

    def cmd_merge_lora_weights(self, target="all"):
        return self.lora_manager.merge(target)

    def cmd_unmerge_lora_weights(self, target="all"):
        return self.lora_manager.unmerge(target)

    def cmd_list_loras(self):
        return self.lora_manager.list_loras()

    def cmd_noop(self):
        return None
