"""The bookkeeping every step-cache policy shares, on a toy block sequence: a request's region
ends at its own length (another request's padding changes nothing), states keyed by LoRA
composition, branch context and denoiser, the LoRA row mapping narrowed to the computing rows,
and the sequence-parallel shards adding their statistics before deciding (two gloo processes)."""

from __future__ import annotations

import torch
from fixtures import toy_block_sequence as toy
from sglang.multimodal_gen.layers.lora.composition import Composition, LoRAContext
from sglang.multimodal_gen.layers.step_cache import (
    CacheRow,
    RequestCache,
    StepCacheConfig,
    cache_rows,
)

FB = StepCacheConfig.of("fbcache", threshold=0.1)


def test_padding_from_another_request_changes_no_decision():
    """``lengths``: a request's statistic covers its own tokens, not the batch's padding."""
    m = toy.model()
    temb = torch.ones(1, toy.D)
    steps = toy.steps(3, 1, drift=0.04)
    cache_alone, cache_batched = RequestCache(FB), RequestCache(FB)
    for x, c in steps:
        with cache_rows([CacheRow(cache_alone)]):
            toy.seq(m, temb).run((x[:, :3], c))
        padded = torch.cat([x[:, :3], torch.zeros(1, 2, toy.D) + 5.0], 1)  # 2 padding tokens
        seq = toy.seq(m, temb)
        seq.lengths = [3]
        with cache_rows([CacheRow(cache_batched)]):
            seq.run((padded, c))
    assert cache_alone.summary() == cache_batched.summary()
    assert 0 < cache_alone.skipped < len(steps)


def test_a_new_lora_composition_never_reuses_a_residual():
    m = toy.model()
    m.lora_context = LoRAContext("transformer")
    temb = torch.ones(2, toy.D)
    steps = toy.steps(1, 2, drift=0.0)  # the same input every step: would skip from step 1 on
    cache = RequestCache(FB)
    toy.ours(m, steps[:3], temb, [CacheRow(cache)] * 2)
    assert (cache.computed, cache.skipped) == (1, 2)
    m.lora_context.active = Composition.of([(1, 0.5)])
    toy.ours(m, steps[:2], temb, [CacheRow(cache)] * 2)
    assert (cache.computed, cache.skipped) == (2, 3)  # computed again under the new one
    # another branch context or another denoiser: its own state too
    toy.ours(m, steps[:1], temb, [CacheRow(cache, "uncond")] * 2)
    toy.ours(toy.model(), steps[:1], temb, [CacheRow(cache)] * 2)
    assert cache.computed == 4


def test_a_call_of_some_rows_narrows_the_lora_row_mapping(monkeypatch):
    """Requests with other adapters share a call; when only some compute, the middle blocks run
    on their rows with their rows' compositions (a LoRA layer needs one per input row)."""
    from sglang.multimodal_gen.layers.lora.composition import RowMapping

    m = toy.model()
    ctx = m.lora_context = LoRAContext("transformer")
    ca, cb = Composition.of([(1, 0.5)]), Composition.of([(2, 1.0)])
    seen = []
    forward = toy.Single.forward

    def recording(self, h, temb):
        seen.append((h.shape[0], None if ctx.mapping is None else ctx.mapping.compositions))
        return forward(self, h, temb)

    monkeypatch.setattr(toy.Single, "forward", recording)
    steady, moving = toy.steps(1, 2, drift=0.04), toy.steps(2, 1, drift=None)
    a, b = RequestCache(FB), RequestCache(FB)
    temb = torch.ones(3, toy.D)
    with ctx.rows(RowMapping.of([ca, cb, ca])):
        for x, y in zip(steady, moving):
            streams = tuple(torch.cat([s[:1], t, s[1:]]) for s, t in zip(x, y))
            with cache_rows([CacheRow(a), CacheRow(b), CacheRow(a)]):
                toy.seq(m, temb).run(streams)
    assert a.skipped > 0 and b.skipped == 0
    partial = [comps for rows, comps in seen if rows == 1]
    assert len(partial) == 2 * a.skipped  # two single blocks per call where only b computed
    assert all(comps == (cb,) for comps in partial)
    assert all(comps == (ca, cb, ca) for rows, comps in seen if rows == 3)


# ---------------------------------------------------------------- sequence-parallel agreement
# A token-wise toy sequence (3 blocks ``x + tanh(x @ w)`` on ``[1, 8, 4]``, random non-zero
# weights): under Ulysses 2 each rank runs its 4 tokens and gets the one-process output of those
# tokens, so only the cache's decisions can make the ranks differ from one process. Tokens 0-3
# are small (0.05) and redrawn every step (their own change ratio is above 1), tokens 4-7 large
# and drifting slowly: the whole sequence's ratio (the shards' sums added, ``sum_over_shards``)
# stays below the threshold for some steps, rank 0's shard alone never does. Without the
# all-reduce rank 0 computes every step and the agreement (max) makes rank 1 compute too.
SP_TOKENS, SP_D, SP_STEPS = 8, 4, 8
SP_CASES = {
    "fbcache": StepCacheConfig.of("fbcache", threshold=0.2),
    "teacache": StepCacheConfig.of("teacache", threshold=0.2, warmup=1),
}


class _TokenBlock(torch.nn.Module):
    def __init__(self, g: torch.Generator):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(SP_D, SP_D, generator=g) / SP_D**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.w)


def _sp_model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(3)
    m = torch.nn.Module()
    m.blocks = torch.nn.ModuleList(_TokenBlock(g) for _ in range(3))
    return m


def _sp_seq(m: torch.nn.Module):
    from sglang.multimodal_gen.layers.block_sequence import (
        BlockSequence,
        BlockStage,
        ModulatedInput,
    )

    return BlockSequence(
        owner=m,
        stages=(BlockStage(m.blocks, lambda b, s, a: (b(s[0]),)),),
        modulated_input=ModulatedInput(lambda s, a: s[0]),  # TeaCache compares the input itself
    )


def _sp_steps() -> list[torch.Tensor]:
    """``[1, 8, 4]`` inputs of :data:`SP_STEPS` steps (see the comment above)."""
    g = torch.Generator().manual_seed(11)
    slow, drift = torch.randn(1, 4, SP_D, generator=g), torch.randn(1, 4, SP_D, generator=g)
    return [
        torch.cat([0.05 * torch.randn(1, 4, SP_D, generator=g), slow + 0.01 * k * drift], 1)
        for k in range(SP_STEPS)
    ]


def _sp_run(method: str, shard: slice) -> tuple[dict, torch.Tensor]:
    """The summary and the outputs (``[steps, 1, tokens, 4]``) of one request over the steps,
    on the tokens ``shard``."""
    m, cache = _sp_model(), RequestCache(SP_CASES[method])
    outs = []
    for x in _sp_steps():
        with cache_rows([CacheRow(cache)]):
            outs.append(_sp_seq(m).run((x[:, shard],))[0])
    return cache.summary(), torch.stack(outs)


def _sp_rank(rank: int) -> tuple[dict[str, tuple[dict, torch.Tensor]], int]:
    """Every method of :data:`SP_CASES` on this rank's half of the tokens."""
    from sglang.multimodal_gen.distributed import get_sp_rank, get_sp_world_size

    half, r = SP_TOKENS // 2, get_sp_rank()
    shard = slice(r * half, (r + 1) * half)
    return {method: _sp_run(method, shard) for method in SP_CASES}, get_sp_world_size()


def test_sequence_parallel_shards_add_their_sums_before_deciding():
    """Ulysses 2 (two gloo processes): both ranks take the one-process decisions and outputs,
    though rank 0's shard alone would compute every step (``sum_over_shards``; FBCache's and
    TeaCache's statistics)."""
    from sglang.multimodal_gen.distributed import ParallelLayout, launch_processes

    half = SP_TOKENS // 2
    layout = ParallelLayout(ulysses_degree=2)
    results = launch_processes(_sp_rank, 2, backend="gloo", layout=layout)
    for method in SP_CASES:
        one, whole = _sp_run(method, slice(None))
        assert one["steps_skipped"] >= 5, (method, one)  # the whole sequence skips
        alone, _ = _sp_run(method, slice(0, half))
        assert alone["steps_skipped"] == 0, (method, alone)  # rank 0's shard alone would not
        for rank, (by_method, world) in enumerate(results):
            summary, out = by_method[method]
            assert world == 2
            assert summary == one, f"{method} rank {rank}: {summary} vs one process {one}"
            ref = whole[:, :, rank * half : (rank + 1) * half]
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=f"{method} {rank}")
