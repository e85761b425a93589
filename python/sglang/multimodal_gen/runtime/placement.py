"""Where a rank's DiT lives and how it runs: compute dtype, DiT CPU offload, the LoRA merge
cache's device, ``torch.compile`` of the blocks.
"""

from __future__ import annotations

import torch

from sglang.multimodal_gen.layers.lora import BaseLayerWithLoRA


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"`` -> bf16 on CUDA, fp32 elsewhere; names -> ``torch.dtype``.

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)} or 'auto'")
    return table[dtype]


#: Graphs dynamo may compile per block class (its ``recompile_limit``, 8 by default) before it
#: gives up; with ``fullgraph=True`` giving up is an error (``FailOnRecompileLimitHit``), and a
#: server reaches 8 quickly: each block class has a graph per input-shape family (Z-Image's
#: refiners and main blocks see three token counts), before and after LoRA, and batch size 1
#: apart from larger batches.
RECOMPILE_LIMIT = 64


def compile_blocks(
    model: torch.nn.Module, fullgraph: bool = True, backend: str = "inductor"
) -> int:
    """``torch.compile`` every transformer block of ``model`` in place (the modules of its
    ``ModuleList``s whose class name ends in ``Block``); returns how many.

    Blocks, not the whole model: the per-request Python around them (patchify, caption padding)
    would break the graph anyway, and equal blocks share one compiled graph per input shape.
    ``fullgraph=True``: a block must trace as one graph (a graph break is an error, not a silent
    fall back to eager between pieces); every family's blocks do, LoRA layers included
    (:meth:`BaseLayerWithLoRA._forward_traced`), and so do the tensor-parallel collectives.

    Compiles happen lazily, on a block's first call per variant, and do not repeat for:

    * LoRA changes: set / unset / switch adapters, strengths, merge / unmerge, a per-request
      composition or a batch of rows with different compositions (all reach the graph as tensor
      values of fixed shapes);
    * other blocks of the same class (one graph serves them all).

    They do repeat (once each, then cached) for: the first call after the first adapter is stored
    on the blocks' layers (the graph gains the LoRA delta), an adapter that needs more slots or a
    larger rank than stored so far (the slot tensors grow), a batch of more than
    :data:`~sglang.multimodal_gen.layers.lora.row_strengths.ROWS_CAP` rows with distinct
    compositions, and a new input shape: the first new resolution or batch size recompiles with
    dynamic sizes (torch's automatic dynamic shapes), later ones reuse that graph.

    Raises dynamo's ``recompile_limit`` (process-wide) to at least :data:`RECOMPILE_LIMIT`.

    Args:
        model: the DiT (its blocks are compiled in place with ``nn.Module.compile``).
        fullgraph: refuse graph breaks (default).
        backend: the ``torch.compile`` backend (``"inductor"``; tests count compiles with
            ``torch._dynamo.testing.CompileCounter``).
    """
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList):
            for block in mod:
                if type(block).__name__.endswith("Block"):
                    block.compile(fullgraph=fullgraph, backend=backend)
                    n += 1
    return n


def merge_cache_device(device: torch.device, cache_bytes: int) -> torch.device | None:
    """Where the merge cache lives: host memory when ``device`` is an accelerator whose free
    memory is less than twice the cache bound (the cache must not starve activations), else
    ``None`` (the weights' device, where a hit swaps storage instead of copying)."""
    if device.type != "cuda" or cache_bytes == 0:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return torch.device("cpu") if free < 2 * cache_bytes else None


class DiTOffloader:
    """Keeps a module's parameters in pinned host memory between commands (``--dit-cpu-offload``).

    :meth:`onload` moves every parameter to the execution device; :meth:`offload` points it back
    at its host buffer, copying the device values into that buffer first when the command may
    have changed them (LoRA merge/unmerge/commit). Only parameters move: small LoRA tensors stay
    on the device; pre-merge snapshots and cached merges are kept in host memory
    (:func:`build_lora_manager` with ``cpu_offload``).
    """

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module = module
        self.device = device
        for m in module.modules():  # parked weights are written in place, never re-pointed
            if isinstance(m, BaseLayerWithLoRA):
                m.swap_storage = False
        self.params = [p for p in module.parameters()]
        self.host = []
        for p in self.params:
            buf = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
            buf.copy_(p.data)
            self.host.append(buf)
        self.on_device = True
        self.offload(dirty=False)

    def onload(self) -> None:
        if self.on_device:
            return
        for p, buf in zip(self.params, self.host):
            p.data = buf.to(self.device, non_blocking=True)
        torch.cuda.synchronize(self.device)
        self.on_device = True

    def offload(self, dirty: bool) -> None:
        if not self.on_device:
            return
        for p, buf in zip(self.params, self.host):
            if dirty:
                buf.copy_(p.data, non_blocking=True)
        if dirty:
            torch.cuda.synchronize(self.device)
        for p, buf in zip(self.params, self.host):
            p.data = buf
        self.on_device = False
