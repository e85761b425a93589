"""Which adapters each row of a module call uses: the requests' LoRA selections turned into the
row mapping of the module's LoRA layers.

A module call of the pipeline (a DiT step, a caption refiner) stacks rows of one or several
requests along dim 0. Each request carries its adapters as a selection (the LoRA manager's
``LoRASelection``: one composition per LoRA target). Right before the call, the module's LoRA
context (:func:`~sglang.multimodal_gen.layers.lora.composition.lora_context_of`, one per target) gets
the :class:`~sglang.multimodal_gen.layers.lora.composition.RowMapping` of the call's rows, and every
LoRA layer of the module computes each row with that row's composition only. Nothing is kept
after the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sglang.multimodal_gen.layers.lora.composition import RowMapping, lora_context_of

__all__ = ["with_row_adapters"]


def with_row_adapters(module: Any, row_lora: Sequence[Any] | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` with ``module``'s LoRA layers computing row ``i`` under ``row_lora[i]``.

    Args:
        module: the module ``fn`` calls (a denoiser; a module without LoRA layers is called as
            is).
        row_lora: one selection per leading row of the call's inputs (``for_target(name)`` ->
            the composition of that LoRA target), or ``None`` / all ``None``: the layers' own
            active compositions.
    """
    ctx = lora_context_of(module)
    if ctx is None or row_lora is None or all(s is None for s in row_lora):
        return fn()
    if any(s is None for s in row_lora):
        raise ValueError("every row of a call needs a LoRA selection, or none does")
    comps = [s.for_target(ctx.target) for s in row_lora]
    if all(c == ctx.active for c in comps):  # the layers' own composition: nothing to map
        return fn()
    with ctx.rows(RowMapping.of(comps)):
        return fn()
