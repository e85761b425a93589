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
