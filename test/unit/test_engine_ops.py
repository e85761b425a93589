"""The engine op table is the one vocabulary: auth, scheduler, routes, engine and runner agree with
it (the routes are registered at its paths, the metrics label requests by the app's routes), and
under ``--dit-cpu-offload`` only commands that need the weights move them (counted)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from sglang.multimodal_gen.engine_ops import (
    ADMIN_PATHS,
    LORA_CHANGE_OPS,
    OPS,
    ROUTED_CALLS,
    SCHEDULER_CALLS,
    get_op,
)
from sglang.multimodal_gen.entrypoints import auth
from sglang.multimodal_gen.entrypoints.images import add_image_routes
from sglang.multimodal_gen.entrypoints.lora_admin import add_lora_routes
from sglang.multimodal_gen.entrypoints.routing import endpoint_label
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.lora.requests import SetLoRAArgs
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


def _routes_app() -> FastAPI:
    """An app with the route groups that serve the op table (handlers are never called)."""
    app = FastAPI()
    add_image_routes(app, None, None, None)
    add_lora_routes(app, None, ("all",))
    return app


def test_every_routed_op_is_served_at_the_table_path():
    served = {(m, r.path): r.name for r in _routes_app().routes for m in r.methods or ()}
    routed = [op for op in OPS.values() if op.path]
    assert {op.name for op in routed} == {"generate", *(op.name for op in ROUTED_CALLS)}
    for op in routed:
        assert (op.method, op.path) in served, op.name
    for op in ROUTED_CALLS:
        assert served[(op.method, op.path)] == op.name


@pytest.mark.parametrize(
    "method,path,label",
    [
        ("POST", "/v1/set_lora", "/v1/set_lora"),
        ("GET", "/v1/set_lora", "/v1/set_lora"),  # 405: still the route's label
        ("GET", "/v1/images/files/abc.png", "/v1/images/files/{name}"),
        ("GET", "/nowhere", "other"),
    ],
)
def test_metrics_label_requests_by_the_route_they_are_for(method, path, label):
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    assert endpoint_label(_routes_app().routes, scope) == label


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
        ("set_lora", {"args": SetLoRAArgs(["a"], [None], ["all"], [1.0], None)}, 1, 1),
    ],
)  # fmt: skip
def test_read_only_commands_never_move_weights(op, kwargs, moves, dirty):
    runner = _runner()
    runner.execute(op, kwargs)
    off = runner.offloaders["transformer"]
    assert (off.onloads, off.offloads, off.dirty) == (moves, moves, dirty)
    assert get_op(op).needs_weights == bool(moves)
