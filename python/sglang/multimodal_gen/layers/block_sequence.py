"""The repeated blocks of a DiT forward, declared once and run by one shared runner.

A DiT's forward embeds its inputs, runs its transformer blocks one after the other, and projects
the result. The middle part is what step caches (first-block / dual-block cache, TeaCache,
MagCache, TaylorSeer) intercept: they run some blocks, compare a statistic with the previous
denoising step and reuse cached residuals for the others. A family makes its blocks cacheable by
DECLARING them as a :class:`BlockSequence` and calling :meth:`BlockSequence.run`; no per-family
caching code exists.

Vocabulary:

* **streams**: the tensors the blocks carry, in the *canonical* layout the sequence declares:
  ``streams[0]`` is the main (image / unified) hidden stream ``[B, S, D]``, further entries are
  side streams (the text stream of dual-stream blocks, ``[B, S_txt, D]``). Every stream has the
  batch rows on dim 0.
* **stage**: a run of blocks sharing one calling convention (Flux: its dual-stream blocks on
  ``(image, text)``, then its single-stream blocks on ``cat([text, image])``). A stage may keep the
  streams in its own layout: ``enter`` turns canonical streams into it, ``leave`` back.
* **row arguments**: per-row tensors the blocks take besides the streams (the timestep embedding
  ``[B, D]``, a key mask ``[B, S]``...). They are given by name so that a cache can run the blocks
  on a subset of the rows (:meth:`BlockSequence.select_rows`); shared arguments (RoPE tables
  without a batch dimension) are captured by the stage's ``call``.

Without an active interceptor :meth:`BlockSequence.run` runs every block in order with exactly the
arithmetic of a plain loop (the uncached numerics are unchanged). An interceptor (a step cache,
installed for one DiT call with :func:`intercept_blocks`) receives the sequence and the input
streams and must return the output streams.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["BlockSequence", "BlockStage", "ModulatedInput", "Streams", "intercept_blocks"]

#: The streams a block sequence carries (``streams[0]``: the main hidden stream ``[B, S, D]``).
Streams = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class BlockStage:
    """A run of blocks with one calling convention.

    Attributes:
        blocks: the blocks, in order (e.g. an ``nn.ModuleList``).
        call: ``call(block, local_streams, row_args) -> local_streams``: one block.
        enter: canonical streams -> this stage's layout (``None``: the canonical layout).
        leave: this stage's layout -> canonical streams (``None``: the canonical layout).
    """

    blocks: Sequence[nn.Module]
    call: Callable[[nn.Module, Streams, dict[str, Any]], Streams]
    enter: Callable[[Streams], Streams] | None = None
    leave: Callable[[Streams], Streams] | None = None


@dataclass(frozen=True)
class ModulatedInput:
    """A family's TeaCache declaration: the timestep-modulated input of its first block and the
    published rescaling of its change (Liu et al., "Timestep Embedding Tells: It's Time to Cache
    for Video Diffusion Model", 2024; ali-vilab/TeaCache).

    Attributes:
        compute: ``compute(streams, row_args) -> m``: what TeaCache compares across steps, from
            the canonical input streams and the row arguments of the sequence (Flux: block 0's
            ``norm1(image, temb)[0]``, ``[B, S, D]``; Wan: the projected timestep ``[B, 6, D]``).
            It must run no collective (every rank calls it once per call).
        coefficients: ``np.poly1d`` coefficients, highest power first, mapping the relative L1
            change of ``m`` to the estimated change of the output; ``(1.0, 0.0)`` (identity)
            where the TeaCache repository publishes none for the family.
        threshold: the family's default ``rel_l1_thresh`` (``--cache-threshold`` replaces it).
        warmup: the family's default count of first calls that always compute (TeaCache's
            ``ret_steps``; ``--cache-warmup`` replaces it).
        per_token: ``m`` is ``[B, S, ...]`` aligned with the tokens of ``streams[0]`` (a cache
            measures a request's rows up to its length); ``False``: ``[B, ...]`` per row.
    """

    compute: Callable[[Streams, dict[str, Any]], torch.Tensor]
    coefficients: tuple[float, ...] = (1.0, 0.0)
    threshold: float = 0.15
    warmup: int = 1
    per_token: bool = True


@dataclass
class BlockSequence:
    """A DiT's repeated blocks (see the module docstring).

    Attributes:
        owner: the DiT module (identifies the denoiser: a two-expert model's experts differ, and
            its LoRA context gives each row's adapter composition).
        stages: the stages, in order; block ``i`` of the sequence counts across stages.
        row_args: per-row arguments of the blocks (tensors with the batch on dim 0, or ``None``).
        lengths: the valid tokens of ``streams[0]`` per row (right padding beyond), or ``None``:
            every token. A cache measures a request's statistic over its rows up to the longest
            of their lengths, so that the padding another request brings into a batch does not
            change it.
        name: tells several sequences of one DiT apart (a cache keys its state on it). A call
            whose flags change what the blocks compute (a perturbed guidance pass, isolated
            modalities) names them (:meth:`variant`), so that a cache never reuses a residual
            computed under other flags.
        cacheable: ``False``: :meth:`run` runs every block plainly even under an interceptor (a
            call whose blocks depend on something the declaration cannot key, e.g. per-row
            weights given by the caller).
        modulated_input: the family's TeaCache declaration (:class:`ModulatedInput`), ``None``:
            the family does not declare one (``--cache-method teacache`` is refused).
    """

    owner: nn.Module
    stages: Sequence[BlockStage]
    row_args: dict[str, torch.Tensor | None] = field(default_factory=dict)
    lengths: Sequence[int] | None = None
    name: str = "blocks"
    cacheable: bool = True
    modulated_input: ModulatedInput | None = None

    @staticmethod
    def variant(name: str, **flags: Any) -> str:
        """``name`` with the flags that change the blocks' arithmetic, e.g.
        ``variant("blocks", stg=(3,))`` -> ``"blocks[stg=(3,)]"``; flags equal to ``None``,
        ``False`` or empty are left out (``variant("blocks")`` is ``"blocks"``). Flag values
        must have a stable ``repr`` (ints, bools, tuples)."""
        kept = [f"{k}={v!r}" for k, v in sorted(flags.items()) if v not in (None, False, (), [])]
        return f"{name}[{','.join(kept)}]" if kept else name

    @property
    def num_blocks(self) -> int:
        """Blocks over all stages."""
        return sum(len(s.blocks) for s in self.stages)

    def run(self, streams: Streams) -> Streams:
        """The output streams of every block, through the active interceptor if one is set.

        Args:
            streams: canonical input streams (``streams[0]`` ``[B, S, D]``).

        Returns:
            Canonical output streams, same shapes.
        """
        interceptor = _INTERCEPTOR.get()
        if interceptor is None or not self.cacheable:
            return self.run_range(streams, 0, self.num_blocks)
        return interceptor(self, streams)

    def run_range(self, streams: Streams, lo: int, hi: int) -> Streams:
        """Blocks ``lo`` to ``hi - 1`` (sequence indices) on canonical ``streams``.

        Raises:
            ValueError: ``0 <= lo <= hi <= num_blocks`` does not hold.
        """
        if not 0 <= lo <= hi <= self.num_blocks:
            raise ValueError(f"block range {lo}:{hi} of a sequence of {self.num_blocks} blocks")
        start = 0
        for stage in self.stages:
            a, b = max(lo, start), min(hi, start + len(stage.blocks))
            if a < b:
                local = stage.enter(streams) if stage.enter else streams
                for i in range(a - start, b - start):
                    local = stage.call(stage.blocks[i], local, self.row_args)
                streams = stage.leave(local) if stage.leave else local
            start += len(stage.blocks)
        return streams

    def select_rows(self, index: torch.Tensor) -> BlockSequence:
        """The same sequence for the rows ``index`` (``[k]`` int64) of a call: row arguments
        and lengths narrowed; the streams given to its runs must hold the same rows."""
        rows = index.tolist()
        return BlockSequence(
            owner=self.owner,
            stages=self.stages,
            row_args={
                k: (None if v is None else v.index_select(0, index.to(v.device)))
                for k, v in self.row_args.items()
            },
            lengths=None if self.lengths is None else [self.lengths[i] for i in rows],
            name=self.name,
            cacheable=self.cacheable,
            modulated_input=self.modulated_input,
        )


Interceptor = Callable[[BlockSequence, Streams], Streams]
_INTERCEPTOR: contextvars.ContextVar[Interceptor | None] = contextvars.ContextVar(
    "block_sequence_interceptor", default=None
)


@contextlib.contextmanager
def intercept_blocks(interceptor: Interceptor | None) -> Iterator[None]:
    """Run every :meth:`BlockSequence.run` of the enclosed calls (this thread) through
    ``interceptor(sequence, streams) -> streams`` (``None``: plainly)."""
    token = _INTERCEPTOR.set(interceptor)
    try:
        yield
    finally:
        _INTERCEPTOR.reset(token)
