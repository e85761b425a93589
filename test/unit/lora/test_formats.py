"""Format adapter: every key format converts to the same deltas as the plain diffusers-format file.

Each test writes a small synthetic safetensors file over the tiny diffusers Z-Image model's module
list, loads it with ``load_lora_state_dict``, converts it with ``convert_to_canonical`` and compares
delta by delta (``scale * B @ A``) against the diffusers-format reference, and, where diffusers' own
Z-Image converter supports the format, against ``ZImagePipeline.lora_state_dict``'s result.
The per-family layouts and the Z-Image/general format cases: ``formats/test_<family>.py``.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.lora_formats import (
    SAMPLE,
    assert_deltas_equal,
    canonical_deltas,
    diffusers_converted_deltas,
    diffusers_sd,
    kohya_name,
    linear_shapes,
    our_slot,
    random_pairs,
    reference_deltas,
    save,
    zimage_spec,
)
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora import convert_to_canonical, load_lora_state_dict
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP


@pytest.fixture(scope="module")
def spec():
    return zimage_spec()


def _convert(tmp_path, sd, spec, name="lora.safetensors", metadata=None):
    path = save(tmp_path, name, sd, metadata)
    loaded, md = load_lora_state_dict(path)
    return path, convert_to_canonical(loaded, md, spec)


def test_vocabulary_covers_every_linear_layer(spec):
    """Every nn.Linear of the diffusers model resolves, kohya-flattened too, to the module and
    shard of the hand-written table (``OUR_SLOTS``), whose shape is the diffusers layer's."""
    for name, (out, fan_in) in linear_shapes().items():
        our, sid = our_slot(name)
        assert spec.lookup(name) == (our, sid), name
        assert spec.vocabulary[spec.flat_vocabulary[name.replace(".", "_")]] == (our, sid), name
        assert spec.module_shapes[our][sid] == (out, fan_in), name
    assert spec.module_shapes["layers.0.attention.to_qkv"] == {
        "q": (64, 64),
        "k": (64, 64),
        "v": (64, 64),
    }
    assert spec.shards("layers.0.feed_forward.w13") == [0, 1]


def test_diffusers_format_every_module(tmp_path, spec):
    names = list(linear_shapes())
    pairs = random_pairs(names)
    path, canon = _convert(tmp_path, diffusers_sd(pairs), spec)
    assert canon.matched_modules == len(names)
    assert canon.source_format == "diffusers"
    assert canon.ignored_keys == []
    ref = reference_deltas(pairs)
    assert_deltas_equal(canonical_deltas(canon, names), ref)
    assert_deltas_equal(diffusers_converted_deltas(path), ref)
    # our names only: fused layers are filled by shard
    assert set(canon.modules) == spec.module_names


@pytest.mark.parametrize(
    "prefix,fmt",
    [
        ("base_model.model.", "peft"),
        ("base_model.model.transformer.", "peft"),
        ("", "diffusers"),
        ("diffusion_model.", "comfyui"),
        ("model.diffusion_model.", "comfyui"),
    ],
)
def test_wrapper_prefixes(tmp_path, spec, prefix, fmt):
    pairs = random_pairs(SAMPLE, seed=1)
    _, canon = _convert(tmp_path, diffusers_sd(pairs, prefix=prefix), spec)
    assert canon.source_format == fmt
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), reference_deltas(pairs))


@pytest.mark.parametrize("adapter", ["default", "my_style"])
def test_adapter_name_infix(tmp_path, spec, adapter):
    pairs = random_pairs(SAMPLE, seed=2)
    sd = {
        k.replace(".lora_A.", f".lora_A.{adapter}.").replace(".lora_B.", f".lora_B.{adapter}."): v
        for k, v in diffusers_sd(pairs, prefix="diffusion_model.").items()
    }
    path, canon = _convert(tmp_path, sd, spec)
    ref = reference_deltas(pairs)
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), ref)
    if adapter == "default":  # diffusers strips only "default."
        assert_deltas_equal(diffusers_converted_deltas(path), ref)


def test_two_adapters_in_one_file_refused(spec):
    pairs = random_pairs(SAMPLE[:2], seed=3)
    sd = {}
    for i, (n, (a, b)) in enumerate(pairs.items()):
        sd[f"{n}.lora_A.ad{i}.weight"] = a
        sd[f"{n}.lora_B.ad{i}.weight"] = b
    with pytest.raises(LoRAFormatError, match="several PEFT adapters"):
        convert_to_canonical(sd, None, spec)


@pytest.mark.parametrize("style", ["kohya", "comfyui_down_up", "dotted"])
def test_kohya_family_with_alpha(tmp_path, spec, style):
    pairs = random_pairs(SAMPLE, seed=4)
    sd, alphas = {}, {}
    for i, (n, (a, b)) in enumerate(pairs.items()):
        base = {
            "kohya": kohya_name(n),
            "comfyui_down_up": "diffusion_model." + n,
            "dotted": "diffusion_model." + n,
        }[style]
        down, up = (
            (".lora.down.weight", ".lora.up.weight")
            if style == "dotted"
            else (
                ".lora_down.weight",
                ".lora_up.weight",
            )
        )
        sd[base + down] = a
        sd[base + up] = b
        alphas[n] = 1.0 + i / 2
        sd[base + ".alpha"] = torch.tensor(alphas[n], dtype=torch.bfloat16)
    path, canon = _convert(tmp_path, sd, spec)
    assert canon.matched_modules == len(SAMPLE)
    ref = reference_deltas(pairs, alphas)
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), ref)
    assert_deltas_equal(diffusers_converted_deltas(path), ref)
    w = canon.modules["all_x_embedder.2-1"][None]
    assert w.scale == pytest.approx(alphas["all_x_embedder.2-1"] / 4)


def test_kohya_without_alpha_means_scale_one(tmp_path, spec):
    pairs = random_pairs(SAMPLE, seed=5)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[kohya_name(n) + ".lora_down.weight"] = a
        sd[kohya_name(n) + ".lora_up.weight"] = b
    _, canon = _convert(tmp_path, sd, spec)
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), reference_deltas(pairs))


def test_original_checkpoint_names(tmp_path, spec):
    """Original Z-Image names (attention.out, final_layer, x_embedder, fused qkv) map through the
    name map, dotted and kohya-flattened."""
    g = torch.Generator().manual_seed(6)
    a_qkv, b_qkv = torch.randn(4, 64, generator=g), torch.randn(192, 4, generator=g)
    a_out, b_out = torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g)
    a_x, b_x = torch.randn(4, 16, generator=g), torch.randn(64, 4, generator=g)
    a_f, b_f = torch.randn(4, 64, generator=g), torch.randn(16, 4, generator=g)
    sd = {
        "diffusion_model.layers.1.attention.qkv.lora_A.weight": a_qkv,
        "diffusion_model.layers.1.attention.qkv.lora_B.weight": b_qkv,
        "lora_unet_layers_0_attention_out.lora_down.weight": a_out,
        "lora_unet_layers_0_attention_out.lora_up.weight": b_out,
        "lora_unet_layers_0_attention_out.alpha": torch.tensor(2.0),
        "x_embedder.lora_A.weight": a_x,
        "x_embedder.lora_B.weight": b_x,
        "lora_unet_final_layer_linear.lora_down.weight": a_f,
        "lora_unet_final_layer_linear.lora_up.weight": b_f,
    }
    _, canon = _convert(tmp_path, sd, spec)
    qkv = canon.modules["layers.1.attention.to_qkv"]
    for i, s in enumerate("qkv"):
        torch.testing.assert_close(qkv[s].delta_weight(), b_qkv[64 * i : 64 * (i + 1)] @ a_qkv)
        assert qkv[s].lora_A is qkv["q"].lora_A  # A shared, not copied per shard
    torch.testing.assert_close(
        canon.modules["layers.0.attention.to_out.0"][None].delta_weight(), 0.5 * b_out @ a_out
    )
    torch.testing.assert_close(canon.modules["all_x_embedder.2-1"][None].delta_weight(), b_x @ a_x)
    torch.testing.assert_close(
        canon.modules["all_final_layer.2-1.linear"][None].delta_weight(), b_f @ a_f
    )
    assert canon.file_modules["layers.1.attention.qkv"] == ("layers.1.attention.to_qkv", None)


def test_fused_qkv_dot_format_matches_diffusers(tmp_path, spec):
    """diffusers splits a `.lora.down` fused qkv into to_q/k/v; our split is the same."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(4, 64, generator=g), torch.randn(192, 4, generator=g)
    sd = {
        "diffusion_model.layers.0.attention.qkv.lora.down.weight": a,
        "diffusion_model.layers.0.attention.qkv.lora.up.weight": b,
        "diffusion_model.layers.0.attention.qkv.alpha": torch.tensor(8.0),
    }
    path, canon = _convert(tmp_path, sd, spec)
    ref = diffusers_converted_deltas(path)
    names = [f"layers.0.attention.to_{s}" for s in "qkv"]
    assert_deltas_equal(canonical_deltas(canon, names), ref)


def test_our_fused_names(tmp_path, spec):
    """A file written in our own fused names (to_qkv, w13) fills every shard."""
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(4, 64, generator=g), torch.randn(340, 4, generator=g)
    sd = {
        "transformer.layers.0.feed_forward.w13.lora_A.weight": a,
        "transformer.layers.0.feed_forward.w13.lora_B.weight": b,
    }
    _, canon = _convert(tmp_path, sd, spec)
    w13 = canon.modules["layers.0.feed_forward.w13"]
    torch.testing.assert_close(w13[0].delta_weight(), b[:170] @ a)
    torch.testing.assert_close(w13[1].delta_weight(), b[170:] @ a)


def test_lora_b_bias_becomes_offset(tmp_path, spec):
    pairs = random_pairs(["layers.0.attention.to_k", "layers.0.feed_forward.w2"], seed=9)
    sd = diffusers_sd(pairs)
    sd["transformer.layers.0.attention.to_k.lora_B.bias"] = torch.randn(64)
    sd["transformer.layers.0.feed_forward.w2.lora_B.bias"] = torch.randn(64)
    _, canon = _convert(tmp_path, sd, spec)
    torch.testing.assert_close(
        canon.modules["layers.0.attention.to_qkv"]["k"].offset,
        sd["transformer.layers.0.attention.to_k.lora_B.bias"],
    )
    assert canon.modules["layers.0.feed_forward.w2"][None].offset.shape == (64,)


def test_dtype_preserved_and_shapes_documented(tmp_path, spec):
    pairs = {n: (a.bfloat16(), b.bfloat16()) for n, (a, b) in random_pairs(SAMPLE).items()}
    _, canon = _convert(tmp_path, diffusers_sd(pairs), spec)
    w = canon.modules["layers.0.attention.to_qkv"]["v"]
    assert w.lora_A.dtype == torch.bfloat16 and w.lora_A.shape == (4, 64)
    assert w.lora_B.shape == (64, 4)
    assert canon.nbytes() > 0


@pytest.mark.parametrize(
    "suffix,feature",
    [
        ("dora_scale", "DoRA"),
        ("lora_magnitude_vector", "DoRA"),
        ("lokr_t2", "Tucker"),
        ("hada_w1_a", "LoHa"),
        ("lora_embedding_A", "embedding LoRA"),
        ("modules_to_save.weight", "modules_to_save"),
        ("diff", "full weight difference"),  # (diff_b bias deltas are supported)
        ("lora_mid.weight", "lora_mid"),
    ],
)
def test_unsupported_features_name_feature_and_key(spec, suffix, feature):
    pairs = random_pairs(SAMPLE[:2], seed=10)
    sd = diffusers_sd(pairs)
    bad = f"transformer.layers.0.attention.to_q.{suffix}"
    sd[bad] = torch.ones(4)
    with pytest.raises(LoRAFormatError) as e:
        convert_to_canonical(sd, None, spec)
    assert feature in str(e.value) and bad in str(e.value)


def test_unknown_key_refused(spec):
    sd = diffusers_sd(random_pairs(SAMPLE[:1]))
    sd["transformer.layers.0.attention.norm_q.weight"] = torch.ones(16)
    with pytest.raises(LoRAFormatError, match="unrecognized LoRA key.*norm_q"):
        convert_to_canonical(sd, None, spec)


def test_missing_half_and_partial_match_refused(spec):
    sd = diffusers_sd(random_pairs(SAMPLE[:2]))
    del sd["transformer.layers.0.attention.to_k.lora_B.weight"]
    with pytest.raises(LoRAFormatError, match="to_k.*lora_B/lora_up is missing"):
        convert_to_canonical(sd, None, spec)
    sd = diffusers_sd(random_pairs(SAMPLE[:2]))
    sd["transformer.layers.7.attention.to_q.lora_A.weight"] = torch.ones(4, 64)
    sd["transformer.layers.7.attention.to_q.lora_B.weight"] = torch.ones(64, 4)
    with pytest.raises(LoRAFormatError, match="1 of 3 LoRA modules do not exist.*layers.7"):
        convert_to_canonical(sd, None, spec)


def test_same_module_twice_refused(spec):
    a, b = random_pairs(["layers.0.attention.to_q"])["layers.0.attention.to_q"]
    sd = {
        "transformer.layers.0.attention.to_q.lora_A.weight": a,
        "transformer.layers.0.attention.to_q.lora_B.weight": b,
        "transformer.layers.0.attention.to_qkv.lora_A.weight": a,
        "transformer.layers.0.attention.to_qkv.lora_B.weight": torch.cat([b, b, b]),
    }
    with pytest.raises(LoRAFormatError, match="targeted twice"):
        convert_to_canonical(sd, None, spec)
    sd = {
        "transformer.layers.0.attention.to_q.lora_A.weight": a,
        "transformer.layers.0.attention.to_q.lora_B.weight": b,
        "lora_unet_layers_0_attention_to_q.lora_down.weight": a,
        "lora_unet_layers_0_attention_to_q.lora_up.weight": b,
    }
    with pytest.raises(LoRAFormatError, match="two [AB] entries"):
        convert_to_canonical(sd, None, spec)


def test_conv_lora_refused(spec):
    sd = {
        "transformer.layers.0.attention.to_q.lora_A.weight": torch.ones(4, 64, 1, 1),
        "transformer.layers.0.attention.to_q.lora_B.weight": torch.ones(64, 4, 1, 1),
    }
    with pytest.raises(LoRAFormatError, match="only linear LoRA"):
        convert_to_canonical(sd, None, spec)


def test_legacy_call_form(spec):
    """``convert_to_canonical(sd, md, module_names, name_map, module_shapes)`` also works."""
    pairs = random_pairs(SAMPLE, seed=12)
    canon = convert_to_canonical(
        diffusers_sd(pairs), {}, spec.module_names, ZIMAGE_NAME_MAP, spec.module_shapes
    )
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), reference_deltas(pairs))


def test_two_component_file_split_by_component(spec):
    """`transformer.` and `transformer_2.` halves of one file go to their own component."""
    p1 = random_pairs(SAMPLE[:3], seed=13)
    p2 = random_pairs(SAMPLE[3:5], seed=14)
    sd = {**diffusers_sd(p1), **diffusers_sd(p2, prefix="transformer_2.")}
    c1 = convert_to_canonical(sd, None, spec, component="transformer")
    c2 = convert_to_canonical(sd, None, spec, component="transformer_2")
    assert_deltas_equal(canonical_deltas(c1, SAMPLE[:3]), reference_deltas(p1))
    assert_deltas_equal(canonical_deltas(c2, SAMPLE[3:5]), reference_deltas(p2))
    assert len(c1.ignored_keys) == 4 and len(c2.ignored_keys) == 6
    with pytest.raises(LoRAFormatError, match="matched 0 modules.*transformer_3"):
        convert_to_canonical(diffusers_sd(p1), None, spec, component="transformer_3")
