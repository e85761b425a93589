"""One log line per HTTP request, ``key=value``, at ``info``.

Every request the app answers (also the ones refused before a handler runs: 400 for a duplicated
header, 401, 403) gets one line from the logger ``sglang.request`` when its answer is complete::

    request_id=3f2a... method=POST path=/v1/images/generations status=200 total_s=0.031
        model=Z-Image-Turbo size=1024x1024 steps=8 n=1 queued_s=0.002 compute_s=0.027

(one line; wrapped here). Probes and scrapes that succeed (``/health``, ``/ready``, ``/metrics``
with a 2xx; a load balancer may send several a second) are written at ``debug`` instead, so they
do not bury the requests; a failing one is at ``info`` like every other request.

The fields after ``total_s`` are there where they apply: a generation
names its ``model``, ``size``, ``steps``, ``n`` (and ``frames`` for a video), a request that ran
on the engine its ``queued_s`` (waiting in the scheduler's queue) and ``compute_s`` (in the
engine), a LoRA command its adapters (``lora``, nicknames only), a video job its ``video_id``.
``status=499`` is a client that went away before its answer.

The request id is sent back as ``X-Request-Id``. A client's own ``X-Request-Id`` is kept when it
is a short token (1-64 letters, digits, ``-_.:``) sent once; otherwise the server makes one (32 hex
digits).

Prompts, negative prompts and LoRA paths are never logged unless ``--log-prompts`` is given
(``prompt=``, ``negative_prompt=``, ``lora_path=``); API keys never are. Values are written bare
when they are plain tokens, else as JSON strings (quotes, escapes: a value cannot start a new line
or a new field); long values are cut.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from sglang.multimodal_gen.entrypoints.scheduler import TaskTiming

__all__ = [
    "PRIVATE_FIELDS",
    "RequestLog",
    "RequestRecord",
    "format_value",
    "lora_summary",
    "record_of",
]

#: The logger of the lines (``--log-level`` sets its level with the rest of the server's).
logger = logging.getLogger("sglang.request")

#: Fields shown only with ``--log-prompts``.
PRIVATE_FIELDS = frozenset({"prompt", "negative_prompt", "lora_path"})
#: Paths whose successful answers are logged at ``debug`` (probes, scrapes).
QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,64}")
_BARE = re.compile(r"[A-Za-z0-9._:/@+\-,{}\[\]*]+")
#: Longest value written (characters): a prompt of 20000 characters stays one bounded line.
MAX_VALUE_CHARS = 1000


def format_value(value: Any) -> str:
    """``value`` as it is written after ``key=`` (see the module docstring)."""
    if isinstance(value, float):
        return f"{value:.3f}"
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_VALUE_CHARS:
        text = f"{text[:MAX_VALUE_CHARS]}...({len(text) - MAX_VALUE_CHARS} more)"
    if _BARE.fullmatch(text):
        return text
    return json.dumps(text, ensure_ascii=True)


def lora_summary(lora: Any) -> str | None:
    """A request's own adapters as the line shows them (``a:0.8,b:1``; ``[]``: none asked for;
    ``None``: the global composition, the field is left out). Nicknames only, never paths."""
    if lora is None:
        return None
    return ",".join(f"{name}:{strength:g}" for name, strength in lora) or "[]"


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when it sent one short token, once; else a new id."""
    given = [v for k, v in headers if k.lower() == b"x-request-id"]
    if len(given) == 1:
        value = given[0].decode("latin-1")
        if _CLIENT_ID.fullmatch(value):
            return value
    return uuid.uuid4().hex


class RequestRecord:
    """What the log line of one request says; the handlers add to it (:meth:`note`,
    :meth:`timing`)."""

    def __init__(self, request_id: str, method: str, path: str):
        self.request_id = request_id
        self.method = method
        self.path = path
        self.fields: dict[str, Any] = {}
        self._timing: TaskTiming | None = None

    def note(self, **fields: Any) -> None:
        """Add fields to the line (``None`` values are left out)."""
        self.fields.update({k: v for k, v in fields.items() if v is not None})

    def timing(self) -> TaskTiming:
        """The :class:`~.scheduler.TaskTiming` to hand the scheduler for this request's work
        (its ``queued_s`` and ``compute_s`` go in the line)."""
        if self._timing is None:
            self._timing = TaskTiming()
        return self._timing

    def line(self, status: int, total_s: float, log_prompts: bool = False) -> str:
        """The log line."""
        parts = [
            ("request_id", self.request_id),
            ("method", self.method),
            ("path", self.path),
            ("status", status),
            ("total_s", total_s),
        ]
        parts += [(k, v) for k, v in self.fields.items() if log_prompts or k not in PRIVATE_FIELDS]
        if self._timing is not None:
            parts += [("queued_s", self._timing.queued_s), ("compute_s", self._timing.compute_s)]
        return " ".join(f"{k}={format_value(v)}" for k, v in parts if v is not None)


def record_of(request: Any) -> RequestRecord:
    """The record of ``request`` (a Starlette request, or an ASGI scope); a detached one when
    the app runs without :class:`RequestLog` (nothing is logged then)."""
    scope = request if isinstance(request, dict) else request.scope
    state = scope.setdefault("state", {})
    record = state.get("request_log")
    if record is None:
        record = RequestRecord("-", scope.get("method", ""), scope.get("path", ""))
        state["request_log"] = record
    return record


class RequestLog:
    """ASGI middleware: the request id, the ``X-Request-Id`` answer header and the log line.

    The outermost of the app's middleware, so every answer of the app is logged.

    Args:
        app: the next ASGI app.
        log_prompts: ``--log-prompts``.
    """

    def __init__(self, app: Any, log_prompts: bool = False):
        self.app = app
        self.log_prompts = log_prompts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = list(scope.get("headers", ()))
        record = RequestRecord(request_id_from(headers), scope.get("method", ""), scope["path"])
        scope.setdefault("state", {})["request_log"] = record
        status = 499  # no answer sent: the client went away first
        tag = (b"x-request-id", record.request_id.encode("ascii"))

        async def send_tagged(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message, headers=[*message.get("headers", ()), tag])
            await send(message)

        try:
            await self.app(scope, receive, send_tagged)
        except BaseException:
            status = 500 if status == 499 else status
            raise
        finally:
            quiet = record.path in QUIET_PATHS and 200 <= status < 300
            level = logging.DEBUG if quiet else logging.INFO
            if logger.isEnabledFor(level):
                total = time.perf_counter() - t0
                logger.log(level, record.line(status, total, self.log_prompts))
