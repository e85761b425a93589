"""Continuous batching: requests join a running denoising loop at a step boundary and leave it
when they finish, each image what the request gives alone.

A scheduler over a real in-process engine (the tiny Z-Image model). Arrivals are made at exact
points of the running loop: the first request's step callback (its ``batch-request-0`` thread,
between two of its steps) queues the next ones, so the assertions are on the order of steps and
answers, never on time. The loop is lock-step (a step runs once every request in it waits at its
call), which makes that order deterministic. References: each request alone through
``engine.generate`` (bar 45 dB as in ``test_batching.py``; measured inf dB, bit-identical).
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

MIN_PSNR = 45.0


@pytest.fixture(scope="module")
def engine(tiny_zimage_dir, tiny_zimage_loras):
    """An in-process engine with adapters ``a`` and ``b`` loaded, none active."""
    with DiffusionEngine(tiny_zimage_dir, device="cpu") as eng:
        eng.set_lora(["a", "b"], list(tiny_zimage_loras))
        eng.unset_lora()
        yield eng


def _req(prompt, seed, steps, lora=None):
    return SamplingParams(prompt=prompt, negative_prompt="blurry", seed=seed, height=32, width=32,
                          num_inference_steps=steps, guidance_scale=3.0, lora=lora)  # fmt: skip


def _image(outputs) -> np.ndarray:
    return np.asarray(outputs[0])


class _Steps:
    """Records ``(request, step)`` of every denoising step the engine's loop makes (the request
    is the batch index of its thread), and runs ``hooks[(0, step)]`` after that step of the
    loop's first request."""

    def __init__(self, engine):
        self.runner = engine._executor.runner  # the in-process runner
        self.events: list = []
        self.hooks: dict = {}
        self._count = self.runner._count_step

    def __enter__(self):
        def step(i, seconds):
            name = threading.current_thread().name
            request = int(name.rsplit("-", 1)[1]) if name.startswith("batch-request-") else None
            self.events.append((request, i))
            hook = self.hooks.pop((request, i), None)
            if hook is not None:
                hook()
            self._count(i, seconds)

        self.runner._count_step = step
        return self

    def __exit__(self, *exc):
        del self.runner._count_step

    def done(self, name):
        """A future callback that records ``(name, "done")`` when it resolves."""
        return lambda fut: self.events.append((name, "done"))


def _wait_idle(scheduler) -> None:
    """Until the scheduler's last loop has returned (it asks for joins once more after its
    last request was answered)."""
    deadline = time.monotonic() + 60
    while scheduler.busy and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not scheduler.busy


@pytest.fixture
def scheduler(engine):
    sched = Scheduler(engine, max_queue_size=8, max_batch_size=4)
    sched.start()
    yield sched
    sched.stop(timeout=30)


def test_a_request_arriving_mid_batch_joins_at_the_next_step_and_leaves_first(engine, scheduler):
    long, short = _req("a red fox", 1, 8), _req("a boat at dusk", 2, 2)
    alone = [_image(engine.generate(r)) for r in (long, short)]
    futs = {}
    with _Steps(engine) as rec:
        rec.hooks[(0, 1)] = lambda: futs.update(short=scheduler.submit_generation(short))
        futs["long"] = scheduler.submit_generation(long)
        got_long = _image(futs["long"].result(timeout=120))
        got_short = _image(futs["short"].result(timeout=120))
    ev = rec.events
    # queued after the long request's step 1, the short one is request 1 of the same loop: its
    # prompt encoding and caption refiner share the calls of steps 2 and 3, its first DiT step
    # the long request's step 4 (request batching started it after step 7)
    assert (1, 0) in ev and ev.index((1, 0)) < ev.index((0, 5)), ev
    # and its last step comes before the long request's step 6
    assert (1, 1) in ev and ev.index((1, 1)) < ev.index((0, 6)), ev
    assert psnr(got_long, alone[0]) >= MIN_PSNR and psnr(got_short, alone[1]) >= MIN_PSNR
    assert psnr(alone[0], alone[1]) < 35  # the two really differ


def test_the_short_request_is_answered_before_the_long_one_ends(engine, scheduler):
    long, short = _req("a red fox", 1, 8), _req("a boat at dusk", 2, 2)
    futs = {}
    with _Steps(engine) as rec:

        def arrive():
            futs["short"] = scheduler.submit_generation(short)
            futs["short"].add_done_callback(rec.done("short"))

        rec.hooks[(0, 0)] = arrive
        futs["long"] = scheduler.submit_generation(long)
        futs["long"].result(timeout=120)
    ev = rec.events
    # the short request's answer comes before the long request's last step
    assert ev.index(("short", "done")) < ev.index((0, 7)), ev


ORDERS = list(itertools.permutations(range(3)))


def test_every_order_of_mixed_arrivals_gives_each_request_its_own_image(engine, scheduler):
    """Three requests with other seeds, step counts and LoRA compositions (none, ``a``,
    ``a + b``), in every arrival order: the first starts alone, the second arrives after its
    first step, the third after its second; all three share one loop and each image is the
    request's own."""
    reqs = [
        _req("a red fox", 1, 4),
        _req("a lighthouse over a calm sea", 2, 3, lora=[("a", 0.8)]),
        _req("a boat", 3, 2, lora=[("a", 1.3), ("b", 0.7)]),
    ]
    alone = [_image(engine.generate(r)) for r in reqs]
    for a, b in itertools.combinations(alone, 2):
        assert psnr(a, b) < 35
    for order in ORDERS:
        _wait_idle(scheduler)  # else the first request may join the last order's loop
        futs = {}
        with _Steps(engine) as rec:
            for k, step in ((1, 0), (2, 1)):
                i = order[k]
                rec.hooks[(0, step)] = lambda i=i, futs=futs: futs.update(
                    {i: scheduler.submit_generation(reqs[i])}
                )
            futs[order[0]] = scheduler.submit_generation(reqs[order[0]])
            futs[order[0]].result(timeout=120)  # its steps 0 and 1 queued the others
            got = {i: _image(futs[i].result(timeout=120)) for i in range(3)}
        joined = {r for r, _ in rec.events}
        assert joined == {0, 1, 2}, (order, rec.events)  # one loop, three requests
        for i in range(3):
            assert psnr(got[i], alone[i]) >= MIN_PSNR, (order, i, psnr(got[i], alone[i]))


def test_an_admin_call_waits_for_the_running_loop_to_drain(engine, scheduler):
    """A generation queued before ``set_lora`` joins the running loop and sees the old weights;
    the ``set_lora`` runs once the loop has drained; the generation queued after it does not join
    and sees the new adapters."""
    long, before, after = _req("a red fox", 1, 6), _req("a boat", 2, 2), _req("a boat", 3, 2)
    alone = [_image(engine.generate(r)) for r in (long, before, after)]
    engine.set_lora("a", None, strength=0.8)
    try:
        after_alone = _image(engine.generate(after))
    finally:
        engine.unset_lora()
    futs = {}
    with _Steps(engine) as rec:

        def arrive():
            futs["before"] = scheduler.submit_generation(before)
            futs["set_lora"] = scheduler.submit_call("set_lora", "a", None, strength=0.8)
            futs["after"] = scheduler.submit_generation(after)
            for name in ("before", "set_lora", "after"):
                futs[name].add_done_callback(rec.done(name))

        rec.hooks[(0, 0)] = arrive
        futs["long"] = scheduler.submit_generation(long)
        futs["long"].add_done_callback(rec.done("long"))
        try:
            got = {k: futs[k].result(timeout=120) for k in ("long", "before", "set_lora", "after")}
        finally:
            scheduler.submit_call("unset_lora").result(timeout=60)
    done = [e[0] for e in rec.events if e[1] == "done"]
    assert done == ["before", "long", "set_lora", "after"], rec.events
    assert psnr(_image(got["long"]), alone[0]) >= MIN_PSNR
    assert psnr(_image(got["before"]), alone[1]) >= MIN_PSNR
    assert psnr(_image(got["after"]), after_alone) >= MIN_PSNR
    assert psnr(after_alone, alone[2]) < 35  # the set_lora changed that image


def test_step_caching_keeps_each_joining_requests_own_state(engine, scheduler):
    """Step caching keys its states per request: a cached request that joins a running loop at
    another step skips the steps it skips alone, and both images are their own."""
    from sglang.multimodal_gen.outputs import STEP_CACHE_INFO

    cache = {"method": "fbcache", "threshold": 0.68}  # skips some of the 6 steps alone
    reqs = [_req("a small red fox", 1, 6), _req("a boat at dusk", 2, 6)]
    reqs = [engine.spec.resolve(r.replace(cache=cache)) for r in reqs]
    alone = [engine.generate(r)[0] for r in reqs]
    futs = {}
    with _Steps(engine) as rec:
        rec.hooks[(0, 1)] = lambda: futs.update(joiner=scheduler.submit_generation(reqs[1]))
        futs["first"] = scheduler.submit_generation(reqs[0])
        got = [futs[k].result(timeout=120)[0] for k in ("first", "joiner")]
    assert {r for r, _ in rec.events} == {0, 1}  # one loop
    for a, b in zip(alone, got):
        assert a.info[STEP_CACHE_INFO] == b.info[STEP_CACHE_INFO]
        assert psnr(np.asarray(a), np.asarray(b)) >= MIN_PSNR
    computed = [a.info[STEP_CACHE_INFO]["steps_computed"] for a in alone]
    assert min(computed) < 6, computed  # the cache really skipped steps
