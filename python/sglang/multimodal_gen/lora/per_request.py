"""Per-request LoRA compositions: a request's adapters as a value the forward applies per row.

:func:`select` turns a request's ``lora`` field into a :class:`LoRASelection`: one
:class:`~sglang.multimodal_gen.layers.lora.Composition` (slots, strengths) per target. Nothing is
applied to any layer: the caller that runs a (batched) forward puts each row's composition in a
:class:`~sglang.multimodal_gen.layers.lora.RowMapping` and runs the model under the target's
:class:`~sglang.multimodal_gen.layers.lora.LoRAContext`; each LoRA layer then computes each row
with its own composition (merged weight for the rows whose composition is merged, the exact base
weight plus the row's delta for the others). So requests with different compositions share one
batch, and a request's composition is never left behind on the layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang.multimodal_gen.layers.lora import Composition
from sglang.multimodal_gen.lora.adapters import AdapterStore
from sglang.multimodal_gen.lora.compose import Composer
from sglang.multimodal_gen.lora.requests import validate_composition

__all__ = ["LoRASelection", "select"]


@dataclass(frozen=True)
class LoRASelection:
    """The compositions one request uses, one per target: a frozen, hashable, picklable value.

    Attributes:
        compositions: ``((target, Composition), ...)`` in the manager's target order.
        slot_epoch: the adapter store's slot epoch when the selection was made (not part of the
            value): once an adapter is unloaded its slot may hold another adapter, so a
            selection is valid until the next LoRA command (``LoRAManager.selection_is_current``).
    """

    compositions: tuple[tuple[str, Composition], ...]
    slot_epoch: int = field(default=0, compare=False, hash=False)

    def for_target(self, name: str) -> Composition:
        """The composition of target ``name``.

        Raises:
            KeyError: not a target of this selection.
        """
        for target, comp in self.compositions:
            if target == name:
                return comp
        raise KeyError(f"no LoRA target {name!r} in this selection ({self.targets})")

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.compositions)

    @property
    def empty(self) -> bool:
        """Whether no target uses any adapter."""
        return not any(c for _, c in self.compositions)


def select(
    store: AdapterStore,
    composer: Composer,
    composition: Sequence[tuple[str, float]] | Sequence[Mapping[str, Any]] | None,
    field: str = "lora",
) -> LoRASelection:
    """The :class:`LoRASelection` of a request's ``composition`` (see
    ``LoRAManager.selection``): ``None`` gives the compositions the targets' layers hold now.
    ``field``: the request field it came from, named by the errors."""
    targets = composer.target_names
    if composition is None:
        comps = tuple((t, composer.state(t).applied) for t in targets)
        return LoRASelection(comps, store.slot_epoch)
    comp = validate_composition(composition, field)
    for name, _ in comp:
        store.require(name, param=field)
    per_target = {t: [(n, s) for n, s in comp if t in store[n].modules] for t in targets}
    composer.check_strengths(per_target, store.__getitem__, field)
    for name, _ in comp:
        store.touch(name)
    comps = tuple((t, composer.slot_composition(t, per_target[t])) for t in targets)
    return LoRASelection(comps, store.slot_epoch)
