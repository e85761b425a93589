"""Launch N local processes that form one parallel layout and run a function in each.

Used by the tests (gloo on the CPU) and by the engine (NCCL when CUDA is available). Each worker
initializes ``torch.distributed`` over a free localhost TCP port (the engine: over the
rendezvous of its :class:`~.multinode.LaunchPlan`, possibly on several nodes), calls
:func:`initialize_model_parallel` (all N ranks in one TP group, or the given
:class:`ParallelLayout`), runs ``fn(rank, *args)``, and sends back its return value.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang.multimodal_gen.configs.launch_plan import LaunchPlan
from sglang.multimodal_gen.distributed.multinode import checked_rendezvous
from sglang.multimodal_gen.distributed.parallel_state import (
    ParallelLayout,
    destroy_model_parallel,
    initialize_model_parallel,
)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    """``"nccl"`` when CUDA devices are visible, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str | None = None,
    layout: ParallelLayout | None = None,
    *,
    plan: LaunchPlan | None = None,
    fingerprint: dict | None = None,
) -> None:
    """Join the process group as ``rank`` of ``world_size`` and create the parallel groups.

    ``layout``: the TP / Ulysses / ring / CFG sizes (default: every rank in one TP group); its
    ``world_size`` must equal ``world_size``.

    Without ``plan``: all ranks on this machine, rendezvous at ``127.0.0.1:port``, ``cuda:rank``.
    With a :class:`~sglang.multimodal_gen.distributed.multinode.LaunchPlan` (multi-node or
    torchrun): rendezvous at ``plan.host:plan.port`` through
    :func:`~sglang.multimodal_gen.distributed.multinode.checked_rendezvous` (every rank's
    ``fingerprint`` must equal rank 0's; ``port`` is unused) and ``cuda:<local rank>``. Threads
    are capped so that N workers on a small machine do not oversubscribe its cores.

    Raises:
        RendezvousTimeoutError, ValueError: see ``checked_rendezvous``.
    """
    layout = layout or ParallelLayout(tp_size=world_size)
    backend = backend or default_backend()
    device_index = rank if plan is None else plan.device_index(rank)
    if backend == "nccl":
        torch.cuda.set_device(device_index)
    else:
        local = world_size if plan is None else len(plan.ranks)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if plan is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
    else:
        store = checked_rendezvous(plan, rank, fingerprint or {})
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    initialize_model_parallel(
        layout.tp_size, layout.ulysses_degree, layout.ring_degree, layout.cfg_degree
    )


def shutdown_worker() -> None:
    """Leave the TP group and destroy the default process group."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(rank, world_size, port, backend, fn, args, queue, layout=None):
    try:
        init_worker(rank, world_size, port, backend, layout)
        result = fn(rank, *args)
        # Plain pickle copies tensor bytes; the queue's own pickler would pass shared-memory file
        # descriptors that vanish when this process exits before the parent reads them.
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as e:  # report every failure to the parent, then exit
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        shutdown_worker()


def launch_processes(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    backend: str | None = None,
    timeout_s: float = 600.0,
    layout: ParallelLayout | None = None,
) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` freshly spawned processes forming one layout.

    Args:
        fn: a module-level (picklable) function.
        nprocs: the number of processes (the TP size when ``layout`` is not given).
        layout: the parallel layout (``layout.world_size == nprocs``).
        args: extra picklable arguments.
        backend: ``"gloo"`` or ``"nccl"``; default: :func:`default_backend`.
        timeout_s: how long to wait for all results (seconds).

    Returns:
        The return values, ordered by rank (each must be picklable).

    Raises:
        RuntimeError: a worker raised (its traceback is in the message) or died without answering.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = find_free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, nprocs, port, backend, fn, args, queue, layout),
            daemon=False,
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(nprocs):
            try:
                rank, ok, value = queue.get(timeout=timeout_s)
            except Exception as e:
                raise RuntimeError(f"TP workers did not answer within {timeout_s} s") from e
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}: {value}")
                break  # the others may now hang on a collective; stop them below
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        raise RuntimeError("TP worker failed:\n" + "\n".join(errors))
    return [results[r] for r in range(nprocs)]
