"""LoRA admin routes: ``POST /v1/set_lora`` (load if a path is given, and activate globally),
``/v1/unset_lora`` (deactivate; adapters stay loaded), ``/v1/unload_lora`` (free one adapter),
``/v1/merge_lora_weights``, ``/v1/unmerge_lora_weights`` and ``GET /v1/list_loras``.

Each runs on the engine through the scheduler, in arrival order with the generations; the admin
key (``--admin-api-key``) is checked by the app's middleware (:mod:`.auth`). With
``--enable-hub-lora``, a ``set_lora`` Hub id missing from the local cache is downloaded in the
handler first (a worker thread), so generations keep running meanwhile; the engine then reads it
from the cache. Their paths and methods
are the op table's (:mod:`~sglang.multimodal_gen.engine_ops`); this module gives each its handler.
The engine's answers leave through :class:`~.public_paths.PublicPaths`: an adapter's path relative
to its ``--lora-dir`` root, never a server path. See ``docs/lora.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from sglang.multimodal_gen.engine_ops import ROUTED_CALLS
from sglang.multimodal_gen.entrypoints.http_body import parse_json_body
from sglang.multimodal_gen.entrypoints.protocol import (
    SetLoRARequest,
    StatusResponse,
    TargetRequest,
    UnloadLoRARequest,
    validate_set_lora,
    validate_target,
)
from sglang.multimodal_gen.entrypoints.request_log import record_of
from sglang.multimodal_gen.entrypoints.routing import RouteContext

#: The commands that take only a ``target``, and what their answer says.
_TARGET_OPS = {
    "unset_lora": "LoRA deactivated on target {target!r} (adapters stay loaded)",
    "merge_lora_weights": "merged the active LoRA into target {target!r}",
    "unmerge_lora_weights": "restored the base weights of target {target!r}",
}


def _status(message: str, detail: Any = None) -> dict:
    """The body of a LoRA admin answer (:class:`~.protocol.StatusResponse`)."""
    return StatusResponse(message=message, detail=detail).model_dump()


def add_lora_routes(
    app: FastAPI,
    ctx: RouteContext,
    targets: tuple[str, ...],
    fetch_hub_lora: Callable[[str], None] | None = None,
) -> None:
    """Register the LoRA admin routes on ``app``: one per scheduled command of the op table
    (:data:`~sglang.multimodal_gen.engine_ops.ROUTED_CALLS`), at the op's path and method, named
    after the op. ``targets`` are the model's LoRA targets (``engine.lora_targets``), against
    which every ``target`` field is checked. ``fetch_hub_lora(path)``, when given
    (``--enable-hub-lora``), downloads a ``set_lora`` path that is a Hub id missing from the
    cache before the command is scheduled (its errors are the answer)."""

    async def run(request: Request, op: str, *args: Any, **kwargs: Any) -> Any:
        """``op`` through the scheduler, timed for the log line; the answer as clients see it."""
        timing = record_of(request).timing()
        result = await ctx.wait_for(ctx.scheduler.submit_call(op, *args, timing=timing, **kwargs))
        return ctx.public_paths.report(result)

    async def set_lora(request: Request):
        req = parse_json_body(await ctx.read_body(request), SetLoRARequest)
        args = validate_set_lora(req, targets)
        names = list(args.nicknames)
        paths = [p for p in args.paths if p is not None]
        record_of(request).note(lora=",".join(names), lora_path=",".join(paths) or None)
        if fetch_hub_lora is not None:
            for path in dict.fromkeys(paths):
                await run_in_threadpool(fetch_hub_lora, path)
        result = await run(request, "set_lora", args)
        return _status(f"active on target {req.target!r}: {', '.join(names)}", result)

    async def unload_lora(request: Request):
        req = parse_json_body(await ctx.read_body(request), UnloadLoRARequest)
        record_of(request).note(lora=req.lora_nickname)
        result = await run(request, "unload_lora", req.lora_nickname)
        return _status(f"unloaded {req.lora_nickname!r}", result)

    def target_route(op: str, done: str):
        """The handler of a command that takes only a ``target`` (an empty body: ``all``)."""

        async def handler(request: Request):
            req = parse_json_body(await ctx.read_body(request), TargetRequest, allow_empty=True)
            target = validate_target(req.target, targets)
            result = await run(request, op, target=target)
            return _status(done.format(target=target), result)

        return handler

    async def list_loras(request: Request):
        return JSONResponse(await run(request, "list_loras"))

    handlers = {
        "set_lora": set_lora,
        "unload_lora": unload_lora,
        "list_loras": list_loras,
        **{op: target_route(op, done) for op, done in _TARGET_OPS.items()},
    }
    for op in ROUTED_CALLS:
        app.add_api_route(op.path, handlers[op.name], methods=[op.method], name=op.name)
