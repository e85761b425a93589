"""One test per LoRA-format case (Z1..Z6 for Z-Image, G1..G7 general), format/loading side.

Each builds the case's key pattern as a tiny safetensors file over the tiny diffusers Z-Image
model's module list (random non-zero tensors), loads and converts it, and compares against deltas
computed by hand from the same tensors (``(alpha / r) B @ A``, looked up through the hand-written
module/shard table ``OUR_SLOTS``) and, where diffusers converts the format, against diffusers.
The HTTP 400 mapping of G5 and the "weights unchanged" parts that need a model with LoRA layers
belong to the server / manager tests; here "nothing changed" means the caller's state dict and
the model weights are untouched.

Last, a diffusers-format file with alpha merged onto our fused q/k/v and w1/w3 layers (TP 1 and 2)
lands at the rows of a hand-written table (``ROWS``, ``RANK_ROWS``), not at the name map's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from fixtures.lora_formats import (
    SAMPLE,
    assert_deltas_equal,
    canonical_deltas,
    diffusers_converted_deltas,
    diffusers_sd,
    kohya_name,
    linear_shapes,
    random_pairs,
    reference_deltas,
    save,
    tiny_zimage,
    zimage_spec,
)
from safetensors.torch import save_file
from sglang.multimodal_gen.errors import InvalidRequestError, LoRAFormatError
from sglang.multimodal_gen.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from sglang.multimodal_gen.layers.lora import wrap_with_lora
from sglang.multimodal_gen.lora import (
    LoRAModelSpec,
    convert_to_canonical,
    load_lora_state_dict,
    resolve_lora_path,
)
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP
from torch import nn


@pytest.fixture(scope="module")
def spec():
    return zimage_spec()


def _load_convert(path, spec, allowed_roots=None):
    sd, md = load_lora_state_dict(path, allowed_roots)
    return convert_to_canonical(sd, md, spec)


def _weights_snapshot():
    return {k: v.clone() for k, v in tiny_zimage().state_dict().items()}


def _assert_weights_unchanged(before):
    after = tiny_zimage().state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_Z1_diffusers_prefix_stripped_and_every_module_loaded(tmp_path, spec):
    names = list(linear_shapes())
    pairs = random_pairs(names, seed=100)
    path = save(tmp_path, "z1.safetensors", diffusers_sd(pairs))
    canon = _load_convert(path, spec)
    assert canon.matched_modules == len(names)
    assert set(canon.modules) == spec.module_names
    ref = reference_deltas(pairs)
    assert_deltas_equal(canonical_deltas(canon, names), ref)
    assert_deltas_equal(diffusers_converted_deltas(path), ref)
    # output differs from base: a layer's output with the delta applied is not the base output
    lin = dict(tiny_zimage().named_modules())["layers.0.attention.to_out.0"]
    x = torch.randn(3, 64)
    w = canon.modules["layers.0.attention.to_out.0"][None]
    y_lora = F.linear(x, lin.weight + w.delta_weight(), lin.bias)
    assert (y_lora - lin(x)).abs().max() > 1e-4


def test_Z2_kohya_flattened_unflattened_by_module_list(tmp_path, spec):
    names = [
        "layers.0.attention.to_q",
        "layers.1.attention.to_out.0",
        "layers.0.feed_forward.w1",
        "layers.1.adaLN_modulation.0",
        "all_x_embedder.2-1",
        "noise_refiner.0.adaLN_modulation.0",
        "context_refiner.0.attention.to_k",
        "t_embedder.mlp.2",
    ]
    pairs = random_pairs(names, seed=101)
    sd, alphas = {}, {}
    for i, (n, (a, b)) in enumerate(pairs.items()):
        sd[kohya_name(n) + ".lora_down.weight"] = a
        sd[kohya_name(n) + ".lora_up.weight"] = b
        alphas[n] = float(i + 1)
        sd[kohya_name(n) + ".alpha"] = torch.tensor(alphas[n])
    path = save(tmp_path, "z2.safetensors", sd)
    canon = _load_convert(path, spec)
    assert canon.matched_modules == len(names) and canon.source_format == "kohya"
    ref = reference_deltas(pairs, alphas)  # scale alpha / r
    assert_deltas_equal(canonical_deltas(canon, names), ref)
    assert_deltas_equal(diffusers_converted_deltas(path), ref)
    # the scale is alpha / r, not folded into the tensors
    w = canon.modules["layers.0.attention.to_qkv"]["q"]
    assert w.scale == pytest.approx(alphas["layers.0.attention.to_q"] / 4)
    torch.testing.assert_close(w.lora_A, pairs["layers.0.attention.to_q"][0])


def _qkv_rows(rank: int, tp_size: int) -> torch.Tensor:
    """Rows of the full ``[q | k | v]`` (4 heads of 16 each, no GQA: 64 rows per section) that
    rank ``rank`` holds: its ``64 / tp_size`` rows of each section (by hand, not the shard map)."""
    n = 64 // tp_size
    return torch.cat(
        [torch.arange(sec * 64 + rank * n, sec * 64 + (rank + 1) * n) for sec in range(3)]
    )


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_Z3_split_qkv_lands_in_fused_sections(tmp_path, spec, tp_size):
    names = [f"layers.{i}.attention.to_{s}" for i in (0, 1) for s in "qkv"]
    pairs = random_pairs(names, seed=102)
    path = save(tmp_path, "z3.safetensors", diffusers_sd(pairs, prefix="diffusion_model."))
    canon = _load_convert(path, spec)
    ref = reference_deltas(pairs)  # by hand: (alpha / r) B @ A, alpha = r
    assert_deltas_equal(canonical_deltas(canon, names), ref)
    assert_deltas_equal(diffusers_converted_deltas(path), ref)
    # each rank's rows of the fused qkv delta equal that rank's rows of the reference q|k|v stack
    full_ref = torch.cat([ref[f"layers.0.attention.to_{s}"] for s in "qkv"])
    qkv = canon.modules["layers.0.attention.to_qkv"]
    for rank in range(tp_size):
        layer = QKVParallelLinear(64, 16, 4, 4, bias=False, tp_rank=rank, tp_size=tp_size)
        ours = torch.cat(
            [
                layer.shard_output_tensor(qkv[s.shard_id].delta_weight(), s.shard_id)
                for s in layer.shard_map
            ]
        )
        expected = full_ref.float()[_qkv_rows(rank, tp_size)]
        torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_Z3_through_our_fused_qkv_lora_layer(tmp_path, spec, tp_size):
    """End to end on our QKV layer: every rank's output equals the dense reference's rows."""
    names = [f"layers.0.attention.to_{s}" for s in "qkv"]
    pairs = random_pairs(names, seed=111)
    canon = _load_convert(
        save(tmp_path, "z3.safetensors", diffusers_sd(pairs, prefix="diffusion_model.")), spec
    )
    ref = reference_deltas(pairs)
    g = torch.Generator().manual_seed(112)
    w_full = torch.randn(192, 64, generator=g, dtype=torch.float64) * 0.1
    x = torch.randn(5, 64, generator=g, dtype=torch.float64)
    delta = torch.cat([ref[n] for n in names])
    y_ref = F.linear(x, w_full + 0.7 * delta)  # [5, 192] in q|k|v order
    for rank in range(tp_size):
        layer = QKVParallelLinear(
            64, 16, 4, 4, bias=False, params_dtype=torch.float64, tp_rank=rank, tp_size=tp_size
        )
        layer.weight_loader(layer.weight, w_full)
        lora = wrap_with_lora(layer)
        lora.add_adapter("style", canon.modules["layers.0.attention.to_qkv"])
        lora.set_active([("style", 0.7)])
        y_local, _ = lora(x)
        expected = y_ref[:, _qkv_rows(rank, tp_size)]
        torch.testing.assert_close(y_local, expected)


def test_Z4_fused_qkv_original_layout_split_exactly(tmp_path, spec):
    g = torch.Generator().manual_seed(103)
    a, b = torch.randn(4, 64, generator=g), torch.randn(3 * 64, 4, generator=g)
    sd = {
        "lora_unet_layers_0_attention_qkv.lora_down.weight": a,
        "lora_unet_layers_0_attention_qkv.lora_up.weight": b,
        "lora_unet_layers_0_attention_qkv.alpha": torch.tensor(2.0),
    }
    canon = _load_convert(save(tmp_path, "z4.safetensors", sd), spec)
    assert canon.matched_modules == 1
    # reference: A shared, B cut in three, same alpha
    pairs = {
        f"layers.0.attention.to_{s}": (a, b[64 * i : 64 * (i + 1)]) for i, s in enumerate("qkv")
    }
    ref = reference_deltas(pairs, {n: 2.0 for n in pairs})
    assert_deltas_equal(canonical_deltas(canon, list(pairs)), ref)


def test_Z5_peft_adapter_infix_stripped(tmp_path, spec):
    pairs = random_pairs(SAMPLE, seed=104)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"diffusion_model.{n}.lora_A.default.weight"] = a
        sd[f"diffusion_model.{n}.lora_B.default.weight"] = b
    path = save(tmp_path, "z5.safetensors", sd)
    canon = _load_convert(path, spec)
    assert canon.matched_modules == len(SAMPLE)
    ref = reference_deltas(pairs)  # by hand: (alpha / r) B @ A, alpha = r
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), ref)
    assert_deltas_equal(diffusers_converted_deltas(path), ref)


def test_Z6_lokr_supported_as_exact_low_rank(tmp_path, spec):
    """LoKr: delta = alpha / rank * kron(w1, w2_a @ w2_b), as an exact (A, B) (docs/lora.md)."""
    g = torch.Generator().manual_seed(113)
    base = "diffusion_model.layers.0.attention.to_q"
    w1, w2a, w2b = (
        torch.randn(4, 4, generator=g),
        torch.randn(16, 2, generator=g),
        torch.randn(2, 16, generator=g),
    )
    ff = "diffusion_model.layers.1.feed_forward.w2"
    f1a, f1b, f2 = (
        torch.randn(2, 1, generator=g),
        torch.randn(1, 10, generator=g),
        torch.randn(32, 17, generator=g),
    )
    sd = {
        f"{base}.lokr_w1": w1,
        f"{base}.lokr_w2_a": w2a,
        f"{base}.lokr_w2_b": w2b,
        f"{base}.alpha": torch.tensor(1.0),
        f"{ff}.lokr_w1_a": f1a,
        f"{ff}.lokr_w1_b": f1b,
        f"{ff}.lokr_w2": f2,
        f"{ff}.alpha": torch.tensor(3.0),
    }
    path = save(tmp_path, "z6.safetensors", sd)
    canon = _load_convert(path, spec)
    assert canon.matched_modules == 2 and canon.source_format == "lokr"
    ref = {
        "layers.0.attention.to_q": 0.5 * torch.kron(w1, w2a @ w2b).double(),
        "layers.1.feed_forward.w2": 3.0 * torch.kron(f1a @ f1b, f2).double(),
    }
    assert_deltas_equal(canonical_deltas(canon, list(ref)), ref, atol=1e-5)
    # diffusers' own LoKr conversion (alpha baked into w1) gives the same deltas
    from diffusers import ZImagePipeline

    d = ZImagePipeline.lora_state_dict(str(path))
    t = "transformer.layers.0.attention.to_q"
    theirs = torch.kron(d[f"{t}.lokr_w1"], d[f"{t}.lokr_w2_a"] @ d[f"{t}.lokr_w2_b"]).double()
    torch.testing.assert_close(theirs, ref["layers.0.attention.to_q"], atol=1e-5, rtol=1e-5)


def test_Z6_full_rank_lokr_clear_error_nothing_changed(tmp_path, spec):
    sd = {
        "diffusion_model.layers.0.attention.to_q.lokr_w1": torch.randn(4, 4),
        "diffusion_model.layers.0.attention.to_q.lokr_w2": torch.randn(16, 16),
        "diffusion_model.layers.0.attention.to_q.alpha": torch.tensor(1.0),
    }
    path = save(tmp_path, "z6.safetensors", sd)
    loaded, md = load_lora_state_dict(path)
    keys_before = list(loaded)
    before = _weights_snapshot()
    with pytest.raises(LoRAFormatError) as e:
        convert_to_canonical(loaded, md, spec)
    assert "LoKr" in str(e.value) and "layers.0.attention.to_q" in str(e.value)
    assert list(loaded) == keys_before
    _assert_weights_unchanged(before)
    sd["diffusion_model.layers.0.attention.to_q.lokr_t2"] = torch.randn(2, 2, 1, 1)
    with pytest.raises(LoRAFormatError, match="Tucker.*lokr_t2"):
        convert_to_canonical(sd, None, spec)


def test_G1_other_architecture_zero_matched(tmp_path, spec):
    g = torch.Generator().manual_seed(105)
    sd = {}
    for blk in (0, 24):
        for m in ("cross_attn_o", "self_attn_q", "ffn_0"):
            k = f"lora_unet_blocks_{blk}_{m}"
            sd[k + ".lora_down.weight"] = torch.randn(4, 64, generator=g)
            sd[k + ".lora_up.weight"] = torch.randn(64, 4, generator=g)
            sd[k + ".alpha"] = torch.tensor(4.0)
    before = _weights_snapshot()
    with pytest.raises(LoRAFormatError) as e:
        _load_convert(save(tmp_path, "g1.safetensors", sd), spec)
    msg = str(e.value)
    assert "matched 0 of 6 modules" in msg and "Z-Image" in msg and "Wan" in msg
    assert len(msg) < 600  # no key dump
    _assert_weights_unchanged(before)


def test_G2_mixed_naming_each_with_own_alpha(tmp_path, spec):
    pairs = random_pairs(SAMPLE, seed=106)
    sd, alphas = {}, {}
    for i, (n, (a, b)) in enumerate(pairs.items()):
        if i % 2 == 0:
            sd[f"transformer.{n}.lora_A.weight"] = a
            sd[f"transformer.{n}.lora_B.weight"] = b
        else:
            sd[kohya_name(n) + ".lora_down.weight"] = a
            sd[kohya_name(n) + ".lora_up.weight"] = b
            alphas[n] = 0.5 * i
            sd[kohya_name(n) + ".alpha"] = torch.tensor(alphas[n])
    canon = _load_convert(save(tmp_path, "g2.safetensors", sd), spec)
    assert canon.matched_modules == len(SAMPLE)
    assert canon.source_format == "diffusers+kohya"
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), reference_deltas(pairs, alphas))


def test_G3_text_encoder_keys_ignored_and_counted(tmp_path, spec, caplog):
    caplog.set_level("INFO", logger="sglang.multimodal_gen.lora.formats")
    pairs = random_pairs(SAMPLE, seed=107)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[kohya_name(n) + ".lora_down.weight"] = a
        sd[kohya_name(n) + ".lora_up.weight"] = b
    te = []
    for i in range(3):
        k = f"lora_te1_text_model_encoder_layers_{i}_self_attn_q_proj"
        te += [k + ".lora_down.weight", k + ".lora_up.weight", k + ".alpha"]
        sd[k + ".lora_down.weight"] = torch.randn(4, 32)
        sd[k + ".lora_up.weight"] = torch.randn(32, 4)
        sd[k + ".alpha"] = torch.tensor(4.0)
    sd["text_encoder.encoder.layer.0.q.lora_A.weight"] = torch.randn(4, 32)
    te.append("text_encoder.encoder.layer.0.q.lora_A.weight")
    canon = _load_convert(save(tmp_path, "g3.safetensors", sd), spec)
    assert sorted(canon.ignored_keys) == sorted(te)
    assert canon.summary()["ignored_keys"] == 10
    assert "10 keys ignored" in caplog.text
    assert canon.matched_modules == len(SAMPLE)
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), reference_deltas(pairs))


@pytest.mark.parametrize(
    "name", ["lora.bin", "lora.pt", "lora.pth", "lora.ckpt", "fake.safetensors"]
)
def test_G4_pickle_refused_without_unpickling(tmp_path, monkeypatch, name):
    sd = diffusers_sd(random_pairs(SAMPLE[:2], seed=108))
    torch.save(sd, tmp_path / name)  # a real pickle, whatever the extension says

    def no_torch_load(*a, **k):
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_torch_load)
    with pytest.raises(LoRAFormatError) as e:
        load_lora_state_dict(tmp_path / name)
    assert "safetensors" in str(e.value)
    # a peft folder holding only a pickle is refused too
    d = tmp_path / "folder"
    d.mkdir()
    torch.save(sd, d / "adapter_model.bin")
    with pytest.raises(LoRAFormatError, match="pickle"):
        load_lora_state_dict(d)


def test_G5_paths_outside_the_lora_root_refused(tmp_path, spec):
    root = tmp_path / "loras"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    sd = diffusers_sd(random_pairs(SAMPLE[:2], seed=109))
    save_file(sd, str(root / "ok.safetensors"))
    save_file(sd, str(outside / "secret.safetensors"))
    os.symlink(outside / "secret.safetensors", root / "link_out.safetensors")
    os.symlink(outside, root / "dir_link")
    roots = [str(root)]
    for bad in (
        "../../etc/passwd",
        "../outside/secret.safetensors",
        str(outside / "secret.safetensors"),
        "link_out.safetensors",
        "dir_link/secret.safetensors",
        "/etc/passwd",
    ):
        with pytest.raises(InvalidRequestError, match="outside the allowed LoRA"):
            resolve_lora_path(bad, roots)
        with pytest.raises(InvalidRequestError):
            load_lora_state_dict(bad, roots)
    # inside: relative to the root, absolute, and via an internal symlink
    os.symlink(root / "ok.safetensors", root / "alias.safetensors")
    for good in ("ok.safetensors", str(root / "ok.safetensors"), "alias.safetensors"):
        assert resolve_lora_path(good, roots) == os.path.realpath(root / "ok.safetensors")
    canon = _load_convert("ok.safetensors", spec, allowed_roots=roots)
    assert canon.matched_modules == 2
    # a folder inside the root whose weights file is a symlink out of it
    sneaky = root / "sneaky"
    sneaky.mkdir()
    os.symlink(outside / "secret.safetensors", sneaky / "adapter_model.safetensors")
    with pytest.raises(InvalidRequestError, match="outside the allowed LoRA"):
        load_lora_state_dict("sneaky", roots)
    with pytest.raises(InvalidRequestError) as e:
        resolve_lora_path("missing.safetensors", roots)
    assert e.value.status_code == 400


@pytest.mark.parametrize("case", ["rank", "in", "out", "fused_out"])
def test_G6_shape_mismatch_names_module_and_shapes(tmp_path, spec, case):
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    name = "layers.1.feed_forward.w3"
    if case == "rank":
        b = torch.randn(170, 3)
    elif case == "in":
        a = torch.randn(4, 32)
        b = torch.randn(170, 4)
    elif case == "out":
        b = torch.randn(171, 4)
    else:
        name = "layers.1.attention.qkv"
        b = torch.randn(190, 4)
    if case != "fused_out" and b.shape[0] == 64:
        b = torch.randn(170, 4)
    sd = {f"transformer.{name}.lora_A.weight": a, f"transformer.{name}.lora_B.weight": b}
    before = _weights_snapshot()
    with pytest.raises(LoRAFormatError) as e:
        _load_convert(save(tmp_path, "g6.safetensors", sd), spec)
    msg = str(e.value)
    assert name in msg and str(tuple(a.shape)) in msg and str(tuple(b.shape)) in msg
    _assert_weights_unchanged(before)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["A", "B", "alpha"])
def test_G7_non_finite_rejected_with_module_name(tmp_path, spec, bad, where):
    pairs = random_pairs(SAMPLE[:3], seed=110)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[kohya_name(n) + ".lora_down.weight"] = a.clone()
        sd[kohya_name(n) + ".lora_up.weight"] = b.clone()
        sd[kohya_name(n) + ".alpha"] = torch.tensor(4.0)
    target = kohya_name("layers.0.attention.to_v")
    key = {"A": ".lora_down.weight", "B": ".lora_up.weight", "alpha": ".alpha"}[where]
    if where == "alpha":
        sd[target + key] = torch.tensor(bad)
    else:
        sd[target + key][1, 2] = bad
    before = _weights_snapshot()
    with pytest.raises(LoRAFormatError, match="NaN or Inf") as e:
        _load_convert(save(tmp_path, "g7.safetensors", sd), spec)
    assert "layers.0.attention.to_v" in str(e.value)
    _assert_weights_unchanged(before)


# ------------------------------------------------------------------- a LoRA file onto our layers
# ``ZIMAGE_NAME_MAP`` is shared by the weight loader and the LoRA loader, so a wrong rule (``w1``
# sent to shard 1, say) is invisible to a test whose expected values come from the same map.
# ``ROWS``: our fused module -> diffusers module -> the rows it occupies in the fused weight, used
# to check a LoRA file converted and merged onto our layers (at TP 1 and TP 2, whose rank rows are
# also spelled out here) against ``W + strength * (alpha / r) * B @ A`` computed by hand.
DIM, HEAD, HEADS, KV_HEADS, FFN = 32, 8, 4, 2, 24  # GQA: k and v sections are half of q
# our fused module -> {diffusers module: (first row, rows)} in the full fused weight
ROWS = {
    "layers.0.attention.to_qkv": {
        "layers.0.attention.to_q": (0, 32),
        "layers.0.attention.to_k": (32, 16),
        "layers.0.attention.to_v": (48, 16),
    },
    "layers.0.feed_forward.w13": {
        "layers.0.feed_forward.w1": (0, 24),
        "layers.0.feed_forward.w3": (24, 24),
    },
}
# rows of the full fused weight that rank r of 2 holds (q: heads 0-1 / 2-3, kv: head 0 / 1)
RANK_ROWS = {
    "layers.0.attention.to_qkv": {
        0: [*range(0, 16), *range(32, 40), *range(48, 56)],
        1: [*range(16, 32), *range(40, 48), *range(56, 64)],
    },
    "layers.0.feed_forward.w13": {
        0: [*range(0, 12), *range(24, 36)],
        1: [*range(12, 24), *range(36, 48)],
    },
}


class _Block(nn.Module):
    def __init__(self, tp_rank, tp_size):
        super().__init__()
        kw = dict(bias=False, tp_rank=tp_rank, tp_size=tp_size)
        self.attention = nn.Module()
        self.attention.to_qkv = QKVParallelLinear(DIM, HEAD, HEADS, KV_HEADS, **kw)
        self.feed_forward = nn.Module()
        self.feed_forward.w13 = MergedColumnParallelLinear(DIM, [FFN, FFN], **kw)


def _model(tp_rank, tp_size, full):
    model = nn.Module()
    model.layers = nn.ModuleList([_Block(tp_rank, tp_size)])
    for name, w in full.items():
        layer = model.get_submodule(name)
        layer.weight_loader(layer.weight, w)
    return model


@pytest.mark.parametrize("tp_size", [1, 2])
def test_lora_file_merges_into_the_hand_table_rows(tmp_path, tp_size):
    """A diffusers-format file with alpha (peft metadata) for q/k/v and w1/w3, converted and
    merged at strength 0.6: every rank's weight is its rows of ``W + 0.6 (alpha / r) B @ A``."""
    g = torch.Generator().manual_seed(31)
    rank, alpha, strength = 4, 6.0, 0.6
    full = {m: torch.randn(64 if "qkv" in m else 48, DIM, generator=g) for m in ROWS}
    expected = {m: w.double().clone() for m, w in full.items()}
    sd = {}
    for our, members in ROWS.items():
        for diffusers_name, (start, rows) in members.items():
            a = torch.randn(rank, DIM, generator=g)
            b = torch.randn(rows, rank, generator=g)
            sd[f"transformer.{diffusers_name}.lora_A.weight"] = a
            sd[f"transformer.{diffusers_name}.lora_B.weight"] = b
            delta = (alpha / rank) * (b.double() @ a.double())
            expected[our][start : start + rows] += strength * delta
    path = tmp_path / "lora.safetensors"
    config = {"transformer.r": rank, "transformer.lora_alpha": alpha}  # as diffusers writes it
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps(config)})
    state, metadata = load_lora_state_dict(path)
    for r in range(tp_size):
        model = _model(r, tp_size, full)
        spec = LoRAModelSpec.from_module(model, ZIMAGE_NAME_MAP, "Z-Image")
        canon = convert_to_canonical(state, metadata, spec)
        assert canon.matched_modules == 5
        for our in ROWS:
            layer = wrap_with_lora(model.get_submodule(our))
            layer.add_adapter("x", canon.modules[our])
            layer.set_active([("x", strength)])
            layer.merge()
            rows = list(range(expected[our].shape[0])) if tp_size == 1 else RANK_ROWS[our][r]
            torch.testing.assert_close(
                layer.weight.double(), expected[our][rows], atol=1e-5, rtol=1e-5
            )
