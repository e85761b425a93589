"""The health monitor alone (a fake clock and step counter), then owned by a scheduler.

The monitor is told what happens (queue changes, task start/end, generation times, death,
shutdown) and answers ``/health``'s questions; nothing here runs a model.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.entrypoints.scheduler_health import HealthMonitor
from sglang.multimodal_gen.errors import EngineDeadError, QueueFullError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Steps:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count


def _monitor(timeout=10.0):
    clock, steps = Clock(), Steps()
    return HealthMonitor(timeout, steps=steps, clock=clock), clock, steps


def test_idle_is_never_stalled():
    m, clock, _ = _monitor()
    clock.now += 1000
    assert m.stalled_s() == 0.0 and m.healthy() and m.unhealthy_reason() is None


def test_work_arriving_while_idle_starts_the_stall_clock():
    m, clock, _ = _monitor()
    clock.now += 1000  # idle for long: not counted
    m.queue_changed(1, 1)
    assert m.stalled_s() == 0.0
    clock.now += 4
    m.queue_changed(2, 2)  # more work while some is pending: the clock keeps running
    clock.now += 7
    assert m.stalled_s() == 11.0 and not m.healthy()
    assert m.unhealthy_reason() == (
        "the engine has made no progress for 11 s while work is pending (running: nothing; "
        "2 waiting)"
    )


def test_a_task_that_never_ends_is_a_stall_naming_it():
    m, clock, _ = _monitor()
    m.queue_changed(1, 1)
    m.queue_changed(0, 0)
    m.task_started("generate", [Future()])
    clock.now += 10
    assert m.healthy()  # at the timeout, not past it
    clock.now += 0.5
    assert not m.healthy()
    assert "running: generate; 0 waiting" in m.unhealthy_reason()
    m.task_finished()  # the call returned: healthy again, nothing pending
    assert m.healthy() and m.stalled_s() == 0.0


def test_steps_are_progress():
    m, clock, steps = _monitor()
    m.task_started("generate", [Future()])
    for _ in range(5):  # a long generation, one step every 8 s: never stalled
        clock.now += 8
        steps.count += 1
        assert m.healthy(), m.stalled_s()
    clock.now += 11  # then the steps stop
    assert not m.healthy()


def test_without_a_step_count_only_starts_and_ends_are_progress():
    clock = Clock()
    m = HealthMonitor(10.0, steps=None, clock=clock)
    f = Future()
    m.task_started("generate", [f])
    assert m.steps_done_for(f) is None
    clock.now += 11
    assert not m.healthy()
    broken = HealthMonitor(10.0, steps=lambda: 1 / 0, clock=clock)  # an engine that cannot say
    broken.task_started("generate", [f])
    assert broken.steps_done_for(f) is None and broken.healthy()


def test_no_timeout_never_stalls():
    m, clock, _ = _monitor(timeout=None)
    m.task_started("set_lora")
    clock.now += 10**6
    assert m.healthy() and m.stalled_s() == 10**6


def test_steps_done_for_each_row_of_a_batch():
    m, _, steps = _monitor()
    steps.count = 40  # earlier generations
    a, b, other = Future(), Future(), Future()
    assert m.steps_done_for(a) is None  # not running
    m.task_started("generate", [a, b])
    steps.count += 6  # three loop steps of the two rows
    assert m.steps_done_for(a) == m.steps_done_for(b) == 3.0
    assert m.steps_done_for(other) is None
    m.task_finished()
    assert m.steps_done_for(a) is None


def test_dead_and_shutting_down():
    m, _, _ = _monitor()
    assert m.engine_died("worker 1 exited")
    assert not m.engine_died("later news")  # the first reason stays
    assert not m.healthy() and m.dead_reason == m.unhealthy_reason() == "worker 1 exited"
    m2, _, _ = _monitor()
    m2.shutdown_began()
    assert not m2.healthy() and m2.unhealthy_reason() == "the server is shutting down"


def test_retry_after_follows_the_mean_generation_time():
    m, _, _ = _monitor()
    assert m.retry_after_s() == 1  # nothing known: one second
    m.generation_finished(4.0)
    m.queue_changed(3, 3)
    assert m.retry_after_s() == 12
    m.generation_finished(9.0)  # 0.8 x 4 + 0.2 x 9 = 5
    assert m.retry_after_s() == 15
    m.queue_changed(100, 100)
    assert m.retry_after_s() == 60  # at most a minute


# ------------------------------------------------------------------ owned by the scheduler
class FakeEngine:
    """Blocking generations that step while ``step`` is set; ``alive`` answers is_alive()."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.steps = 0
        self.alive = True
        self.started = threading.Event()

    def generate(self, params):
        self.started.set()
        while not self.release.wait(0.01):
            pass
        self.steps += params.num_inference_steps
        return ["image"]

    def steps_done(self) -> int:
        return self.steps

    def is_alive(self) -> bool:
        return self.alive

    def list_loras(self) -> dict:
        return {}


class Params:
    num_inference_steps = 2


def _wait(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_events_from_two_threads_do_not_interleave():
    """Continuous batching: a finishing request's ``generation_left`` comes from the engine's
    compute thread while the scheduler's thread may be inside another event. Here it is sent
    while ``generations_joined`` of the same future is half done (reading the step count): it
    must wait for that event to end, so the left generation is not counted as running after."""
    f, other = Future(), Future()
    joining = threading.Event()
    left = threading.Thread(target=lambda: monitor.generation_left(f))

    def steps():  # inside generations_joined: the other thread's event runs or waits now
        if joining.is_set() and left.ident is None:
            left.start()
            left.join(timeout=0.3)  # returns at once unless the monitor makes it wait
        return 5

    monitor = HealthMonitor(10.0, steps=steps, clock=Clock())
    monitor.task_started("generate", [other])
    joining.set()
    monitor.generations_joined([f], rows=2)
    left.join(timeout=5)
    assert not left.is_alive()
    assert monitor.steps_done_for(f) is None  # it left after it joined
    assert monitor.steps_done_for(other) == 0.0


def test_scheduler_tells_its_monitor():
    engine = FakeEngine()
    sched = Scheduler(engine, 1, stall_timeout_s=0.2, idle_check_s=0.05)
    sched.start()
    try:
        time.sleep(0.3)
        assert sched.healthy()  # idle is not stalled
        running = sched.submit_generation(Params())
        assert engine.started.wait(10)
        waiting = sched.submit_generation(Params())
        with pytest.raises(QueueFullError):
            sched.submit_generation(Params())
        assert sched.steps_done_for(running) == 0.0 and sched.steps_done_for(waiting) is None
        _wait(lambda: not sched.healthy(), "the stall was not noticed")
        assert "running: generate; 1 waiting" in sched.unhealthy_reason()
        engine.release.set()
        assert running.result(10) == waiting.result(10) == ["image"]
        _wait(sched.healthy, "not healthy after the call returned")
        assert sched.retry_after_s() == 1
        engine.alive = False
        assert not sched.healthy()
        assert sched.dead_reason == "the engine reported that it is not alive"
        with pytest.raises(EngineDeadError, match="not alive"):
            sched.submit_call("list_loras")
    finally:
        sched.stop(timeout=1)


def test_shutdown_is_unhealthy():
    sched = Scheduler(FakeEngine(), 1)
    sched.start()
    sched.begin_shutdown(5)
    assert not sched.healthy() and sched.unhealthy_reason() == "the server is shutting down"
    assert sched.stop(timeout=1)
