"""``ComputeThread``: the in-process engine's one thread for loading and every command."""

from __future__ import annotations

import threading

import pytest
from sglang.multimodal_gen.runtime.compute_thread import ComputeThread


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    ct = ComputeThread(name="test-compute")
    try:
        idents = [ct.call(threading.get_ident) for _ in range(3)]
        assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
        order: list[int] = []
        callers = [threading.Thread(target=ct.call, args=(order.append, i)) for i in range(8)]
        for t in callers:
            t.start()
        for t in callers:
            t.join()
        assert sorted(order) == list(range(8))
        with pytest.raises(KeyError, match="boom"):
            ct.call(lambda: {}["boom"])
        assert ct.call(lambda: 7) == 7  # still serving after an error
        # a call made from the compute thread runs inline instead of waiting for itself
        assert ct.call(lambda: ct.call(threading.get_ident)) == idents[0]
    finally:
        ct.stop()


def test_a_stopped_thread_refuses_calls():
    from sglang.multimodal_gen.errors import EngineDeadError

    ct = ComputeThread()
    ct.stop()
    ct._thread.join(timeout=10)
    assert not ct._thread.is_alive()
    with pytest.raises(EngineDeadError, match="shut down"):
        ct.call(int)


def _interrupt_main_thread_soon(delay_s: float) -> None:
    import os
    import signal
    import time

    def fire():
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()


def test_ctrl_c_in_the_caller_interrupts_the_running_call():
    """The caller's KeyboardInterrupt is raised in the compute thread at its next Python line
    (as it would be on the caller's own thread); the caller re-raises it once the call stopped,
    and the thread keeps serving."""
    import time

    ct = ComputeThread()
    seen: list[str] = []

    def long_call():
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.01)
            seen.append("finished")
        except KeyboardInterrupt:
            seen.append("interrupted")
            raise

    try:
        _interrupt_main_thread_soon(0.3)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            ct.call(long_call)
        assert seen == ["interrupted"] and time.monotonic() - t0 < 30
        assert ct.call(lambda: 5) == 5
    finally:
        ct.stop()


def test_stop_runs_what_is_queued_and_refuses_later_calls():
    from sglang.multimodal_gen.errors import EngineDeadError

    ct = ComputeThread()
    release, started = threading.Event(), threading.Event()
    ct_result: list = []

    def blocker():
        started.set()
        release.wait(30)
        return "first"

    def second():
        try:
            ct_result.append(ct.call(int))
        except EngineDeadError as e:
            ct_result.append(e)

    first = threading.Thread(target=lambda: ct_result.append(ct.call(blocker)))
    first.start()
    started.wait(10)
    late = threading.Thread(target=second)
    late.start()
    while ct._queue.qsize() == 0:  # the second call is queued behind the running one
        threading.Event().wait(0.01)
    ct.stop()
    release.set()
    first.join(30)
    late.join(30)
    assert not late.is_alive() and not first.is_alive()
    assert sorted(map(str, ct_result)) == ["0", "first"]  # both ran: the running one, the queued
    with pytest.raises(EngineDeadError):  # later ones are refused, none waits forever
        ct.call(int)


def test_the_idle_thread_keeps_no_reference_to_a_finished_call():
    import gc
    import weakref

    import torch

    ct = ComputeThread()
    try:
        refs = []

        def fails():
            t = torch.ones(4)
            refs.append(weakref.ref(t))
            raise ValueError("boom")

        with pytest.raises(ValueError):
            ct.call(fails)
        gc.collect()
        assert refs[0]() is None  # the error's traceback (and its tensors) were released
    finally:
        ct.stop()


def test_an_interrupted_call_that_fails_otherwise_reports_its_error_as_the_cause():
    """E.g. a LoRA restore cut short resets the weights and raises EngineDeadError: the caller
    gets its KeyboardInterrupt with that error as ``__cause__`` (the engine then stops)."""
    import time

    from sglang.multimodal_gen.errors import EngineDeadError

    ct = ComputeThread()

    def restore():
        try:
            while True:
                time.sleep(0.01)
        except KeyboardInterrupt:
            raise EngineDeadError("weights reset to base") from None

    try:
        _interrupt_main_thread_soon(0.3)
        with pytest.raises(KeyboardInterrupt) as info:
            ct.call(restore)
        assert isinstance(info.value.__cause__, EngineDeadError)
        assert ct.call(lambda: 3) == 3
    finally:
        ct.stop()
