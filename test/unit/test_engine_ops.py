"""The engine op table is the one vocabulary: auth, scheduler, routes, engine and runner agree with
it, and under ``--dit-cpu-offload`` only commands that need the weights move them (counted)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from sglang.multimodal_gen.engine_ops import (
    ADMIN_PATHS,
    LORA_CHANGE_OPS,
    OPS,
    SCHEDULER_CALLS,
    get_op,
)
from sglang.multimodal_gen.entrypoints import auth
from sglang.multimodal_gen.entrypoints.http_server import _check_op_routes
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.runtime.engine import DiffusionEngine
from sglang.multimodal_gen.runtime.runner import ModelRunner


def test_every_reader_uses_the_table():
    assert auth.ADMIN_PATHS is ADMIN_PATHS
    assert ADMIN_PATHS == {
        "/v1/set_lora",
        "/v1/unset_lora",
        "/v1/unload_lora",
        "/v1/merge_lora_weights",
        "/v1/unmerge_lora_weights",
    }
    assert Scheduler.ADMIN_METHODS == SCHEDULER_CALLS
    assert set(LORA_CHANGE_OPS) < set(SCHEDULER_CALLS) and "list_loras" in SCHEDULER_CALLS
    for op in OPS.values():
        assert callable(getattr(ModelRunner, f"cmd_{op.name}")), op.name
        if op.scheduled:
            assert callable(getattr(DiffusionEngine, op.name)), op.name
    with pytest.raises(ValueError, match="unknown engine command 'nope'"):
        get_op("nope")


def test_a_missing_route_is_caught_when_the_app_is_built():
    app = FastAPI()

    @app.post("/v1/set_lora")
    def _set():  # pragma: no cover - never called
        return None

    with pytest.raises(RuntimeError, match="engine ops without their HTTP route") as e:
        _check_op_routes(app)
    assert "unset_lora" in str(e.value) and "'set_lora'" not in str(e.value)


class _CountingOffloader:
    def __init__(self):
        self.on_device, self.onloads, self.offloads, self.dirty = False, 0, 0, 0

    def onload(self):
        self.onloads += not self.on_device
        self.on_device = True

    def offload(self, dirty):
        if self.on_device:
            self.offloads += 1
            self.dirty += bool(dirty)
        self.on_device = False


class _FakeManager:
    def __getattr__(self, name):
        return lambda *a, **k: {"status": "ok"}


def _runner():
    runner = object.__new__(ModelRunner)
    runner.offloaders = {"transformer": _CountingOffloader()}
    runner.per_expert_offload = False
    runner.lora_manager = _FakeManager()
    runner.tp_rank = 0
    return runner


@pytest.mark.parametrize(
    "op,kwargs,moves,dirty",
    [
        ("list_loras", {}, 0, 0),
        ("noop", {}, 0, 0),
        ("unset_lora", {"target": "all"}, 1, 1),
        ("merge_lora_weights", {"target": "all"}, 1, 1),
        ("unload_lora", {"nickname": "a"}, 1, 1),
        ("set_lora", {"nicknames": ["a"], "paths": [None], "targets": ["all"], "strengths": [1.0]}, 1, 1),
    ],
)  # fmt: skip
def test_read_only_commands_never_move_weights(op, kwargs, moves, dirty):
    runner = _runner()
    runner.execute(op, kwargs)
    off = runner.offloaders["transformer"]
    assert (off.onloads, off.offloads, off.dirty) == (moves, moves, dirty)
    assert get_op(op).needs_weights == bool(moves)
