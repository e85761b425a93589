"""DiffusionEngine API: request validation, error types across TP ranks, a dying worker."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
from sglang.multimodal_gen.configs.sampling_params import RequestSpec
from sglang.multimodal_gen.errors import EngineDeadError, InvalidRequestError
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("height", 40, "height"),
        ("width", 0, "width"),
        ("num_inference_steps", 0, "num_inference_steps"),
        ("guidance_scale", float("nan"), "guidance_scale"),
        ("seed", -1, "seed"),
        ("num_outputs_per_prompt", 0, "num_outputs_per_prompt"),
        ("lora", [("a", 1.0), ("a", 2.0)], "lora"),
        ("lora", [("a", float("inf"))], "lora"),
        ("prompt", None, "prompt"),
    ],
)
def test_request_validation_names_the_field(field, value, param):
    req = SamplingParams(prompt="x", height=32, width=32).replace(**{field: value})
    spec = dataclasses.replace(RequestSpec.generic(), spatial_factor=16)
    with pytest.raises(InvalidRequestError) as e:
        spec.resolve(req)
    assert e.value.param == param and e.value.status_code == 400


def test_seedless_requests_differ_and_shutdown_is_final(tiny_zimage_dir):
    engine = DiffusionEngine(tiny_zimage_dir)
    req = SamplingParams(prompt="x", height=16, width=16, num_inference_steps=1)
    a, b = (np.asarray(engine.generate(req)[0]) for _ in range(2))
    assert not np.array_equal(a, b)  # a fresh seed per request
    images = engine.generate(prompt="x", height=16, width=32, num_outputs_per_prompt=2)
    assert [im.size for im in images] == [(32, 16), (32, 16)]
    engine.shutdown()
    assert not engine.is_alive()
    with pytest.raises(EngineDeadError):
        engine.generate(req)


def test_dead_tp_worker_makes_engine_dead(tiny_zimage_dir):
    engine = DiffusionEngine(tiny_zimage_dir, tp_size=2, device="cpu")
    try:
        assert engine.is_alive()
        os.kill(engine._executor.workers.procs[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine._executor.workers.procs[1].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_alive()
        with pytest.raises(EngineDeadError):
            engine.generate(prompt="x", height=16, width=16, seed=1)
    finally:
        engine.shutdown()
    assert all(not p.is_alive() for p in engine._executor.workers.procs)


def test_bad_model_path_and_tp_errors(tiny_zimage_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        DiffusionEngine(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"rank 0: .*n_heads=2 is not divisible by tp_size=3"):
        DiffusionEngine(tiny_zimage_dir, tp_size=3, device="cpu")


def test_in_process_engine_loads_and_runs_on_one_thread(tiny_zimage_dir):
    """Loading and every generation run on the engine's compute thread, whichever thread calls
    (the server's scheduler thread, the main thread): one OpenMP team on the CPU."""
    import threading

    from sglang.multimodal_gen.runtime.runner import ModelRunner

    loaded_on: list[int] = []
    init = ModelRunner.__init__

    def spy(self, *a, **k):
        loaded_on.append(threading.get_ident())
        init(self, *a, **k)

    ModelRunner.__init__ = spy
    try:
        engine = DiffusionEngine(tiny_zimage_dir, device="cpu")
    finally:
        ModelRunner.__init__ = init
    with engine:
        pipe = engine._executor.compute.call(lambda: engine._executor.runner.pipeline)
        ran_on: list[int] = []
        forward = pipe.transformer.forward

        def record(*a, **k):
            ran_on.append(threading.get_ident())
            return forward(*a, **k)

        pipe.transformer.forward = record
        req = SamplingParams(prompt="a fox", height=32, width=32, num_inference_steps=1, seed=1)
        engine.generate(req)
        other = threading.Thread(target=engine.generate_batch, args=([req, req],))
        other.start()
        other.join()
        assert len(ran_on) >= 2 and set(ran_on) == set(loaded_on)
        assert threading.get_ident() not in loaded_on


def test_a_dropped_engine_frees_its_model_and_thread(tiny_zimage_dir):
    import gc
    import threading
    import weakref

    engine = DiffusionEngine(tiny_zimage_dir, device="cpu")
    runner = weakref.ref(engine._executor.runner)
    thread = engine._executor.compute._thread
    del engine
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()
    gc.collect()
    assert runner() is None
    assert thread not in threading.enumerate()
