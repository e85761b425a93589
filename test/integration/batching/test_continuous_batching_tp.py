"""Continuous batching with worker processes: TP 2 (two gloo workers, the shared
``zimage_tp2_engine``), Ulysses 2 and CFG parallel 2 (engines of their own, extended tier).

Rank 0 asks the engine for joining requests at every step boundary and broadcasts them with its
adapter selections, so both ranks admit the same request at the same step (rank 1 of the shared
engine refuses to select adapters itself: a join selected there would fail). The arrival is made
at an exact point of the running loop with rank 0's step gate (``fixtures.tp_engine.step_gate``):
the long request stops after its first step, the short one is queued, then the loop goes on.
References: each request alone through ``engine.generate`` on the same engine (bar 45 dB as in
``test_continuous_batching.py``).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from fixtures.tiny_models import psnr
from fixtures.tp_engine import step_gate
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.runtime import SamplingParams

MIN_PSNR = 45.0


def _req(prompt, seed, steps, lora=None):
    return SamplingParams(prompt=prompt, negative_prompt="blurry", seed=seed, height=32, width=32,
                          num_inference_steps=steps, guidance_scale=3.0, lora=lora)  # fmt: skip


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(params=["tp2", "ulysses2", "cfg2"])
def parallel_engine(request, tiny_zimage_dir):
    """A two-rank engine with the worker hook ``strict_ranks`` (its step gate, and rank 1
    refusing to select adapters); TP 2 is the session's shared engine."""
    if request.param == "tp2":
        yield request.getfixturevalue("zimage_tp2_engine")
        return
    from fixtures.tp_engine import strict_ranks
    from sglang.multimodal_gen.runtime import DiffusionEngine

    layout = dict(ulysses_degree=2) if request.param == "ulysses2" else dict(cfg_degree=2)
    with DiffusionEngine(
        tiny_zimage_dir, device="cpu", _worker_setup=strict_ranks, **layout
    ) as engine:
        yield engine


@pytest.fixture
def gate():
    path = step_gate(os.getpid())
    path.mkdir(exist_ok=True)
    for name in ("arm", "reached", "go"):
        (path / name).unlink(missing_ok=True)
    yield path
    (path / "go").touch()  # never leave rank 0 waiting
    (path / "arm").unlink(missing_ok=True)


def test_a_request_arriving_mid_batch_joins_the_running_loop_and_leaves_first(
    parallel_engine, gate, tiny_zimage_loras
):
    engine = parallel_engine
    assert engine.continuous_batching
    engine.set_lora(["a", "b"], list(tiny_zimage_loras))
    engine.unset_lora()
    long, short = _req("a red fox", 1, 8), _req("a boat at dusk", 2, 2, lora=[("a", 0.8)])
    alone = [np.asarray(engine.generate(r)[0]) for r in (long, short)]
    assert psnr(alone[0], alone[1]) < 35  # the two really differ
    sched = Scheduler(engine, max_queue_size=8, max_batch_size=4)
    sched.start()
    try:
        steps = engine._executor.steps_done
        start = steps()
        done_at: dict = {}
        (gate / "arm").touch()
        fut_long = sched.submit_generation(long)
        fut_long.add_done_callback(lambda f: done_at.setdefault("long", steps() - start))
        _wait_for(lambda: (gate / "reached").exists() or fut_long.done(), "the first step")
        assert not fut_long.done(), fut_long.exception()
        fut_short = sched.submit_generation(short)
        fut_short.add_done_callback(lambda f: done_at.setdefault("short", steps() - start))
        _wait_for(lambda: sched.queue_depth == 1, "the short request in the queue")
        (gate / "go").touch()
        got_short = np.asarray(fut_short.result(timeout=60)[0])
        got_long = np.asarray(fut_long.result(timeout=60)[0])
    finally:
        (gate / "go").touch()
        sched.stop(timeout=60)
    # the short request (2 steps) joined the running loop: answered while the long one had
    # steps left (request batching would have started it after the long one's 8 steps)
    assert done_at["short"] < 10 and done_at["short"] < done_at["long"], done_at
    assert psnr(got_long, alone[0]) >= MIN_PSNR
    assert psnr(got_short, alone[1]) >= MIN_PSNR


def test_joiners_that_fail_fail_alone_with_their_own_error(zimage_tp2_engine):
    """Under TP 2, requests joining at the first boundary (``generate_continuous`` directly:
    the scheduler would not let a request with another ``cache`` join) that fail on rank 0 before
    they run: a prompt rank 0's encoder rejects, a ``cache`` the server cannot honour (MagCache
    without calibrated ratios: refused when the generation is set up). Each fails with the error
    it gives alone, the running request finishes with its own image, and the engine serves on
    (no rank left waiting in a broadcast)."""
    from fixtures.tp_engine import BAD

    engine = zimage_tp2_engine
    long = _req("a red fox", 1, 4)
    bad = [
        _req(f"a {BAD} prompt", 2, 2),
        SamplingParams(prompt="a boat", seed=3, height=32, width=32, num_inference_steps=2,
                       cache={"method": "magcache"}),
    ]  # fmt: skip
    alone_errors = []
    for r in bad:
        with pytest.raises(Exception) as info:
            engine.generate(r)
        alone_errors.append(info.value)
    alone_long = np.asarray(engine.generate(long)[0])
    asked, results = [], {}

    def admit(running):
        asked.append(running)
        return bad if len(asked) == 1 else []

    engine.generate_continuous([long], admit, lambda i, r: results.__setitem__(i, r))
    assert sorted(results) == [0, 1, 2], results
    for err, alone in zip((results[1], results[2]), alone_errors):
        assert type(err) is type(alone) and str(err) == str(alone), (err, alone)
    assert psnr(np.asarray(results[0][0]), alone_long) >= MIN_PSNR
    assert np.asarray(engine.generate(_req("a boat", 3, 2))[0]).shape == (32, 32, 3)


def test_a_request_that_cannot_be_resolved_fails_alone_and_the_next_keeps_its_number(
    zimage_tp2_engine,
):
    """``admit`` gives a good request and something that is not a request, then another good
    one: the bad one fails alone and each good one gets its own image (no other request's
    result under its number)."""
    engine = zimage_tp2_engine
    long, first, second = _req("a red fox", 1, 4), _req("a boat", 2, 2), _req("a lighthouse", 3, 2)
    alone = {
        k: np.asarray(engine.generate(r)[0]) for k, r in (("first", first), ("second", second))
    }
    assert psnr(alone["first"], alone["second"]) < 35
    asked, results = [], {}

    def admit(running):
        asked.append(running)
        return {1: [first, object()], 2: [second]}.get(len(asked), [])

    engine.generate_continuous([long], admit, lambda i, r: results.__setitem__(i, r))
    assert sorted(results) == [0, 1, 2, 3], results
    assert isinstance(results[2], Exception)
    assert psnr(np.asarray(results[1][0]), alone["first"]) >= MIN_PSNR
    assert psnr(np.asarray(results[3][0]), alone["second"]) >= MIN_PSNR


def test_an_answer_too_late_for_the_last_boundary_still_answers_its_requests(tiny_zimage_dir):
    """With worker processes rank 0 waits ``heartbeat_s`` for ``admit``'s answer; an answer
    later than that for the loop's last boundary finds the loop gone, and its request is
    answered with an error instead of never."""
    from sglang.multimodal_gen.errors import SGLangError
    from sglang.multimodal_gen.runtime import DiffusionEngine

    with DiffusionEngine(tiny_zimage_dir, tp_size=2, device="cpu", heartbeat_s=1.0) as engine:
        late, results = _req("a boat", 2, 2), {}

        def admit(running):
            if running:
                return []
            time.sleep(2.5)  # past heartbeat_s
            return [late]

        engine.generate_continuous([_req("a red fox", 1, 2)], admit, results.__setitem__)
        assert sorted(results) == [0, 1], results
        assert isinstance(results[1], SGLangError) and "too late" in str(results[1])
        assert np.asarray(engine.generate(late)[0]).shape == (32, 32, 3)  # still serving


def test_every_order_of_mixed_joins_gives_each_request_its_own_image(
    zimage_tp2_engine, tiny_zimage_loras
):
    """Three requests with other seeds, step counts (4, 3, 2) and LoRA compositions (none, ``a``,
    ``a + b``), in every order: the first starts the loop, the second joins at the first step
    boundary, the third at the second; they finish at different steps, so rank 0's decodes
    fall between the others' DiT calls (``generate_continuous`` directly: exact boundaries)."""
    import itertools

    engine = zimage_tp2_engine
    engine.set_lora(["a", "b"], list(tiny_zimage_loras))
    engine.unset_lora()
    reqs = [
        _req("a red fox", 1, 4),
        _req("a lighthouse over a calm sea", 2, 3, lora=[("a", 0.8)]),
        _req("a boat", 3, 2, lora=[("a", 1.3), ("b", 0.7)]),
    ]
    alone = [np.asarray(engine.generate(r)[0]) for r in reqs]
    for x, y in itertools.combinations(alone, 2):
        assert psnr(x, y) < 35
    for order in itertools.permutations(range(3)):
        asked, results = [], {}

        def admit(running, order=order, asked=asked):
            asked.append(running)
            return {1: [reqs[order[1]]], 2: [reqs[order[2]]]}.get(len(asked), [])

        engine.generate_continuous([reqs[order[0]]], admit, results.__setitem__)
        assert sorted(results) == [0, 1, 2], (order, results)
        for k, i in enumerate(order):
            assert psnr(np.asarray(results[k][0]), alone[i]) >= MIN_PSNR, (order, i)
