"""WAN_NAME_MAP against a hand-written table: diffusers and original (Wan-AI) module names ->
(our module, shard id). The expected targets are written out here, not derived from the rules."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.configs.wan import WanArchConfig
from sglang.multimodal_gen.models.dits.wan import WanTransformer
from sglang.multimodal_gen.models.dits.wan_names import WAN_NAME_MAP

DIFFUSERS = [
    # self-attention: split q/k/v -> fused QKV
    ("blocks.0.attn1.to_q", ("blocks.0.attn1.to_qkv", "q")),
    ("blocks.7.attn1.to_k", ("blocks.7.attn1.to_qkv", "k")),
    ("blocks.39.attn1.to_v", ("blocks.39.attn1.to_qkv", "v")),
    ("blocks.0.attn1.to_out.0", ("blocks.0.attn1.to_out.0", None)),
    ("blocks.0.attn1.norm_q", ("blocks.0.attn1.norm_q", None)),
    ("blocks.0.attn1.norm_k", ("blocks.0.attn1.norm_k", None)),
    # cross-attention: q alone, k/v -> merged k|v
    ("blocks.2.attn2.to_q", ("blocks.2.attn2.to_q", None)),
    ("blocks.2.attn2.to_k", ("blocks.2.attn2.to_kv", 0)),
    ("blocks.2.attn2.to_v", ("blocks.2.attn2.to_kv", 1)),
    ("blocks.2.attn2.to_out.0", ("blocks.2.attn2.to_out.0", None)),
    ("blocks.2.attn2.norm_k", ("blocks.2.attn2.norm_k", None)),
    # FFN, norms
    ("blocks.5.ffn.net.0.proj", ("blocks.5.ffn.net.0.proj", None)),
    ("blocks.5.ffn.net.2", ("blocks.5.ffn.net.2", None)),
    ("blocks.5.norm2", ("blocks.5.norm2", None)),
    # top level
    ("patch_embedding", ("patch_embedding", None)),
    (
        "condition_embedder.time_embedder.linear_1",
        ("condition_embedder.time_embedder.linear_1", None),
    ),
    (
        "condition_embedder.time_embedder.linear_2",
        ("condition_embedder.time_embedder.linear_2", None),
    ),
    ("condition_embedder.time_proj", ("condition_embedder.time_proj", None)),
    (
        "condition_embedder.text_embedder.linear_1",
        ("condition_embedder.text_embedder.linear_1", None),
    ),
    (
        "condition_embedder.text_embedder.linear_2",
        ("condition_embedder.text_embedder.linear_2", None),
    ),
    ("proj_out", ("proj_out", None)),
    # our fused names (= diffusers' names after fuse_projections()) resolve to themselves
    ("blocks.0.attn1.to_qkv", ("blocks.0.attn1.to_qkv", None)),
    ("blocks.0.attn2.to_kv", ("blocks.0.attn2.to_kv", None)),
]

ORIGINAL = [
    ("blocks.0.self_attn.q", ("blocks.0.attn1.to_qkv", "q")),
    ("blocks.0.self_attn.k", ("blocks.0.attn1.to_qkv", "k")),
    ("blocks.0.self_attn.v", ("blocks.0.attn1.to_qkv", "v")),
    ("blocks.0.self_attn.o", ("blocks.0.attn1.to_out.0", None)),
    ("blocks.11.self_attn.norm_q", ("blocks.11.attn1.norm_q", None)),
    ("blocks.11.self_attn.norm_k", ("blocks.11.attn1.norm_k", None)),
    ("blocks.3.cross_attn.q", ("blocks.3.attn2.to_q", None)),
    ("blocks.3.cross_attn.k", ("blocks.3.attn2.to_kv", 0)),
    ("blocks.3.cross_attn.v", ("blocks.3.attn2.to_kv", 1)),
    ("blocks.3.cross_attn.o", ("blocks.3.attn2.to_out.0", None)),
    ("blocks.3.cross_attn.norm_q", ("blocks.3.attn2.norm_q", None)),
    ("blocks.3.cross_attn.norm_k", ("blocks.3.attn2.norm_k", None)),
    ("blocks.29.ffn.0", ("blocks.29.ffn.net.0.proj", None)),
    ("blocks.29.ffn.2", ("blocks.29.ffn.net.2", None)),
    ("blocks.4.norm3", ("blocks.4.norm2", None)),  # the original's affine cross-attention norm
    ("text_embedding.0", ("condition_embedder.text_embedder.linear_1", None)),
    ("text_embedding.2", ("condition_embedder.text_embedder.linear_2", None)),
    ("time_embedding.0", ("condition_embedder.time_embedder.linear_1", None)),
    ("time_embedding.2", ("condition_embedder.time_embedder.linear_2", None)),
    ("time_projection.1", ("condition_embedder.time_proj", None)),
    ("head.head", ("proj_out", None)),
    ("patch_embedding", ("patch_embedding", None)),
    # wrapper prefixes (ComfyUI single files, Wan LoRA files)
    ("diffusion_model.blocks.1.self_attn.q", ("blocks.1.attn1.to_qkv", "q")),
    ("model.diffusion_model.blocks.1.cross_attn.v", ("blocks.1.attn2.to_kv", 1)),
    ("diffusion_model.head.head", ("proj_out", None)),
]

# parameters renamed as a whole (module path + leaf): bare parameters of a block / the head
PARAMS = [
    ("blocks.0.modulation", ("blocks.0.scale_shift_table", None)),
    ("blocks.27.modulation", ("blocks.27.scale_shift_table", None)),
    ("head.modulation", ("scale_shift_table", None)),
    ("model.diffusion_model.blocks.3.modulation", ("blocks.3.scale_shift_table", None)),
    ("diffusion_model.head.modulation", ("scale_shift_table", None)),
    ("blocks.0.scale_shift_table", ("blocks.0.scale_shift_table", None)),
    ("scale_shift_table", ("scale_shift_table", None)),
    ("blocks.2.self_attn.v.bias", ("blocks.2.attn1.to_qkv.bias", "v")),
    ("blocks.2.attn2.to_k.weight", ("blocks.2.attn2.to_kv.weight", 0)),
    ("blocks.2.norm3.weight", ("blocks.2.norm2.weight", None)),
    ("head.head.bias", ("proj_out.bias", None)),
    ("blocks.2.self_attn.norm_q.weight", ("blocks.2.attn1.norm_q.weight", None)),
]


def _tiny(num_layers: int = 40) -> WanTransformer:
    cfg = WanArchConfig(
        num_attention_heads=2,
        attention_head_dim=6,
        in_channels=4,
        out_channels=4,
        text_dim=8,
        freq_dim=8,
        ffn_dim=8,
        num_layers=num_layers,
    )
    return WanTransformer(cfg, tp_rank=0, tp_size=1)


@pytest.mark.parametrize(
    "name,expected", DIFFUSERS + ORIGINAL, ids=[n for n, _ in DIFFUSERS + ORIGINAL]
)
def test_resolve(name, expected):
    assert WAN_NAME_MAP.resolve(name) == expected


@pytest.mark.parametrize("name,expected", PARAMS, ids=[n for n, _ in PARAMS])
def test_resolve_param(name, expected):
    assert WAN_NAME_MAP.resolve_param(name) == expected


def test_every_target_is_a_module_or_parameter_of_ours_with_that_shard():
    """At the real depth (40 blocks, tiny width) every resolved module exists and its shard id is
    one of that layer's shards; every renamed parameter exists."""
    model = _tiny()
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name, (ours, shard) in DIFFUSERS + ORIGINAL:
        assert ours in modules, name
        if shard is not None:
            assert shard in modules[ours].output_shard_ids, name
    for name, (ours, _) in PARAMS:
        assert ours in params, name


def test_lora_vocabulary_reaches_original_and_kohya_names():
    """The LoRA adapter's vocabulary (built by inverting the rules) contains the original Wan
    spellings, also flattened kohya-style, with the right targets."""
    from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec

    spec = LoRAModelSpec.from_module(_tiny(num_layers=2), WAN_NAME_MAP)
    assert spec.shards("blocks.1.attn1.to_qkv") == ["q", "k", "v"]
    assert spec.shards("blocks.1.attn2.to_kv") == [0, 1]
    vocab = spec.vocabulary
    assert vocab["blocks.1.self_attn.q"] == ("blocks.1.attn1.to_qkv", "q")
    assert vocab["blocks.0.self_attn.o"] == ("blocks.0.attn1.to_out.0", None)
    assert vocab["blocks.0.cross_attn.q"] == ("blocks.0.attn2.to_q", None)
    assert vocab["blocks.0.cross_attn.k"] == ("blocks.0.attn2.to_kv", 0)
    assert vocab["blocks.1.cross_attn.v"] == ("blocks.1.attn2.to_kv", 1)
    assert vocab["blocks.1.ffn.0"] == ("blocks.1.ffn.net.0.proj", None)
    assert vocab["blocks.1.ffn.2"] == ("blocks.1.ffn.net.2", None)
    assert vocab["blocks.0.attn1.to_v"] == ("blocks.0.attn1.to_qkv", "v")
    assert vocab["head.head"] == ("proj_out", None)
    assert vocab["time_projection.1"] == ("condition_embedder.time_proj", None)
    assert vocab["text_embedding.0"] == ("condition_embedder.text_embedder.linear_1", None)
    flat = spec.flat_vocabulary
    assert flat["blocks_0_self_attn_q"] == "blocks.0.self_attn.q"
    assert flat["blocks_1_cross_attn_o"] == "blocks.1.cross_attn.o"
    assert flat["blocks_1_ffn_0"] == "blocks.1.ffn.0"


@pytest.mark.parametrize(
    "config,n_params",
    [
        # Wan2.1 14B / each Wan2.2 A14B expert; TI2V-5B. Counts equal diffusers'
        # WanTransformer3DModel with the same config (checked once on the meta device)
        ({}, 14_288_491_584),
        (
            dict(num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48),
            4_999_787_712,
        ),
    ],
    ids=["a14b", "ti2v-5b"],
)
def test_real_configs_build_with_the_reference_parameter_count(config, n_params):
    """The full-size models build (on the meta device) with the reference's parameter count; at
    TP 8 a rank holds 1/8 of every split layer, including the q/k norm weights."""
    cfg = WanArchConfig(**config, out_channels=config.get("in_channels", 16))
    full = WanTransformer(cfg, tp_rank=0, tp_size=1, device="meta")
    assert sum(p.numel() for p in full.parameters()) == n_params
    tp8 = WanTransformer(cfg, tp_rank=7, tp_size=8, device="meta")
    d = cfg.inner_dim
    blk = tp8.blocks[0]
    assert blk.attn1.to_qkv.weight.shape == (3 * d // 8, d)
    assert blk.attn2.to_kv.weight.shape == (2 * d // 8, d)
    assert blk.attn1.norm_q.weight.shape == (d // 8,)
    assert blk.ffn.net[2].weight.shape == (d, cfg.ffn_dim // 8)
