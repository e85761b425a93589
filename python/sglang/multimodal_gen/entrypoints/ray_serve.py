"""N replicas of the engine behind Ray Serve, with the server's own OpenAI routes.

Each replica is a Ray Serve deployment replica that builds one engine (any TP size inside it) and
serves :func:`~sglang.multimodal_gen.entrypoints.http_server.create_app` as its ASGI app, so every
route, limit and error is the HTTP server's. Ray Serve routes requests to replicas, scales the
replica count on the number of ongoing requests per replica (``target_ongoing_requests``),
restarts a replica whose :meth:`DiffusionReplica.check_health` fails (engine dead) and drains one
that is stopping.

LoRA admin calls (``ADMIN_PATHS``: set/unset/unload/merge/unmerge) change every replica:

1. the replica that receives the call takes a cluster-wide lock (the :class:`LoRAOpLog` actor),
   catches up with the log, and runs the call on its own engine. If it fails there, the error is
   the answer and nothing is logged: no replica changed (each engine's change is atomic).
2. Otherwise the call is appended to the log; every other replica replays it through its own app
   (the same route) within a fraction of a second and reports. The answer carries ``replicas``:
   ``{replica_id: {"status", "error"}}`` for every live replica.
3. A replica that cannot apply a logged call marks itself unhealthy, so Ray Serve replaces it; a
   new replica (autoscaling or replacement) replays the whole log before it takes traffic. So
   every replica that serves runs the same adapters: the change is on all of them or on none.

Run (``pip install "sglang[ray]"``)::

    python -m sglang.multimodal_gen.entrypoints.ray_serve --model-path M --num-replicas 2 \\
        --port 8000 [--max-replicas 4 --target-ongoing-requests 2] [any sglang serve flag]

or from Python: ``serve.run(build_app(ServerArgs(...), num_replicas=2))``. Every response has an
``x-sglang-replica`` header naming the replica that answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from typing import Any

import ray
from ray import serve

from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.entrypoints.auth import ADMIN_PATHS

logger = logging.getLogger(__name__)

__all__ = ["DiffusionReplica", "LoRAOpLog", "build_app", "main"]

POLL_S = 0.2  # how often a replica looks for logged admin calls
LIVE_S = 10.0  # a replica not heard from for this long is not waited for
ADMIN_WAIT_S = 300.0  # how long an admin call waits for the other replicas' reports
LOCK_LEASE_S = 600.0  # a lock holder that died releases the lock after this long


@ray.remote(num_cpus=0)
class LoRAOpLog:
    """The ordered log of admin calls every replica replays, a lock, and per-replica reports."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, bytes]] = []
        self.lock: tuple[str, float] | None = None
        self.seen: dict[str, tuple[int, float]] = {}  # replica -> (applied, last heartbeat)
        self.reports: dict[int, dict[str, dict]] = {}

    def acquire(self, replica: str) -> bool:
        now = time.monotonic()
        if self.lock is None or self.lock[0] == replica or now - self.lock[1] > LOCK_LEASE_S:
            self.lock = (replica, now)
            return True
        return False

    def release(self, replica: str) -> None:
        if self.lock is not None and self.lock[0] == replica:
            self.lock = None

    def append(self, replica: str, path: str, body: bytes) -> int:
        assert self.lock is not None and self.lock[0] == replica, "append without the lock"
        self.ops.append((path, body))
        return len(self.ops)

    def since(self, replica: str, applied: int) -> list[tuple[int, str, bytes]]:
        """Heartbeat of ``replica`` (at ``applied``) and the calls it has not applied yet."""
        self.seen[replica] = (applied, time.monotonic())
        return [(i + 1, p, b) for i, (p, b) in enumerate(self.ops[applied:], start=applied)]

    def head(self) -> int:
        return len(self.ops)

    def report(self, replica: str, seq: int, status: int, error: str | None) -> None:
        self.reports.setdefault(seq, {})[replica] = {"status": status, "error": error}
        applied, _ = self.seen.get(replica, (0, 0.0))
        self.seen[replica] = (max(applied, seq), time.monotonic())

    def outcome(self, seq: int) -> tuple[dict, list[str]]:
        """The reports for ``seq`` and the live replicas that have not reported yet."""
        now = time.monotonic()
        got = dict(self.reports.get(seq, {}))
        live = [r for r, (_, t) in self.seen.items() if now - t < LIVE_S]
        return got, [r for r in live if r not in got]


def _log_actor(app_name: str):
    return LoRAOpLog.options(
        name=f"sglang-lora-log-{app_name}", namespace="sglang", lifetime="detached",
        get_if_exists=True,
    ).remote()  # fmt: skip


#: Client headers an admin call keeps on its way through the log: the API key and where a
#: browser request comes from (the app's own checks run on them).
_FORWARDED = (b"authorization", b"host", b"origin", b"sec-fetch-site")


async def _call_app(
    app: Any,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict | list[tuple[str, Any]] | None = None,
) -> tuple[int, bytes]:
    """Run one request through ``app`` in this process (its routes, its validation, its auth).
    ``headers``: a dict, or ``(name, value)`` pairs kept as they are (a name may repeat)."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or [])
        if not any(k.lower() == "content-type" for k, _ in pairs):
            pairs.append(("content-type", "application/json"))
        r = await client.request(method, path, content=body, headers=pairs, timeout=None)
        return r.status_code, r.content


def _error_text(status: int, content: bytes) -> str | None:
    if 200 <= status < 300:
        return None
    try:
        return json.loads(content)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return content[:200].decode("utf-8", "replace")


class _AdminFanOut:
    """ASGI middleware of a replica: admin calls go through the log (module docstring); every
    response is tagged with ``x-sglang-replica``."""

    def __init__(self, app: Any, replica: DiffusionReplica):
        self.app = app
        self.replica = replica

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tag = (b"x-sglang-replica", self.replica.replica_id.encode())
        if scope["method"] == "POST" and scope["path"] in ADMIN_PATHS:
            body = await _read_all(receive)
            status, content = await self.replica.admin(scope, body)
            headers = [(b"content-type", b"application/json"), tag]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": content})
            return

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + [tag])
            await send(message)

        await self.app(scope, receive, tagged)


async def _read_all(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


@serve.ingress()
class DiffusionReplica:
    """One Ray Serve replica: an engine, the HTTP server's app, and its place in the admin log.

    Args:
        server_args: the ``sglang serve`` arguments as a dict (``dataclasses.asdict``).
        app_name: the Serve application's name (names the log actor).
    """

    def __init__(self, server_args: dict, app_name: str = "default"):
        from sglang.multimodal_gen.entrypoints.http_server import build_engine, create_app

        self.args = ServerArgs(**server_args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.log = _log_actor(app_name)
        self.engine = build_engine(self.args)
        self.inner = create_app(self.engine, self.args, shutdown_engine=True)
        self.applied = 0
        self.broken: str | None = None
        self._local = threading.Lock()  # one applier at a time: this replica's admin or poller
        self._stop = threading.Event()
        # startup adapters, then every logged call, before Serve sends traffic here
        from sglang.multimodal_gen.entrypoints.http_server import load_startup_loras

        load_startup_loras(self.engine, self.args)
        self._scheduler_started = False
        self._poller = threading.Thread(target=self._poll, name="lora-log", daemon=True)

    def __serve_build_asgi_app__(self):
        return _Starting(_AdminFanOut(self.inner, self), self)

    def start(self) -> None:
        """Catch up with the log (in the app's running lifespan), then keep polling."""
        if not self._poller.is_alive():
            with self._local:
                self._apply_pending()
            self._poller.start()

    # ------------------------------------------------------------------ log replay
    def _apply_pending(self) -> None:
        pending = ray.get(self.log.since.remote(self.replica_id, self.applied))
        keys = self.args.user_api_keys
        key = self.args.admin_api_key or (keys[0] if keys else None)  # it was authorized
        own = {"authorization": f"Bearer {key}"} if key else {}
        for seq, path, body in pending:
            status, content = asyncio.run(_call_app(self.inner, "POST", path, body, own))
            error = _error_text(status, content)
            self.log.report.remote(self.replica_id, seq, status, error)
            self.applied = seq
            if error is not None:  # the others applied it: this replica must not serve
                self.broken = f"logged admin call {seq} ({path}) failed here: {error}"
                logger.error("%s; asking Ray Serve to replace this replica", self.broken)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                with self._local:
                    self._apply_pending()
            except Exception:  # the log actor restarting, a transient Ray error: try again
                logger.warning("LoRA log poll failed", exc_info=True)

    async def admin(self, scope, body: bytes) -> tuple[int, bytes]:
        """Run an admin call here, then on every replica through the log (module docstring)."""
        path = scope["path"]
        while not await self.log.acquire.remote(self.replica_id):
            await asyncio.sleep(POLL_S)
        try:
            with self._local:
                await asyncio.to_thread(self._apply_pending)
                client = [  # raw values, every copy: a header sent twice is refused there
                    (k.decode("latin-1"), v) for k, v in scope.get("headers", ()) if k in _FORWARDED
                ]
                status, content = await _call_app(self.inner, "POST", path, body, client)
                if _error_text(status, content) is not None:
                    return status, content  # refused here: nothing logged, nothing changed
                seq = await self.log.append.remote(self.replica_id, path, body)
                self.applied = seq
                await self.log.report.remote(self.replica_id, seq, status, None)
        finally:
            await self.log.release.remote(self.replica_id)
        deadline = time.monotonic() + ADMIN_WAIT_S
        while True:
            reports, missing = await self.log.outcome.remote(seq)
            if not missing or time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL_S)
        for r in missing:
            reports[r] = {"status": None, "error": "no report yet (it applies the call on its "
                          "next poll, or is being replaced)"}  # fmt: skip
        answer = json.loads(content)
        answer["replicas"] = reports
        return status, json.dumps(answer).encode()

    # ------------------------------------------------------------------ Serve hooks
    def check_health(self) -> None:
        """Ray Serve's health check: raising makes it replace this replica."""
        if self.broken:
            raise RuntimeError(self.broken)
        if not self.engine.is_alive():
            raise RuntimeError("the engine is not alive")

    def __del__(self) -> None:
        self._stop.set()


class _Starting:
    """Start the replica's log poller once the app's lifespan (the scheduler) is running."""

    def __init__(self, app: Any, replica: DiffusionReplica):
        self.app = app
        self.replica = replica

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":

            async def started(message) -> None:
                if message["type"] == "lifespan.startup.complete":
                    await asyncio.to_thread(self.replica.start)
                await send(message)

            await self.app(scope, receive, started)
            return
        await self.app(scope, receive, send)


def build_app(
    server_args: ServerArgs,
    num_replicas: int = 1,
    max_replicas: int | None = None,
    target_ongoing_requests: float = 2.0,
    ray_actor_options: dict | None = None,
    app_name: str = "default",
):
    """The Serve application: ``num_replicas`` replicas, or autoscaling between
    ``num_replicas`` and ``max_replicas`` on ongoing requests per replica.

    ``max_ongoing_requests`` per replica is ``max_queue_size + 1`` (the queue and the running
    request), so Ray Serve queues the rest in its router instead of getting 503s.
    """
    import dataclasses

    options: dict[str, Any] = dict(
        ray_actor_options=ray_actor_options or {"num_cpus": 1},
        max_ongoing_requests=int(server_args.max_queue_size) + 1,
        health_check_period_s=5.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=float(server_args.graceful_shutdown_timeout_s),
    )
    if max_replicas is not None and max_replicas > num_replicas:
        options["autoscaling_config"] = {
            "min_replicas": int(num_replicas),
            "max_replicas": int(max_replicas),
            "target_ongoing_requests": float(target_ongoing_requests),
        }
    else:
        options["num_replicas"] = int(num_replicas)
    deployment = serve.deployment(DiffusionReplica, name="sglang-diffusion", **options)
    return deployment.bind(dataclasses.asdict(server_args), app_name)


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang.multimodal_gen.entrypoints.ray_serve``: run until interrupted."""
    parser = ServerArgs.add_cli_args(argparse.ArgumentParser(prog="sglang ray_serve"))
    g = parser.add_argument_group("Ray Serve")
    g.add_argument("--num-replicas", type=int, default=1, help="replicas (the minimum)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=2.0,
        help="autoscaling target: ongoing requests per replica (default 2)",
    )
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    g.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": server_args.host, "port": server_args.port})
    actor = {"num_cpus": args.num_cpus_per_replica, "num_gpus": args.num_gpus_per_replica}
    app = build_app(
        server_args, args.num_replicas, args.max_replicas, args.target_ongoing_requests, actor
    )
    serve.run(app, name="default", route_prefix="/", blocking=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
