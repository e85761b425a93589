"""Tensor-parallel process group state.

Usage (every rank)::

    torch.distributed.init_process_group("gloo" or "nccl", ...)
    initialize_model_parallel(tensor_parallel_size=N)

Without :func:`initialize_model_parallel` everything behaves as TP size 1 (rank 0): the getters
return ``(0, 1)`` and the collectives are identities. This lets a single-process program (and the
tests that build a layer "as rank r of n") use the same code.
"""

from __future__ import annotations

import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
# Control messages (commands, LoRA payloads, broadcast conditioning) travel on a gloo group, as
# vLLM's ``cpu_group``: pickled objects on an NCCL group would be staged through the GPU.
_CPU_GROUP: dist.ProcessGroup | None = None
_TP_RANKS: tuple[int, ...] = ()


def initialize_model_parallel(tensor_parallel_size: int = 1) -> None:
    """Create the tensor-parallel group over all ranks of the default process group.

    Args:
        tensor_parallel_size: number of ranks that shard each layer. Must equal the world size
            (data/pipeline parallelism are not implemented).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized, or the group exists already.
        ValueError: ``tensor_parallel_size`` does not match the world size.
    """
    global _TP_GROUP, _TP_RANKS, _CPU_GROUP
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel() needs torch.distributed.init_process_group() first"
        )
    if _TP_GROUP is not None:
        raise RuntimeError("the tensor-parallel group is already initialized")
    world = dist.get_world_size()
    if tensor_parallel_size != world:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} must equal the world size {world}"
        )
    _TP_RANKS = tuple(range(world))
    # The default group already spans exactly these ranks; a new_group would only add a
    # second communicator (and a second NCCL init) for the same set.
    _TP_GROUP = dist.group.WORLD
    _CPU_GROUP = (
        dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    )


def destroy_model_parallel() -> None:
    """Forget the TP group (the default process group is left to the caller)."""
    global _TP_GROUP, _TP_RANKS, _CPU_GROUP
    _TP_GROUP = None
    _CPU_GROUP = None
    _TP_RANKS = ()


def model_parallel_is_initialized() -> bool:
    return _TP_GROUP is not None


def get_tp_group() -> dist.ProcessGroup | None:
    """The TP process group, or ``None`` when running as TP size 1 without initialization."""
    return _TP_GROUP


def get_tp_cpu_group() -> dist.ProcessGroup | None:
    """The gloo group over the TP ranks for control messages (``None`` without initialization)."""
    return _CPU_GROUP


def get_tp_rank() -> int:
    """This process's rank in the TP group (0 without initialization)."""
    return dist.get_rank(_TP_GROUP) if _TP_GROUP is not None else 0


def get_tp_world_size() -> int:
    """The TP group size (1 without initialization)."""
    return dist.get_world_size(_TP_GROUP) if _TP_GROUP is not None else 1
