"""``runtime/engine.py``: when an engine offers continuous batching (in one process and with
worker processes alike).

A continuous loop (``DiffusionEngine.generate_continuous``) takes requests of different step
counts (the scheduler's join key leaves ``num_inference_steps`` out). A two-expert model whose
experts are offloaded one at a time (``ModelRunner.per_expert_offload``: Wan2.2 A14B with
``--dit-cpu-offload``) must not run such a loop: its requests would switch experts at different
steps, and one request moving its expert onto the device parks the expert another request is
still calling. Such an engine batches whole requests only (equal step counts, one switch step).
The engines here are built without a model: only the executor kind and the runner's flag count.
"""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.runtime.engine import DiffusionEngine
from sglang.multimodal_gen.runtime.executors import MultiprocExecutor, UniProcExecutor


def _engine(executor_cls, per_expert_offload: bool) -> DiffusionEngine:
    engine = object.__new__(DiffusionEngine)
    executor = object.__new__(executor_cls)
    executor.info = {"per_expert_offload": per_expert_offload}  # the runner's model info
    engine._executor = executor
    return engine


@pytest.mark.parametrize(
    ("executor_cls", "per_expert_offload", "expected"),
    [
        (UniProcExecutor, False, True),  # one process, experts resident: joins and mixed steps
        (UniProcExecutor, True, False),  # experts offloaded one at a time: whole batches only
        (MultiprocExecutor, False, True),  # worker processes: rank 0 decides, broadcasts
        (MultiprocExecutor, True, False),
    ],
)
def test_continuous_batching_needs_resident_experts(executor_cls, per_expert_offload, expected):
    assert _engine(executor_cls, per_expert_offload).continuous_batching is expected
