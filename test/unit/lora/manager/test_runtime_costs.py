"""What the LoRA runtime costs at any model size, counted rather than timed.

- the fp32 merge workspace is bounded by its chunk size and freed after every manager operation;
- a ``set_lora`` of an unchanged file reads nothing, a new or rewritten one is read exactly once,
  and the one-pass content digest equals the digest of the file's bytes;
- a per-request composition (a selection run as the rows' composition) on a merged target merges
  nothing, before or after, and leaves the weight tensors themselves in place (no copy);
- a failed restore resets every layer to its base weights and refuses later calls;
- the adapter memory bound evicts least recently used adapters and refuses one adapter larger
  than the bound with a 4xx naming ``lora_path``; the merge cache stays within its bound;
- one ``set_lora`` call or one request's composition names at most ``MAX_ADAPTERS_PER_CALL``
  adapters (HTTP and Python API alike; nothing is read for a refused call), and a file named for
  several nicknames in one call is read and converted once.

References: fp64 dense forwards of the same adapters (``reference_output``); tolerances as in
``fixtures/lora_model.py`` (1e-3: outputs grow to ~1e2 through the residual blocks).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from fixtures import lora_model
from fixtures.lora_model import (
    ATOL,
    RTOL,
    assert_params_equal,
    build_model,
    make_manager,
    model_input,
    params,
    reference_output,
    run_model,
    write_lora,
)
from sglang.multimodal_gen.errors import EngineDeadError, InvalidRequestError, NotFoundError
from sglang.multimodal_gen.layers.lora import (
    RowMapping,
    compute,
    workspace_stats,
)
from sglang.multimodal_gen.lora import safetensors_io
from sglang.multimodal_gen.lora.transactions import LoRAStateError

files = lora_model.files  # the adapter files (a module-scoped fixture)


def _layers(mgr):
    return mgr.layers("transformer").values()


def _merges(mgr) -> int:
    return sum(layer.merges for layer in _layers(mgr))


# ------------------------------------------------------------------------------ workspace
def test_merge_workspace_bounded_and_freed_after_every_op(files, monkeypatch):
    chunk = 4 * 32 * 5  # five rows of a 32-wide fp32 workspace: every layer needs several chunks
    monkeypatch.setattr(compute, "MERGE_CHUNK_BYTES", chunk)
    model = build_model()
    mgr = make_manager(model, files)
    x = model_input(1)
    workspace_stats(reset_peak=True)
    before = workspace_stats()["allocations"]
    ops = [
        lambda: mgr.set_lora("a", files["a"][0], merge_mode="merge"),
        lambda: mgr.set_lora("b", files["b"][0], strengths=0.5, merge_mode="merge"),
        lambda: mgr.unmerge(),
        lambda: mgr.merge(),
        lambda: mgr.unset_lora(),
        lambda: mgr.set_lora(["a", "b"], [None, None], strengths=[1.0, -0.5]),
        lambda: mgr.unload_adapter("b"),
        lambda: mgr.commit_as_base(),
    ]
    for op in ops:
        op()
        assert workspace_stats()["live"] == 0
        assert mgr.memory_report()["workspace_bytes"] == 0
    sel = mgr.selection([("a", 0.3)])
    with mgr.context("transformer").rows(RowMapping.whole(sel.for_target("transformer"))):
        run_model(model, x)
    assert workspace_stats()["live"] == 0
    stats = workspace_stats()
    assert stats["allocations"] > before  # the merges did use (and free) workspaces
    assert 0 < stats["peak"] <= chunk
    # chunked merges are the merges: the committed model computes the adapter at strength 1
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(files["a"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_merge_frees_cuda_memory():
    from sglang.multimodal_gen.layers.lora.compute import merged_weight

    dev = torch.device("cuda")
    base = torch.randn(4096, 1024, device=dev, dtype=torch.bfloat16)
    term = (0.5, torch.randn(8, 1024, device=dev), torch.randn(4096, 8, device=dev), 0)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated(dev)
    out = merged_weight(base, [term], chunk_bytes=1 << 20)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(dev) - start == out.numel() * out.element_size()


def test_chunked_merge_equals_whole_merge_in_fp32():
    g = torch.Generator().manual_seed(7)
    from sglang.multimodal_gen.layers.lora.compute import merged_weight

    base = torch.randn(37, 16, generator=g).to(torch.bfloat16)
    terms = [  # (strength x scale, A [r, in], B [rows, r], first row)
        (0.7, torch.randn(3, 16, generator=g), torch.randn(20, 3, generator=g), 5),
        (-1.5, torch.randn(2, 16, generator=g), torch.randn(37, 2, generator=g), 0),
    ]
    want = base.double().clone()
    for eff, a, b, start in terms:
        want[start : start + b.shape[0]] += eff * (b.double() @ a.double())
    for chunk in (4 * 16 * 1, 4 * 16 * 6, 1 << 20):
        got = merged_weight(base, terms, chunk_bytes=chunk)
        assert got.dtype == torch.bfloat16
        # rounded once from fp32: within one bf16 ulp of the fp64 sum
        torch.testing.assert_close(got.double(), want, atol=0, rtol=2**-7)


# ------------------------------------------------------------------------------ reads
def test_unchanged_file_is_not_read_again(files, tmp_path):
    path = str(tmp_path / "x.safetensors")
    write_lora(path, 31)
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    reads = safetensors_io.READ_STATS["files"]
    mgr.set_lora("x", path, merge_mode="merge")
    assert safetensors_io.READ_STATS["files"] == reads + 1
    uid = mgr.adapter("x").uid
    for _ in range(3):
        mgr.set_lora("x", path, strengths=0.5, merge_mode="merge")
    assert safetensors_io.READ_STATS["files"] == reads + 1  # stat only
    # touched (mtime changes), same content: read once more, the loaded adapter kept
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    mgr.set_lora("x", path)
    assert safetensors_io.READ_STATS["files"] == reads + 2
    assert mgr.adapter("x").uid == uid
    mgr.set_lora("x", path)
    assert safetensors_io.READ_STATS["files"] == reads + 2
    # rewritten: read and reloaded
    new = write_lora(path, 32)
    mgr.set_lora("x", path, merge_mode="merge")
    assert safetensors_io.READ_STATS["files"] == reads + 3
    assert mgr.adapter("x").uid != uid
    x = model_input(3)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(new, 1.0)]), atol=ATOL, rtol=RTOL
    )


def test_one_pass_digest_is_the_file_digest(files):
    path = files["b"][0]
    _, _, digest = safetensors_io.read_safetensors(path)
    with open(path, "rb") as f:
        assert digest == hashlib.blake2b(f.read(), digest_size=16).hexdigest()


# ------------------------------------------------------------------------------ per request
def _rows(mgr, model, x, comps):
    """``model(x)`` with row ``i`` under the selection of ``comps[i]`` (``None``: global)."""
    sels = [mgr.selection(c).for_target("transformer") for c in comps]
    with mgr.context("transformer").rows(RowMapping.of(sels)):
        return run_model(model, x)


def test_request_on_merged_target_merges_nothing(files):
    model = build_model()
    mgr = make_manager(model, files)
    mgr.load_adapter("b", files["b"][0])
    mgr.set_lora("a", files["a"][0], strengths=0.8, merge_mode="merge")
    before = params(model)
    ptrs = [layer.base_layer.weight.data_ptr() for layer in _layers(mgr)]
    merged = [layer.merged for layer in _layers(mgr)]
    assert any(merged)
    merges = _merges(mgr)
    x = model_input(4)
    a, b = files["a"][1], files["b"][1]
    comps = ([("b", 0.5)], [("a", 0.3), ("b", -1.0)], [], [("a", 0.8)], None)
    for comp in comps:
        got = _rows(mgr, model, x, [comp, comp])
        named = [("a", 0.8)] if comp is None else comp
        want = reference_output(x, [({"a": a, "b": b}[n], s) for n, s in named])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
        assert [layer.merged for layer in _layers(mgr)] == merged
        assert _merges(mgr) == merges  # nothing merged for the request, nor after it
        assert [layer.base_layer.weight.data_ptr() for layer in _layers(mgr)] == ptrs
    # every pair of them in one batch: each row as alone
    for c0 in comps:
        for c1 in comps:
            got = _rows(mgr, model, x, [c0, c1])
            assert torch.equal(got[0], _rows(mgr, model, x[:1], [c0])[0])
            assert torch.equal(got[1], _rows(mgr, model, x[1:], [c1])[0])
    assert _merges(mgr) == merges
    assert_params_equal(model, before)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(a, 0.8)]), atol=ATOL, rtol=RTOL
    )


def test_failed_restore_resets_to_base_and_refuses_later_calls(files, monkeypatch):
    """A TP change rolled back (another rank failed) whose restore fails on a layer: every layer
    is reset to its base weight, the manager refuses later calls (503)."""
    model = build_model()
    base = params(model)
    mgr = make_manager(model, files)
    mgr.load_adapter("b", files["b"][0])
    mgr.set_lora("a", files["a"][0], merge_mode="merge")
    victim = next(iter(_layers(mgr)))
    real = type(victim).merge
    failed = []

    def failing_merge(self, *args, **kwargs):
        if self is victim and not failed:
            failed.append(1)
            raise torch.cuda.OutOfMemoryError("simulated: out of memory while restoring")
        return real(self, *args, **kwargs)

    mgr.begin_change()
    mgr.set_lora("b", None, merge_mode="dynamic")
    monkeypatch.setattr(type(victim), "merge", failing_merge)
    with pytest.raises(LoRAStateError) as e:
        mgr.rollback_change()
    assert failed and isinstance(e.value, EngineDeadError) and e.value.status_code == 503
    # every layer is at a known state: its base weight, nothing active, not merged
    for layer in _layers(mgr):
        assert not layer.merged and not layer.active
    assert_params_equal(model, base)
    x = model_input(5)
    torch.testing.assert_close(run_model(model, x), reference_output(x, []), atol=ATOL, rtol=RTOL)
    for call in (
        lambda: mgr.set_lora("a"),
        mgr.list_loras,
        lambda: mgr.unset_lora(),
        lambda: mgr.selection(None),
    ):
        with pytest.raises(LoRAStateError):
            call()


def test_refused_selection_changes_nothing(files):
    """A request's composition that overflows where it is used, or names an unknown adapter, is
    refused naming ``lora``; a valid one only touches its adapters in the LRU."""
    model = build_model()
    mgr = make_manager(model, files)
    mgr.load_adapter("b", files["b"][0])
    mgr.load_adapter("c", files["c"][0])
    mgr.set_lora("a", files["a"][0], merge_mode="auto")
    before, state = params(model), mgr.list_loras()
    for comp in ([("b", 3e38)], [("b", 1.0), ("zzz", 1.0)], [("b", float("nan"))]):
        with pytest.raises((InvalidRequestError, NotFoundError)) as e:
            mgr.selection(comp)
        assert e.value.param == "lora"
    assert_params_equal(model, before)
    assert mgr.list_loras() == state
    assert mgr.loaded_nicknames == ["b", "c", "a"]
    mgr.selection([("b", 1.0)])
    assert mgr.loaded_nicknames == ["c", "a", "b"]  # touched: the LRU one is now c


# ------------------------------------------------------------------------------ budgets
def test_adapter_budget_lru_and_one_adapter_too_large(files):
    probe = make_manager(build_model(), files)
    probe.load_adapter("a", files["a"][0])
    size_a = probe.loaded_bytes()
    model = build_model()
    mgr = make_manager(model, files, max_loaded_bytes=int(2.5 * size_a))
    mgr.load_adapter("a1", files["a"][0])
    mgr.load_adapter("a2", files["a"][0])
    mgr.set_lora("a1")  # a1 used last: a2 is the LRU one
    mgr.load_adapter("a3", files["a"][0])
    assert mgr.loaded_nicknames == ["a1", "a3"]
    report = mgr.memory_report()
    assert report["loaded_bytes"] <= report["max_loaded_bytes"] and report["adapter_evictions"] == 1
    before, listed = params(model), mgr.list_loras()
    small = make_manager(build_model(), files, max_loaded_bytes=size_a // 2)
    with pytest.raises(InvalidRequestError, match="more than the whole adapter memory bound") as e:
        small.set_lora("a", files["a"][0])
    assert e.value.param == "lora_path" and e.value.status_code == 400
    assert small.loaded_nicknames == []
    with pytest.raises(InvalidRequestError, match="bound") as e:
        mgr.set_lora(["a1", "a3", "a4"], [None, None, files["a"][0]])  # all pinned: no room
    assert e.value.param == "lora_path"
    assert_params_equal(model, before)
    assert mgr.list_loras()["loaded"] == listed["loaded"]


def test_merge_cache_bound_and_snapshot_memory(files):
    model = build_model()
    probe = make_manager(build_model(), files)
    weights = probe.memory_report()["lora_weight_bytes"]
    mgr = make_manager(model, files, merge_cache_bytes=weights // 2)
    mgr.load_adapter("b", files["b"][0])
    mgr.load_adapter("a", files["a"][0])
    for name in ("a", "b", "a", "b"):
        mgr.set_lora(name, merge_mode="merge")
        report = mgr.memory_report()
        assert report["merge_cache_bytes"] <= report["merge_cache_max_bytes"]
        # one snapshot per merged layer, no more than the weights the adapters touch
        assert 0 < report["snapshot_bytes"] <= 1.1 * report["affected_weight_bytes"]
    assert mgr.cache.stats()["evictions"] > 0
    mgr.unset_lora()
    assert mgr.memory_report()["snapshot_bytes"] == 0


# ------------------------------------------------------------------------------ adapters per call
def test_adapters_per_call_are_bounded(files):
    """A set_lora naming 10000 nicknames (a 100 KB body) or a request composing 2000 adapters used
    to hold the engine for minutes; both are a 400 naming the field before anything is read."""
    from sglang.multimodal_gen.configs.sampling_params import RequestLimits, RequestSpec
    from sglang.multimodal_gen.configs.zimage import ZImageSamplingParams
    from sglang.multimodal_gen.entrypoints.http_body import parse_json_body
    from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception
    from sglang.multimodal_gen.entrypoints.protocol import (
        ImageGenerationRequest,
        SetLoRARequest,
        image_job,
        validate_set_lora,
    )
    from sglang.multimodal_gen.lora.requests import MAX_ADAPTERS_PER_CALL as N

    assert N == 64
    targets = ("all", "transformer")
    spec = RequestSpec(
        "zimage",
        "Z-Image",
        ZImageSamplingParams,
        ZImageSamplingParams(height=1024, width=1024, num_inference_steps=8, guidance_scale=0.0),
        RequestLimits(max_image_size=1024, max_num_outputs_per_prompt=8, max_inference_steps=1000),
        spatial_factor=16,
    )

    def set_lora_body(n):
        body = {"lora_nickname": [f"x{i}" for i in range(n)], "lora_path": "a.safetensors"}
        return parse_json_body(json.dumps(body).encode(), SetLoRARequest)

    def generation_body(n):
        body = {"prompt": "p", "size": "64x64", "lora": [{"name": f"x{i}"} for i in range(n)]}
        return parse_json_body(json.dumps(body).encode(), ImageGenerationRequest)

    # the HTTP routes' validation
    assert len(validate_set_lora(set_lora_body(N), targets).nicknames) == N
    assert len(image_job(generation_body(N), spec).params.lora) == N
    for call, param, n in (
        (lambda n: validate_set_lora(set_lora_body(n), targets), "lora_nickname", 10_000),
        (lambda n: validate_set_lora(set_lora_body(n), targets), "lora_nickname", N + 1),
        (lambda n: image_job(generation_body(n), spec), "lora", 2000),
        (lambda n: image_job(generation_body(n), spec), "lora", N + 1),
    ):
        with pytest.raises(InvalidRequestError) as e:
            call(n)
        status, body, _ = describe_exception(e.value)
        assert (status, body["error"]["param"]) == (400, param)
        assert f"names {n} adapters" in e.value.message and f"at most {N}" in e.value.message


def test_adapters_per_call_are_bounded_in_the_manager(files):
    """The Python API refuses what the HTTP routes refuse, before reading anything."""
    from sglang.multimodal_gen.lora.requests import MAX_ADAPTERS_PER_CALL as N

    model = build_model()
    mgr = make_manager(model, files)
    before, reads = params(model), safetensors_io.READ_STATS["files"]
    with pytest.raises(InvalidRequestError) as e:
        mgr.set_lora([f"x{i}" for i in range(N + 1)], files["a"][0])
    assert e.value.param == "lora_nickname"
    assert safetensors_io.READ_STATS["files"] == reads and mgr.loaded_nicknames == []
    mgr.set_lora("a", files["a"][0])
    many = [("a", 1.0)] + [(f"x{i}", 1.0) for i in range(N)]
    with pytest.raises(InvalidRequestError) as e:
        mgr.selection(many)
    assert e.value.param == "lora" and f"names {N + 1} adapters" in e.value.message
    mgr.unset_lora()
    assert_params_equal(model, before)


def test_one_file_for_many_nicknames_is_read_and_converted_once(files, monkeypatch):
    from sglang.multimodal_gen.lora import staging

    converted = []
    real = staging.convert_to_canonical

    def counting(*args, **kwargs):
        converted.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(staging, "convert_to_canonical", counting)
    model = build_model()
    mgr = make_manager(model, files)
    reads = safetensors_io.READ_STATS["files"]
    names = [f"n{i}" for i in range(5)]
    mgr.set_lora(names, files["a"][0], strengths=0.2, merge_mode="dynamic")
    assert safetensors_io.READ_STATS["files"] == reads + 1 and len(converted) == 1
    assert sorted(mgr.loaded_nicknames) == names
    assert len({mgr.adapter(n).uid for n in names}) == 5  # each its own adapter
    x = model_input(4)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(files["a"][1], 1.0)]), atol=ATOL, rtol=RTOL
    )
