"""Merge cache: hit/miss, key separation (strength, alpha, module, file identity, base version),
byte bound and LRU eviction, exact bytes restored through a LoRA layer."""

from __future__ import annotations

import torch
from lora_helpers import build_layer, full_weights, load, random_adapter
from sglang.multimodal_gen.layers.lora import wrap_with_lora
from sglang.multimodal_gen.lora.merge_cache import AdapterKey, MergeCache, MergeKey


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
    # replacing a key does not double count
    cache.put(keys[3], torch.randn(16, 16))
    assert cache.bytes == 3 * one
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
    """Two fp32 layers merged one after the other: the first result is unchanged (safe to cache)."""
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
    assert first.data_ptr() != layers[0].base_layer.weight.data_ptr()
