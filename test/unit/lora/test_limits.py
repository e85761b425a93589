"""The bounds of ``lora/limits.py``, on files built here (docs/lora.md, "Bounds").

Each hostile file is refused through the ``LoRAManager`` (what ``/v1/set_lora`` runs) as an HTTP 400
naming ``lora_path``, the file and the entry at fault, with nothing changed (weights, loaded
adapters): an alpha outside ``0 < alpha <= 1024 r`` (1e38, an int64 2**62, negative, zero; in the
file or in its config), a header or metadata beyond its size, more tensors than the model can use
(refused from the raw header: fast, and leaving no memory behind), key names no conversion could
use (refused before any tensor is read). A rank above the layer's width is stored exactly at rank
``min(in, out)``, checked against ``scale * B @ A`` computed here.
"""

from __future__ import annotations

import gc
import json
import time

import pytest
import torch
from fixtures.lora_model import DIM, FFN, assert_params_equal, build_model, make_manager, params
from safetensors.torch import save_file
from sglang.multimodal_gen.entrypoints.openai_errors import describe_exception
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora import load_lora_state_dict
from sglang.multimodal_gen.lora import safetensors_io as sio
from sglang.multimodal_gen.lora.limits import (
    MAX_ALPHA_PER_RANK,
    MAX_HEADER_BYTES,
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_TENSORS,
    OTHER_KEYS_ALLOWANCE,
    TENSORS_PER_SHARD,
    tensor_cap,
)

R = 4
OUT = "transformer.layers.0.attention.to_out.0"  # a 32 x 32 layer of the tiny model


def _pair(seed=0, rank=R, rows=DIM, cols=DIM):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, cols, generator=g) * 0.1, torch.randn(rows, rank, generator=g) * 0.1


def _file(tmp_path, extra=None, metadata=None, name="l.safetensors", rank=R):
    a, b = _pair(rank=rank)
    sd = {f"{OUT}.lora_A.weight": a, f"{OUT}.lora_B.weight": b, **(extra or {})}
    path = tmp_path / name
    save_file(sd, str(path), metadata=metadata)
    return path


def _refused(tmp_path, path):
    """``set_lora`` of ``path`` on a fresh manager: the error, after checking it is an HTTP 400
    naming ``lora_path`` and that nothing changed."""
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    before = params(model)
    with pytest.raises(LoRAFormatError) as e:
        mgr.set_lora("x", str(path))
    status, body, _ = describe_exception(e.value)
    assert (status, body["error"]["param"]) == (400, "lora_path"), (status, body)
    assert mgr.list_loras()["loaded"] == []
    assert_params_equal(model, before)
    return e.value.message


def _merged_delta(tmp_path, path, module="layers.0.attention.to_out.0"):
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    w0 = params(model)[f"{module}.weight"].double()
    mgr.set_lora("x", str(path), merge_mode="merge")
    return params(model)[f"{module}.weight"].double() - w0


# ------------------------------------------------------------------------------------ alpha


@pytest.mark.parametrize(
    "alpha,shown,why",
    [
        (torch.tensor(1e38), "1e+38", "trainers write 1 to 2 x rank"),
        (torch.tensor(2**62, dtype=torch.int64), "4.61169e+18", "trainers write 1 to 2 x rank"),
        (torch.tensor(-4.0), "-4", "give a negative strength"),
        (torch.tensor(0.0), "0", "no-op"),
        (torch.tensor(float(MAX_ALPHA_PER_RANK * R + 1)), "4097", "trainers write"),
    ],
    ids=["1e38", "int64_2^62", "negative", "zero", "just_above"],
)
def test_alpha_out_of_range_is_refused_naming_the_key(tmp_path, alpha, shown, why):
    msg = _refused(tmp_path, _file(tmp_path, {f"{OUT}.alpha": alpha}))
    assert f"key '{OUT}.alpha'" in msg and f"alpha {shown} is out of range" in msg, msg
    assert "0 < alpha <= 1024 x rank (rank 4: at most 4096)" in msg and why in msg, msg


@pytest.mark.parametrize(
    "alpha", [torch.tensor(MAX_ALPHA_PER_RANK * R), torch.tensor(8.0), torch.tensor(1.0)]
)
def test_alpha_within_the_bound_loads_with_scale_alpha_over_r(tmp_path, alpha):
    """The bound itself (an int64 4096 at rank 4), 2r and 1 load, with scale ``alpha / r``."""
    path = _file(tmp_path, {f"{OUT}.alpha": alpha})
    a, b = _pair()
    want = (float(alpha) / R) * (b.double() @ a.double())
    torch.testing.assert_close(_merged_delta(tmp_path, path), want, atol=1e-3, rtol=1e-4)


def test_config_alpha_out_of_range_names_the_field(tmp_path):
    """An alpha from the adapter config is held to the same bound per module: the message names
    the source and the field (``lora_alpha``, or the ``alpha_pattern`` key that matched)."""
    path = _file(tmp_path, metadata={"r": "4", "lora_alpha": "1e30"}, name="c.safetensors")
    msg = _refused(tmp_path, path)
    assert "module 'layers.0.attention.to_out.0' (safetensors metadata: lora_alpha)" in msg, msg
    pattern = json.dumps({"to_out.0": -2.0})
    path = _file(tmp_path, metadata={"alpha_pattern": pattern}, name="p.safetensors")
    msg = _refused(tmp_path, path)
    assert "(safetensors metadata: alpha_pattern['to_out.0'])" in msg and "alpha -2" in msg, msg


def test_lokr_alpha_out_of_range_is_refused(tmp_path):
    """A decomposed LoKr module scales by alpha / rank: held to the same bound."""
    g = torch.Generator().manual_seed(3)
    m = "diffusion_model.layers.0.attention.to_out.0"
    sd = {
        f"{m}.lokr_w1": torch.randn(4, 4, generator=g),
        f"{m}.lokr_w2_a": torch.randn(8, 2, generator=g),
        f"{m}.lokr_w2_b": torch.randn(2, 8, generator=g),
        f"{m}.alpha": torch.tensor(1e30),
    }
    save_file(sd, str(tmp_path / "k.safetensors"))
    msg = _refused(tmp_path, tmp_path / "k.safetensors")
    assert f"key '{m}.alpha'" in msg and "LoKr alpha / rank = 5e+29 is out of range" in msg, msg


# ------------------------------------------------------------------------------------ rank


@pytest.mark.parametrize(
    "name,module,rows,cols",
    [
        ("transformer.layers.0.attention.to_out.0", "layers.0.attention.to_out.0", DIM, DIM),
        ("transformer.layers.1.feed_forward.w2", "layers.1.feed_forward.w2", DIM, FFN),
        ("transformer.layers.0.feed_forward.w1", "layers.0.feed_forward.w13", FFN, DIM),
    ],
    ids=["square", "out<in", "shard_of_fused"],
)
def test_rank_above_the_layer_width_is_stored_at_rank_min_in_out_exactly(
    tmp_path, name, module, rows, cols
):
    """Rank 300 on layers of width 32 / 48: loaded, the stored rank is ``min(in, out)`` of the
    shard, and the delta is ``(alpha / r) B @ A`` of the file (the w1 shard: rows [0, FFN) of our
    fused ``w13``)."""
    rank, alpha = 300, 600.0
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(rank, cols, generator=g) * 0.05, torch.randn(rows, rank, generator=g) * 0.05
    sd = {
        f"{name}.lora_A.weight": a,
        f"{name}.lora_B.weight": b,
        f"{name}.alpha": torch.tensor(alpha),
    }
    save_file(sd, str(tmp_path / "r.safetensors"))
    want = torch.zeros(2 * FFN if module.endswith("w13") else rows, cols, dtype=torch.float64)
    want[:rows] = (alpha / rank) * (b.double() @ a.double())
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    w0 = params(model)[f"{module}.weight"].double()
    mgr.set_lora("x", str(tmp_path / "r.safetensors"), merge_mode="merge")
    got = params(model)[f"{module}.weight"].double() - w0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    canon = mgr.stager.convert(*mgr.stager.read_source(str(tmp_path / "r.safetensors")))
    (shards,) = canon["transformer"].modules.values()
    (w,) = shards.values()
    assert w.lora_A.shape[0] == min(rows, cols) and w.lora_B.shape[1] == min(rows, cols)


# ------------------------------------------------------------------------------------ header


def test_a_header_beyond_the_bound_is_refused_without_reading_it(tmp_path):
    """A 60 MB header (its length is the file's first 8 bytes): refused before it is read."""
    n = 60_000_000
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little") + b'{"__metadata__": {"x": "')
        f.truncate(8 + n)  # sparse: the header's length is all that is looked at
    before = dict(sio.READ_STATS)
    t0 = time.monotonic()
    msg = _refused(tmp_path, path)
    assert time.monotonic() - t0 < 2.0
    assert f"its header is {n} bytes; a LoRA file's header is at most {MAX_HEADER_BYTES}" in msg
    assert sio.READ_STATS == before


def test_metadata_beyond_its_bounds_is_refused_naming_the_entry(tmp_path):
    many = {f"k{i}": "v" for i in range(200_000)}
    msg = _refused(tmp_path, _file(tmp_path, metadata=many, name="many.safetensors"))
    assert "its __metadata__ has 200000 entries (e.g. 'k" in msg, msg
    assert f"at most {MAX_METADATA_ENTRIES} are read" in msg, msg
    big = {"ss_tag_frequency": "{}", "modelspec.thumbnail": "x" * (MAX_METADATA_BYTES + 1)}
    msg = _refused(tmp_path, _file(tmp_path, metadata=big, name="big.safetensors"))
    assert f"(entry 'modelspec.thumbnail': {MAX_METADATA_BYTES + 1})" in msg, msg
    # what trainers write is far inside: a kohya-sized header loads
    kohya = {f"ss_{i}": "x" * 200 for i in range(120)} | {"ss_tag_frequency": "t" * 500_000}
    _merged_delta(tmp_path, _file(tmp_path, metadata=kohya, name="ok.safetensors"))


# ------------------------------------------------------------------------------------ tensors


def _junk_file(path, count: int, name="junk.{i}") -> None:
    """``count`` one-float tensors named ``name``, written as raw bytes (no tensor in memory)."""
    entries = ",".join(
        f'"{name.format(i=i)}":{{"dtype":"F32","shape":[1],"data_offsets":[{4 * i},{4 * i + 4}]}}'
        for i in range(count)
    )
    raw = ("{" + entries + "}").encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + bytes(4 * count))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_hundred_thousand_junk_tensors_are_refused_fast_and_keep_no_memory(tmp_path):
    """Counted in the raw header: refused in well under 2 s (it took 10.8 s when every tensor
    was read first), leaving RSS within 16 MB of where it was (it grew by 67 MB)."""
    path = tmp_path / "junk.safetensors"
    _junk_file(path, 100_000)
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    cap = mgr.stager.max_tensors
    before = params(model)
    gc.collect()
    rss0, t0 = _rss_bytes(), time.monotonic()
    with pytest.raises(LoRAFormatError) as e:
        mgr.set_lora("x", str(path))
    elapsed = time.monotonic() - t0
    gc.collect()
    grown = _rss_bytes() - rss0
    assert elapsed < 2.0, elapsed
    assert grown < 16 << 20, grown
    assert f"it holds 100000 tensors; at most {cap} are read for this model" in e.value.message
    assert e.value.param == "lora_path" and mgr.list_loras()["loaded"] == []
    assert_params_equal(model, before)


def test_the_tensor_cap_is_what_the_model_can_use():
    """10 tensors per output shard of every LoRA-able layer, plus 4096 (text encoders...); the
    Python API without a model reads at most MAX_TENSORS."""
    mgr = make_manager(build_model(), {"root": "/"})
    shards = sum(len(s) for s in mgr.stager.specs["transformer"].module_shapes.values())
    assert shards == 2 * (3 + 1 + 2 + 1 + 1)  # per block: q|k|v, to_out, w1|w3, w2, adaLN
    assert mgr.stager.max_tensors == TENSORS_PER_SHARD * shards + OTHER_KEYS_ALLOWANCE
    assert tensor_cap([3, 1]) == 40 + OTHER_KEYS_ALLOWANCE and MAX_TENSORS == 65536


def test_the_tensor_cap_is_exact(tmp_path):
    path = tmp_path / "n.safetensors"
    _junk_file(path, 50)
    assert len(load_lora_state_dict(path, max_tensors=50)[0]) == 50
    with pytest.raises(LoRAFormatError, match="it holds 50 tensors; at most 49 are read"):
        load_lora_state_dict(path, max_tensors=49)


def test_unusable_key_names_are_refused_before_any_tensor_is_read(tmp_path):
    """Under the cap but named like nothing a LoRA holds (or a feature we refuse): refused from the
    header's names, the tensors never read."""
    path = tmp_path / "names.safetensors"
    _junk_file(path, 3000, name="model.layers.{i}.weight")
    before = dict(sio.READ_STATS)
    t0 = time.monotonic()
    msg = _refused(tmp_path, path)
    assert time.monotonic() - t0 < 2.0
    assert "unrecognized LoRA key 'model.layers.0.weight'" in msg, msg
    assert sio.READ_STATS == before
    a, b = _pair()
    sd = {
        f"{OUT}.lora_A.weight": a,
        f"{OUT}.lora_B.weight": b,
        f"{OUT}.dora_scale": b[:, 0].clone(),
    }
    save_file(sd, str(tmp_path / "dora.safetensors"))
    msg = _refused(tmp_path, tmp_path / "dora.safetensors")
    assert "DoRA (dora_scale)" in msg and sio.READ_STATS == before, msg
