"""CFG parallelism: each rank of the CFG group runs one guidance branch of a DiT call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from sglang.multimodal_gen.distributed import get_cfg_group, get_cfg_rank, get_cfg_world_size
from sglang.multimodal_gen.layers.step_cache import cache_rows
from sglang.multimodal_gen.pipelines.batching import branch_rows
from sglang.multimodal_gen.pipelines.lora_rows import with_row_adapters

__all__ = ["STEP_CACHE_ARG", "cfg_parallel_call"]

#: The batched argument of a DiT call that carries each row's step cache
#: (:class:`~sglang.multimodal_gen.layers.step_cache.CacheRow`); taken out before the call.
STEP_CACHE_ARG = "_step_cache_rows"


def cfg_parallel_call(
    denoiser,
    rows: int,
    args: dict[str, Any],
    batched: tuple[str, ...],
    row_lora: Sequence[Any] | None = None,
) -> Any:
    """``denoiser(**args)`` where the ``batched`` arguments stack ``rows`` CFG branches along
    dim 0 (branch-major); with CFG parallelism each rank of the CFG group runs only its branch
    and one all-gather reassembles the full ``[rows * b, ...]`` output (a tensor, or a list of
    per-item tensors). See ``StagedPipeline.run_branches``.

    Args:
        row_lora: the LoRA selection of each row of the batched arguments (``None``: the layers'
            active compositions); under CFG parallelism this rank's branch takes its share.

    Raises:
        ValueError: ``rows`` differs from the CFG degree while CFG parallelism is on.
    """
    cfg = get_cfg_world_size()
    if STEP_CACHE_ARG in args:
        args = dict(args)
        cache = args.pop(STEP_CACHE_ARG)
        batched = tuple(k for k in batched if k != STEP_CACHE_ARG)
        if cfg > 1 and rows > 1:
            cache = branch_rows(cache, get_cfg_rank(), rows)
        with cache_rows(cache):
            return cfg_parallel_call(denoiser, rows, args, batched, row_lora)
    if cfg == 1 or rows == 1:
        return with_row_adapters(denoiser, row_lora, lambda: denoiser(**args))
    if rows != cfg:
        raise ValueError(f"{rows} CFG branches cannot be split over cfg_degree={cfg}")
    r = get_cfg_rank()
    local = {k: (branch_rows(v, r, rows) if k in batched else v) for k, v in args.items()}
    if row_lora is not None:
        n = len(row_lora)
        row_lora = list(row_lora)[r * n // rows : (r + 1) * n // rows]
    out = with_row_adapters(denoiser, row_lora, lambda: denoiser(**local))
    as_list = isinstance(out, list)
    t = torch.stack(out) if as_list else out
    parts = [torch.empty_like(t) for _ in range(cfg)]
    torch.distributed.all_gather(parts, t.contiguous(), group=get_cfg_group())
    full = torch.cat(parts, 0)
    return list(full.unbind(0)) if as_list else full
