"""Start this launcher's TP worker processes; run a follower node until the leader stops.

:func:`spawn_workers` starts one process per rank of a
:class:`~sglang.multimodal_gen.distributed.multinode.LaunchPlan` (all ranks of a single-node
engine, the ranks of one node of a multi-node job, or the single rank of a ``torchrun`` process).
The leader's :class:`~sglang.multimodal_gen.runtime.engine.DiffusionEngine` sends commands to rank
0; a *follower* launcher (``--node-rank`` > 0, or a torchrun rank > 0) only runs
:func:`run_follower`: its ranks execute what rank 0 broadcasts, it serves no HTTP and writes no
output, and it returns when rank 0 shuts the job down (``sglang`` then exits 0).
"""

from __future__ import annotations

import logging
import os
import queue as queue_mod
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sglang.multimodal_gen.configs.launch_plan import (
    DEFAULT_DIST_TIMEOUT_S,
    LaunchPlan,
    plan_launch,
    running_under_torchrun,
)
from sglang.multimodal_gen.errors import EngineDeadError
from sglang.multimodal_gen.runtime.error_transport import unpack_error
from sglang.multimodal_gen.runtime.worker import tp_worker_main

logger = logging.getLogger(__name__)

__all__ = [
    "Workers",
    "backend_for",
    "launch_plan",
    "multinode_kwargs",
    "run_follower",
    "run_follower_node",
    "spawn_workers",
]


def backend_for(device: str) -> str:
    """NCCL for tensors on CUDA, gloo on the CPU (control messages always use a gloo group)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class Workers:
    """The processes of one launcher and its queues (``cmd_q`` is read by rank 0 only)."""

    procs: list
    cmd_q: object
    res_q: object
    steps: object = None  # multiprocessing.Value("q"): rank 0's finished denoising steps

    def dead(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if not p.is_alive()]

    def kill(self) -> None:
        """SIGKILL the workers still running (they ignore SIGTERM/SIGINT, see ``tp_worker_main``)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + 5  # one deadline for all, not 5 s each
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))


def spawn_workers(
    plan: LaunchPlan,
    runner_kwargs: dict,
    heartbeat_s: float,
    worker_setup: Callable | None = None,
) -> Workers:
    """Start one ``tp_worker_main`` process per rank in ``plan.ranks``.

    ``runner_kwargs`` are the :class:`~sglang.multimodal_gen.runtime.runner.ModelRunner`
    arguments plus ``device``; their :func:`~.multinode.fingerprint` is what the rendezvous
    compares across nodes.
    """
    import torch.multiprocessing as mp

    from sglang.multimodal_gen.configs.launch_plan import fingerprint

    backend = backend_for(runner_kwargs["device"])
    fp = fingerprint(plan, runner_kwargs, backend)
    ctx = mp.get_context("spawn")
    cmd_q, res_q = ctx.Queue(), ctx.Queue()
    steps = ctx.Value("q", 0, lock=False)
    procs = [
        ctx.Process(
            target=tp_worker_main,
            args=(
                r,
                plan,
                backend,
                dict(runner_kwargs),
                cmd_q,
                res_q,
                heartbeat_s,
                worker_setup,
                fp,
                steps,
            ),
            daemon=True,
        )  # fmt: skip
        for r in plan.ranks
    ]
    for p in procs:
        p.start()
    return Workers(procs, cmd_q, res_q, steps)


def wait_message(workers: Workers, timeout_s: float | None = None, who: str = "TP workers"):
    """The next ``(kind, ok, payload)`` from ``workers``.

    Raises:
        EngineDeadError: a worker exited first (exit codes in the message), or nothing came
            within ``timeout_s``.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            return workers.res_q.get(timeout=0.5)
        except queue_mod.Empty:
            pass
        dead = workers.dead()
        if dead:
            try:  # a last message may have been queued just before the exit
                return workers.res_q.get(timeout=0.5)
            except queue_mod.Empty:
                pass
            codes = [workers.procs[i].exitcode for i in dead]
            raise EngineDeadError(f"{who} {dead} exited (exit codes {codes})")
        if deadline is not None and time.monotonic() > deadline:
            raise EngineDeadError(f"{who} did not answer within {timeout_s} s")


FOLLOWER_STOP_GRACE_S = 30.0


def _note_stop_signals() -> list[float]:
    """Record SIGTERM/SIGINT (their time, in the returned list) instead of dying at once."""
    import signal
    import threading

    got: list[float] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: got.append(time.monotonic()) if not got else None)
    return got


def run_follower(
    plan: LaunchPlan,
    runner_kwargs: dict,
    startup_timeout_s: float = 900.0,
    heartbeat_s: float = 60.0,
) -> None:
    """Run the ranks of a follower launcher until rank 0 shuts the job down.

    Raises:
        RendezvousTimeoutError / ValueError: the rendezvous failed (a node missing, other
            settings than node 0's) or the model failed to load on some rank (its error).
        EngineDeadError: the workers lost rank 0 (node 0 died) or stopped on a failed LoRA
            rollback.
    """
    where = f"rank(s) {', '.join(map(str, plan.ranks))} on node {plan.node_rank}"
    workers = spawn_workers(plan, runner_kwargs, heartbeat_s)
    try:
        _, ok, payload = wait_message(workers, startup_timeout_s, f"{where}: workers")
        if not ok:
            rank, err = payload
            raise unpack_error(err, rank)
        logger.info("%s ready; following rank 0 at %s:%d", where, plan.host, plan.port)
        stop_asked = _note_stop_signals()
        while True:
            try:
                kind, ok, payload = wait_message(workers, 1.0, f"{where}: workers")
            except EngineDeadError:
                if workers.dead():
                    raise
                # SIGTERM (torchrun, Kubernetes) reaches every node at once: give rank 0 time to
                # shut the job down, then leave anyway
                if stop_asked and time.monotonic() - stop_asked[0] > FOLLOWER_STOP_GRACE_S:
                    logger.info("%s: stopped by signal before rank 0 shut down", where)
                    return
                continue
            if kind != "stopped":
                continue
            if not ok:
                rank, err = payload
                raise EngineDeadError(f"{where} stopped: {unpack_error(err, rank)}")
            for p in workers.procs:
                p.join(timeout=30)
            logger.info("%s: rank 0 shut the job down", where)
            return
    finally:
        workers.kill()


def run_follower_node(
    model_path: str | None = None,
    tp_size: int = 1,
    device: str | None = None,
    dtype: str | None = None,
    dit_cpu_offload: bool = False,
    sp_degree: int | None = None,
    ulysses_degree: int | None = None,
    ring_degree: int | None = None,
    cfg_degree: int = 1,
    attention_backend: str = "auto",
    enable_torch_compile: bool = False,
    float32_matmul_precision: str = "highest",
    cpu_gemm_backend: str = "auto",
    revision: str | None = None,
    transformer_path: str | None = None,
    transformer_weights_path: str | None = None,
    quantization: str | None = None,
    step_cache: Any = None,
    **multinode: Any,
) -> bool:
    """Run this launcher as a follower when the flags (or torchrun) say it does not hold rank 0.

    Takes the :class:`~sglang.multimodal_gen.runtime.engine.DiffusionEngine` arguments that
    shape the job (model, transformer weights, layout, kernels, multi-node), so a follower builds
    exactly the ranks the leader expects (the rendezvous compares their fingerprints).

    Returns:
        ``False`` at once on the leader (the caller then builds a :class:`DiffusionEngine`);
        ``True`` after a follower's ranks followed rank 0 until it shut the job down.

    Raises:
        as :func:`~.nodes.run_follower`, and ``InvalidRequestError`` for a bad ``device``.
    """
    from sglang.multimodal_gen.runtime.model_source import (
        check_device,
        layout_for_model,
        resolve_model_path,
        weight_options,
    )

    torchrun = running_under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1
    if int(multinode.get("nnodes", 1) or 1) == 1 and not torchrun:
        return False  # one node, no torchrun: this launcher leads
    model_path, _ = resolve_model_path(model_path, revision)  # each node fetches its own copy
    weights = weight_options(transformer_path, transformer_weights_path, quantization)
    layout = layout_for_model(
        model_path, tp_size, sp_degree, ulysses_degree, ring_degree, cfg_degree
    )
    plan = launch_plan(layout.world_size, **multinode)
    if plan is None or plan.is_leader:
        return False
    device = check_device(device)
    kwargs = dict(
        model_path=model_path, dtype=dtype, lora_dirs=(), generator_device=None,
        dit_cpu_offload=bool(dit_cpu_offload), attention_backend=attention_backend,
        enable_torch_compile=bool(enable_torch_compile), device=device, layout=layout,
        float32_matmul_precision=float32_matmul_precision, cpu_gemm_backend=cpu_gemm_backend,
        weights=weights, step_cache=step_cache,
    )  # fmt: skip
    run_follower(plan, kwargs)
    return True


def multinode_kwargs(args) -> dict:
    """The engine's multi-node keyword arguments from a ``ServerArgs`` (or a CLI namespace)."""
    return dict(
        nnodes=int(getattr(args, "nnodes", 1) or 1),
        node_rank=int(getattr(args, "node_rank", 0) or 0),
        dist_init_addr=getattr(args, "dist_init_addr", None),
        dist_timeout_s=float(
            getattr(args, "dist_timeout_s", None)
            or getattr(args, "dist_timeout", None)
            or DEFAULT_DIST_TIMEOUT_S
        ),
    )


def launch_plan(
    world_size: int,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    dist_timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
) -> LaunchPlan | None:
    """This launcher's :class:`LaunchPlan`; ``None`` for one process (TP 1 on one node, run in
    the caller). Raises ``ValueError`` for inconsistent flags (``plan_launch``)."""
    torchrun = running_under_torchrun() and int(os.environ["WORLD_SIZE"]) > 1
    if int(world_size) == 1 and int(nnodes) == 1 and not torchrun:
        return None
    return plan_launch(world_size, nnodes, node_rank, dist_init_addr, dist_timeout_s)
