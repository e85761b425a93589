"""Prometheus metrics of the HTTP server (``GET /metrics``).

Each :class:`ServerMetrics` owns its own ``CollectorRegistry``, so several apps in one process (the
tests) do not collide. Metric names (all prefixed ``sglang_``):

- ``sglang_http_requests_total{endpoint, status}``: requests by route template and HTTP status;
- ``sglang_queue_depth``: generation requests waiting for the engine;
- ``sglang_engine_alive``: 1 while the engine serves, 0 once it is dead;
- ``sglang_request_e2e_seconds``: generation requests, from arrival to response body ready;
- ``sglang_queue_wait_seconds``: time a generation waited for the engine;
- ``sglang_generation_seconds``: engine time of one generation call;
- ``sglang_step_seconds``: mean denoising-step time of each generation (engine time / steps; the
  engine API returns whole generations, so this includes text encoding and VAE decode spread over
  the steps);
- ``sglang_lora_admin_seconds{op}``: ``set_lora`` (load + switch), ``unset_lora`` (switch),
  ``merge_lora_weights``, ``unmerge_lora_weights``, ``unload_lora``;
- ``sglang_lora_memory_bytes{kind}``: the LoRA runtime's memory after the last LoRA command
  (``loaded``, ``max_loaded``, ``snapshot``, ``merge_cache``, ``merge_cache_max``, ``compiled``,
  ``workspace_peak``; see ``list_loras()["memory"]``);
- ``sglang_images_generated_total``.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from sglang.multimodal_gen.entrypoints.scheduler import SchedulerMetrics

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600,
)  # fmt: skip
_LORA_MEMORY_KINDS = (
    "loaded", "max_loaded", "snapshot", "merge_cache", "merge_cache_max", "compiled",
    "workspace_peak",
)  # fmt: skip
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServerMetrics(SchedulerMetrics):
    """The server's Prometheus collectors; also the scheduler's metrics hook."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "sglang_http_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge("sglang_queue_depth", "generation requests waiting", registry=r)
        self.engine_alive = Gauge("sglang_engine_alive", "1 while the engine serves", registry=r)
        self.engine_alive.set(1)
        self.e2e = Histogram(
            "sglang_request_e2e_seconds", "generation request latency, arrival to response",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "sglang_queue_wait_seconds", "time a generation waited for the engine",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.generation = Histogram(
            "sglang_generation_seconds", "engine time of one generation call",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.step = Histogram(
            "sglang_step_seconds", "mean denoising-step time per generation",
            buckets=_STEP_BUCKETS, registry=r,
        )  # fmt: skip
        self.lora_admin = Histogram(
            "sglang_lora_admin_seconds", "LoRA load/switch/merge time by operation", ["op"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.images = Counter("sglang_images_generated", "images returned", registry=r)
        self.lora_memory = Gauge(
            "sglang_lora_memory_bytes", "LoRA runtime memory by kind (rank 0)", ["kind"],
            registry=r,
        )  # fmt: skip

    # SchedulerMetrics hooks -------------------------------------------------------------
    def set_queue_depth(self, depth: int) -> None:
        self.queue_depth.set(depth)

    def observe_generation(self, wait_s: float, run_s: float, steps: int | None) -> None:
        self.queue_wait.observe(wait_s)
        self.generation.observe(run_s)
        if steps:
            self.step.observe(run_s / steps)

    def observe_admin(self, op: str, seconds: float) -> None:
        self.lora_admin.labels(op=op).observe(seconds)

    def observe_lora_memory(self, memory: dict) -> None:
        for kind in _LORA_MEMORY_KINDS:
            value = memory.get(f"{kind}_bytes")
            if isinstance(value, int | float):
                self.lora_memory.labels(kind=kind).set(value)

    def set_engine_alive(self, alive: bool) -> None:
        self.engine_alive.set(1 if alive else 0)

    # HTTP side ----------------------------------------------------------------------------
    def observe_request(self, endpoint: str, status: int) -> None:
        """Count one finished HTTP request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        """The text exposition format of every collector."""
        return generate_latest(self.registry)
