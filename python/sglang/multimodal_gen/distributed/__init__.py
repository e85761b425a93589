"""Tensor-parallel groups, collectives and local process launch."""

from sglang.multimodal_gen.distributed.communication import (
    broadcast_object,
    broadcast_tensors_cpu,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from sglang.multimodal_gen.distributed.launch import (
    default_backend,
    find_free_port,
    init_worker,
    launch_processes,
    shutdown_worker,
)
from sglang.multimodal_gen.distributed.parallel_state import (
    destroy_model_parallel,
    get_tp_cpu_group,
    get_tp_group,
    get_tp_rank,
    get_tp_world_size,
    initialize_model_parallel,
    model_parallel_is_initialized,
)

__all__ = [
    "broadcast_object",
    "broadcast_tensors_cpu",
    "default_backend",
    "destroy_model_parallel",
    "find_free_port",
    "get_tp_cpu_group",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_world_size",
    "init_worker",
    "initialize_model_parallel",
    "launch_processes",
    "model_parallel_is_initialized",
    "shutdown_worker",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
