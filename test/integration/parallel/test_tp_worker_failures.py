"""Multi-process engines fail one request, not the engine, and never leave orphan workers.

* A failure only rank 0 can meet (prompt encoding: the text encoders live on rank 0) fails that
  request on every rank, alone and in a batch, under tensor and sequence parallelism. A test hook
  (``fixtures.tp_engine.strict_ranks``; at TP 2 the shared engine's) makes rank 0's encoder raise
  for prompts holding ``BOOM`` (as a tokenizer or text encoder rejecting a prompt would). Before
  the fix rank 0 raised before the conditioning broadcast, the other rank waited in it forever,
  and the engine hung.
* Workers ignore SIGTERM (the launcher owns their lifetime); when the launching process is killed
  outright they exit by themselves within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from fixtures.tiny_models import psnr
from fixtures.tp_engine import BAD, strict_ranks
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams


def _req(prompt, seed=3):
    return SamplingParams(
        prompt=prompt, height=32, width=32, num_inference_steps=2, seed=seed, guidance_scale=2.0
    )


@pytest.fixture
def sp2_engine(tiny_zimage_dir):
    with DiffusionEngine(
        tiny_zimage_dir, device="cpu", ulysses_degree=2, _worker_setup=strict_ranks
    ) as engine:
        yield engine


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp2", "sp2"])
def test_rank0_encoder_failure_fails_the_request_not_the_engine(request, layout):
    # TP 2: the session's shared engine (same worker hook)
    engine = request.getfixturevalue({"tp2": "zimage_tp2_engine", "sp2": "sp2_engine"}[layout])
    good = np.asarray(engine.generate(_req("a red square"))[0])
    with pytest.raises(ValueError, match="rejects"):
        engine.generate(_req(f"a {BAD} square"))
    # same ranks, same order: the next request is still the image it was
    assert np.array_equal(np.asarray(engine.generate(_req("a red square"))[0]), good)

    # in a batch the failing request fails alone and the others are their own images
    reqs = [_req("a red square"), _req(f"{BAD}!", seed=4), _req("a blue circle", seed=5)]
    outs = engine.generate_batch(reqs)
    assert isinstance(outs[1], ValueError) and "rejects" in str(outs[1])
    assert psnr(np.asarray(outs[0][0]), good) >= 45
    alone = np.asarray(engine.generate(reqs[2])[0])
    assert psnr(np.asarray(outs[2][0]), alone) >= 45
    assert psnr(alone, good) < 30  # the two good requests are far apart
    assert engine.is_alive()


@pytest.mark.timeout(300)
def test_tp2_interrupted_call_does_not_hand_its_answer_to_the_next(zimage_tp2_engine):
    """A caller interrupted while the TP workers run its command: the workers still answer it,
    and that answer must be dropped, not returned to the next call (before: ``list_loras()``
    returned the interrupted generation's image)."""
    engine = zimage_tp2_engine
    expected = np.asarray(engine.generate(_req("a red square"))[0])
    wait = engine._executor._wait_result
    calls = [0]

    def interrupted_once(*a, **k):
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt  # as a Ctrl-C while waiting for the workers
        return wait(*a, **k)

    engine._executor._wait_result = interrupted_once
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(_req("a red square"))
        assert isinstance(engine.list_loras(), dict)
        assert np.array_equal(np.asarray(engine.generate(_req("a red square"))[0]), expected)
    finally:
        del engine._executor._wait_result  # the shared engine: back to the class's method


LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from sglang.multimodal_gen.runtime import DiffusionEngine

    engine = DiffusionEngine({model!r}, tp_size=2, device="cpu")
    print("PIDS", *[p.pid for p in engine._executor.workers.procs], flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split()[2] != "Z"


@pytest.mark.timeout(300)
def test_workers_exit_when_the_launcher_is_killed(tiny_zimage_dir):
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER.format(model=tiny_zimage_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the launcher exited before its workers started"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if _alive(p)]
        for p in left:  # leave no orphan behind even when the test fails
            os.kill(p, signal.SIGKILL)
        assert not left, f"workers {left} outlived their launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
