"""The engine over its executor, and the multi-process executor's command protocol, without a
model: fake executors and fake worker queues (the real ones run in the engine's integration tests).
"""

from __future__ import annotations

import queue
import threading

import pytest
from sglang.multimodal_gen.errors import EngineDeadError, NotFoundError
from sglang.multimodal_gen.runtime.engine import DiffusionEngine
from sglang.multimodal_gen.runtime.error_transport import pack_error
from sglang.multimodal_gen.runtime.executors import MultiprocExecutor
from sglang.multimodal_gen.runtime.nodes import Workers


class FakeExecutor:
    def __init__(self):
        self.info = {"spatial_factor": 16, "family": "zimage", "lora_targets": ["all"]}
        self.calls: list = []
        self.alive = True
        self.shutdowns = 0

    def execute(self, op, kwargs):
        self.calls.append((op, kwargs))
        return {"op": op}

    def is_alive(self):
        return self.alive

    def steps_done(self):
        return 7

    def shutdown(self):
        self.shutdowns += 1


def _engine(executor) -> DiffusionEngine:
    engine = object.__new__(
        DiffusionEngine
    )  # the constructor's checks and loading are not tested here
    engine._lock = threading.Lock()
    engine._closed = False
    engine._executor = executor
    engine._info = executor.info
    return engine


def test_the_engine_runs_every_call_on_its_executor():
    ex = FakeExecutor()
    with _engine(ex) as engine:
        assert engine.list_loras() == {"op": "list_loras"}
        assert engine.unset_lora("transformer") == {"op": "unset_lora"}
        assert ex.calls == [("list_loras", {}), ("unset_lora", {"target": "transformer"})]
        assert engine.steps_done() == 7 and engine.is_alive()
        assert engine.spatial_factor == 16 and engine.lora_targets == ("all",)
        with pytest.raises(ValueError, match="unknown engine command 'nope'"):
            engine._call("nope")
        ex.alive = False
        assert not engine.is_alive()
        with pytest.raises(EngineDeadError, match="worker processes are not running"):
            engine.list_loras()
    assert ex.shutdowns == 1 and not engine.is_alive()
    engine.shutdown()  # idempotent
    assert ex.shutdowns == 1
    with pytest.raises(EngineDeadError, match="has been shut down"):
        engine.list_loras()


class FakeProc:
    def __init__(self):
        self.alive = True
        self.exitcode = None
        self.joined = 0

    def is_alive(self):
        return self.alive

    def join(self, timeout=None):
        self.joined += 1

    def kill(self):
        self.alive = False


class RankZero:
    """Answers each command put on ``cmd_q`` with the next scripted reply, on its own thread."""

    def __init__(self, workers: Workers, replies: list):
        self.seen: list = []
        self._workers, self._replies = workers, list(replies)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def join(self):
        self._thread.join(timeout=10)

    def _serve(self):
        while True:
            cmd = self._workers.cmd_q.get()
            self.seen.append(cmd[0])
            if cmd[0] == "shutdown":
                return
            if not self._replies:
                continue  # a rank 0 that died answers nothing
            self._workers.res_q.put(("result", *self._replies.pop(0)))


def _executor(replies) -> tuple[MultiprocExecutor, RankZero]:
    ex = object.__new__(MultiprocExecutor)  # no processes: the queues are served by a thread
    ex._dead, ex._closed, ex._in_call, ex._stale_results = False, False, False, 0
    ex.workers = Workers([FakeProc(), FakeProc()], queue.Queue(), queue.Queue())
    ex.info = {}
    return ex, RankZero(ex.workers, replies)


def test_errors_of_any_rank_come_back_as_their_type():
    ex, rank0 = _executor(
        [(True, {"loaded": []}), (False, (1, pack_error(NotFoundError("no adapter 'x'"))))]
    )
    assert ex.execute("list_loras", {}) == {"loaded": []}
    with pytest.raises(NotFoundError, match="no adapter 'x'"):
        ex.execute("unload_lora", {"nickname": "x"})
    assert ex.is_alive()  # a failed command is not a dead executor
    ex.shutdown()
    rank0.join()
    assert rank0.seen == ["list_loras", "unload_lora", "shutdown"] and not ex.is_alive()
    assert all(p.joined and not p.alive for p in ex.workers.procs)
    with pytest.raises(EngineDeadError, match="shut down"):
        ex.execute("list_loras", {})


def test_an_interrupted_call_does_not_hand_its_answer_to_the_next():
    ex, _ = _executor([(True, "image of the interrupted call"), (True, {"loaded": []})])
    wait = ex._wait_result
    calls = [0]

    def interrupted_once(*a, **k):
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt  # as a Ctrl-C while waiting for the workers
        return wait(*a, **k)

    ex._wait_result = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        ex.execute("generate", {})
    assert ex.execute("list_loras", {}) == {"loaded": []}
    ex.shutdown()


def test_a_failed_rollback_makes_the_executor_dead():
    stopped = EngineDeadError("LoRA rollback failed; the TP workers stop (restart the engine)")
    ex, _ = _executor([(False, (1, pack_error(stopped)))])
    with pytest.raises(EngineDeadError, match="rollback failed"):
        ex.execute("set_lora", {})
    assert not ex.is_alive()
    ex.shutdown()


def test_a_dead_worker_is_a_dead_executor():
    ex, _ = _executor([])
    ex.workers.procs[1].alive = False
    ex.workers.procs[1].exitcode = -9
    assert not ex.is_alive()
    with pytest.raises(EngineDeadError, match=r"TP workers \[1\] exited \(exit codes \[-9\]\)"):
        ex.execute("list_loras", {})
    ex.shutdown()
