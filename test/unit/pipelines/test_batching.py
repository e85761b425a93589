"""``StepBatcher`` with joins and leaves (continuous batching), on toy request bodies.

Each body makes ``steps`` module calls through the rendezvous, one row each, carrying its request
index and step as the row's value; the toy module returns ``10 * x`` and logs the rows of every
call it runs. Expected logs are written out by hand: a request that joins at a step boundary
shares the next call with the running ones (its first row beside their next rows), a request
that finishes leaves while the others go on, and a request admitted after every other left
still runs.
"""

from __future__ import annotations

import threading

import torch
from sglang.multimodal_gen.pipelines.batching import StepBatcher

MODULE = object()


def _module_call(log):
    def run(module, rows, args, batched, row_lora):
        assert module is MODULE and rows == 1
        log.append([tuple(int(v) for v in r) for r in args["x"]])
        return args["x"] * 10

    return run


def _body(batcher, log, seen, name, steps, done):
    """A request of ``steps`` calls; ``seen[name]`` gets what came back, ``done`` its end."""

    def body(index):
        out = []
        for s in range(steps):
            x = torch.tensor([[index, s]])
            out.append(batcher.submit(index, _module_call(log), MODULE, 1, {"x": x}, ("x",)))
        seen[name] = [tuple(int(v) for v in o[0]) for o in out]
        done.append((name, len(log)))  # the calls run so far when it finished

    return body


def test_a_request_joins_at_a_step_boundary_and_leaves_before_the_others():
    log, seen, done, asked = [], {}, [], []
    batcher = StepBatcher(1)
    first = _body(batcher, log, seen, "long", 5, done)
    joiner = _body(batcher, log, seen, "short", 2, done)

    def admit(running):
        asked.append((len(log), running))
        return [joiner] if len(log) == 2 and running == 1 else []

    batcher.run([lambda: first(0)], admit=admit)
    # request 1 joined after two calls: its rows share the calls of steps 2 and 3 of request 0
    assert log == [[(0, 0)], [(0, 1)], [(0, 2), (1, 0)], [(0, 3), (1, 1)], [(0, 4)]]
    assert seen == {"long": [(0, s * 10) for s in range(5)], "short": [(10, 0), (10, 10)]}
    # the short request left after its last call, before the long one's last step ran
    assert done == [("short", 4), ("long", 5)]
    # asked once per step boundary, and once more when every request had left
    assert asked == [(0, 1), (1, 1), (2, 1), (3, 2), (4, 1), (5, 0)]


def test_a_request_admitted_after_the_batch_drained_still_runs():
    log, seen, done = [], {}, []
    batcher = StepBatcher(1)
    late = _body(batcher, log, seen, "late", 1, done)
    gave = []

    def admit(running):
        if running == 0 and not gave:
            gave.append(True)
            return [late]
        return []

    batcher.run([lambda: _body(batcher, log, seen, "first", 1, done)(0)], admit=admit)
    assert log == [[(0, 0)], [(1, 0)]]
    assert [n for n, _ in done] == ["first", "late"]


def test_joiners_take_the_next_indices_and_the_prologue_turns():
    """Two requests admitted at once are requests 1 and 2; each one's prologue (the broadcast of
    its conditioning) waits for the turns before it, as in a batch that started together."""
    log, seen, done, order = [], {}, [], []
    batcher = StepBatcher(1)
    lock = threading.Lock()

    def with_prologue(name, steps):
        inner = _body(batcher, log, seen, name, steps, done)

        def body(index):
            with batcher.prologue(index):
                with lock:
                    order.append((name, index))
            inner(index)

        return body

    admitted = []

    def admit(running):
        if len(log) == 1 and not admitted:
            admitted.append(True)
            return [with_prologue("b", 1), with_prologue("c", 1)]
        return []

    batcher.run([lambda: with_prologue("a", 3)(0)], admit=admit)
    assert order == [("a", 0), ("b", 1), ("c", 2)]
    assert log == [[(0, 0)], [(0, 1), (1, 0), (2, 0)], [(0, 2)]]
