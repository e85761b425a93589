"""``DiffusionEngine``: the blocking generation API over one model, at any TP size.

TP 1 runs the :class:`~sglang.multimodal_gen.runtime.runner.ModelRunner` in the calling process.
TP N spawns N worker processes that form one TP group (gloo on CPU, NCCL on CUDA; rank ``r`` uses
``cuda:r``). Every call becomes a command ``(op, kwargs)`` put on rank 0's queue; rank 0
reads the LoRA files a ``set_lora`` names (a read error is answered at once, no other rank is
involved), broadcasts the command with the files' contents (``broadcast_object``), and all ranks
execute it in the same order, then gather their outcomes so a failure on any rank is reported;
rank 0 sends the result back. A LoRA change is all-or-nothing across ranks: when it fails on any
rank, the ranks where it succeeded roll it back (:meth:`ModelRunner.execute` with ``agree``); if a
rollback itself fails, the workers stop (the engine is dead) rather than serve from diverged
weights. While idle, rank 0 broadcasts a no-op every ``heartbeat_s`` so the other ranks'
collectives never time out.
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from sglang.multimodal_gen import errors as errors_mod
from sglang.multimodal_gen.engine_ops import get_op
from sglang.multimodal_gen.errors import EngineDeadError
from sglang.multimodal_gen.lora.requests import normalize_set_lora
from sglang.multimodal_gen.runtime.request import GenerationRequest
from sglang.multimodal_gen.runtime.runner import ModelRunner
from sglang.multimodal_gen.runtime.worker import tp_worker_main, unpack_error

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- engine
class DiffusionEngine:
    """Load a model and serve blocking calls (one caller at a time; calls are serialized).

    Args:
        model_path: diffusers-format directory; ``None`` uses the embedded tiny default model
            (random weights: noise images), built once under the user cache dir.
        tp_size: tensor-parallel size (N local processes when > 1).
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available.
        dtype: ``"auto"|"float32"|"float16"|"bfloat16"`` or a ``torch.dtype`` (auto: bf16 on
            CUDA, fp32 on CPU).
        lora_dirs: allowed roots for local LoRA paths (realpath containment). ``None`` (default):
            any local path, as for a user's own ``sglang generate``. Empty: no local path (a
            server started without ``--lora-dir``); Hub ids in the local Hugging Face cache and
            ``set_lora(..., trusted=True)`` (startup ``--lora-path``) are accepted in every case.
        generator_device: device of the seeded generator (default: the execution device type).
        dit_cpu_offload: on CUDA keep the DiT weights in pinned host memory between calls
            (moved to the GPU for each call); ignored, with one log line, without a GPU.
        startup_timeout_s: how long TP workers may take to load.
        heartbeat_s: idle period after which rank 0 pings the other ranks.
        lora_merge_cache_gb: bound of the LoRA merge cache per rank, GiB (default 1).
        max_loaded_lora_gb: bound of the loaded LoRA adapters per rank, GiB (default 8).
        _worker_setup: tests only: ``fn(runner, rank)`` run in every TP worker after its runner
            is built (a picklable module-level function).

    Raises:
        ValueError / FileNotFoundError: bad model directory or TP size (e.g. ``n_heads`` not
            divisible), with the message of the failing rank.
    """

    def __init__(
        self,
        model_path: str | None = None,
        tp_size: int = 1,
        device: str | None = None,
        dtype: str | torch.dtype | None = None,
        lora_dirs: Sequence[str] | None = None,
        generator_device: str | None = None,
        dit_cpu_offload: bool = False,
        startup_timeout_s: float = 900.0,
        heartbeat_s: float = 60.0,
        lora_merge_cache_gb: float | None = None,
        max_loaded_lora_gb: float | None = None,
        _worker_setup: Callable[[ModelRunner, int], None] | None = None,
    ):
        if model_path is None:
            from sglang.multimodal_gen.models.default_model import (
                default_model_name,
                default_model_path,
            )

            model_path = default_model_path()
            self.model_name = default_model_name()
        else:
            if not os.path.isdir(model_path):
                model_path = _resolve_hub_cache(model_path)
            self.model_name = os.path.basename(os.path.normpath(model_path))
        if int(tp_size) < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.model_path = model_path
        self.tp_size = int(tp_size)
        device = check_device(device)  # a bad --device is one clear error, before any loading
        self.device = device
        if dit_cpu_offload and torch.device(device).type != "cuda":
            logger.info("dit_cpu_offload has no effect without a GPU; ignored")
        self._lock = threading.Lock()
        self._dead = False
        self._closed = False
        self._runner: ModelRunner | None = None
        self._procs: list = []
        runner_kwargs = dict(
            model_path=model_path,
            dtype=dtype,
            lora_dirs=None if lora_dirs is None else tuple(lora_dirs),
            generator_device=generator_device,
            dit_cpu_offload=bool(dit_cpu_offload),
            lora_merge_cache_gb=lora_merge_cache_gb,
            max_loaded_lora_gb=max_loaded_lora_gb,
        )
        if self.tp_size == 1:
            self._runner = ModelRunner(device=device, **runner_kwargs)
            self._info = self._runner.info()
        else:
            self._start_workers(
                dict(runner_kwargs, device=device), startup_timeout_s, heartbeat_s, _worker_setup
            )

    @classmethod
    def from_args(cls, server_args) -> DiffusionEngine:
        """Build from a :class:`~sglang.multimodal_gen.configs.server_args.ServerArgs` (the server).

        Local LoRA paths sent to this engine must lie inside ``--lora-dir``; without it, none are
        accepted (startup ``--lora-path`` adapters are loaded with ``trusted=True``).
        """
        return cls(
            model_path=server_args.model_path,
            tp_size=server_args.tp_size,
            device=server_args.device,
            dtype=server_args.dtype,
            lora_dirs=tuple(server_args.lora_dirs),
            dit_cpu_offload=bool(getattr(server_args, "dit_cpu_offload", False)),
            lora_merge_cache_gb=getattr(server_args, "lora_merge_cache_gb", None),
            max_loaded_lora_gb=getattr(server_args, "max_loaded_lora_gb", None),
        )

    # ------------------------------------------------------------------ workers
    def _start_workers(
        self,
        runner_kwargs: dict,
        timeout_s: float,
        heartbeat_s: float,
        worker_setup: Callable | None = None,
    ) -> None:
        import torch.multiprocessing as mp

        from sglang.multimodal_gen.distributed import find_free_port

        backend = "nccl" if torch.device(runner_kwargs["device"]).type == "cuda" else "gloo"
        ctx = mp.get_context("spawn")
        self._cmd_q = ctx.Queue()
        self._res_q = ctx.Queue()
        port = find_free_port()
        self._procs = [
            ctx.Process(
                target=tp_worker_main,
                args=(
                    r,
                    self.tp_size,
                    port,
                    backend,
                    dict(runner_kwargs),
                    self._cmd_q,
                    self._res_q,
                    heartbeat_s,
                    worker_setup,
                ),
                daemon=True,
            )  # fmt: skip
            for r in range(self.tp_size)
        ]
        for p in self._procs:
            p.start()
        try:
            kind, ok, payload = self._wait_result(timeout_s)
        except BaseException:
            self._kill_workers()
            raise
        if not ok:
            self._kill_workers()
            rank, err = payload
            raise unpack_error(err, rank)
        self._info = payload

    def _wait_result(self, timeout_s: float | None = None):
        import time

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return self._res_q.get(timeout=0.5)
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                self._dead = True
                # a last result may have been queued just before the exit
                try:
                    return self._res_q.get(timeout=0.5)
                except queue_mod.Empty:
                    pass
                codes = [self._procs[r].exitcode for r in dead]
                raise EngineDeadError(f"TP worker(s) {dead} exited (exit codes {codes})")
            if deadline is not None and time.monotonic() > deadline:
                self._dead = True
                raise EngineDeadError(f"TP workers did not answer within {timeout_s} s")

    def _kill_workers(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)

    def _call(self, op: str, **kwargs) -> Any:
        get_op(op)  # the op table is the vocabulary (ValueError otherwise)
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine has been shut down")
            if self._dead or not self.is_alive():
                raise EngineDeadError("the engine's worker processes are not running")
            if self._runner is not None:
                try:
                    return self._runner.execute(op, kwargs)
                except EngineDeadError:  # e.g. a LoRA restore failed: stop serving mixed weights
                    self._dead = True
                    raise
            self._cmd_q.put((op, kwargs))
            _, ok, payload = self._wait_result()
            if ok:
                return payload
            rank, err = payload
            exc = unpack_error(err, rank)
            if isinstance(exc, EngineDeadError):  # the workers stopped (LoRA state lost)
                self._dead = True
            raise exc

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
    def defaults(self) -> dict:
        """The family's sampling defaults and limits (``SamplingDefaults.as_dict()``)."""
        return dict(self._info["defaults"])

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """Valid LoRA ``target`` values of this model (``"all"`` first), from its LoRA manager."""
        return tuple(self._info["lora_targets"])

    def generate(self, req: GenerationRequest, progress: bool | None = None) -> list:
        """Generate ``req.num_images`` images.

        Returns:
            ``list[PIL.Image.Image]`` (RGB, ``req.width`` x ``req.height``).

        Raises:
            InvalidRequestError: a bad field (``param`` names it) or an unknown adapter in
                ``req.lora`` (``NotFoundError``); EngineDeadError: a worker died.
        """
        from PIL import Image

        self._check_modality("image")
        arr = self._call("generate", req=self._prepared(req), progress=progress)
        return [Image.fromarray(a) for a in arr]

    def generate_video(self, req: GenerationRequest, progress: bool | None = None) -> list:
        """Generate ``req.num_images`` videos of ``req.num_frames`` frames (video models).

        Returns:
            ``list[np.ndarray]``, each uint8 ``[frames, height, width, 3]``.

        Raises:
            InvalidRequestError: an image model (``param="model"``) or a bad field; as
                :meth:`generate` otherwise.
        """
        self._check_modality("video")
        return list(self._call("generate", req=self._prepared(req), progress=progress))

    @property
    def modality(self) -> str:
        """``"image"`` or ``"video"``: what the served model makes."""
        return str(self.defaults.get("modality", "image"))

    def _check_modality(self, want: str) -> None:
        if self.modality != want:
            raise errors_mod.InvalidRequestError(
                f"{self.model_name} is a {self.modality} model; it cannot make {want}s",
                param="model",
            )

    def _prepared(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with the family's defaults, validated, with a drawn seed if it had none."""
        req = req.with_defaults(self.defaults)
        req.validate(self.spatial_factor, self.defaults)
        if req.seed is None:
            req = replace(req, seed=secrets.randbits(63))
        return req

    def set_lora(
        self,
        lora_nickname: str | Sequence[str],
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
        nickname, a nickname appears once per target. ``trusted=True`` (the operator's own
        startup ``--lora-path``) reads local paths outside ``lora_dirs`` too. At TP > 1 rank 0
        reads the files and sends their contents to every rank; the change applies on every rank
        or on none. Returns the manager's JSON-able summary. Raises
        ``InvalidRequestError``/``NotFoundError``/``LoRAFormatError``.
        """
        args = normalize_set_lora(
            lora_nickname, lora_path, target, strength, merge_mode,
            valid_targets=self.lora_targets,
        )  # fmt: skip
        return self._call(
            "set_lora",
            nicknames=args.nicknames,
            paths=args.paths,
            targets=args.targets,
            strengths=args.strengths,
            merge_mode=args.merge_mode,
            trusted=bool(trusted),
        )

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

    def is_alive(self) -> bool:
        if self._closed or self._dead:
            return False
        if self._runner is not None:
            return True
        return all(p.is_alive() for p in self._procs)

    def shutdown(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._procs:
            try:
                self._cmd_q.put(("shutdown", {}))
            except Exception:
                pass
            for p in self._procs:
                p.join(timeout=10)
            self._kill_workers()
        self._runner = None

    def __enter__(self) -> DiffusionEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def check_device(device: str | None) -> str:
    """The execution device for ``device`` (``None``: CUDA when available, else the CPU).

    Raises:
        InvalidRequestError: ``param="device"``; not a device name, or a device this machine
            does not have (CUDA without a GPU or a CUDA build of torch, ``cuda:N`` past the GPU
            count, ``mps`` off macOS...).
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise errors_mod.InvalidRequestError(
            f"--device {device!r} is not a device; use cpu, cuda or cuda:N", param="device"
        ) from None
    if dev.type == "cpu":
        return device
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU found"
            raise errors_mod.InvalidRequestError(
                f"--device {device!r}: CUDA is not available on this machine ({why}); use "
                "--device cpu",
                param="device",
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise errors_mod.InvalidRequestError(
                f"--device {device!r}: this machine has {count} GPU(s) (cuda:0 to "
                f"cuda:{count - 1})",
                param="device",
            )
        return device
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if callable(available) and available():
        return device
    raise errors_mod.InvalidRequestError(
        f"--device {device!r}: {dev.type} is not available on this machine; use cpu or cuda",
        param="device",
    )


def _resolve_hub_cache(model_id: str) -> str:
    """Resolve ``owner/name`` from the local Hugging Face cache only (no download).

    Raises:
        FileNotFoundError: not a directory and not in the local cache.
    """
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_id, local_files_only=True)
    except Exception as e:
        raise FileNotFoundError(
            f"model path {model_id!r} is not a directory and is not in the local Hugging Face "
            "cache (nothing is downloaded)"
        ) from e
