"""Merge cache: hit/miss, key separation (strength, alpha, module, file identity, base version),
byte bound and LRU eviction, exact bytes restored through a LoRA layer; and through
:class:`LoRAManager`, the same adapter at two strengths and on two targets, against merged weights
computed by hand (``W + strength * (alpha / r) * B @ A`` at rows from a hand-written table)."""

from __future__ import annotations

import torch
from fixtures.lora_layers import build_layer, full_weights, load, random_adapter
from safetensors.torch import save_file
from sglang.multimodal_gen.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.lora import wrap_with_lora
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.lora.merge_cache import AdapterKey, MergeCache, MergeKey
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP
from torch import nn


def _key(module="m", strength=1.0, scale=0.5, identity="f:1:2", version=0):
    return MergeKey(module, version, (AdapterKey(identity, strength, ((None, scale),)),))


def test_hit_miss_and_key_separation():
    cache = MergeCache(1 << 20)
    t = torch.randn(8, 8)
    assert cache.get(_key()) is None and cache.misses == 1
    assert cache.put(_key(), t)
    hit = cache.get(_key())
    assert torch.equal(hit, t) and hit.data_ptr() == t.data_ptr() and cache.hits == 1  # no copy
    # every field of the key separates entries
    for other in (
        _key(strength=0.5),
        _key(scale=0.25),  # alpha / rank / rsLoRA change the scale
        _key(module="n"),
        _key(identity="f:1:3"),  # file edited (mtime)
        _key(version=1),  # base weights committed since
    ):
        assert cache.get(other) is None
    two = MergeKey("m", 0, (*_key().adapters, AdapterKey("g:1:1", 1.0, ((None, 1.0),))))
    assert cache.get(two) is None
    assert cache.stats()["entries"] == 1 and cache.stats()["bytes"] == t.numel() * 4


def test_byte_bound_and_lru_eviction():
    one = 16 * 16 * 4
    cache = MergeCache(3 * one)
    keys = [_key(module=f"m{i}") for i in range(4)]
    for k in keys[:3]:
        assert cache.put(k, torch.randn(16, 16))
    cache.get(keys[0])  # m0 becomes most recently used; m1 is now the oldest
    cache.put(keys[3], torch.randn(16, 16))
    assert keys[1] not in cache and keys[0] in cache and keys[3] in cache
    assert cache.bytes == 3 * one <= cache.max_bytes and cache.evictions == 1
    assert not cache.put(_key(module="big"), torch.randn(64, 64))  # larger than the bound
    assert cache.bytes == 3 * one
    # replacing a key does not double count, so it evicts nothing
    cache.put(keys[3], torch.randn(16, 16))
    assert cache.bytes == 3 * one
    assert len(cache) == 3 and cache.evictions == 1 and keys[0] in cache
    assert cache.invalidate(lambda k: k.module in ("m0", "m3")) == 2
    assert cache.bytes == one
    disabled = MergeCache(0)
    assert not disabled.put(keys[0], torch.randn(1)) and len(disabled) == 0


def test_cached_merge_restores_exact_bytes():
    w, b = full_weights("qkv", 1, torch.bfloat16)
    layer = wrap_with_lora(load(build_layer("qkv", dtype=torch.bfloat16), w, b))
    layer.add_adapter("a", random_adapter("qkv", 2, ranks=(4, 2, 3)))
    layer.add_adapter("b", random_adapter("qkv", 3, ranks=(5,)))
    cache = MergeCache(1 << 20)
    original = layer.base_layer.weight.clone()
    layer.set_active([("a", 0.8)])
    merged_a = layer.merge()
    cache.put(_key(module="qkv"), merged_a)
    merged_a_bits = layer.base_layer.weight.clone()
    layer.set_active([("b", 1.0)])  # re-merged from the snapshot
    assert not torch.equal(layer.base_layer.weight, merged_a_bits)
    layer.set_active([("a", 0.8)], cached=cache.get(_key(module="qkv")))
    assert torch.equal(layer.base_layer.weight, merged_a_bits)
    layer.unmerge()
    assert torch.equal(layer.base_layer.weight, original)
    layer.merge(cached=cache.get(_key(module="qkv")))
    assert torch.equal(layer.base_layer.weight, merged_a_bits)
    # the cached tensor was not written through
    assert torch.equal(cache.get(_key(module="qkv")), merged_a_bits)


def test_merge_results_do_not_alias_a_shared_buffer():
    """Two fp32 layers merged one after the other: the first result is unchanged (safe to cache).

    The parameter is pointed at the merged tensor (swapped in, not copied), and neither a later
    merge of another layer nor the unmerge writes into it."""
    layers = []
    for seed in (5, 6):
        w, b = full_weights("column", seed)
        layer = wrap_with_lora(load(build_layer("column"), w, b))
        layer.add_adapter("a", random_adapter("column", seed + 10))
        layer.set_active([("a", 1.0)])
        layers.append(layer)
    first = layers[0].merge()
    first_bits = first.clone()
    layers[1].merge()
    assert torch.equal(first, first_bits)
    assert torch.equal(first, layers[0].base_layer.weight)
    assert first.data_ptr() == layers[0].base_layer.weight.data_ptr()
    layers[0].unmerge()
    assert torch.equal(first, first_bits)
    assert first.data_ptr() != layers[0].base_layer.weight.data_ptr()


# ----------------------------------------------------------------------------- through the manager
D, F_ = 16, 24
# our module -> (full shape, {diffusers module in the file: (first row, rows)}), by hand
_MODULES = {
    "layers.0.attention.to_qkv": (
        (3 * D, D),
        {"layers.0.attention.to_q": (0, D), "layers.0.attention.to_k": (D, D)},
    ),
    "layers.0.attention.to_out.0": ((D, D), {"layers.0.attention.to_out.0": (0, D)}),
    "layers.0.feed_forward.w13": (
        (2 * F_, D),
        {"layers.0.feed_forward.w1": (0, F_), "layers.0.feed_forward.w3": (F_, F_)},
    ),
}


def _target(seed):
    """One target: a block of our layers under Z-Image names, with seeded full weights."""
    model = nn.Module()
    block = nn.Module()
    model.layers = nn.ModuleList([block])
    block.attention = nn.Module()
    block.attention.to_qkv = QKVParallelLinear(D, 4, 4, bias=False, tp_rank=0, tp_size=1)
    block.attention.to_out = nn.ModuleList([RowParallelLinear(D, D, bias=False, tp_size=1)])
    block.feed_forward = nn.Module()
    block.feed_forward.w13 = MergedColumnParallelLinear(D, [F_, F_], bias=False, tp_size=1)
    g = torch.Generator().manual_seed(seed)
    full = {}
    for name, (shape, _) in _MODULES.items():
        full[name] = torch.randn(*shape, generator=g)
        layer = model.get_submodule(name)
        layer.weight_loader(layer.weight, full[name])
    return model, full


def _kohya_file(path, rank=4, alpha=2.0, seed=7):
    """A kohya file (alpha 2, rank 4: scale 0.5); returns ``{our module: delta at strength 1}``."""
    g = torch.Generator().manual_seed(seed)
    sd, deltas = {}, {}
    for our, (shape, members) in _MODULES.items():
        deltas[our] = torch.zeros(shape, dtype=torch.float64)
        for name, (start, rows) in members.items():
            a, b = torch.randn(rank, D, generator=g), torch.randn(rows, rank, generator=g)
            flat = "lora_unet_" + name.replace(".", "_")
            sd[f"{flat}.lora_down.weight"] = a
            sd[f"{flat}.lora_up.weight"] = b
            sd[f"{flat}.alpha"] = torch.tensor(alpha)
            deltas[our][start : start + rows] += (alpha / rank) * (b.double() @ a.double())
    save_file(sd, str(path))
    return deltas


def test_manager_cache_keys_strength_and_target(tmp_path):
    """Same adapter, strengths 1 and 0.5, on one target then both: every merged weight equals the
    hand reference, also when it comes from the cache (a key without the strength or the target
    would hand back another composition's merge)."""
    deltas = _kohya_file(tmp_path / "a.safetensors")
    (m1, w1), (m2, w2) = _target(1), _target(2)
    mgr = LoRAManager(
        {"transformer": m1, "transformer_2": m2},
        ZIMAGE_NAME_MAP,
        allowed_roots=[str(tmp_path)],
        default_merge_mode="merge",
    )
    bases = {"transformer": w1, "transformer_2": w2}
    strengths = {"transformer": 0.0, "transformer_2": 0.0}
    steps = [  # (target, strength, cache hits expected in this step)
        ("transformer", 1.0, 0),
        ("transformer", 0.5, 0),
        ("all", 1.0, 3),  # transformer: its strength-1 merges; transformer_2: none of its own
        ("transformer_2", 0.5, 0),
        ("all", 0.5, 3),  # transformer: its strength-0.5 merges; transformer_2 is unchanged
    ]
    for i, (target, strength, hits) in enumerate(steps):
        before = mgr.cache.hits
        mgr.set_lora("a", None if i else str(tmp_path / "a.safetensors"), target, strength)
        assert mgr.cache.hits - before == hits, (i, mgr.cache.stats())
        for t in strengths if target == "all" else [target]:
            strengths[t] = strength
        for t, full in bases.items():
            layers = mgr.layers(t)
            for module, w in full.items():
                assert layers[module].merged == (strengths[t] != 0.0)
                want = w.double() + strengths[t] * deltas[module]
                torch.testing.assert_close(
                    layers[module].weight.double(), want, atol=1e-5, rtol=1e-5,
                    msg=lambda m, t=t, mod=module, i=i: f"step {i}, {t}:{mod}: {m}",
                )  # fmt: skip
