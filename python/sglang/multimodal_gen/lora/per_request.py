"""Per-request LoRA compositions: apply for one generation, then restore exactly; or, for a
batch whose requests use different compositions, resolve each one to a row of a
:class:`~sglang.multimodal_gen.layers.lora.rows.RowPlan` (:meth:`PerRequestMixin.row_composition`).

Under a savepoint (:mod:`~sglang.multimodal_gen.lora.transactions`) the request's composition is
applied with mode ``"request"`` (:mod:`~sglang.multimodal_gen.lora.compose`): merged layers run it
as an overlay, unmerged layers switch their dynamic composition; the generation runs; the
savepoint is always rolled back. At TP > 1 both steps are agreed across ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.requests import validate_composition
from sglang.multimodal_gen.lora.transactions import LoRAStateError

__all__ = ["PerRequestMixin"]


class PerRequestMixin:
    """``use_composition`` of the LoRA manager."""

    def _checked_composition(self, composition):
        """``(composition, {target: its part})`` after every check of :meth:`use_composition`."""
        self._check_usable()
        comp = validate_composition(composition, "lora")
        for name, _ in comp:
            self._registry.require(name, param="lora")
        per_target = {
            t: [(n, s) for n, s in comp if t in self._registry[n].modules] for t in self._targets
        }
        self._check_strengths(per_target, self._registry.__getitem__, "lora")
        return comp, per_target

    def selection(self, composition):
        """TRANSITIONAL (replaced by the slot-based selection): ``None`` only."""
        if composition is None:
            return None
        raise NotImplementedError("per-request LoRA compositions are being rewired")

    def row_composition(
        self, composition: Sequence[tuple[str, float]] | Sequence[Mapping[str, Any]]
    ) -> list[tuple[str, float]]:
        """A request's composition as a row of a mixed batch: ``[(layer adapter id, strength)]``
        for :class:`~sglang.multimodal_gen.layers.lora.rows.RowPlan`, after the checks of
        :meth:`use_composition`. Nothing changes on the layers: each row's adapters are applied
        in the batched forward itself, so requests with different compositions share a batch.

        Raises:
            NotFoundError, InvalidRequestError: as :meth:`use_composition` (``param="lora"``).
        """
        comp, _ = self._checked_composition(composition)
        self._touch([n for n, _ in comp])
        return [(self._registry[n].uid, s) for n, s in comp]

    @contextlib.contextmanager
    def use_composition(
        self,
        composition: Sequence[tuple[str, float]] | Sequence[Mapping[str, Any]] | None,
        agree: Callable[[BaseException | None], bool] | None = None,
    ) -> Iterator[None]:
        """Run the block with ``composition`` ``[(nickname, strength), ...]`` active on every
        target, then restore the previous state exactly.

        ``None`` leaves the current state. Layers whose composition is unchanged cost nothing;
        unmerged layers switch their dynamic composition; merged layers keep their weights and
        run the request as an overlay (``merged + (request - merged)``), so nothing is merged or
        unmerged, before or after. Entries may also be ``{"name": ..., "scale": ...}`` mappings.

        Args:
            agree: TP > 1: called on every rank with this rank's error (or ``None``) after the
                composition is applied and again after it is restored; returns whether every
                rank succeeded. A failed apply on any rank rolls back on every rank; a failed
                restore on any rank is a :class:`LoRAStateError` on every rank.

        Raises:
            NotFoundError: an unknown nickname (``param="lora"``).
            InvalidRequestError: a bad strength, a duplicate, more than
                :data:`~sglang.multimodal_gen.lora.requests.MAX_ADAPTERS_PER_CALL` entries
                (``param="lora"``).
            LoRAStateError: the restore failed (every layer reset to its base weights; the
                engine must stop serving: HTTP 503).
        """
        if composition is None:
            yield
            return
        err: BaseException | None = None
        began = False
        try:
            comp, per_target = self._checked_composition(composition)
            self._begin()
            began = True
            self._request_composition = comp
            for t, tcomp in per_target.items():
                if tcomp != self._state[t].composition:
                    self._apply(t, tcomp, "request", param="lora")
        except BaseException as e:
            err = e
        ok = err is None if agree is None else agree(err)
        if not ok:
            self._request_composition = None
            if began:
                self._rollback()
            if err is not None:
                raise err
            raise InvalidRequestError(
                "the request's LoRA composition failed on another TP rank", "lora"
            )
        try:
            yield
        finally:
            self._request_composition = None
            restore_err: BaseException | None = None
            try:
                self._rollback()
            except BaseException as e:
                restore_err = e
            all_ok = restore_err is None if agree is None else agree(restore_err)
            if restore_err is not None:
                raise restore_err
            if not all_ok:
                self._quarantine("restoring a request's LoRA composition failed on another rank")
                raise LoRAStateError(
                    "restoring a request's LoRA composition failed on another TP rank; the "
                    "engine stops serving (restart it)"
                )
            self._touch([n for n, _ in comp])
