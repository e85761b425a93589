"""The engine's health as the scheduler sees it: dead, stalled, progressing (``/health``).

:class:`HealthMonitor` is owned by the :class:`~sglang.multimodal_gen.entrypoints.scheduler.
Scheduler`, which tells it what happens: the queue changed (work arrived, left or was taken), a
task started or finished, a generation took so long, the engine died, shutdown began. It reads
the engine's denoising-step count itself, through the function it was given (``engine.
steps_done``), and answers whether the engine is healthy, why not, when to retry, and how far a
running generation got.

Progress is a task starting or ending, or a denoising step ending (when the engine counts them),
so a long generation is not taken for a hung call; work arriving while nothing was pending starts
the stall clock afresh.

Events come from more than one thread: the scheduler's loop, and in continuous batching the
``on_done`` callback of a finishing request (``generation_left`` / ``generation_finished``), which
the engine calls from its compute thread outside the scheduler's lock; answers are asked from the
HTTP handlers' threads. Every event and every answer runs under the monitor's own lock (a re-entrant one, as
answers call one another), so each sees and leaves the fields consistent: an event never
interleaves with another or with an answer.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

__all__ = ["HealthMonitor"]

logger = logging.getLogger(__name__)


class HealthMonitor:
    """Stall detection, the dead reason and per-generation step progress of one engine.

    Args:
        stall_timeout_s: unhealthy while work is pending and nothing started, finished or
            stepped for this long, in seconds (``None``: never).
        steps: the engine's count of finished denoising steps (``engine.steps_done``; ``None``
            or a function that raises or returns ``None``: the engine does not count, and only
            task starts and ends are progress).
        clock: monotonic seconds (``time.monotonic``; tests pass a fake one).
    """

    def __init__(
        self,
        stall_timeout_s: float | None = None,
        *,
        steps: Callable[[], int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stall_timeout_s = stall_timeout_s
        self._steps = steps
        self._clock = clock
        self._progress_at = clock()  # last progress, or work arriving while nothing was pending
        self._steps_seen: int | None = None  # the step count when last looked at
        self._queued = 0  # tasks waiting (generations and admin calls)
        self._waiting_generations = 0
        self._running: str | None = None  # the kind of the task running now
        # id(future) -> (step count at its start, rows sharing its loop), generations running now
        self._running_gens: dict[int, tuple[int | None, int]] = {}
        self._avg_generation_s: float | None = None
        self._dead_reason: str | None = None
        self._shutting_down = False
        self._lock = threading.RLock()  # every event and answer (module docstring)

    # ------------------------------------------------------------------ events
    def queue_changed(self, queued: int, waiting_generations: int) -> None:
        """The queue now holds ``queued`` tasks, ``waiting_generations`` of them generations.
        Work arriving while nothing was pending starts the stall clock."""
        with self._lock:
            if queued and not self._queued and self._running is None:
                self._progress_at = self._clock()
            self._queued, self._waiting_generations = queued, waiting_generations

    def task_started(self, kind: str, generations: Sequence[Future] = ()) -> None:
        """A task of ``kind`` (``"generate"`` or an engine method) started; ``generations`` are
        the futures of the generations it runs (a batch shares one denoising loop)."""
        with self._lock:
            steps = self._engine_steps()
            self._running_gens = {id(f): (steps, len(generations)) for f in generations}
            self._running = kind
            self._progress_at = self._clock()

    def generations_joined(self, generations: Sequence[Future], rows: int) -> None:
        """``generations`` joined the running denoising loop (continuous batching), which now
        runs ``rows`` generations."""
        with self._lock:
            steps = self._engine_steps()
            for f in generations:
                self._running_gens[id(f)] = (steps, rows)
            self._progress_at = self._clock()

    def generation_left(self, generation: Future) -> None:
        """A generation of the running denoising loop was answered while the loop goes on."""
        with self._lock:
            self._running_gens.pop(id(generation), None)

    def task_finished(self) -> None:
        """The running task finished (with a result or an error)."""
        with self._lock:
            self._running_gens = {}
            self._running = None
            self._progress_at = self._clock()

    def generation_finished(self, run_s: float) -> None:
        """A generation (or a batch of them) took ``run_s`` seconds of engine time."""
        with self._lock:
            avg = self._avg_generation_s
            self._avg_generation_s = run_s if avg is None else 0.8 * avg + 0.2 * run_s

    def engine_died(self, reason: str) -> bool:
        """The engine cannot serve any more. Returns whether this is the first such news (the
        first reason is kept)."""
        with self._lock:
            if self._dead_reason is not None:
                return False
            self._dead_reason = reason
            return True

    def shutdown_began(self) -> None:
        """The server accepts no new work from now on."""
        with self._lock:
            self._shutting_down = True

    # ------------------------------------------------------------------ answers
    @property
    def dead_reason(self) -> str | None:
        """Why the engine is dead, or ``None``."""
        with self._lock:
            return self._dead_reason

    @property
    def pending(self) -> bool:
        """Whether a task runs or waits."""
        with self._lock:
            return self._running is not None or self._queued > 0

    def stalled_s(self) -> float:
        """Seconds without progress while work is pending; 0 when nothing is pending. A step
        the engine finished since the last look counts as progress now."""
        with self._lock:
            if not self.pending:
                return 0.0
            self._note_engine_steps()
            return max(0.0, self._clock() - self._progress_at)

    def stalled(self) -> bool:
        """Whether :meth:`stalled_s` is past the stall timeout."""
        with self._lock:
            return self.stall_timeout_s is not None and self.stalled_s() > self.stall_timeout_s

    def healthy(self) -> bool:
        """Not dead, not shutting down, not stalled (the engine's own liveness is asked by the
        scheduler, which reports a death through :meth:`engine_died`)."""
        with self._lock:
            return self._dead_reason is None and not self._shutting_down and not self.stalled()

    def unhealthy_reason(self) -> str | None:
        """Why :meth:`healthy` is false (``None`` when it is not)."""
        with self._lock:
            if self._dead_reason is not None:
                return self._dead_reason
            if self._shutting_down:
                return "the server is shutting down"
            if self.stalled():
                return (
                    f"the engine has made no progress for {self.stalled_s():.0f} s while work is "
                    f"pending (running: {self._running or 'nothing'}; {self._queued} waiting)"
                )
            return None

    def retry_after_s(self) -> int:
        """A guess of when a slot frees up: the mean generation time x waiting generations,
        clamped to 1..60 s."""
        with self._lock:
            avg = self._avg_generation_s or 1.0
            return int(min(60, max(1, math.ceil(avg * max(1, self._waiting_generations)))))

    def steps_done_for(self, future: Future) -> float | None:
        """Denoising steps a running generation has finished (``None``: not running, or the
        engine does not count steps). The rows of a batch step together, so each gets its
        share of the engine's count (a video job's ``progress``)."""
        with self._lock:
            start, rows = self._running_gens.get(id(future), (None, 1))
            if start is None:
                return None
            now = self._engine_steps()
            return None if now is None else max(0, now - start) / rows

    # ------------------------------------------------------------------ internals
    def _engine_steps(self) -> int | None:
        if self._steps is None:
            return None
        try:
            steps = self._steps()
            return None if steps is None else int(steps)
        except Exception:  # an engine that cannot say
            return None

    def _note_engine_steps(self) -> None:
        steps = self._engine_steps()
        if steps is None:  # an engine that cannot say: starts and ends only
            return
        if self._steps_seen is not None and steps != self._steps_seen:
            self._progress_at = self._clock()
        self._steps_seen = steps
