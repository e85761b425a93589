"""Collectives over the tensor-parallel group and control messages over the whole world
(identities in a single process)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sglang.multimodal_gen.distributed.parallel_state import (
    get_tp_group,
    get_tp_world_size,
    get_world_cpu_group,
    get_world_size,
)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks, in place (as vLLM/SGLang do: no copy of the output).

    Args:
        x: any shape and dtype; identical shape on every rank; overwritten with the sum.

    Returns:
        ``x`` (holding the sum at TP > 1; untouched at TP 1).
    """
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x, group=get_tp_group())
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate ``x`` from every TP rank along ``dim``, in rank order.

    Args:
        x: ``[..., n, ...]`` with the same shape on every rank.
        dim: the dimension to concatenate (default: last).

    Returns:
        ``[..., tp_size * n, ...]``; ``x`` itself at TP 1.
    """
    world = get_tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=get_tp_group())
    return torch.cat(parts, dim=dim)


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Send a picklable object from global rank ``src`` to every rank and return it.

    Ranks other than ``src`` pass anything (ignored). Identity in a single process. Used by the
    engine so that every rank (TP, SP and CFG alike) applies the same requests and LoRA changes
    in the same order.
    """
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=get_world_cpu_group())
    return box[0]


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def broadcast_tensors_cpu(obj: Any, src: int = 0, device: torch.device | str = "cpu") -> Any:
    """Broadcast a nest of dicts/lists/tuples of tensors from rank ``src`` over the CPU group.

    Tensors travel through host memory (moved to the CPU on ``src``) and arrive on ``device``
    with their dtypes and values unchanged. Identity in a single process.
    """
    if get_world_size() == 1:
        return obj
    if dist.get_rank(get_world_cpu_group()) == src:
        obj = _map_tensors(obj, lambda t: t.detach().cpu())
    out = broadcast_object(obj, src=src)
    return _map_tensors(out, lambda t: t.to(device))
