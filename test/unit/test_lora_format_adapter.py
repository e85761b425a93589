"""Format adapter: every key format converts to the same deltas as the plain diffusers-format file.

Each test writes a small synthetic safetensors file over the tiny diffusers Z-Image model's module
list, loads it with ``load_lora_state_dict``, converts it with ``convert_to_canonical`` and compares
delta by delta (``scale * B @ A``) against the diffusers-format reference, and, where diffusers' own
Z-Image converter supports the format, against ``ZImagePipeline.lora_state_dict``'s result.
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
from sglang.multimodal_gen.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.lora import (
    LoRAModelSpec,
    convert_to_canonical,
    guess_architecture,
    load_lora_state_dict,
)
from sglang.multimodal_gen.lora.key_grammar import best_architecture
from sglang.multimodal_gen.lora.lokr import lokr_to_lora
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


def test_guess_architecture():
    assert guess_architecture(["lora_unet_blocks_3_self_attn_q.lora_down.weight"]) == "Wan"
    assert guess_architecture(["transformer.single_transformer_blocks.0.attn.to_q"]) == "Flux"
    assert guess_architecture(["lora_unet_down_blocks_0_attentions_0"]).startswith("Stable")
    assert guess_architecture(["transformer.layers.0.attention.to_q.lora_A.weight"]) == "Z-Image"
    assert guess_architecture(["foo.bar"]) is None


# A HunyuanVideo-like file: its double blocks share Flux's ``double_blocks.N`` prefix.
_TOY_SIGNATURE = (r"double_blocks[._]\d+[._]img_attn_qkv", r"individual_token_refiner")
_TOY_KEYS = [
    "transformer.double_blocks.0.img_attn_qkv.lora_A.weight",
    "transformer.double_blocks.1.img_attn_qkv.lora_A.weight",
    "transformer.txt_in.individual_token_refiner.blocks.0.mlp.fc1.lora_A.weight",
]
_FLUX_KEYS = [
    "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight",
    "transformer.single_transformer_blocks.1.attn.to_q.lora_A.weight",
]


def test_guess_architecture_scores_keys_whatever_the_registration_order(monkeypatch):
    """A file that two families' signatures match goes to the family matching more of its keys,
    not to the first registered (Flux's ``double_blocks`` pattern also matches the toy family's
    double-block keys; first-match-wins called such a file Flux); ties go to the signature that
    matched the longest piece of a key."""
    from sglang.multimodal_gen.models import registry

    registry.list_families()  # the served families first, as in a real process
    # a copy of the registry, restored when the test ends: the toy family does not outlive it
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    registry.register_family(
        registry.ModelFamily(
            name="toy-video",
            display_name="ToyVideo",
            pipeline_classes=("ToyVideoPipeline",),
            pipeline="toy.module:ToyVideoPipeline",
            denoisers=(),
            lora_signature=_TOY_SIGNATURE,
        )
    )
    assert list(registry._FAMILIES)[-1] == "toy-video"  # registered after Flux
    assert guess_architecture(_TOY_KEYS) == "ToyVideo"  # 3 keys against Flux's 2
    assert guess_architecture(_TOY_KEYS[:2]) == "ToyVideo"  # 2 each: the longer match
    assert guess_architecture(_FLUX_KEYS + _TOY_KEYS[:1]) == "Flux"  # 3 against 1
    assert guess_architecture(["lora_unet_blocks_3_self_attn_q.lora_down.weight"]) == "Wan"


def test_best_architecture_does_not_depend_on_the_order_of_the_signatures():
    flux = ("Flux", [r"(double_blocks|single_blocks|single_transformer_blocks)[._]\d+"])
    toy = ("ToyVideo", list(_TOY_SIGNATURE))
    for sigs in ([flux, toy], [toy, flux]):
        assert best_architecture(_TOY_KEYS, sigs) == "ToyVideo"
        assert best_architecture(_TOY_KEYS[:2], sigs) == "ToyVideo"
        assert best_architecture(_FLUX_KEYS + _TOY_KEYS[:1], sigs) == "Flux"
        assert best_architecture(["foo.bar"], sigs) is None
    # an exact tie (same count, same longest match) goes to the name that sorts first
    a, b = ("B-arch", [r"blocks\.0"]), ("A-arch", [r"blocks\.0"])
    assert best_architecture(["blocks.0.x"], [a, b]) == best_architecture(["blocks.0.x"], [b, a])
    assert best_architecture(["blocks.0.x"], [a, b]) == "A-arch"


class _OurBlock(torch.nn.Module):
    """A block built from our parallel layers (fused qkv and gate/up), as our DiT will be."""

    def __init__(self):
        super().__init__()
        kw = dict(tp_rank=0, tp_size=1)
        self.attention = torch.nn.Module()
        self.attention.to_qkv = QKVParallelLinear(64, 16, 4, 2, bias=False, **kw)
        self.attention.to_out = torch.nn.ModuleList([RowParallelLinear(64, 64, bias=False, **kw)])
        self.feed_forward = torch.nn.Module()
        self.feed_forward.w13 = MergedColumnParallelLinear(64, [170, 170], bias=False, **kw)
        self.adaLN_modulation = torch.nn.ModuleList([ReplicatedLinear(64, 256, **kw)])


def test_spec_from_our_parallel_layers(tmp_path):
    """A model of our fused layers: split q/k/v (GQA) and w1/w3 files land in their shards."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_OurBlock()])
    spec = LoRAModelSpec.from_module(model, ZIMAGE_NAME_MAP, "ours")
    assert spec.module_shapes["layers.0.attention.to_qkv"] == {
        "q": (64, 64),
        "k": (32, 64),
        "v": (32, 64),
    }
    assert spec.module_shapes["layers.0.feed_forward.w13"] == {0: (170, 64), 1: (170, 64)}
    g = torch.Generator().manual_seed(11)
    sizes = {"to_q": 64, "to_k": 32, "to_v": 32, "to_out.0": 64}
    sd, ref = {}, {}
    for n, out in sizes.items():
        a, b = torch.randn(2, 64, generator=g), torch.randn(out, 2, generator=g)
        sd[f"lora_unet_layers_0_attention_{n.replace('.', '_')}.lora_down.weight"] = a
        sd[f"lora_unet_layers_0_attention_{n.replace('.', '_')}.lora_up.weight"] = b
        ref[n] = b @ a
    canon = convert_to_canonical(sd, None, spec)
    qkv = canon.modules["layers.0.attention.to_qkv"]
    for s in "qkv":
        torch.testing.assert_close(qkv[s].delta_weight(), ref[f"to_{s}"])
    torch.testing.assert_close(
        canon.modules["layers.0.attention.to_out.0"][None].delta_weight(), ref["to_out.0"]
    )


def test_legacy_call_form(spec):
    """``convert_to_canonical(sd, md, module_names, name_map, module_shapes)`` also works."""
    pairs = random_pairs(SAMPLE, seed=12)
    canon = convert_to_canonical(
        diffusers_sd(pairs), {}, spec.module_names, ZIMAGE_NAME_MAP, spec.module_shapes
    )
    assert_deltas_equal(canonical_deltas(canon, SAMPLE), reference_deltas(pairs))


def test_spec_of_our_zimage_dit_equals_diffusers_spec(spec):
    """Our DiT (fused to_qkv / w13) and the diffusers model through the name map agree."""
    from sglang.multimodal_gen.configs.zimage import ZImageArchConfig
    from sglang.multimodal_gen.models.dits.zimage import ZImageTransformer

    cfg = ZImageArchConfig(
        in_channels=4,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        cap_feat_dim=32,
        axes_dims=(4, 6, 6),
        axes_lens=(32, 32, 32),
    )
    ours = LoRAModelSpec.from_module(ZImageTransformer(cfg), ZIMAGE_NAME_MAP, "Z-Image")
    assert ours.module_shapes == spec.module_shapes


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


@pytest.mark.parametrize(
    "parts,expected_rank",
    [
        ({"w1": (4, 4), "w2_a": (16, 2), "w2_b": (2, 16)}, 8),  # (I, W1) x (w2_a, w2_b)
        ({"w1_a": (4, 1), "w1_b": (1, 4), "w2": (16, 16)}, 16),  # (w1_a, w1_b) x (I or W2)
        ({"w1_a": (8, 2), "w1_b": (2, 2), "w2_a": (8, 3), "w2_b": (3, 32)}, 6),
        ({"w1": (2, 8), "w2_a": (32, 4), "w2_b": (4, 8)}, 8),
    ],
)
def test_lokr_exact_low_rank(parts, expected_rank):
    """B @ A of the converted pair equals kron(W1, W2) * scale exactly (LyCORIS semantics)."""
    g = torch.Generator().manual_seed(15)
    t = {
        k: torch.randn(*shape, generator=g, dtype=torch.float64).float()
        for k, shape in parts.items()
    }
    w1 = t["w1"] if "w1" in t else t["w1_a"] @ t["w1_b"]
    w2 = t["w2"] if "w2" in t else t["w2_a"] @ t["w2_b"]
    rank = t["w2_b"].shape[0] if "w2_b" in t else t["w1_b"].shape[0]
    a, b, scale = lokr_to_lora(t, torch.tensor(3.0), "m")
    assert a.shape[0] == expected_rank and b.shape[1] == expected_rank
    assert scale == pytest.approx(3.0 / rank)
    torch.testing.assert_close(b @ a, torch.kron(w1, w2), atol=1e-5, rtol=1e-5)
    # no alpha: scale 1
    assert lokr_to_lora(t, None, "m")[2] == 1.0


def test_lokr_refusals():
    g = torch.Generator().manual_seed(16)
    full = {"w1": torch.randn(4, 4, generator=g), "w2": torch.randn(16, 16, generator=g)}
    with pytest.raises(LoRAFormatError, match="no low-rank form"):
        lokr_to_lora(full, torch.tensor(1.0), "m")
    with pytest.raises(LoRAFormatError, match="missing"):
        lokr_to_lora({"w1": full["w1"]}, None, "m")
    with pytest.raises(LoRAFormatError, match="do not chain"):
        lokr_to_lora(
            {"w1": full["w1"], "w2_a": torch.ones(16, 2), "w2_b": torch.ones(3, 16)}, None, "m"
        )
    with pytest.raises(LoRAFormatError, match="only linear"):
        lokr_to_lora({"w1": full["w1"], "w2": torch.ones(16, 16, 1, 1)}, None, "m")
