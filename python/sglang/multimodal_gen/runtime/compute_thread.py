"""One long-lived OS thread for all of an in-process engine's tensor work.

Why: PyTorch's CPU kernels run on OpenMP (libgomp), which keeps a thread team for every thread
that ever ran a parallel region, for as long as that thread lives. When the model is loaded on one
thread (say the main thread of ``sglang serve``) and requests run on another (the scheduler's),
two teams exist; once libgomp manages more threads than there are cores it stops spinning
between parallel regions and every small op pays a futex wake-up. Measured on a 2-core VM: a
multiply of 786k floats 34 -> 93 us, a 2048 x 96 x 288 GEMM 500 -> 607 us, as soon as the main
thread had computed anything and a second thread computed. Loading and every command on the same
thread keeps one team. (TP workers need no help: each is a process whose main thread does it all.)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["ComputeThread"]


class ComputeThread:
    """A daemon thread that runs submitted calls one at a time, in order.

    Daemon, so that a Ctrl-C in the caller ends the process without waiting for a running
    generation (the caller's :meth:`call` is interrupted; the work is abandoned with the process).

    Args:
        name: the thread's name (shown by py-spy and in ``threading.enumerate()``).
    """

    def __init__(self, name: str = "sglang-engine"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # delivered to the caller, the thread keeps serving
                fut.set_exception(e)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the compute thread; its result, or its exception re-raised.
        Called from the compute thread itself, it runs inline (no deadlock)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        if not self._thread.is_alive():
            raise RuntimeError("the engine's compute thread has stopped")
        fut: Future = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut.result()

    def stop(self) -> None:
        """Let the thread finish what it runs and exit (idempotent; returns at once)."""
        self._queue.put(None)
