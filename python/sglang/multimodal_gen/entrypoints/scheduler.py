"""The scheduler: one thread that owns the engine and runs its work in arrival order.

Why one thread: the engine's methods are blocking and must be called from one thread at a time, and
the design requires that a ``set_lora`` never changes weights under a running generation. With a
single FIFO, both hold by construction:

- a generation without its own ``lora`` runs with the global composition in force when it *starts*
  (every admin change queued before it has been applied, none queued after it has);
- a generation with its own ``lora`` gets exactly that composition (the engine applies and restores
  it around the call);
- admin changes (``set_lora``, ``unset_lora``, merge, ...) are applied between generations, in the
  order they arrived, and the engine broadcasts them to its TP ranks in that same order.

Generation requests are bounded by ``max_queue_size`` (waiting, not counting the running one); the
next one gets :class:`~sglang.multimodal_gen.errors.QueueFullError` (HTTP 503 + ``Retry-After``).
Admin calls are never refused for a full queue: they are cheap and an operator must be able to act
on a busy server.

When the engine dies (``EngineDeadError`` or ``engine.is_alive()`` false) every waiting request
fails with ``EngineDeadError`` (HTTP 503) and new ones are refused at once, so nothing hangs.

An engine that is alive but stuck (a call that never returns) is noticed too: with
``stall_timeout_s``, :meth:`Scheduler.healthy` is false while work is pending and no task has
started or finished, and no denoising step ended (``engine.steps_done()``), for that long
(``/health`` turns 503; it recovers when the engine moves again). The scheduler's
:class:`~.scheduler_health.HealthMonitor` (``scheduler.health``) keeps that account: the scheduler
tells it what happens, ``/health`` asks it.

Batching (``max_batch_size > 1``): when a generation reaches the head of the queue, the waiting
generations with the same sampling settings (every field of the request but the per-row ones:
prompts, seed, adapters; and whether a negative prompt is given) join it, up to ``max_batch_size``, waiting up to ``batch_wait_s``
for more to arrive; the engine runs them in one denoising loop (``engine.generate_batch``), each
with its own seed, prompts and LoRA composition. Only generations queued before the first waiting admin call can
join, so admin changes stay ordered with generations exactly as without batching.

Continuous batching (the default with ``max_batch_size > 1``, on an engine whose
``continuous_batching`` is true: one process): the loop is not closed when it starts. At every
denoising step boundary the engine asks the scheduler for more (``engine.generate_continuous``);
the generations at the head of the queue whose settings match the running loop's, but for the
number of steps (:func:`_join_key`), join it while there is room (``max_batch_size`` requests in
the loop), each with its own timestep from then on; a finished generation's future resolves at
once while the others go on. Admission is strictly first come first served: it stops at the first
waiting task that cannot join (an admin call, or a generation with other settings), so a running
loop never overtakes a waiting task (a new loop gathers its first generations as request batching
does, above), an admin call runs as soon as the generations in the loop (all queued before it)
have finished, and no running loop sees a weight change. A
single generation runs this way too, so that others can join it. Engines with worker processes
(TP, sequence or CFG parallelism) batch whole requests only: a join would have to be decided on
rank 0 and broadcast with the step to every rank, which is not built.

Adapters: a generation naming adapters (its own ``lora``) that will not be loaded when it runs is
refused as it is queued (``NotFoundError``, 404 naming ``lora``), by the scheduler's
:class:`~.adapter_ledger.AdapterLedger` (``scheduler.adapters``), which counts the LoRA commands
queued ahead of it; the ledger starts from the engine's ``list_loras()``, asked by
:meth:`Scheduler.start` before the worker thread exists.

Timing: a :class:`TaskTiming` handed to :meth:`Scheduler.submit_generation` or
:meth:`Scheduler.submit_call` gets the task's times (queued, started, finished) for the request's
log line.

This module does not import FastAPI; it is plain threading and ``concurrent.futures``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sglang.multimodal_gen.engine_ops import OPS, SCHEDULER_CALLS
from sglang.multimodal_gen.entrypoints.adapter_ledger import AdapterLedger
from sglang.multimodal_gen.entrypoints.scheduler_health import HealthMonitor
from sglang.multimodal_gen.errors import EngineDeadError, QueueFullError

logger = logging.getLogger(__name__)


class ServerShuttingDownError(EngineDeadError):
    """The server received SIGTERM and accepts no new work (HTTP 503)."""


@dataclass
class TaskTiming:
    """When a queued task was queued, started and finished (``time.perf_counter``); the
    scheduler fills it in. The tasks of a whole-request batch share its start and end; in a
    continuous batch each starts when it joins and ends when it is answered."""

    queued_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def queued_s(self) -> float | None:
        """Seconds waiting in the queue (``None``: it never started)."""
        if self.queued_at is None or self.started_at is None:
            return None
        return self.started_at - self.queued_at

    @property
    def compute_s(self) -> float | None:
        """Seconds in the engine (``None``: it did not finish)."""
        if self.started_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.started_at


_SEQ = itertools.count(1)


@dataclass
class _Task:
    kind: str  # "generate" (args: one SamplingParams) or the name of an engine method
    args: tuple
    kwargs: dict
    future: Future
    timing: TaskTiming | None = None
    enqueued_at: float = field(default_factory=time.perf_counter)
    seq: int = field(default_factory=lambda: next(_SEQ))

    def __post_init__(self) -> None:
        if self.timing is not None:
            self.timing.queued_at = self.enqueued_at

    def started(self, at: float) -> None:
        if self.timing is not None:
            self.timing.started_at = at

    def ended(self, at: float) -> None:
        if self.timing is not None:
            self.timing.finished_at = at


class SchedulerMetrics:
    """Hooks the scheduler calls; the default does nothing. See ``entrypoints.metrics``."""

    def set_queue_depth(self, depth: int) -> None:  # pragma: no cover - trivial
        pass

    def observe_generation(self, wait_s: float, run_s: float, steps: int | None) -> None:
        pass  # pragma: no cover - trivial

    def observe_lora_memory(self, memory: dict) -> None:  # pragma: no cover - trivial
        """The LoRA manager's memory report after a LoRA command (``list_loras()["memory"]``)."""

    def observe_admin(self, op: str, seconds: float) -> None:  # pragma: no cover - trivial
        pass

    def set_engine_alive(self, alive: bool) -> None:  # pragma: no cover - trivial
        pass


def _join_key(task: _Task) -> tuple:
    """Generations with equal keys can share a continuous loop: :func:`_batch_key` but for the
    number of steps (a joining request is at another step anyway: its timestep is its own row
    of the DiT call, so the calls still concatenate)."""
    kind, fixed, *rest = _batch_key(task)
    return (kind, tuple(f for f in fixed if f[0] != "num_inference_steps"), *rest)


def _shares_loops(task: _Task) -> bool:
    """Whether the generation can share a denoising loop at all: a request whose key is its own
    (a copy of it would not batch with it, e.g. LTX-2 two-stage generation, two loops at two
    sizes) runs alone, through ``engine.generate``."""
    params = task.args[0]
    return params.batch_key() == copy.copy(params).batch_key()


def _batch_key(task: _Task) -> tuple:
    """Generations with equal keys can share a denoising loop: every field of the request must
    match but the per-row ones (prompts, seed, adapters; a negative prompt's presence, not its
    text, changes CFG)."""
    return task.args[0].batch_key()


class Scheduler:
    """Runs engine calls on one worker thread, first come first served.

    Args:
        engine: an object with the ``DiffusionEngine`` methods (``generate``, ``set_lora``, ...,
            ``is_alive``).
        max_queue_size: generation requests allowed to wait (>= 1).
        metrics: a :class:`SchedulerMetrics` (queue depth, latencies, LoRA admin times).
        idle_check_s: how often the idle worker polls ``engine.is_alive()``.
        stall_timeout_s: :meth:`healthy` is false while work is pending and nothing started,
            finished or stepped for this long (``None``: never; see :attr:`health`).
        max_batch_size: generations run together at most (1: one at a time).
        batch_wait_s: how long a batch that is not full waits for more requests (seconds).
        adapters: the account of loaded adapters generations are checked against (a new
            :class:`~.adapter_ledger.AdapterLedger` when omitted).
        continuous_batching: with ``max_batch_size > 1``, let generations join a running loop
            at its step boundaries (see the module docstring; only on an engine whose
            ``continuous_batching`` is true); ``False``: whole batches only.
    """

    ADMIN_METHODS = SCHEDULER_CALLS  # the op table's scheduled commands

    def __init__(
        self,
        engine: Any,
        max_queue_size: int = 64,
        *,
        metrics: SchedulerMetrics | None = None,
        idle_check_s: float = 0.5,
        stall_timeout_s: float | None = None,
        max_batch_size: int = 1,
        batch_wait_s: float = 0.0,
        adapters: AdapterLedger | None = None,
        continuous_batching: bool = True,
    ):
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {max_queue_size}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = int(max_batch_size)
        self.batch_wait_s = max(0.0, float(batch_wait_s))
        self.continuous_batching = bool(continuous_batching)
        self.engine = engine
        self.max_queue_size = max_queue_size
        self.metrics = metrics or SchedulerMetrics()
        #: the adapters loaded once the queued LoRA commands have run (checked on submission)
        self.adapters = adapters or AdapterLedger()
        self._idle_check_s = idle_check_s
        #: dead, stalled, step progress: told what happens here, asked by ``/health``
        self.health = HealthMonitor(stall_timeout_s, steps=getattr(engine, "steps_done", None))
        self._queue: deque[_Task] = deque()
        self._cond = threading.Condition()
        self._waiting_generations = 0
        self._running: _Task | None = None
        self._accepting = True
        self._shutdown_deadline: float | None = None  # set by begin_shutdown
        self._stop = False
        self._started = False
        self._thread = threading.Thread(target=self._loop, name="sglang-scheduler", daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Take the engine's loaded adapters (:attr:`adapters`), then start the worker thread
        (idempotent). The one engine call made outside the worker thread, before it exists."""
        if not self._started and not self._stop:
            self._started = True
            self._sync_adapters()  # before the first task: the queued commands are all pending
            self._thread.start()

    def begin_shutdown(self, timeout: float | None = None) -> None:
        """Refuse new work from now on (:class:`ServerShuttingDownError`, 503) and let queued and
        running work go on; a later :meth:`stop` waits at most until ``timeout`` seconds from now
        (the server calls this when SIGTERM arrives, so the whole shutdown stays within one
        ``--timeout-graceful-shutdown``). Idempotent: the first deadline stays."""
        with self._cond:
            self._accepting = False
            self.health.shutdown_began()
            if timeout is not None and self._shutdown_deadline is None:
                self._shutdown_deadline = time.monotonic() + timeout

    @property
    def shutting_down(self) -> bool:
        """Whether :meth:`begin_shutdown` or :meth:`stop` was called."""
        return not self._accepting or self._stop

    def stop(self, timeout: float | None = None) -> bool:
        """Stop accepting work, let queued and running work finish, then stop the thread.

        Args:
            timeout: seconds to wait for the queue to drain (never past the deadline that
                :meth:`begin_shutdown` set); what is still queued afterwards fails with
                :class:`ServerShuttingDownError`.

        Returns:
            True when everything finished in time.
        """
        with self._cond:
            self._accepting = False
            self.health.shutdown_began()
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._shutdown_deadline is not None:
                deadline = min(deadline or math.inf, self._shutdown_deadline)
            while (self._queue or self._running is not None) and self._thread.is_alive():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(timeout=remaining if remaining is not None else 0.5)
            drained = not self._queue and self._running is None
            self._fail_all_locked(ServerShuttingDownError("the server is shutting down"))
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5 if drained else 0.1)
        return drained

    # ------------------------------------------------------------------ state
    @property
    def queue_depth(self) -> int:
        """Generation requests waiting (not counting the one running)."""
        return self._waiting_generations

    @property
    def busy(self) -> bool:
        """True while a task runs."""
        return self._running is not None

    # ------------------------------------------------------------------ health
    @property
    def dead_reason(self) -> str | None:
        """Why the engine is considered dead, or ``None``."""
        return self.health.dead_reason

    def engine_alive(self) -> bool:
        """True while the worker thread runs and ``engine.is_alive()`` says so.

        ``engine.is_alive()`` must be cheap and safe to call from any thread (it checks worker
        processes; it does not touch the model). A dead engine is remembered: everything queued
        fails with ``EngineDeadError``.
        """
        if self.health.dead_reason is not None:
            return False
        if self._started and not self._thread.is_alive():
            if self._stop:
                return True  # stopped on purpose; the engine itself may be fine
            self._mark_dead("the scheduler thread is not running")
            return False
        try:
            alive = bool(self.engine.is_alive())
        except Exception as e:  # an engine that cannot answer is not alive
            logger.warning("engine.is_alive() raised %r", e)
            alive = False
        if not alive:
            self._mark_dead("the engine reported that it is not alive")
        return alive

    def healthy(self) -> bool:
        """True when the server accepts new work and the engine is alive and makes progress
        (``/health``)."""
        return not self.shutting_down and self.engine_alive() and self.health.healthy()

    def unhealthy_reason(self) -> str | None:
        """Why :meth:`healthy` is false (``None`` when it is not)."""
        return self.health.unhealthy_reason()

    def stalled_s(self) -> float:
        """Seconds without progress while work is pending (0 when nothing is)."""
        return self.health.stalled_s()

    def retry_after_s(self) -> int:
        """A guess of when a slot frees up, in seconds (``Retry-After`` of a full queue)."""
        return self.health.retry_after_s()

    def steps_done_for(self, future: Future) -> float | None:
        """Denoising steps the running generation of ``future`` has finished (``None``: not
        running, or the engine does not count steps)."""
        return self.health.steps_done_for(future)

    # ------------------------------------------------------------------ submission
    def _check_open(self) -> None:
        if self.health.dead_reason is not None:
            raise EngineDeadError(f"the engine is not available: {self.health.dead_reason}")
        if not self._accepting or self._stop:
            raise ServerShuttingDownError("the server is shutting down and accepts no new work")

    def submit_generation(self, params: Any, timing: TaskTiming | None = None) -> Future:
        """Queue one generation (a resolved ``SamplingParams``); the future resolves to the
        engine's outputs (PIL images, or ``Video`` objects for a video model).

        Raises:
            NotFoundError: 404, ``param="lora"``; its ``lora`` names an adapter that will not be
                loaded when it runs (:attr:`adapters`). Nothing is queued.
            QueueFullError: ``max_queue_size`` requests are already waiting.
            EngineDeadError: the engine is dead or the server is shutting down.
        """
        lora = getattr(params, "lora", None)
        with self._cond:
            self._check_open()
            # under the queue lock: the LoRA commands queued ahead are exactly those counted
            self.adapters.check(name for name, _ in lora or ())
            if self._waiting_generations >= self.max_queue_size:
                raise QueueFullError(
                    f"the request queue is full ({self.max_queue_size} waiting); retry later",
                    retry_after_s=self.retry_after_s(),
                )
            task = _Task("generate", (params,), {}, Future(), timing)
            self._queue.append(task)
            self._waiting_generations += 1
            self._queue_changed_locked()
            self._cond.notify_all()
        task.future.add_done_callback(lambda fut: self._forget_if_cancelled(task))
        return task.future

    def _forget_if_cancelled(self, task: _Task) -> None:
        """A generation cancelled while waiting leaves the queue at once (frees its slot)."""
        if not task.future.cancelled():
            return
        with self._cond:
            try:
                self._queue.remove(task)
            except ValueError:
                return  # already taken by the worker (which skips it) or failed
            self._waiting_generations -= 1
            self._queue_changed_locked()

    def submit_call(
        self, method: str, *args: Any, timing: TaskTiming | None = None, **kwargs: Any
    ) -> Future:
        """Queue ``engine.<method>(*args, **kwargs)`` (an admin call) behind the work before it.

        Raises:
            ValueError: ``method`` is not one of :attr:`ADMIN_METHODS`.
            EngineDeadError: the engine is dead or the server is shutting down.
        """
        if method not in self.ADMIN_METHODS:
            raise ValueError(f"unknown engine method {method!r}")
        with self._cond:
            self._check_open()
            task = _Task(method, args, kwargs, Future(), timing)
            self._queue.append(task)
            self.adapters.queued(task.seq, method, args, kwargs)
            # before the worker can take it: the ledger hears of the ends in the queue's order
            task.future.add_done_callback(lambda fut: self._adapters_after(task.seq, fut))
            self._queue_changed_locked()
            self._cond.notify_all()
        return task.future

    def _adapters_after(self, seq: int, fut: Future) -> None:
        """Tell the ledger how a queued command ended (run, failed, or dropped unrun)."""
        ok = not fut.cancelled() and fut.exception() is None
        self.adapters.finished(seq, fut.result() if ok else None, ok=ok)

    def _queue_changed_locked(self) -> None:
        """Tell the metrics and the health monitor what the queue holds now."""
        self.metrics.set_queue_depth(self._waiting_generations)
        self.health.queue_changed(len(self._queue), self._waiting_generations)

    # ------------------------------------------------------------------ worker
    def _mark_dead(self, reason: str) -> None:
        with self._cond:
            if self.health.engine_died(reason):
                logger.error("engine marked dead: %s", reason)
                self.metrics.set_engine_alive(False)
            self._fail_all_locked(EngineDeadError(f"the engine is not available: {reason}"))
            self._cond.notify_all()

    def _engine_alive(self) -> bool:
        """``engine.is_alive()``; ``False`` when it raises."""
        try:
            return bool(self.engine.is_alive())
        except Exception:
            return False

    def _mark_dead_if_down(self, e: BaseException, reason: str) -> None:
        """After an engine call raised ``e``: mark the engine dead when ``e`` is an
        :class:`EngineDeadError` (its message as the reason) or the engine says it is not alive
        (``reason``)."""
        if isinstance(e, EngineDeadError):
            self._mark_dead(e.message)
        elif not self._engine_alive():
            self._mark_dead(reason)

    def _fail_all_locked(self, exc: Exception) -> None:
        while self._queue:
            task = self._queue.popleft()
            if task.kind == "generate":
                self._waiting_generations -= 1
            if task.future.set_running_or_notify_cancel():
                task.future.set_exception(exc)
        self._queue_changed_locked()

    def _next_task(self) -> list[_Task] | None:
        with self._cond:
            while not self._queue and not self._stop:
                if not self._cond.wait(timeout=self._idle_check_s):
                    break  # idle: go check the engine
            if not self._queue:
                return None
            task = self._queue.popleft()
            batch = [task]
            if task.kind == "generate" and self.max_batch_size > 1:
                self._take_batch_locked(batch)
            self._waiting_generations -= sum(t.kind == "generate" for t in batch)
            self._running = task
            self._queue_changed_locked()
            return batch

    def _continuous(self) -> bool:
        """Whether generations run as continuous batches (see the module docstring)."""
        return (
            self.continuous_batching
            and self.max_batch_size > 1
            and getattr(self.engine, "continuous_batching", False) is True
            and hasattr(self.engine, "generate_continuous")
        )

    def _take_batch_locked(self, batch: list[_Task]) -> None:
        """Add to ``batch`` the waiting generations that can share its loop (see the module
        docstring), waiting up to ``batch_wait_s`` while it is not full."""
        key_of = _join_key if self._continuous() else _batch_key
        key = key_of(batch[0])
        deadline = time.monotonic() + self.batch_wait_s
        while True:
            for t in list(self._queue):
                if len(batch) >= self.max_batch_size or t.kind != "generate":
                    break  # nothing after an admin call may move ahead of it
                if key_of(t) == key:
                    self._queue.remove(t)
                    batch.append(t)
            left = deadline - time.monotonic()
            if len(batch) >= self.max_batch_size or left <= 0 or self._stop:
                return
            if any(t.kind != "generate" for t in self._queue):
                return  # an admin call waits: do not hold it back
            self._cond.wait(timeout=left)

    def _sync_adapters(self) -> None:
        """The ledger's starting point: the engine's own report (an engine without one, or one
        that fails to give it, leaves the ledger unknowing: it then refuses nothing)."""
        report = None
        list_loras = getattr(self.engine, "list_loras", None)
        if list_loras is not None:
            try:
                report = list_loras()
            except Exception as e:
                logger.warning("list_loras() failed (%s); adapters are checked by the engine", e)
        self.adapters.sync(report)

    def _loop(self) -> None:
        while not self._stop:
            batch = self._next_task()
            if batch is None:
                if self._stop:
                    break
                if not self._engine_alive():
                    self._mark_dead("the engine reported that it is not alive")
                    break
                continue
            try:
                # skip the tasks whose client went away
                live = [t for t in batch if t.future.set_running_or_notify_cancel()]
                gens = [t.future for t in live if t.kind == "generate"]
                self.health.task_started(batch[0].kind, gens)
                if (
                    gens
                    and len(gens) == len(live)
                    and self._continuous()
                    and _shares_loops(live[0])
                ):
                    self._run_continuous(live)
                elif len(live) > 1:
                    self._run_batch(live)
                elif live:
                    self._run(live[0])
            finally:
                with self._cond:
                    self._running = None
                    self.health.task_finished()
                    self._cond.notify_all()
            if self.health.dead_reason is not None:
                break

    def _run_continuous(self, tasks: list[_Task]) -> None:
        """Generations in one continuous loop (``engine.generate_continuous``): more join it
        at its step boundaries (:meth:`_admit`); each future resolves when its request
        finished."""
        key = _join_key(tasks[0])
        session: list[_Task | None] = list(tasks)  # the engine's request index -> task
        begun: list[float] = [time.perf_counter()] * len(tasks)
        for t in tasks:
            t.started(begun[0])

        def admit(running: int) -> list:
            joined = self._admit(key, running)
            now = time.perf_counter()
            for t in joined:
                t.started(now)
                session.append(t)
                begun.append(now)
            return [t.args[0] for t in joined]

        def on_done(index: int, result: Any) -> None:
            t, end = session[index], time.perf_counter()
            session[index] = None  # the loop may outlive many requests: keep none of its own
            self.health.generation_left(t.future)
            t.ended(end)
            run_s = end - begun[index]
            self.health.generation_finished(run_s)
            steps = getattr(t.args[0], "num_inference_steps", None)
            self.metrics.observe_generation(begun[index] - t.enqueued_at, run_s, steps)
            if isinstance(result, BaseException):
                t.future.set_exception(result)
            else:
                t.future.set_result(result)

        try:
            self.engine.generate_continuous([t.args[0] for t in tasks], admit, on_done)
        except BaseException as e:
            for t in session:
                if t is not None and not t.future.done():
                    t.ended(time.perf_counter())
                    t.future.set_exception(e)
            self._mark_dead_if_down(e, getattr(e, "message", None) or type(e).__name__)
            return
        for t in session:  # an engine that skipped one: its caller must not wait forever
            if t is not None and not t.future.done():
                t.future.set_exception(RuntimeError("the engine returned no result"))

    def _admit(self, key: tuple, running: int) -> list[_Task]:
        """The waiting generations that join a running loop of ``key`` now (asked by the engine
        at a step boundary; ``running``: requests in the loop): from the head of the queue,
        while they match and there is room; the first task that cannot join stops it (first
        come first served: an admin call waits only for the loop to drain)."""
        taken: list[_Task] = []
        with self._cond:
            if self.health.dead_reason is not None:
                return taken
            popped = False
            while self._queue and len(taken) < self.max_batch_size - running:
                t = self._queue[0]
                if t.kind != "generate" or _join_key(t) != key:
                    break
                self._queue.popleft()
                self._waiting_generations -= 1
                popped = True
                if t.future.set_running_or_notify_cancel():  # skip a client that went away
                    taken.append(t)
            if popped:
                self._queue_changed_locked()
                self.health.generations_joined([t.future for t in taken], running + len(taken))
        return taken

    def _run_batch(self, tasks: list[_Task]) -> None:
        """Generations that share one denoising loop; each future gets its own result."""
        if not hasattr(self.engine, "generate_batch"):  # an engine without batching
            for t in tasks:
                self._run(t)
            return
        start = time.perf_counter()
        requests = [t.args[0] for t in tasks]
        for t in tasks:
            t.started(start)
        try:
            results = self.engine.generate_batch(requests)
        except BaseException as e:
            for t in tasks:
                t.ended(time.perf_counter())
                t.future.set_exception(e)
            self._mark_dead_if_down(e, getattr(e, "message", None) or type(e).__name__)
            return
        run_s = time.perf_counter() - start
        self.health.generation_finished(run_s)
        for t in tasks:
            t.ended(start + run_s)
        for t, req, res in zip(tasks, requests, results):
            self.metrics.observe_generation(
                start - t.enqueued_at, run_s, getattr(req, "num_inference_steps", None)
            )
            if isinstance(res, BaseException):
                t.future.set_exception(res)
            else:
                t.future.set_result(res)

    def _run(self, task: _Task) -> None:
        start = time.perf_counter()
        task.started(start)
        steps = None
        try:
            if task.kind == "generate":
                request = task.args[0]
                steps = getattr(request, "num_inference_steps", None)
                result = self.engine.generate(request)
            else:
                result = getattr(self.engine, task.kind)(*task.args, **task.kwargs)
        except BaseException as e:  # delivered to the waiting handler, which maps it
            task.ended(time.perf_counter())
            task.future.set_exception(e)
            self._mark_dead_if_down(e, f"{type(e).__name__} while running {task.kind}")
            return
        end = time.perf_counter()
        task.ended(end)
        if task.kind == "generate":
            run_s = end - start
            self.health.generation_finished(run_s)
            self.metrics.observe_generation(start - task.enqueued_at, run_s, steps)
        elif OPS[task.kind].changes_lora:
            self.metrics.observe_admin(task.kind, end - start)
        if isinstance(result, dict) and isinstance(result.get("memory"), dict):
            self.metrics.observe_lora_memory(result["memory"])
        task.future.set_result(result)
