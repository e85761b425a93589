"""The scheduler's view of the engine's health: dead, stalled, progressing (``/health``).

A mixin of :class:`~sglang.multimodal_gen.entrypoints.scheduler.Scheduler`, which owns the state
it reads: ``engine``, ``metrics``, ``stall_timeout_s``, the worker ``_thread`` and its
``_started``/``_stop`` flags, ``_dead_reason``, ``_running``/``_queue``, ``_accepting``,
``_progress_at`` (last task start/end), ``_steps_seen`` (the engine's step count when last looked
at), ``_running_gens`` (the generations running now), ``_avg_generation_s`` and
``_waiting_generations``; and the ``_mark_dead`` and ``_cond`` it calls.

Progress is a task starting or ending, or a denoising step ending (``engine.steps_done()``, when
the engine counts them), so a long generation is not taken for a hung call.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future
from typing import Any

__all__ = ["SchedulerHealth"]

logger = logging.getLogger("sglang.multimodal_gen.entrypoints.scheduler")


class SchedulerHealth:
    """Liveness, stall detection and per-generation step progress (see the module docstring)."""

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is considered dead, or ``None``."""
        return self._dead_reason

    def engine_alive(self) -> bool:
        """True while the worker thread runs and ``engine.is_alive()`` says so.

        ``engine.is_alive()`` must be cheap and safe to call from any thread (it checks worker
        processes; it does not touch the model). A dead engine is remembered: everything queued
        fails with ``EngineDeadError``.
        """
        if self._dead_reason is not None:
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

    def stalled_s(self) -> float:
        """Seconds without progress (no task started or finished, and no denoising step, when
        the engine counts them: ``engine.steps_done()``) while work is pending; 0 when nothing
        is pending."""
        if self._running is None and not self._queue:
            return 0.0
        self._note_engine_steps()
        return max(0.0, time.monotonic() - self._progress_at)

    def _engine_steps(self) -> int | None:
        read = getattr(self.engine, "steps_done", None)
        try:
            return None if read is None else int(read())
        except Exception:  # an engine that cannot say
            return None

    def _note_started(self, tasks: list[Any]) -> None:
        steps = self._engine_steps()
        gens = [t for t in tasks if t.kind == "generate"]
        for t in gens:
            t.steps_at_start, t.batch_rows = steps, len(gens)
        with self._cond:
            self._running_gens = {id(t.future): t for t in gens}

    def steps_done_for(self, future: Future) -> float | None:
        """Denoising steps a running generation has finished (``None``: not running, or the
        engine does not count steps). The requests of a batch step together, so each gets its
        share of the engine's count (a video job's ``progress``)."""
        task = self._running_gens.get(id(future))
        if task is None or task.steps_at_start is None:
            return None
        now = self._engine_steps()
        return None if now is None else max(0, now - task.steps_at_start) / task.batch_rows

    def _note_engine_steps(self) -> None:
        """A step since the last look counts as progress now (looked at when health is asked:
        a long generation that keeps stepping is not stalled)."""
        steps = self._engine_steps()
        if steps is None:  # an engine that cannot say: starts and ends only
            return
        if self._steps_seen is not None and steps != self._steps_seen:
            self._progress_at = time.monotonic()
        self._steps_seen = steps

    def _stalled(self) -> bool:
        return self.stall_timeout_s is not None and self.stalled_s() > self.stall_timeout_s

    def healthy(self) -> bool:
        """True when the engine is alive, makes progress, and the server accepts new work
        (``/health``)."""
        return self._accepting and not self._stop and self.engine_alive() and not self._stalled()

    def unhealthy_reason(self) -> str | None:
        """Why :meth:`healthy` is false (``None`` when it is not)."""
        if self._dead_reason is not None:
            return self._dead_reason
        if not self._accepting or self._stop:
            return "the server is shutting down"
        if self._stalled():
            running = self._running.kind if self._running is not None else "nothing"
            return (
                f"the engine has made no progress for {self.stalled_s():.0f} s while work is "
                f"pending (running: {running}; {len(self._queue)} waiting)"
            )
        return None

    def retry_after_s(self) -> int:
        """A guess of when a slot frees up: the mean generation time x waiting requests, 1..60 s."""
        avg = self._avg_generation_s or 1.0
        return int(min(60, max(1, math.ceil(avg * max(1, self._waiting_generations)))))
