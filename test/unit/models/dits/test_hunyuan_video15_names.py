"""HUNYUAN_VIDEO15_NAME_MAP against a hand-written table: diffusers and original (Tencent) module
names -> (our module, shard id). The expected targets are written out here, not derived from the
rules; the Tencent names are those of diffusers' ``scripts/convert_hunyuan_video1_5_to_diffusers.py``."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.configs.hunyuan_video15 import HunyuanVideo15ArchConfig
from sglang.multimodal_gen.models.dits.hunyuan_video15 import HunyuanVideo15Transformer
from sglang.multimodal_gen.models.dits.hunyuan_video15_names import HUNYUAN_VIDEO15_NAME_MAP

R = "context_embedder.token_refiner.refiner_blocks"

DIFFUSERS = [
    # dual-stream blocks: split q/k/v -> fused
    ("transformer_blocks.0.attn.to_q", ("transformer_blocks.0.attn.to_qkv", "q")),
    ("transformer_blocks.53.attn.to_k", ("transformer_blocks.53.attn.to_qkv", "k")),
    ("transformer_blocks.7.attn.to_v", ("transformer_blocks.7.attn.to_qkv", "v")),
    ("transformer_blocks.1.attn.add_q_proj", ("transformer_blocks.1.attn.to_added_qkv", "q")),
    ("transformer_blocks.1.attn.add_k_proj", ("transformer_blocks.1.attn.to_added_qkv", "k")),
    ("transformer_blocks.1.attn.add_v_proj", ("transformer_blocks.1.attn.to_added_qkv", "v")),
    ("transformer_blocks.1.attn.to_out.0", ("transformer_blocks.1.attn.to_out.0", None)),
    ("transformer_blocks.1.attn.to_add_out", ("transformer_blocks.1.attn.to_add_out", None)),
    ("transformer_blocks.1.attn.norm_added_k", ("transformer_blocks.1.attn.norm_added_k", None)),
    ("transformer_blocks.2.norm1.linear", ("transformer_blocks.2.norm1.linear", None)),
    ("transformer_blocks.2.ff_context.net.2", ("transformer_blocks.2.ff_context.net.2", None)),
    # refiner blocks: their own fused q/k/v
    (f"{R}.0.attn.to_q", (f"{R}.0.attn.to_qkv", "q")),
    (f"{R}.1.attn.to_k", (f"{R}.1.attn.to_qkv", "k")),
    (f"{R}.1.attn.to_v", (f"{R}.1.attn.to_qkv", "v")),
    (f"{R}.1.attn.to_out.0", (f"{R}.1.attn.to_out.0", None)),
    (f"{R}.1.ff.net.0.proj", (f"{R}.1.ff.net.0.proj", None)),
    (f"{R}.1.norm_out.linear", (f"{R}.1.norm_out.linear", None)),
    # top level: unchanged
    ("x_embedder.proj", ("x_embedder.proj", None)),
    ("context_embedder.proj_in", ("context_embedder.proj_in", None)),
    ("context_embedder_2.linear_3", ("context_embedder_2.linear_3", None)),
    ("image_embedder.norm_out", ("image_embedder.norm_out", None)),
    ("cond_type_embed", ("cond_type_embed", None)),
    ("norm_out.linear", ("norm_out.linear", None)),
    ("proj_out", ("proj_out", None)),
    # our fused names resolve to themselves
    ("transformer_blocks.0.attn.to_qkv", ("transformer_blocks.0.attn.to_qkv", None)),
    ("transformer_blocks.0.attn.to_added_qkv", ("transformer_blocks.0.attn.to_added_qkv", None)),
]

TENCENT = [
    ("double_blocks.0.img_attn_q", ("transformer_blocks.0.attn.to_qkv", "q")),
    ("double_blocks.0.img_attn_k", ("transformer_blocks.0.attn.to_qkv", "k")),
    ("double_blocks.53.img_attn_v", ("transformer_blocks.53.attn.to_qkv", "v")),
    ("double_blocks.3.txt_attn_q", ("transformer_blocks.3.attn.to_added_qkv", "q")),
    ("double_blocks.3.txt_attn_k", ("transformer_blocks.3.attn.to_added_qkv", "k")),
    ("double_blocks.3.txt_attn_v", ("transformer_blocks.3.attn.to_added_qkv", "v")),
    ("double_blocks.3.img_attn_q_norm", ("transformer_blocks.3.attn.norm_q", None)),
    ("double_blocks.3.img_attn_k_norm", ("transformer_blocks.3.attn.norm_k", None)),
    ("double_blocks.3.txt_attn_q_norm", ("transformer_blocks.3.attn.norm_added_q", None)),
    ("double_blocks.3.txt_attn_k_norm", ("transformer_blocks.3.attn.norm_added_k", None)),
    ("double_blocks.3.img_attn_proj", ("transformer_blocks.3.attn.to_out.0", None)),
    ("double_blocks.3.txt_attn_proj", ("transformer_blocks.3.attn.to_add_out", None)),
    ("double_blocks.3.img_mod.linear", ("transformer_blocks.3.norm1.linear", None)),
    ("double_blocks.3.txt_mod.linear", ("transformer_blocks.3.norm1_context.linear", None)),
    ("double_blocks.3.img_mlp.fc1", ("transformer_blocks.3.ff.net.0.proj", None)),
    ("double_blocks.3.img_mlp.fc2", ("transformer_blocks.3.ff.net.2", None)),
    ("double_blocks.3.txt_mlp.fc1", ("transformer_blocks.3.ff_context.net.0.proj", None)),
    ("double_blocks.3.txt_mlp.fc2", ("transformer_blocks.3.ff_context.net.2", None)),
    ("txt_in.individual_token_refiner.blocks.1.self_attn_qkv", (f"{R}.1.attn.to_qkv", None)),
    ("txt_in.individual_token_refiner.blocks.1.self_attn_proj", (f"{R}.1.attn.to_out.0", None)),
    ("txt_in.individual_token_refiner.blocks.0.mlp.fc1", (f"{R}.0.ff.net.0.proj", None)),
    ("txt_in.individual_token_refiner.blocks.0.mlp.fc2", (f"{R}.0.ff.net.2", None)),
    (
        "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1",
        (f"{R}.0.norm_out.linear", None),
    ),
    ("txt_in.individual_token_refiner.blocks.0.norm1", (f"{R}.0.norm1", None)),
    ("txt_in.input_embedder", ("context_embedder.proj_in", None)),
    (
        "txt_in.t_embedder.mlp.0",
        ("context_embedder.time_text_embed.timestep_embedder.linear_1", None),
    ),
    (
        "txt_in.t_embedder.mlp.2",
        ("context_embedder.time_text_embed.timestep_embedder.linear_2", None),
    ),
    (
        "txt_in.c_embedder.linear_1",
        ("context_embedder.time_text_embed.text_embedder.linear_1", None),
    ),
    (
        "txt_in.c_embedder.linear_2",
        ("context_embedder.time_text_embed.text_embedder.linear_2", None),
    ),
    ("time_in.mlp.0", ("time_embed.timestep_embedder.linear_1", None)),
    ("time_in.mlp.2", ("time_embed.timestep_embedder.linear_2", None)),
    ("img_in.proj", ("x_embedder.proj", None)),
    ("cond_type_embedding", ("cond_type_embed", None)),
    ("byt5_in.layernorm", ("context_embedder_2.norm", None)),
    ("byt5_in.fc1", ("context_embedder_2.linear_1", None)),
    ("byt5_in.fc2", ("context_embedder_2.linear_2", None)),
    ("byt5_in.fc3", ("context_embedder_2.linear_3", None)),
    ("vision_in.proj.0", ("image_embedder.norm_in", None)),
    ("vision_in.proj.1", ("image_embedder.linear_1", None)),
    ("vision_in.proj.3", ("image_embedder.linear_2", None)),
    ("vision_in.proj.4", ("image_embedder.norm_out", None)),
    ("final_layer.linear", ("proj_out", None)),
    ("final_layer.adaLN_modulation.1", ("norm_out.linear", None)),  # rows swapped, see below
    # ComfyUI single-file / LoRA wrappers
    ("model.diffusion_model.double_blocks.2.img_attn_q", ("transformer_blocks.2.attn.to_qkv", "q")),
    ("diffusion_model.final_layer.linear", ("proj_out", None)),
]


def _tiny(num_layers: int = 54) -> HunyuanVideo15Transformer:
    cfg = HunyuanVideo15ArchConfig(
        in_channels=3,
        out_channels=2,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=num_layers,
        text_embed_dim=4,
        text_embed_2_dim=4,
        image_embed_dim=4,
        rope_axes_dim=(2, 2, 4),
    )
    return HunyuanVideo15Transformer(cfg, tp_rank=0, tp_size=1, device="meta")


@pytest.mark.parametrize(
    "name,expected", DIFFUSERS + TENCENT, ids=[n for n, _ in DIFFUSERS + TENCENT]
)
def test_resolve(name, expected):
    assert HUNYUAN_VIDEO15_NAME_MAP.resolve(name) == expected


def test_final_layer_rows_are_swapped_and_nothing_else_is():
    """Tencent's final-layer modulation rows are (shift, scale); diffusers' (scale, shift)."""
    assert HUNYUAN_VIDEO15_NAME_MAP.row_order("final_layer.adaLN_modulation.1") == (1, 0)
    for name, _ in DIFFUSERS + TENCENT:
        if not name.endswith("final_layer.adaLN_modulation.1"):
            assert HUNYUAN_VIDEO15_NAME_MAP.row_order(name) is None, name


def test_every_target_is_a_module_of_ours_with_that_shard():
    """At the real depth (54 blocks, tiny width) every resolved module exists and its shard id is
    one of that layer's shards."""
    modules = dict(_tiny().named_modules())
    for name, (ours, shard) in DIFFUSERS + TENCENT:
        assert ours in modules, name
        if shard is not None:
            assert shard in modules[ours].output_shard_ids, name


def test_resolve_param_keeps_the_leaf():
    nm = HUNYUAN_VIDEO15_NAME_MAP
    assert nm.resolve_param("double_blocks.0.img_attn_q.bias") == (
        "transformer_blocks.0.attn.to_qkv.bias",
        "q",
    )
    assert nm.resolve_param("cond_type_embedding.weight") == ("cond_type_embed.weight", None)
    assert nm.resolve_param("double_blocks.0.txt_attn_k_norm.weight") == (
        "transformer_blocks.0.attn.norm_added_k.weight",
        None,
    )


def test_lora_vocabulary_reaches_tencent_names():
    """The LoRA adapter's vocabulary (built by inverting the rules) has the Tencent spellings with
    their targets, for the blocks and for the refiner."""
    from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec

    with torch.device("cpu"):
        model = _tiny(num_layers=2)
    spec = LoRAModelSpec.from_module(model, HUNYUAN_VIDEO15_NAME_MAP)
    assert spec.shards("transformer_blocks.1.attn.to_qkv") == ["q", "k", "v"]
    vocab = spec.vocabulary
    assert vocab["double_blocks.1.img_attn_q"] == ("transformer_blocks.1.attn.to_qkv", "q")
    assert vocab["double_blocks.0.txt_attn_proj"] == ("transformer_blocks.0.attn.to_add_out", None)
