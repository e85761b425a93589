"""How a :class:`~sglang.multimodal_gen.runtime.engine.DiffusionEngine` runs its commands.

One interface (:class:`Executor`), two executors (vLLM's names):

- :class:`UniProcExecutor`: one process (TP 1 on one node). The
  :class:`~sglang.multimodal_gen.runtime.runner.ModelRunner` is built and every command runs on
  one :class:`~sglang.multimodal_gen.runtime.compute_thread.ComputeThread` (why: see that module).
- :class:`MultiprocExecutor`: one worker process per rank of this node
  (:func:`~sglang.multimodal_gen.runtime.nodes.spawn_workers`; gloo on CPU, NCCL on CUDA, each
  rank on the CUDA device of its local rank; with ``nnodes > 1`` or under ``torchrun`` only this
  node's ranks, the others being started by :func:`~.nodes.run_follower` on their nodes). Every
  command ``(op, kwargs)`` is put on rank 0's queue; rank 0 reads the LoRA files a ``set_lora``
  names (a read error is answered at once, no other rank is involved), broadcasts the command
  with the files' contents, and all ranks execute it in the same order, then gather their
  outcomes so a failure on any rank is reported; rank 0 sends the result back
  (:mod:`~sglang.multimodal_gen.runtime.worker`). A LoRA change is all-or-nothing across ranks:
  when it fails on any rank, the ranks where it succeeded roll it back
  (:meth:`ModelRunner.execute` with ``agree``); if a rollback itself fails, the workers stop (the
  executor is dead) rather than serve from diverged weights. While idle, rank 0 broadcasts a
  no-op every ``heartbeat_s`` so the other ranks' collectives never time out. A continuous
  ``generate_batch`` (its ``admit`` / ``on_done`` callables stay in this process) is sent marked
  ``continuous``; while it runs, rank 0 asks for joining requests at every step boundary and
  reports each finished request, and :meth:`MultiprocExecutor.execute` answers and forwards
  those messages (:class:`~sglang.multimodal_gen.runtime.worker.ContinuousLink`).

Both are called by one caller at a time (the engine serializes its calls).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from sglang.multimodal_gen.configs.launch_plan import LaunchPlan
from sglang.multimodal_gen.errors import EngineDeadError
from sglang.multimodal_gen.runtime.compute_thread import ComputeThread
from sglang.multimodal_gen.runtime.error_transport import unpack_error
from sglang.multimodal_gen.runtime.nodes import Workers, spawn_workers, wait_message
from sglang.multimodal_gen.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor"]


class Executor(Protocol):
    """What the engine needs from an executor.

    Attributes:
        info: the runner's description of the model (:meth:`ModelRunner.info`), read once
            the model is loaded.
    """

    info: dict

    def execute(self, op: str, kwargs: dict) -> Any:
        """Run command ``op`` (an ``engine_ops`` name) with ``kwargs``; its result.

        Raises:
            EngineDeadError: the executor cannot serve (a worker died, a LoRA rollback failed;
                it stays dead), or was shut down.
            whatever the command raised (the same error types across processes).
        """

    def is_alive(self) -> bool:
        """Whether commands can run (cheap, safe from any thread; does not touch the model)."""

    def steps_done(self) -> int:
        """Denoising steps finished so far, all requests together (0 before the first)."""

    def shutdown(self) -> None:
        """Stop and free everything (idempotent)."""


class UniProcExecutor:
    """The runner in this process, loaded and driven on one compute thread.

    Args:
        runner_kwargs: the :class:`ModelRunner` arguments (with ``device``).

    Attributes:
        compute: the :class:`ComputeThread` every command runs on.
        runner: the :class:`ModelRunner` (``None`` after :meth:`shutdown`).

    Raises:
        whatever building the runner raises (the thread is stopped first).
    """

    def __init__(self, runner_kwargs: dict):
        self.compute = ComputeThread()
        # an executor dropped without shutdown() still stops its thread (and frees the model)
        weakref.finalize(self, self.compute.stop)
        self._dead = False
        try:
            self.runner: ModelRunner | None = self.compute.call(ModelRunner, **runner_kwargs)
            self.info: dict = self.compute.call(self.runner.info)
        except BaseException:
            self.compute.stop()
            raise
        self._steps = self.runner.steps

    def execute(self, op: str, kwargs: dict) -> Any:
        runner = self.runner  # shutdown() may clear it meanwhile
        if runner is None:
            raise EngineDeadError("the engine has been shut down")
        try:
            return self.compute.call(runner.execute, op, kwargs)
        except EngineDeadError:  # e.g. a LoRA restore failed: stop serving mixed weights
            self._dead = True
            raise
        except (KeyboardInterrupt, SystemExit) as e:  # the call may have failed so too
            if isinstance(e.__cause__, EngineDeadError):
                self._dead = True
            raise

    def is_alive(self) -> bool:
        return not self._dead and self.runner is not None

    def steps_done(self) -> int:
        return int(self._steps.value)

    def shutdown(self) -> None:
        self.compute.stop()
        self.runner = None


class MultiprocExecutor:
    """This node's ranks in worker processes, commanded through rank 0's queue.

    Args:
        plan: this launcher's :class:`LaunchPlan` (its ranks, the rendezvous).
        runner_kwargs: the :class:`ModelRunner` arguments (with ``device`` and ``layout``).
        startup_timeout_s: how long the workers may take to load the model.
        heartbeat_s: idle period after which rank 0 pings the other ranks.
        worker_setup: tests only: ``fn(runner, rank)`` run in every worker after its runner is
            built (a picklable module-level function).

    Attributes:
        workers: the processes and their queues (:class:`~.nodes.Workers`).

    Raises:
        the first error of any rank while loading (``ValueError``/``FileNotFoundError``...,
        prefixed with the rank), ``RendezvousTimeoutError``, or ``EngineDeadError`` when a
        worker exits first or nothing comes within ``startup_timeout_s`` (the workers are
        killed).
    """

    def __init__(
        self,
        plan: LaunchPlan,
        runner_kwargs: dict,
        startup_timeout_s: float,
        heartbeat_s: float,
        worker_setup: Callable | None = None,
    ):
        self._dead = False
        self._closed = False
        self._in_call = False
        self._stale_results = 0  # results still to come for interrupted calls
        self.workers: Workers = spawn_workers(plan, runner_kwargs, heartbeat_s, worker_setup)
        try:
            _, ok, payload = self._wait_result(startup_timeout_s)
        except BaseException:
            self.workers.kill()
            raise
        if not ok:
            self.workers.kill()
            rank, err = payload
            raise unpack_error(err, rank)
        self.info: dict = payload

    def _wait_result(self, timeout_s: float | None = None):
        """The next ``(kind, ok, payload)`` of the workers (see :func:`~.nodes.wait_message`)."""
        try:
            return wait_message(self.workers, timeout_s)
        except EngineDeadError:
            self._dead = True
            raise

    def execute(self, op: str, kwargs: dict) -> Any:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        self._in_call = True
        admit, on_done = kwargs.pop("admit", None), kwargs.pop("on_done", None)
        if admit is not None or on_done is not None:
            kwargs = dict(kwargs, continuous=True)
        sent = False
        try:
            try:
                # first the answers of calls whose callers were interrupted (a continuous one
                # still asking for joins gets none; its reports are dropped)
                while self._stale_results:
                    self._next_result(None, None)
                    self._stale_results -= 1
                self.workers.cmd_q.put((op, kwargs))
                sent = True
                _, ok, payload = self._next_result(admit, on_done)
            except (KeyboardInterrupt, SystemExit):
                # the workers still finish this command: its answer is not the next call's
                self._stale_results += int(sent)
                raise
        finally:
            self._in_call = False
        if ok:
            return payload
        rank, err = payload
        exc = unpack_error(err, rank)
        if isinstance(exc, EngineDeadError):  # the workers stopped (LoRA state lost)
            self._dead = True
        raise exc

    def _next_result(self, admit, on_done):
        """The next ``("result", ok, payload)``, answering a continuous loop's ``admit``
        questions (``admit(running)``'s requests, or none when it raised: the loop goes on) and
        forwarding its ``done`` reports to ``on_done(index, (ok, payload, 0))`` meanwhile (rank 0
        reports: an error's message is prefixed ``rank 0:`` as a command's)."""
        while True:
            kind, ok, payload = self._wait_result()
            if kind == "admit":  # answered in every case: rank 0 waits for it
                reqs: list = []
                try:
                    if admit is not None:
                        reqs = list(admit(payload))
                except Exception:
                    logger.exception("continuous batching: admit failed; nothing joins")
                finally:
                    self.workers.cmd_q.put(("admitted", reqs))
            elif kind == "done":
                if on_done is not None:
                    index, result = payload
                    try:  # rank 0's outcome (an error says so, as a command's does)
                        on_done(index, (ok, result, 0))
                    except Exception:
                        logger.exception("continuous batching: on_done(%d) failed", index)
            else:
                return kind, ok, payload

    def is_alive(self) -> bool:
        if self._closed or self._dead:
            return False
        return all(p.is_alive() for p in self.workers.procs)

    def steps_done(self) -> int:
        steps = self.workers.steps
        return 0 if steps is None else int(steps.value)

    def shutdown(self) -> None:
        """Send ``shutdown`` to rank 0 and wait for every worker under one deadline (10 s; 1 s
        when a call is still in flight, as past the server's graceful timeout, since the workers
        would not read the command), then kill what is left."""
        if self._closed:
            return
        self._closed = True
        try:
            self.workers.cmd_q.put(("shutdown", {}))
        except Exception:
            pass
        deadline = time.monotonic() + (1.0 if self._in_call else 10.0)
        for p in self.workers.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.workers.kill()
