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
    ct = ComputeThread()
    ct.stop()
    ct._thread.join(timeout=10)
    with pytest.raises(RuntimeError, match="stopped"):
        ct.call(int)
