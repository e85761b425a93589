"""The URL image store (``entrypoints/images.py``): bounded in count, bytes and age."""

from __future__ import annotations


def test_url_image_store_is_bounded_in_bytes_too():
    from sglang.multimodal_gen.entrypoints.images import ImageStore

    store = ImageStore(capacity=10, max_bytes=100)
    names = [store.put(bytes([i]) * 40, "png") for i in range(3)]
    assert store.get(names[0]) is None  # 120 bytes > 100: the oldest went
    assert store.get(names[1])[0] == bytes([1]) * 40 and store.get(names[2]) is not None
    big = store.put(b"x" * 500, "png")  # over the bound alone: kept, the others dropped
    assert store.get(big)[0] == b"x" * 500
    assert all(store.get(n) is None for n in names)
    small = store.put(b"y" * 10, "jpeg")  # the big one goes now
    assert store.get(big) is None and store.get(small) == (b"y" * 10, "image/jpeg")
    expiring = ImageStore(capacity=10, max_bytes=100, ttl_s=0.0)
    old = expiring.put(b"z" * 60, "png")
    assert expiring.get(old) is None  # expired: its bytes are no longer counted
    fresh = expiring.put(b"w" * 60, "png")
    expiring.ttl_s = 3600.0
    assert expiring.get(fresh) == (b"w" * 60, "image/png")  # 60 + 60 would have evicted it
    assert expiring.put(b"v" * 40, "png") and expiring.get(fresh) is not None
    counted = ImageStore(capacity=2)
    first = counted.put(b"a", "png")
    counted.put(b"b", "png")
    counted.put(b"c", "png")
    assert counted.get(first) is None  # the count bound as before
