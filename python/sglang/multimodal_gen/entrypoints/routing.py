"""What every route of the app shares: error envelopes, auth and counting, the engine's answers.

- :class:`EnvelopeRoute` turns any error a handler raises into the OpenAI error envelope (its
  message without the server's paths, :mod:`.public_paths`);
- :class:`AuthAndCount` refuses a duplicated credential or body header, checks the API key
  before anything else, notes the request's :class:`~.auth.Principal` and counts requests by
  status;
- :class:`RouteContext` is handed to each route group (images, LoRA admin, videos): it reads
  bodies with the server's bounds, awaits the scheduler's futures (503 if the engine dies, the
  queued work dropped if the client leaves) and checks the ``model`` field.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match, Router

from sglang.multimodal_gen.configs.sampling_params import RequestSpec
from sglang.multimodal_gen.entrypoints.auth import (
    ANONYMOUS,
    ApiKeyAuth,
    AuthRefusal,
    Principal,
    cross_origin_reason,
)
from sglang.multimodal_gen.entrypoints.http_body import MAX_BODY_BYTES, ClientGoneError, read_body
from sglang.multimodal_gen.entrypoints.metrics import ServerMetrics
from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception, error_body
from sglang.multimodal_gen.entrypoints.public_paths import PublicPaths
from sglang.multimodal_gen.entrypoints.public_url import PublicUrl
from sglang.multimodal_gen.entrypoints.request_headers import duplicated_header, single_headers
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler, ServerShuttingDownError
from sglang.multimodal_gen.errors import EngineDeadError, NotFoundError
from sglang.multimodal_gen.image_inputs import ImageLimits


def _error_response(exc: BaseException, public: PublicPaths | None = None) -> JSONResponse:
    status, body, headers = describe_exception(exc)
    if public is not None:  # never the server's own paths (engine messages, OSError texts)
        body["error"]["message"] = public.scrub(body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=headers)


def principal_of(request: Request) -> Principal:
    """Who ``request`` acts for (:class:`AuthAndCount` notes it; :data:`~.auth.ANONYMOUS` for
    an app without it)."""
    return request.scope.get("state", {}).get("principal", ANONYMOUS)


class EnvelopeRoute(APIRoute):
    """A route whose handler errors of any kind become OpenAI error envelopes."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (StarletteHTTPException, RequestValidationError):
                raise  # handled by the app's exception handlers
            except Exception as e:
                return _error_response(e, getattr(request.app.state, "public_paths", None))
            except asyncio.CancelledError:
                # uvicorn cancels what is still open when --timeout-graceful-shutdown ends,
                # wherever the handler is (reading the body, waiting for the engine): a 503
                scheduler = getattr(request.app.state, "scheduler", None)
                if scheduler is None or not scheduler.shutting_down:
                    raise
                return _error_response(
                    ServerShuttingDownError(
                        "the server is shutting down and the request did not finish within "
                        "--timeout-graceful-shutdown"
                    )
                )

        return guarded


_CONVERTER = re.compile(r"\{(\w+):\w+\}")


def endpoint_label(routes: Sequence[BaseRoute], scope: dict) -> str:
    """The metrics label of a request: the path template of the app's route it matches
    (``/v1/images/files/{name}``; a converter is left out: ``/v1/models/{model}``), the route
    whose path matches when only the method does not (a 405), else ``"other"``."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return _CONVERTER.sub(r"{\1}", route.path)
        if match is Match.PARTIAL and partial is None:
            partial = route
    return "other" if partial is None else _CONVERTER.sub(r"{\1}", partial.path)


class AuthAndCount:
    """ASGI middleware: a security-relevant header sent twice is refused first (400 naming it,
    :mod:`.request_headers`), then the API-key check (401; 403 for a user key on an admin
    route), then the cross-origin check (:func:`~.auth.cross_origin_reason`, 403); the request's
    :class:`~.auth.Principal` goes in ``scope["state"]["principal"]``. Every request is counted
    by status and by the app's route it is for (:func:`endpoint_label`).

    A plain ASGI class rather than ``@app.middleware("http")``, so the handlers receive the
    server's own ``receive`` and can notice a client disconnecting (``request.is_disconnected``).

    Args:
        app: the next ASGI app.
        auth: the API keys.
        metrics: where requests are counted.
        router: the app's router, whose routes name the endpoints.
    """

    def __init__(self, app: Any, auth: ApiKeyAuth, metrics: ServerMetrics, router: Router):
        self.app = app
        self.auth = auth
        self.metrics = metrics
        self.router = router

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        raw_headers = list(scope.get("headers", ()))
        status = 500
        try:
            twice = duplicated_header(raw_headers)
            if twice is not None:  # which copy counts is anybody's guess: neither does
                status = 400
                body = error_body(
                    f"the {twice} header appears more than once; send it once",
                    400,
                    param=twice,
                    code="duplicate_header",
                )
                await JSONResponse(body, 400)(scope, receive, send)
                return
            headers = single_headers(raw_headers)
            raw_auth = headers.get(b"authorization")
            authorization = None if raw_auth is None else raw_auth.decode("latin-1")
            who = self.auth.authenticate(path, authorization)
            if isinstance(who, AuthRefusal):
                status = who.status
                body = error_body(who.message, who.status, param=None, code=who.code)
                extra = {"WWW-Authenticate": "Bearer"} if who.status == 401 else None
                await JSONResponse(body, who.status, headers=extra)(scope, receive, send)
                return
            scope.setdefault("state", {})["principal"] = who
            reason = cross_origin_reason(scope.get("method", "GET"), headers)
            if reason is not None:
                status = 403
                body = error_body(reason, 403, param=None, code="cross_origin_request")
                await JSONResponse(body, 403)(scope, receive, send)
                return

            async def send_and_note(message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.observe_request(endpoint_label(self.router.routes, scope), status)


@dataclass(frozen=True)
class RouteContext:
    """The server state the route groups share (built once by ``create_app``).

    Attributes:
        scheduler: the only way to the engine (one thread, arrival order).
        spec: what a request to the served model may ask for, with the server's bounds (every
            generation request is resolved against it once, in its handler).
        model_id: the id ``/v1/models`` reports.
        model_aliases: the names a request's ``model`` field may use.
        timeout_body_s: seconds a request body has to arrive (``None``: no bound).
        public_paths: how the server's paths are shown in answers (:mod:`.public_paths`).
        public_url: the base of the server's links (:mod:`.public_url`).
        image_limits: bounds of a request's input images (``--max-input-image-bytes``,
            ``--max-input-bytes``, ``--max-input-images``).
        image_url_hosts: hosts whose image URLs may be fetched (``--image-url-allowed-hosts``;
            empty: none).
    """

    scheduler: Scheduler
    spec: RequestSpec
    model_id: str
    model_aliases: frozenset[str]
    timeout_body_s: float | None
    public_paths: PublicPaths = field(default_factory=PublicPaths)
    public_url: PublicUrl = field(default_factory=lambda: PublicUrl(None, "127.0.0.1", 30000))
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    image_url_hosts: tuple[str, ...] = ()

    async def read_body(self, request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
        """The body, bounded in size (``limit`` bytes) and arrival time
        (:func:`~.http_body.read_body`)."""
        return await read_body(request, limit, self.timeout_body_s)

    async def wait_for(self, future: Future, request: Request | None = None) -> Any:
        """Await a scheduler future.

        503 instead of hanging if the engine dies meanwhile. With ``request`` (generations), a
        client that disconnects while its work still waits in the queue has it dropped.

        Raises:
            EngineDeadError: 503; the engine stopped while the work was pending.
            ClientGoneError: the client disconnected (nothing is sent).
        """
        afut = asyncio.wrap_future(future)
        next_alive_check = time.monotonic() + 1.0
        try:
            while True:
                done, _ = await asyncio.wait({afut}, timeout=0.25)
                if done:
                    return afut.result()
                if request is not None and await request.is_disconnected():
                    dropped = future.cancel()  # False once it runs: the result is discarded
                    raise ClientGoneError(
                        "the client disconnected"
                        + ("; its queued request was dropped" if dropped else "")
                    )
                if time.monotonic() >= next_alive_check:
                    next_alive_check = time.monotonic() + 1.0
                    if not await run_in_threadpool(self.scheduler.engine_alive):
                        future.cancel()
                        raise EngineDeadError(
                            "the engine is not available: "
                            f"{self.scheduler.dead_reason or 'not alive'}"
                        )
        except asyncio.CancelledError:
            future.cancel()  # the handler itself was cancelled: drop the work if not started
            raise  # past --timeout-graceful-shutdown: EnvelopeRoute answers 503

    def check_model(self, model: str | None) -> None:
        """Check a request's ``model`` field (``None``: the served model).

        Raises:
            NotFoundError: 404 ``model_not_found``; not a name of the served model.
        """
        if model is not None and model not in self.model_aliases:
            raise NotFoundError(
                f"model {model!r} is not served here; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )
