"""``launch_processes``: a failing worker's error reaches the caller (2 gloo processes)."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.distributed import (
    launch_processes,
)


def _boom(rank):
    if rank == 1:
        raise RuntimeError("worker one failed on purpose")
    return rank


def test_launch_reports_worker_failure():
    with pytest.raises(RuntimeError, match="worker one failed on purpose"):
        launch_processes(_boom, 2, backend="gloo", timeout_s=120)
