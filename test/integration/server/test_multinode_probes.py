"""Liveness and readiness probes (``/health``, ``/ready``, GET and HEAD) that load balancers, Ray
Serve and Kubernetes use in front of replicas and multi-node jobs; on the fake engine."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from fixtures.server import FakeEngine, assert_envelope, running_server
from sglang.multimodal_gen.configs.server_args import ServerArgs


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_ready_turns_503_while_the_queue_is_full_and_health_stays_200():
    engine = FakeEngine()
    engine.release.clear()  # generate blocks until released
    args = ServerArgs(max_queue_size=2, api_key="secret")
    with running_server(engine, args) as (url, app, _):
        scheduler = app.state.scheduler
        for path in ("/health", "/ready"):  # no key needed: probes carry none
            assert httpx.get(f"{url}{path}").status_code == 200
            head = httpx.head(f"{url}{path}")
            assert head.status_code == 200 and head.content == b""
        assert httpx.get(f"{url}/ready").json() == {"status": "ready", "queue_depth": 0}
        auth = {"Authorization": "Bearer secret"}
        with ThreadPoolExecutor(max_workers=3) as pool:
            try:

                def post(i):
                    return pool.submit(httpx.post, f"{url}/v1/images/generations",
                                       json={"prompt": "p", "size": "32x32", "seed": i,
                                             "num_inference_steps": 1},
                                       headers=auth, timeout=60)  # fmt: skip

                # one running first: three at once could all queue before the worker takes
                # one, and the third would then find the queue (limit 2) full
                futures = [post(0)]
                _wait(lambda: scheduler.busy, "the first request did not start")
                futures += [post(1), post(2)]
                _wait(lambda: scheduler.queue_depth == 2, "queue not full")
                err = assert_envelope(httpx.get(f"{url}/ready"), 503)
                assert "queue is full" in err["message"]
                assert httpx.head(f"{url}/ready").status_code == 503
                assert httpx.get(f"{url}/health").status_code == 200  # busy is not dead
            finally:
                engine.release.set()
            assert [f.result().status_code for f in futures] == [200, 200, 200]
        assert httpx.get(f"{url}/ready").status_code == 200
        engine.alive = False  # the engine died: neither alive nor ready
        assert_envelope(httpx.get(f"{url}/health"), 503)
        assert_envelope(httpx.get(f"{url}/ready"), 503)
        assert httpx.head(f"{url}/health").status_code == 503
