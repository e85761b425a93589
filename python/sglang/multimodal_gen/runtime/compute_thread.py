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

import ctypes
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from sglang.multimodal_gen.errors import EngineDeadError

T = TypeVar("T")

__all__ = ["ComputeThread"]

# how long a Ctrl-C waits for the interrupted call to stop at its next Python line
_INTERRUPT_GRACE_S = 60.0


class ComputeThread:
    """A daemon thread that runs submitted calls one at a time, in order.

    A ``KeyboardInterrupt`` in a caller waiting in :meth:`call` is passed on to the call it waits
    for (raised in the compute thread at its next Python line, between two torch ops, as it would
    be on the main thread); the caller re-raises once that call stopped, so Ctrl-C behaves as
    if the work ran on the caller's thread and the interpreter never finalizes under a running
    op. The thread keeps no reference to a finished call (its function, arguments, result or
    error), so a dropped engine frees its model.

    Args:
        name: the thread's name (shown by py-spy and in ``threading.enumerate()``).
    """

    def __init__(self, name: str = "sglang-engine"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._state = threading.Lock()
        self._current: Future | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            fut, fn, args, kwargs = item
            del item
            if fut.set_running_or_notify_cancel():
                ok, value = self._run(fut, fn, args, kwargs)
                del fn, args, kwargs
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
                del value
            del fut
        while True:  # defensive: nothing is queued after the stop marker, but never leave a wait
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0].set_running_or_notify_cancel():
                item[0].set_exception(EngineDeadError("the engine has been shut down"))

    def _run(self, fut: Future, fn, args, kwargs) -> tuple[bool, Any]:
        with self._state:
            self._current = fut
        outcome: tuple[bool, Any] | None = None
        try:
            try:
                outcome = (True, fn(*args, **kwargs))
            except BaseException as e:  # delivered to the caller, the thread keeps serving
                outcome = (False, e)
            with self._state:
                self._current = None
        except KeyboardInterrupt as e:  # an interrupt that landed just after fn returned
            with self._state:
                self._current = None
            if outcome is None:
                outcome = (False, e)
        return outcome

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the compute thread; its result, or its exception re-raised.
        Called from the compute thread itself, it runs inline (no deadlock).

        Raises:
            EngineDeadError: the thread was stopped (:meth:`stop`).
        """
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: Future = Future()
        with self._state:
            if self._stopped or not self._thread.is_alive():
                raise EngineDeadError("the engine has been shut down")
            self._queue.put((fut, fn, args, kwargs))
        try:
            return fut.result()
        except KeyboardInterrupt:
            self._interrupt(fut)
            try:
                fut.result(timeout=_INTERRUPT_GRACE_S)
            except BaseException:
                pass
            raise

    def _interrupt(self, fut: Future) -> None:
        """Raise ``KeyboardInterrupt`` in the compute thread if it is still running ``fut``
        (queued but not started: cancelled instead)."""
        if fut.cancel():
            return
        with self._state:
            if self._current is fut and self._thread.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(self._thread.ident), ctypes.py_object(KeyboardInterrupt)
                )

    def stop(self) -> None:
        """Refuse new calls (``EngineDeadError``); the thread finishes the calls already queued
        and exits (idempotent; returns at once)."""
        with self._state:
            if self._stopped:
                return
            self._stopped = True
            self._queue.put(None)
