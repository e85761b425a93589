"""The adapters a queued request will find loaded (``entrypoints/adapter_ledger.py``): the engine's,
plus what the LoRA commands queued ahead of it load, minus what they free; through the scheduler,
a request is checked against exactly the commands queued before it."""

from __future__ import annotations

import threading

import pytest
from sglang.multimodal_gen.entrypoints.adapter_ledger import AdapterLedger, loaded_names
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.errors import NotFoundError
from sglang.multimodal_gen.lora.requests import SetLoRAArgs


def _set(*names, path="x.safetensors"):
    return SetLoRAArgs(list(names), [path] * len(names), ["all"] * len(names), [1.0] * len(names),
                       None)  # fmt: skip


def test_queued_commands_count_in_order():
    ledger = AdapterLedger()
    ledger.sync({"loaded": [{"nickname": "a"}]})
    ledger.queued(1, "set_lora", (_set("b"),))
    ledger.queued(2, "unload_lora", ("a",))
    assert ledger.view() == {"b"}
    with pytest.raises(NotFoundError) as e:
        ledger.check(["a"])
    assert e.value.param == "lora" and "'a'" in e.value.message
    ledger.check(["b"])
    ledger.finished(1, {"status": "ok"})  # done: b is loaded
    ledger.finished(2, None, ok=False)  # the unload failed: a stays
    assert ledger.view() == {"a", "b"}


def test_a_failed_or_dropped_load_is_taken_back_and_reuse_loads_nothing():
    ledger = AdapterLedger()
    ledger.sync({"loaded": {}})
    ledger.queued(1, "set_lora", (_set("b"),))
    ledger.queued(2, "set_lora", (_set("c", path=None),))  # reuse: needs c loaded already
    assert ledger.view() == {"b"}
    ledger.finished(1, None, ok=False)
    ledger.finished(2, None, ok=False)
    assert ledger.view() == set()


def test_the_engines_report_replaces_the_account():
    """The engine may have unloaded least recently used adapters to make room."""
    ledger = AdapterLedger()
    ledger.sync({"loaded": [{"nickname": "old"}]})
    ledger.queued(1, "set_lora", (_set("new"),))
    ledger.finished(1, {"status": "ok", "loaded": ["new"]})
    assert ledger.view() == {"new"}


def test_unknowing_it_refuses_nothing():
    ledger = AdapterLedger()
    ledger.check(["anything"])
    ledger.sync(None)
    ledger.check(["anything"])
    assert loaded_names({"loaded": [1, 2]}) is None and loaded_names("x") is None


class _Engine:
    """An engine whose admin calls block until released (to keep commands queued)."""

    def __init__(self, loaded):
        self.loaded = set(loaded)
        self.gate = threading.Event()
        self.ran = []

    def list_loras(self):
        return {"loaded": {n: {} for n in self.loaded}}

    def set_lora(self, args, *a, **k):
        self.gate.wait(10)
        self.loaded |= set(args.nicknames)
        self.ran.append(("set_lora", list(args.nicknames)))
        return {"status": "ok"}

    def unload_lora(self, name):
        self.gate.wait(10)
        self.loaded.discard(name)
        self.ran.append(("unload_lora", name))

    def generate(self, params):
        missing = [n for n, _ in params.lora or () if n not in self.loaded]
        if missing:
            raise NotFoundError(f"{missing} not loaded", param="lora")
        self.ran.append(("generate", [n for n, _ in params.lora or ()]))
        return ["image"]

    def is_alive(self):
        return True


class _Params:
    num_inference_steps = 1

    def __init__(self, *names):
        self.lora = tuple((n, 1.0) for n in names)


def test_the_scheduler_checks_a_generation_against_the_commands_queued_before_it():
    engine = _Engine({"a"})
    scheduler = Scheduler(engine, max_queue_size=8, idle_check_s=0.05)
    scheduler.start()
    try:
        busy = scheduler.submit_call("set_lora", _set("b"))  # blocks the engine thread
        queued_unload = scheduler.submit_call("unload_lora", "a")
        with pytest.raises(NotFoundError) as e:  # a is unloaded before this one would run
            scheduler.submit_generation(_Params("a"))
        assert e.value.param == "lora"
        with pytest.raises(NotFoundError):
            scheduler.submit_generation(_Params("c"))
        later = scheduler.submit_generation(_Params("b"))  # b loads ahead of it: accepted
        assert scheduler.queue_depth == 1  # the refused ones were never queued
        engine.gate.set()
        assert busy.result(10)["status"] == "ok" and queued_unload.result(10) is None
        assert later.result(10) == ["image"]
        assert engine.ran == [("set_lora", ["b"]), ("unload_lora", "a"), ("generate", ["b"])]
        assert scheduler.adapters.view() == {"b"}
    finally:
        engine.gate.set()
        scheduler.stop(timeout=10)
