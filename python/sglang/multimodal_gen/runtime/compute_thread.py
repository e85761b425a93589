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
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from sglang.multimodal_gen.errors import EngineDeadError

T = TypeVar("T")

__all__ = ["ComputeThread", "exit_code_for_process"]

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

    _instances: weakref.WeakSet[ComputeThread] = weakref.WeakSet()

    def __init__(self, name: str = "sglang-engine"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._state = threading.Lock()
        self._current: Future | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        ComputeThread._instances.add(self)

    @classmethod
    def any_busy(cls) -> bool:
        """Whether some compute thread of this process is running a call (a CLI that exits
        then must leave with ``os._exit``: finalizing the interpreter under a running torch op
        aborts the process)."""
        return any(ct._current is not None and ct._thread.is_alive() for ct in list(cls._instances))

    def _loop(self) -> None:
        while True:
            fut = None
            try:
                item = self._queue.get()
                if item is None:
                    break
                fut, fn, args, kwargs = item
                del item
                self._run(fut, fn, args, kwargs)
                del fn, args, kwargs
            except KeyboardInterrupt as e:  # delivered late, after the call itself returned
                with self._state:
                    self._current = None
                if fut is not None and not fut.done():
                    fut.set_exception(e)
            fut = None
        while True:  # defensive: nothing is queued after the stop marker, but never leave a wait
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0].set_running_or_notify_cancel():
                item[0].set_exception(EngineDeadError("the engine has been shut down"))

    def _run(self, fut: Future, fn, args, kwargs) -> None:
        """Run one call and resolve ``fut``. An interrupt is injected only while ``_current``
        is ``fut`` (both set under ``_state``), so it lands in ``fn`` or, at worst, just after
        it (then ``_loop`` resolves ``fut``)."""
        with self._state:
            if not fut.set_running_or_notify_cancel():
                return  # cancelled by an interrupted caller before it started
            self._current = fut
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # delivered to the caller, the thread keeps serving
            with self._state:
                self._current = None
            fut.set_exception(e)
            return
        with self._state:
            self._current = None
        fut.set_result(result)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the compute thread; its result, or its exception re-raised.
        Called from the compute thread itself, it runs inline (no deadlock).

        A ``KeyboardInterrupt`` or ``SystemExit`` raised in the caller while it waits is
        passed on as ``KeyboardInterrupt`` into the call (or cancels it if it has not started);
        the caller waits up to a minute for the call to stop, then re-raises its own exception
        with the call's own error, if it failed otherwise, as ``__cause__``.

        Raises:
            EngineDeadError: the thread was stopped (:meth:`stop`).
        """
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: Future = Future()
        try:
            with self._state:
                if self._stopped or not self._thread.is_alive():
                    raise EngineDeadError("the engine has been shut down")
                self._queue.put((fut, fn, args, kwargs))
            return fut.result()
        except (KeyboardInterrupt, SystemExit) as stop:
            self._interrupt(fut)
            try:
                fut.result(timeout=_INTERRUPT_GRACE_S)
            except (KeyboardInterrupt, CancelledError, FutureTimeout):
                pass
            except BaseException as own:  # e.g. a LoRA restore failed: the caller must know
                stop.__cause__ = own
            raise

    def _interrupt(self, fut: Future) -> None:
        """Raise ``KeyboardInterrupt`` in the compute thread if it is running ``fut``; cancel
        ``fut`` if it has not started."""
        with self._state:
            if fut.cancel():
                return
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


def exit_code_for_process(code: int) -> int:
    """``code``, after leaving at once with it (``os._exit``) when an engine's compute thread
    is still inside a call: a Ctrl-C or SIGTERM that did not stop the call within its grace
    time would otherwise end in an abort while the interpreter finalizes under a running torch
    op. The console scripts pass their exit code through this."""
    if ComputeThread.any_busy():
        import os
        import sys

        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream must not keep the process alive
                pass
        os._exit(code)
    return code
