"""``DiffusionEngine``: the blocking generation API over one model, at any parallel size.

The engine resolves the model, the device and the parallel layout, checks the settings, and
chooses its executor once (:mod:`~sglang.multimodal_gen.runtime.executors`): in this process
for one rank (:class:`~.executors.UniProcExecutor`), else worker processes for this node's ranks
(:class:`~.executors.MultiprocExecutor`). Every public method becomes one command of the op table
(:mod:`~sglang.multimodal_gen.engine_ops`) run by the executor, one caller at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from sglang.multimodal_gen import errors as errors_mod
from sglang.multimodal_gen.configs.launch_plan import DEFAULT_DIST_TIMEOUT_S
from sglang.multimodal_gen.configs.parallel import check_float32_matmul_precision
from sglang.multimodal_gen.configs.sampling_params import RequestSpec, SamplingParams
from sglang.multimodal_gen.engine_ops import get_op
from sglang.multimodal_gen.errors import EngineDeadError
from sglang.multimodal_gen.layers.attention import check_attention_backend
from sglang.multimodal_gen.layers.cpu_gemm import check_cpu_gemm_backend
from sglang.multimodal_gen.layers.step_cache import StepCacheConfig
from sglang.multimodal_gen.lora.requests import SetLoRAArgs, normalize_set_lora
from sglang.multimodal_gen.runtime.error_transport import unpack_error
from sglang.multimodal_gen.runtime.executors import (
    Executor,
    MultiprocExecutor,
    UniProcExecutor,
)
from sglang.multimodal_gen.runtime.model_source import (
    check_device,
    job_kwargs,
    layout_for_model,
    resolve_model_path,
    weight_options,
)
from sglang.multimodal_gen.runtime.nodes import launch_plan, multinode_kwargs
from sglang.multimodal_gen.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)


class DiffusionEngine:
    """Load a model and serve blocking calls (one caller at a time; calls are serialized).

    Args:
        model_path: diffusers-format directory, or a Hugging Face Hub repo id (``owner/name``)
            downloaded into the Hub cache when it is not there (only the files the engine reads;
            ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HOME``/``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` as
            ``huggingface_hub`` reads them); ``None`` uses the embedded tiny default model
            (random weights: noise images), built once under the user cache dir.
        revision: the Hub revision of ``model_path`` (a branch, tag or commit; default the
            repo's default branch); ignored for a local directory.
        transformer_path: a transformer folder (own ``config.json`` + safetensors, e.g. a
            ModelOpt FP8 / NVFP4 export) replacing the model's ``transformer/``; a local folder
            or a Hub repo id (``--transformer-path``).
        transformer_weights_path: a safetensors file or folder, or a Hub id (``owner/name`` or
            ``owner/name/file.safetensors``), replacing the weights of ``transformer/`` (its
            ``config.json`` kept; a quantization config may sit in the safetensors metadata).
            Exclusive with ``transformer_path`` (``--transformer-weights-path``).
        quantization: quantize the floating-point transformer while loading (``"fp8"``;
            ``--quantization``). The three reach every rank's loader as one
            :class:`~sglang.multimodal_gen.models.loader.WeightOptions`.
        step_cache: step caching of the DiT blocks on every rank (``--cache-method``;
            :class:`~sglang.multimodal_gen.layers.step_cache.StepCacheConfig`), ``None``: off.
        tp_size: tensor-parallel size.
        sp_degree, ulysses_degree, ring_degree: sequence parallelism (Ulysses all-to-all x ring
            attention); unset degrees are chosen as ``configs.parallel.resolve_layout`` does,
            with the model's head count.
        cfg_degree: 2 runs the two CFG branches on different ranks (``--enable-cfg-parallel``).
            The engine runs ``tp_size * ulysses_degree * ring_degree * cfg_degree`` local
            processes when that is > 1.
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available.
        dtype: ``"auto"|"float32"|"float16"|"bfloat16"`` or a ``torch.dtype`` (auto: bf16 on
            CUDA, fp32 on CPU).
        lora_dirs: allowed roots for local LoRA paths (realpath containment). ``None`` (default):
            any local path, as for a user's own ``sglang generate``. Empty: no local path (a
            server started without ``--lora-dir``); Hub ids in the local Hugging Face cache and
            ``set_lora(..., trusted=True)`` (startup ``--lora-path``) are accepted in every case.
        allow_hub_lora: a ``set_lora`` Hub id (``owner/name``) that is not in the local cache is
            downloaded (default ``True``, as ``sglang generate``; ``sglang serve`` passes its
            ``--enable-hub-lora``, off by default). ``False``: Hub ids from the local cache only;
            ``trusted=True`` calls (startup ``--lora-path``) download in every case.
        generator_device: device of the seeded generator (default: the execution device type).
        attention_backend: SDPA kernel (``auto``, ``flash``, ``efficient``, ``cudnn``, ``math``).
        enable_torch_compile: ``torch.compile`` the DiT blocks (opt-in; compile time on first use).
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` in the engine's
            processes (``highest``, ``high``, ``medium``); with TP 1 that is the calling process.
        cpu_gemm_backend: the kernel of fp32 linear layers on the CPU in the engine's processes
            (``auto``, ``onednn``, ``onednn-packed``, ``blas``: ``layers.cpu_gemm``).
        dit_cpu_offload: on CUDA keep the DiT weights in pinned host memory between calls
            (moved to the GPU for each call); ignored, with one log line, without a GPU.
        nnodes, node_rank, dist_init_addr, dist_timeout_s: multi-node launch (``--nnodes``,
            ``--node-rank``, ``--dist-init-addr HOST:PORT``, ``--dist-timeout``); the engine runs
            on the node with rank 0 (node 0, or torchrun's ``RANK=0``) and starts that node's
            ranks. Under ``torchrun`` the placement comes from its environment.
        startup_timeout_s: how long TP workers may take to load.
        heartbeat_s: idle period after which rank 0 pings the other ranks.
        lora_merge_cache_gb: bound of the LoRA merge cache per rank, GiB (default 1).
        max_loaded_lora_gb: bound of the loaded LoRA adapters per rank, GiB (default 8).
        _worker_setup: tests only: ``fn(runner, rank)`` run in every TP worker after its runner
            is built (a picklable module-level function).

    Raises:
        ValueError / FileNotFoundError: bad model directory or TP size (e.g. ``n_heads`` not
            divisible), with the message of the failing rank; a transformer path that does not
            exist; a bad quantized checkpoint (``ModelLoadError`` naming the checkpoint key);
            this is not the node of rank 0; another node was started with other settings.
        RendezvousTimeoutError: a node did not join within ``dist_timeout_s``.
    """

    def __init__(
        self,
        model_path: str | None = None,
        tp_size: int = 1,
        device: str | None = None,
        sp_degree: int | None = None,
        ulysses_degree: int | None = None,
        ring_degree: int | None = None,
        cfg_degree: int = 1,
        dtype: str | torch.dtype | None = None,
        lora_dirs: Sequence[str] | None = None,
        generator_device: str | None = None,
        dit_cpu_offload: bool = False,
        attention_backend: str = "auto",
        enable_torch_compile: bool = False,
        float32_matmul_precision: str = "highest",
        cpu_gemm_backend: str = "auto",
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
        startup_timeout_s: float = 900.0,
        heartbeat_s: float = 60.0,
        lora_merge_cache_gb: float | None = None,
        max_loaded_lora_gb: float | None = None,
        revision: str | None = None,
        allow_hub_lora: bool = True,
        transformer_path: str | None = None,
        transformer_weights_path: str | None = None,
        quantization: str | None = None,
        step_cache: StepCacheConfig | None = None,
        _worker_setup: Callable[[ModelRunner, int], None] | None = None,
    ):
        if int(tp_size) < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        model_path, self.model_name = resolve_model_path(model_path, revision)
        weights = weight_options(transformer_path, transformer_weights_path, quantization)
        self.layout = layout_for_model(
            model_path, tp_size, sp_degree, ulysses_degree, ring_degree, cfg_degree
        )
        plan = launch_plan(
            self.layout.world_size, nnodes, node_rank, dist_init_addr, dist_timeout_s
        )
        if plan is not None and not plan.is_leader:
            raise ValueError(
                f"node {plan.node_rank} does not run rank 0; start it with "
                "sglang.multimodal_gen.runtime.nodes.run_follower (sglang serve/generate do)"
            )
        self.model_path = model_path
        self.tp_size = int(tp_size)
        self.world_size = self.layout.world_size
        device = check_device(device)  # a bad --device is one clear error, before any loading
        # so are bad kernel settings (the workers would refuse them only once started)
        check_attention_backend(attention_backend, device)
        check_float32_matmul_precision(float32_matmul_precision, "float32_matmul_precision")
        check_cpu_gemm_backend(cpu_gemm_backend)
        self.device = device
        if dit_cpu_offload and torch.device(device).type != "cuda":
            logger.info("dit_cpu_offload has no effect without a GPU; ignored")
        self._lock = threading.Lock()  # one call at a time
        self._closed = False
        runner_kwargs = dict(
            model_path=model_path,
            device=device,
            dtype=dtype,
            lora_dirs=None if lora_dirs is None else tuple(lora_dirs),
            allow_hub_lora=bool(allow_hub_lora),
            generator_device=generator_device,
            dit_cpu_offload=bool(dit_cpu_offload),
            attention_backend=attention_backend,
            enable_torch_compile=bool(enable_torch_compile),
            float32_matmul_precision=float32_matmul_precision,
            cpu_gemm_backend=cpu_gemm_backend,
            lora_merge_cache_gb=lora_merge_cache_gb,
            max_loaded_lora_gb=max_loaded_lora_gb,
            weights=weights,
            step_cache=step_cache,
        )
        self._executor: Executor
        if plan is None:
            self._executor = UniProcExecutor(runner_kwargs)
        else:
            self._executor = MultiprocExecutor(
                plan,
                dict(runner_kwargs, layout=self.layout),
                startup_timeout_s,
                heartbeat_s,
                _worker_setup,
            )
        self._info = self._executor.info

    @classmethod
    def from_args(cls, server_args) -> DiffusionEngine:
        """Build from a :class:`~sglang.multimodal_gen.configs.server_args.ServerArgs` (the server).

        Local LoRA paths sent to this engine must lie inside ``--lora-dir``; without it, none are
        accepted (startup ``--lora-path`` adapters are loaded with ``trusted=True``). Hub LoRA ids
        that are not cached are downloaded only with ``--enable-hub-lora``.
        """
        return cls(
            **job_kwargs(server_args),
            lora_dirs=tuple(server_args.lora_dirs),
            allow_hub_lora=bool(getattr(server_args, "enable_hub_lora", False)),
            lora_merge_cache_gb=getattr(server_args, "lora_merge_cache_gb", None),
            max_loaded_lora_gb=getattr(server_args, "max_loaded_lora_gb", None),
            **multinode_kwargs(server_args),
        )

    def _call(self, op: str, **kwargs) -> Any:
        get_op(op)  # the op table is the vocabulary (ValueError otherwise)
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine has been shut down")
            if not self._executor.is_alive():
                raise EngineDeadError("the engine's worker processes are not running")
            return self._executor.execute(op, kwargs)

    # ------------------------------------------------------------------ API
    @property
    def spatial_factor(self) -> int:
        """Width/height must be multiples of this (VAE factor x patch size: 16 for Z-Image)."""
        return int(self._info["spatial_factor"])

    @property
    def family(self) -> str:
        """The served model's family id (``"zimage"``, ``"flux"``...)."""
        return str(self._info["family"])

    @property
    def model_info(self) -> dict:
        """The runner's description of the model: family, defaults, TP sizes, LoRA targets."""
        return dict(self._info)

    @property
    def spec(self) -> RequestSpec:
        """What a request to the served model may ask for: its ``SamplingParams`` class (the
        family's fields), defaults and limits. ``engine.spec.params(prompt=..., ...)`` builds a
        request; ``engine.spec.resolve(params)`` fills the defaults, checks every value and
        draws the seed (``generate`` does it for an unresolved request)."""
        return self._info["spec"]

    @property
    def defaults(self) -> dict:
        """The model's defaults and limits as one flat dict (``RequestSpec.as_dict()``)."""
        return dict(self._info["defaults"])

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """Valid LoRA ``target`` values of this model (``"all"`` first), from its LoRA manager."""
        return tuple(self._info["lora_targets"])

    @property
    def modality(self) -> str:
        """``"image"`` or ``"video"``: what the served model makes."""
        return self.spec.outputs

    def generate(
        self, params: SamplingParams | None = None, progress: bool | None = None, **fields: Any
    ) -> list:
        """Run one request.

        Args:
            params: the request (``SamplingParams`` or the family's subclass; resolved here when
                it is not: the model's defaults, every value checked, a seed drawn), or ``None``
                to build it from ``fields`` (``engine.generate(prompt="a fox", seed=1)``).
            progress: tqdm bar over the steps (default: when stderr is a terminal).

        Returns:
            ``num_outputs_per_prompt`` outputs: PIL images (RGB) for an image model,
            :class:`~sglang.multimodal_gen.outputs.Video` objects for a video model.

        Raises:
            InvalidRequestError: a bad field (``param`` names it), a field the model does not
                declare, an unknown adapter in ``lora`` (``NotFoundError``); EngineDeadError: a
                worker died.
        """
        params = self._resolve(params, fields)
        return list(self._call("generate", params=params, progress=progress))

    def generate_batch(self, reqs: Sequence[SamplingParams], progress: bool | None = None):
        """Run several requests in one denoising loop (their module calls batched step by step).

        Each request gets what :meth:`generate` would give it alone, up to the
        batch-size-dependent rounding of the GEMMs (none on the CPU: the GEMMs there are
        row-invariant). Requests with different sizes, step counts or CFG settings are accepted
        (their calls then run one after the other); requests with different ``lora``
        compositions share the calls, each row with its own adapters.

        Returns:
            One entry per request, in order: its outputs, or the exception it raised (a bad
            field or an unknown adapter fails that request only).

        Raises:
            EngineDeadError: a worker died.
        """
        results: list = [None] * len(reqs)
        ready: list[tuple[int, SamplingParams]] = []
        for i, r in enumerate(reqs):
            try:
                ready.append((i, self._resolve(r, {})))
            except errors_mod.SGLangError as e:
                results[i] = e
        if ready:
            out = self._call("generate_batch", reqs=[r for _, r in ready], progress=progress)
            for (i, _), (ok, val) in zip(ready, out):
                results[i] = list(val) if ok else unpack_error(val)
        return results

    @property
    def continuous_batching(self) -> bool:
        """Whether :meth:`generate_continuous` can take requests into a running loop: in one
        process, and with worker processes (TP / SP / CFG ranks, on one node or several: rank 0
        asks for joins at every step boundary and broadcasts them, so every rank admits the
        same requests at the same step; :class:`~.worker.ContinuousLink`). Not a model whose
        two experts are offloaded one at a time (``ModelRunner.per_expert_offload``, reported
        in :attr:`model_info`): a continuous loop mixes step counts, so its requests would
        switch experts at different steps, each parking the expert another one still calls;
        such an engine batches whole requests only (:meth:`generate_batch`)."""
        return not self._executor.info.get("per_expert_offload", False)

    def generate_continuous(
        self,
        reqs: Sequence[SamplingParams],
        admit: Callable[[int], Sequence[SamplingParams]],
        on_done: Callable[[int, Any], None],
        progress: bool | None = None,
    ) -> None:
        """Continuous batching: run ``reqs`` in one denoising loop that takes more requests at
        its step boundaries and hands each result out as soon as its request finished
        (``pipelines.batching``); returns when no request is left and ``admit`` gives none.

        Args:
            admit: ``admit(running) -> requests`` (``running``: requests in the loop now), asked
                on the engine's thread at every step boundary; the requests it returns join now.
                It must be quick and must not call the engine (with worker processes rank 0
                waits ``heartbeat_s`` for its answer: a later one joins at the next boundary,
                or, at the loop's last boundary, fails its requests with ``SGLangError``). A
                request it gives that cannot be resolved fails alone.
            on_done: ``on_done(index, result)``: request ``index`` finished (``reqs`` are
                0..n-1, admitted requests are numbered on in the order ``admit`` gave them);
                ``result`` is its outputs (as :meth:`generate`'s) or the exception it failed
                with (a bad field or an unknown adapter fails that request only). Called from
                the engine's threads, once per request.

        Raises:
            ValueError: :attr:`continuous_batching` is false.
            EngineDeadError: a worker died (requests not yet answered get no ``on_done``).
        """
        if not self.continuous_batching:
            raise ValueError(
                "continuous batching needs the DiT experts resident (no per-expert offload)"
            )
        index_of: list[int] = []  # the runner's request index -> the caller's
        answered: set[int] = set()  # runner indices
        counted = [0]

        def resolved(batch: Sequence[SamplingParams]) -> list[SamplingParams]:
            ready = []
            for r in batch:
                index = counted[0]
                counted[0] += 1
                try:  # any failure is this request's alone (the others keep their numbers)
                    ready.append(self._resolve(r, {}))
                except Exception as e:
                    on_done(index, e)
                    continue
                index_of.append(index)
            return ready

        def done(i: int, result: tuple) -> None:
            answered.add(i)
            ok, val = result[:2]  # worker processes add the reporting rank
            rank = result[2] if len(result) > 2 else None
            on_done(index_of[i], list(val) if ok else unpack_error(val, rank))

        first = resolved(reqs)
        self._call(
            "generate_batch",
            reqs=first,
            progress=progress,
            admit=lambda running: resolved(admit(running)),
            on_done=done,
        )
        # every request taken from `admit` is answered once: with worker processes rank 0
        # stops waiting for an answer after heartbeat_s, and one that comes later for the
        # loop's last boundary finds the loop gone (an `admit` that slow breaks its contract)
        for i, index in enumerate(index_of):
            if i not in answered:
                on_done(
                    index,
                    errors_mod.SGLangError(
                        "the request was admitted after its continuous batch had ended "
                        "(admit answered too late); submit it again"
                    ),
                )

    def _resolve(self, params: SamplingParams | None, fields: dict) -> SamplingParams:
        if params is None:
            params = self.spec.params(**fields)
        elif fields:
            raise TypeError(f"unexpected arguments next to a SamplingParams: {sorted(fields)}")
        return self.spec.resolve(params)

    def set_lora(
        self,
        lora_nickname: str | Sequence[str] | SetLoRAArgs,
        lora_path: str | Sequence[str | None] | None = None,
        target: str | Sequence[str] = "all",
        strength: float | Sequence[float] = 1.0,
        merge_mode: str | None = None,
        *,
        trusted: bool = False,
    ) -> dict:
        """Load (if ``lora_path`` given) and activate adapters; lists compose several.

        Arguments follow :func:`~sglang.multimodal_gen.lora.requests.normalize_set_lora`: a
        scalar or one-element list applies to every nickname, other lists need one entry per
        nickname, a nickname appears once per target; they are normalised here, once (a
        ``SetLoRAArgs`` already normalised, as the HTTP layer sends it, is taken as is).
        ``trusted=True`` (the operator's own startup ``--lora-path``) reads local paths outside
        ``lora_dirs`` too. At TP > 1 rank 0 reads the files and sends their contents to every
        rank; the change applies on every rank or on none. Returns the manager's JSON-able
        summary. Raises ``InvalidRequestError``/``NotFoundError``/``LoRAFormatError``.
        """
        if isinstance(lora_nickname, SetLoRAArgs):
            args = lora_nickname
        else:
            args = normalize_set_lora(
                lora_nickname, lora_path, target, strength, merge_mode,
                valid_targets=self.lora_targets,
            )  # fmt: skip
        return self._call("set_lora", args=args, trusted=bool(trusted))

    def unset_lora(self, target: str = "all") -> Any:
        """Deactivate the adapters of ``target`` (they stay loaded)."""
        return self._call("unset_lora", target=target)

    def unload_lora(self, nickname: str) -> Any:
        """Free a loaded adapter (``NotFoundError`` if unknown)."""
        return self._call("unload_lora", nickname=nickname)

    def merge_lora_weights(self, target: str = "all") -> Any:
        return self._call("merge_lora_weights", target=target)

    def unmerge_lora_weights(self, target: str = "all") -> Any:
        return self._call("unmerge_lora_weights", target=target)

    def list_loras(self) -> dict:
        return self._call("list_loras")

    def steps_done(self) -> int:
        """Denoising steps finished so far, all requests together (grows while a generation
        runs; the server's ``--health-stall-timeout`` watches it). 0 before the first."""
        return self._executor.steps_done()

    def is_alive(self) -> bool:
        """Whether the engine can serve: not shut down, its executor alive (cheap, safe from any
        thread: it checks worker processes, it does not touch the model)."""
        return not self._closed and self._executor.is_alive()

    def shutdown(self) -> None:
        """Stop the executor: its thread or its worker processes (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown()

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


__all__ = ["DiffusionEngine", "check_device", "resolve_model_path"]
