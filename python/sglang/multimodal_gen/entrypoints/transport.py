"""The connection layer under the app: uvicorn's h11 protocol with the bounds uvicorn lacks, the
``uvicorn.Config`` and ``uvicorn.Server`` of a server, and running it under SIGTERM/SIGINT.

Request headers must arrive within ``timeout_headers_s`` of the connection opening (or of the
previous answer), else 408; connections above ``limit_concurrency`` are answered 503 and closed
at once; idle kept-alive connections close after ``timeout_keep_alive_s``
(:func:`uvicorn_config`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.entrypoints.openai_errors import error_body

logger = logging.getLogger(__name__)


def _raw_error_response(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 answer with the error envelope that closes the connection (written
    by the protocol before any request is parsed, so without the app)."""
    body = json.dumps(error_body(message, status)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    )
    if status == 503:
        head += "retry-after: 1\r\n"
    return (head + "\r\n").encode() + body


def guarded_protocol_class(timeout_headers_s: float | None, limit_concurrency: int | None):
    """uvicorn's h11 protocol with the two bounds uvicorn lacks.

    - ``timeout_headers_s``: the request line and headers must arrive within this many seconds
      of the connection opening or of the previous answer on it (uvicorn's own
      ``timeout_keep_alive`` only starts after an answer, and any byte resets it), else the
      connection gets 408 and is closed: idle or trickling sockets do not pile up.
    - ``limit_concurrency``: a connection opened while that many are open gets 503 and is closed
      at once, so file descriptors stay bounded.
    """
    from uvicorn.protocols.http.h11_impl import H11Protocol

    busy = _raw_error_response(503, "Service Unavailable", "too many open connections; retry later")
    slow = _raw_error_response(
        408, "Request Timeout", f"request headers did not arrive within {timeout_headers_s} s"
    )

    class GuardedH11Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if limit_concurrency is not None and len(self.connections) > limit_concurrency:
                transport.write(busy)
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            if timeout_headers_s:
                self._header_timer = self.loop.call_later(timeout_headers_s, self._headers_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.write(slow)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers, on a kept-alive socket

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_config(app: Any, server_args: ServerArgs, **overrides: Any) -> Any:
    """The ``uvicorn.Config`` of ``app`` under ``server_args``' connection bounds
    (``timeout_keep_alive_s``, ``timeout_headers_s``, ``limit_concurrency``)."""
    import uvicorn

    kwargs = dict(
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level.lower(),
        access_log=server_args.log_level.lower() == "debug",
        timeout_graceful_shutdown=float(server_args.graceful_shutdown_timeout_s),
        timeout_keep_alive=max(1, int(server_args.timeout_keep_alive_s)),
        http=guarded_protocol_class(
            server_args.timeout_headers_s or None, server_args.limit_concurrency or None
        ),
    )
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)


def uvicorn_server(
    app: Any, server_args: ServerArgs, on_shutdown: Callable[[], None] | None = None
) -> Any:
    """A ``uvicorn.Server`` of :func:`uvicorn_config` that calls ``on_shutdown()`` the moment its
    graceful shutdown starts, before it waits (up to ``graceful_shutdown_timeout_s``) for open
    requests: the server refuses new work from then on and the app's own drain keeps to the same
    deadline."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            await super().shutdown(sockets)

    return _Server(uvicorn_config(app, server_args))


def run_uvicorn(server: Any) -> None:
    """Run uvicorn; a SIGTERM/SIGINT that ended a graceful shutdown ends the process with 0.

    uvicorn re-raises the signal it caught once it has shut down, so the process would die from it;
    with these handlers installed it is simply noted, and ``sglang serve`` exits normally.
    """
    import signal

    got: list[int] = []

    def note(signum, frame):
        got.append(signum)

    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    else:
        previous = {}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if got:
        logger.info("stopped by signal %d after a graceful shutdown", got[-1])
