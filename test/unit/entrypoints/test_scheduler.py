"""The scheduler's batches never take a generation queued behind an admin call.

A generation queued after a ``set_lora`` must run with the adapters that call sets: the batcher
may only gather generations that are ahead of every waiting admin call. The engine here records
the order of its calls; the first generation holds the engine while the others queue.
"""

from __future__ import annotations

import threading
import time

from sglang.multimodal_gen.configs.sampling_params import SamplingParams
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler


class RecordingEngine:
    def __init__(self):
        self.log: list = []
        self.hold = threading.Event()
        self.started = threading.Event()

    def is_alive(self) -> bool:
        return True

    def steps_done(self) -> int:
        return 0

    def generate(self, params):
        self.log.append(("generate", [params.prompt]))
        self.started.set()
        self.hold.wait(30)
        return [params.prompt]

    def generate_batch(self, reqs):
        self.log.append(("generate_batch", [r.prompt for r in reqs]))
        return [[r.prompt] for r in reqs]

    def set_lora(self, *args, **kwargs):
        self.log.append(("set_lora", []))
        return {"status": "ok"}


def _params(prompt: str) -> SamplingParams:
    return SamplingParams(prompt=prompt, height=64, width=64, num_inference_steps=2, seed=1)


def test_a_generation_behind_set_lora_is_not_batched_ahead_of_it():
    engine = RecordingEngine()
    sched = Scheduler(engine, max_queue_size=8, max_batch_size=4, batch_wait_s=0.2)
    sched.start()
    try:
        first = sched.submit_generation(_params("first"))
        assert engine.started.wait(30)  # the engine is busy: the rest queue up
        before = sched.submit_generation(_params("before"))
        admin = sched.submit_call("set_lora", "style", "style.safetensors")
        after = sched.submit_generation(_params("after"))
        time.sleep(0.1)
        engine.hold.set()
        for fut in (first, before, admin, after):
            fut.result(timeout=30)
    finally:
        sched.stop(timeout=10)
    order = [(kind, prompts) for kind, prompts in engine.log]
    assert order[0] == ("generate", ["first"])
    flat = [p for _, prompts in order[1:] for p in (prompts or ["<set_lora>"])]
    assert flat == ["before", "<set_lora>", "after"], order


class ContinuousEngine:
    """A continuous-batching engine in miniature: ``generate_continuous`` runs lock-step
    rounds; each round first asks ``admit`` (the scheduler's step boundary), then every running
    request does one step, and a request that did all its steps is answered at once. Hooks
    ``at_round[r]`` run at the start of round ``r`` (to queue work mid-batch). ``log`` records
    every engine call; ``rounds`` the prompts that stepped in each round."""

    continuous_batching = True

    def __init__(self):
        self.log: list = []
        self.rounds: list[list[str]] = []
        self.at_round: dict = {}

    def is_alive(self) -> bool:
        return True

    def steps_done(self) -> int:
        return 0

    def generate_continuous(self, reqs, admit, on_done, progress=None):
        self.log.append(("generate_continuous", [r.prompt for r in reqs]))
        running = [[i, r, 0] for i, r in enumerate(reqs)]
        count = len(reqs)
        r = 0
        while True:
            if r in self.at_round:
                self.at_round.pop(r)()
            joined = admit(len(running))
            if joined:
                self.log.append(("joined", [p.prompt for p in joined]))
            for p in joined:
                running.append([count, p, 0])
                count += 1
            if not running:
                return
            self.rounds.append([row[1].prompt for row in running])
            for row in running:
                row[2] += 1
            for row in [row for row in running if row[2] == row[1].num_inference_steps]:
                running.remove(row)
                on_done(row[0], [row[1].prompt])
            r += 1

    def generate(self, params):
        self.log.append(("generate", [params.prompt]))
        return [params.prompt]

    def set_lora(self, *args, **kwargs):
        self.log.append(("set_lora", []))
        return {"status": "ok"}


class _Solo(SamplingParams):
    """A request whose batch key is its own (as LTX-2 two-stage generation's)."""

    def batch_key(self) -> tuple:
        return (*super().batch_key(), id(self))


def _gen(prompt: str, steps: int = 2, size: int = 64) -> SamplingParams:
    return SamplingParams(prompt=prompt, height=size, width=size, num_inference_steps=steps, seed=1)


def _continuous(engine, **kw) -> Scheduler:
    sched = Scheduler(engine, max_queue_size=16, **{"max_batch_size": 4, **kw})
    sched.start()
    return sched


def test_a_generation_joins_a_running_loop_and_returns_before_it_ends():
    engine = ContinuousEngine()
    sched = _continuous(engine)
    futs = {}
    engine.at_round[1] = lambda: futs.update(short=sched.submit_generation(_gen("short", 2)))
    # a waiting generation is answered while the loop still runs (not when the batch ends)
    engine.at_round[4] = lambda: futs.update(short_done=futs["short"].done())
    try:
        futs["long"] = sched.submit_generation(_gen("long", 6))
        assert futs["long"].result(timeout=30) == ["long"]
        assert futs["short"].result(timeout=30) == ["short"]
    finally:
        sched.stop(timeout=10)
    # another step count may join (the timesteps are per row); it joined at the next boundary
    assert engine.log == [("generate_continuous", ["long"]), ("joined", ["short"])]
    assert engine.rounds[:4] == [["long"], ["long", "short"], ["long", "short"], ["long"]]
    assert futs["short_done"] is True


def test_joins_stop_at_an_admin_call_and_at_other_settings():
    """First come first served: the generation queued before set_lora joins, the one after it
    does not (it must see the new adapters); the admin call runs when the loop drained; a
    generation of another size at the head of the queue stops joins (the matching one behind it
    does not join the running loop)."""
    engine = ContinuousEngine()
    sched = _continuous(engine)
    futs = []

    def queue_work():
        futs.append(sched.submit_generation(_gen("before", 2)))
        futs.append(sched.submit_call("set_lora", "style", "style.safetensors"))
        futs.append(sched.submit_generation(_gen("after", 2)))
        futs.append(sched.submit_generation(_gen("other-size", 2, size=32)))
        futs.append(sched.submit_generation(_gen("behind-other", 2)))

    engine.at_round[1] = queue_work
    try:
        futs.append(sched.submit_generation(_gen("first", 3)))
        for f in futs:
            f.result(timeout=30)
    finally:
        sched.stop(timeout=10)
    assert engine.log == [
        ("generate_continuous", ["first"]),
        ("joined", ["before"]),
        ("set_lora", []),
        # a new loop gathers matching generations from the whole queue, as request batching
        # does; only joins are strictly in order
        ("generate_continuous", ["after", "behind-other"]),
        ("generate_continuous", ["other-size"]),
    ], engine.log


def test_joins_fill_the_batch_up_to_max_batch_size():
    engine = ContinuousEngine()
    sched = _continuous(engine, max_batch_size=2)
    futs = []
    engine.at_round[1] = lambda: futs.extend(
        sched.submit_generation(_gen(p, 2)) for p in ("b", "c", "d")
    )
    try:
        futs.append(sched.submit_generation(_gen("a", 3)))
        for f in futs:
            f.result(timeout=30)
    finally:
        sched.stop(timeout=10)
    assert max(len(r) for r in engine.rounds) == 2
    # b joins a's loop; c takes a's place when a leaves, d b's
    assert engine.rounds == [["a"], ["a", "b"], ["a", "b"], ["c", "d"], ["c", "d"]], engine.rounds


def test_a_request_that_shares_no_loop_runs_alone():
    """A request whose key is its own (LTX-2 two-stage: its pipeline refuses to run in a batch)
    goes to ``engine.generate``, not into a continuous loop; nothing joins it."""
    engine = ContinuousEngine()
    sched = _continuous(engine)
    try:
        solo = sched.submit_generation(
            _Solo(prompt="solo", height=64, width=64, num_inference_steps=2, seed=1)
        )
        assert solo.result(timeout=30) == ["solo"]
        assert sched.submit_generation(_gen("next")).result(timeout=30) == ["next"]
    finally:
        sched.stop(timeout=10)
    assert engine.log == [("generate", ["solo"]), ("generate_continuous", ["next"])]
