"""FLUX_NAME_MAP against a hand-written table: diffusers and original (BFL) module names ->
(our module, shard id). The expected targets are written out here, not derived from the rules."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.configs.flux import FluxArchConfig
from sglang.multimodal_gen.models.dits.flux import FluxTransformer
from sglang.multimodal_gen.models.dits.flux_names import FLUX_NAME_MAP

TB, STB = "transformer_blocks", "single_transformer_blocks"

DIFFUSERS = [
    # double blocks: split q/k/v -> fused QKV layers
    ("transformer_blocks.0.attn.to_q", (f"{TB}.0.attn.to_qkv", "q")),
    ("transformer_blocks.3.attn.to_k", (f"{TB}.3.attn.to_qkv", "k")),
    ("transformer_blocks.18.attn.to_v", (f"{TB}.18.attn.to_qkv", "v")),
    ("transformer_blocks.0.attn.add_q_proj", (f"{TB}.0.attn.to_added_qkv", "q")),
    ("transformer_blocks.7.attn.add_k_proj", (f"{TB}.7.attn.to_added_qkv", "k")),
    ("transformer_blocks.7.attn.add_v_proj", (f"{TB}.7.attn.to_added_qkv", "v")),
    # double blocks: unchanged names
    ("transformer_blocks.0.attn.to_out.0", (f"{TB}.0.attn.to_out.0", None)),
    ("transformer_blocks.0.attn.to_add_out", (f"{TB}.0.attn.to_add_out", None)),
    ("transformer_blocks.1.attn.norm_q", (f"{TB}.1.attn.norm_q", None)),
    ("transformer_blocks.1.attn.norm_added_k", (f"{TB}.1.attn.norm_added_k", None)),
    ("transformer_blocks.2.ff.net.0.proj", (f"{TB}.2.ff.net.0.proj", None)),
    ("transformer_blocks.2.ff.net.2", (f"{TB}.2.ff.net.2", None)),
    ("transformer_blocks.2.ff_context.net.0.proj", (f"{TB}.2.ff_context.net.0.proj", None)),
    ("transformer_blocks.2.ff_context.net.2", (f"{TB}.2.ff_context.net.2", None)),
    ("transformer_blocks.4.norm1.linear", (f"{TB}.4.norm1.linear", None)),
    ("transformer_blocks.4.norm1_context.linear", (f"{TB}.4.norm1_context.linear", None)),
    # single blocks: q/k/v/mlp -> one merged layer, int shard ids in row order
    ("single_transformer_blocks.0.attn.to_q", (f"{STB}.0.to_qkv_mlp", 0)),
    ("single_transformer_blocks.0.attn.to_k", (f"{STB}.0.to_qkv_mlp", 1)),
    ("single_transformer_blocks.21.attn.to_v", (f"{STB}.21.to_qkv_mlp", 2)),
    ("single_transformer_blocks.37.proj_mlp", (f"{STB}.37.to_qkv_mlp", 3)),
    ("single_transformer_blocks.37.proj_out", (f"{STB}.37.proj_out", None)),
    ("single_transformer_blocks.5.norm.linear", (f"{STB}.5.norm.linear", None)),
    ("single_transformer_blocks.5.attn.norm_k", (f"{STB}.5.attn.norm_k", None)),
    # top level
    ("x_embedder", ("x_embedder", None)),
    ("context_embedder", ("context_embedder", None)),
    (
        "time_text_embed.timestep_embedder.linear_1",
        ("time_text_embed.timestep_embedder.linear_1", None),
    ),
    (
        "time_text_embed.guidance_embedder.linear_2",
        ("time_text_embed.guidance_embedder.linear_2", None),
    ),
    ("time_text_embed.text_embedder.linear_1", ("time_text_embed.text_embedder.linear_1", None)),
    ("norm_out.linear", ("norm_out.linear", None)),
    ("proj_out", ("proj_out", None)),
    # our own fused names resolve to themselves, whole layer
    ("transformer_blocks.0.attn.to_qkv", (f"{TB}.0.attn.to_qkv", None)),
    ("transformer_blocks.0.attn.to_added_qkv", (f"{TB}.0.attn.to_added_qkv", None)),
    ("single_transformer_blocks.0.to_qkv_mlp", (f"{STB}.0.to_qkv_mlp", None)),
]

BFL = [
    ("double_blocks.0.img_attn.qkv", (f"{TB}.0.attn.to_qkv", None)),
    ("double_blocks.12.txt_attn.qkv", (f"{TB}.12.attn.to_added_qkv", None)),
    ("double_blocks.0.img_attn.proj", (f"{TB}.0.attn.to_out.0", None)),
    ("double_blocks.0.txt_attn.proj", (f"{TB}.0.attn.to_add_out", None)),
    ("double_blocks.3.img_mlp.0", (f"{TB}.3.ff.net.0.proj", None)),
    ("double_blocks.3.img_mlp.2", (f"{TB}.3.ff.net.2", None)),
    ("double_blocks.3.txt_mlp.0", (f"{TB}.3.ff_context.net.0.proj", None)),
    ("double_blocks.3.txt_mlp.2", (f"{TB}.3.ff_context.net.2", None)),
    ("double_blocks.18.img_mod.lin", (f"{TB}.18.norm1.linear", None)),
    ("double_blocks.18.txt_mod.lin", (f"{TB}.18.norm1_context.linear", None)),
    ("double_blocks.1.img_attn.norm.query_norm", (f"{TB}.1.attn.norm_q", None)),
    ("double_blocks.1.img_attn.norm.key_norm", (f"{TB}.1.attn.norm_k", None)),
    ("double_blocks.1.txt_attn.norm.query_norm", (f"{TB}.1.attn.norm_added_q", None)),
    ("double_blocks.1.txt_attn.norm.key_norm", (f"{TB}.1.attn.norm_added_k", None)),
    ("single_blocks.0.linear1", (f"{STB}.0.to_qkv_mlp", None)),
    ("single_blocks.37.linear2", (f"{STB}.37.proj_out", None)),
    ("single_blocks.9.modulation.lin", (f"{STB}.9.norm.linear", None)),
    ("single_blocks.9.norm.query_norm", (f"{STB}.9.attn.norm_q", None)),
    ("single_blocks.9.norm.key_norm", (f"{STB}.9.attn.norm_k", None)),
    ("img_in", ("x_embedder", None)),
    ("txt_in", ("context_embedder", None)),
    ("time_in.in_layer", ("time_text_embed.timestep_embedder.linear_1", None)),
    ("time_in.out_layer", ("time_text_embed.timestep_embedder.linear_2", None)),
    ("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1", None)),
    ("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2", None)),
    ("guidance_in.in_layer", ("time_text_embed.guidance_embedder.linear_1", None)),
    ("guidance_in.out_layer", ("time_text_embed.guidance_embedder.linear_2", None)),
    ("final_layer.linear", ("proj_out", None)),
    ("final_layer.adaLN_modulation.1", ("norm_out.linear", None)),  # halves swapped elsewhere
    # wrapper prefixes of single-file / ComfyUI checkpoints
    ("model.diffusion_model.double_blocks.2.img_attn.qkv", (f"{TB}.2.attn.to_qkv", None)),
    ("diffusion_model.single_blocks.1.linear1", (f"{STB}.1.to_qkv_mlp", None)),
]


@pytest.mark.parametrize("name,expected", DIFFUSERS + BFL, ids=[n for n, _ in DIFFUSERS + BFL])
def test_resolve(name, expected):
    assert FLUX_NAME_MAP.resolve(name) == expected


def test_resolve_param_keeps_the_leaf():
    assert FLUX_NAME_MAP.resolve_param("single_transformer_blocks.2.proj_mlp.bias") == (
        "single_transformer_blocks.2.to_qkv_mlp.bias",
        3,
    )
    assert FLUX_NAME_MAP.resolve_param("double_blocks.0.img_attn.qkv.weight") == (
        "transformer_blocks.0.attn.to_qkv.weight",
        None,
    )


def test_every_target_is_a_module_of_ours_with_that_shard():
    """Each resolved name exists in a model with 19 double and 38 single blocks (the real depth,
    tiny width), and the shard id is one of that layer's shards."""
    cfg = FluxArchConfig(
        in_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        axes_dims_rope=(2, 2, 4),
        joint_attention_dim=8,
        pooled_projection_dim=8,
        guidance_embeds=True,
    )
    modules = dict(FluxTransformer(cfg, tp_rank=0, tp_size=1).named_modules())
    for name, (ours, shard) in DIFFUSERS + BFL:
        assert ours in modules, name
        if shard is not None:
            assert shard in modules[ours].output_shard_ids, name


def test_lora_vocabulary_reaches_bfl_and_kohya_names():
    """The LoRA adapter's vocabulary (built by inverting the rules) contains the BFL spellings,
    also flattened kohya-style, with the right targets."""
    from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec

    cfg = FluxArchConfig(
        in_channels=8,
        num_layers=2,
        num_single_layers=2,
        num_attention_heads=2,
        attention_head_dim=8,
        axes_dims_rope=(2, 2, 4),
        joint_attention_dim=8,
        pooled_projection_dim=8,
    )
    spec = LoRAModelSpec.from_module(FluxTransformer(cfg, tp_rank=0, tp_size=1), FLUX_NAME_MAP)
    assert spec.shards(f"{STB}.1.to_qkv_mlp") == [0, 1, 2, 3]
    assert spec.shards(f"{TB}.0.attn.to_added_qkv") == ["q", "k", "v"]
    vocab = spec.vocabulary
    assert vocab["double_blocks.1.img_attn.qkv"] == (f"{TB}.1.attn.to_qkv", None)
    assert vocab["double_blocks.0.txt_mlp.2"] == (f"{TB}.0.ff_context.net.2", None)
    assert vocab["single_blocks.1.linear1"] == (f"{STB}.1.to_qkv_mlp", None)
    assert vocab["single_blocks.0.linear2"] == (f"{STB}.0.proj_out", None)
    assert vocab[f"{STB}.1.proj_mlp"] == (f"{STB}.1.to_qkv_mlp", 3)
    assert vocab[f"{TB}.1.attn.add_v_proj"] == (f"{TB}.1.attn.to_added_qkv", "v")
    assert vocab["final_layer.adaLN_modulation.1"] == ("norm_out.linear", None)
    flat = spec.flat_vocabulary
    assert flat["double_blocks_0_img_attn_qkv"] == "double_blocks.0.img_attn.qkv"
    assert flat["single_blocks_1_linear1"] == "single_blocks.1.linear1"
    assert flat["single_transformer_blocks_0_attn_to_q"] == f"{STB}.0.attn.to_q"
    assert vocab[flat["single_transformer_blocks_0_attn_to_q"]] == (f"{STB}.0.to_qkv_mlp", 0)
