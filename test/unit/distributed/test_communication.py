"""The collectives without an initialized process group: everything is TP 1 (identity)."""

from __future__ import annotations

import torch
from sglang.multimodal_gen.distributed import (
    broadcast_object,
    get_tp_rank,
    get_tp_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


def test_without_initialization_everything_is_tp1():
    assert get_tp_world_size() == 1 and get_tp_rank() == 0
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x
    assert broadcast_object("same") == "same"
