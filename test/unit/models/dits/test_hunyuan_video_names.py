"""HUNYUAN_VIDEO_NAME_MAP against a hand-written table: diffusers and original (Tencent) module
names -> (our module, shard id). The expected targets are written out here, not derived from the
rules; every one must be a module of our (tiny) model."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.configs.hunyuan_video import HunyuanVideoArchConfig
from sglang.multimodal_gen.models.dits.hunyuan_video import HunyuanVideoTransformer
from sglang.multimodal_gen.models.dits.hunyuan_video_names import HUNYUAN_VIDEO_NAME_MAP

TB, STB = "transformer_blocks", "single_transformer_blocks"
RB = "context_embedder.token_refiner.refiner_blocks"
TTE = "time_text_embed"
CTE = "context_embedder.time_text_embed"

DIFFUSERS = [
    ("transformer_blocks.0.attn.to_q", (f"{TB}.0.attn.to_qkv", "q")),
    ("transformer_blocks.1.attn.to_v", (f"{TB}.1.attn.to_qkv", "v")),
    ("transformer_blocks.1.attn.add_k_proj", (f"{TB}.1.attn.to_added_qkv", "k")),
    ("transformer_blocks.0.attn.to_out.0", (f"{TB}.0.attn.to_out.0", None)),
    ("transformer_blocks.0.attn.to_add_out", (f"{TB}.0.attn.to_add_out", None)),
    ("transformer_blocks.1.attn.norm_added_q", (f"{TB}.1.attn.norm_added_q", None)),
    ("transformer_blocks.1.ff_context.net.2", (f"{TB}.1.ff_context.net.2", None)),
    ("transformer_blocks.1.norm1_context.linear", (f"{TB}.1.norm1_context.linear", None)),
    ("single_transformer_blocks.0.attn.to_q", (f"{STB}.0.to_qkv_mlp", 0)),
    ("single_transformer_blocks.1.attn.to_k", (f"{STB}.1.to_qkv_mlp", 1)),
    ("single_transformer_blocks.1.attn.to_v", (f"{STB}.1.to_qkv_mlp", 2)),
    ("single_transformer_blocks.0.proj_mlp", (f"{STB}.0.to_qkv_mlp", 3)),
    ("single_transformer_blocks.0.proj_out", (f"{STB}.0.proj_out", None)),
    ("single_transformer_blocks.1.attn.norm_k", (f"{STB}.1.attn.norm_k", None)),
    (f"{RB}.0.attn.to_q", (f"{RB}.0.attn.to_qkv", "q")),
    (f"{RB}.1.attn.to_k", (f"{RB}.1.attn.to_qkv", "k")),
    (f"{RB}.1.attn.to_v", (f"{RB}.1.attn.to_qkv", "v")),
    (f"{RB}.1.attn.to_out.0", (f"{RB}.1.attn.to_out.0", None)),
    (f"{RB}.0.ff.net.0.proj", (f"{RB}.0.ff.net.0.proj", None)),
    (f"{RB}.0.norm_out.linear", (f"{RB}.0.norm_out.linear", None)),
    (f"{RB}.0.norm1", (f"{RB}.0.norm1", None)),
    ("context_embedder.proj_in", ("context_embedder.proj_in", None)),
    (f"{CTE}.timestep_embedder.linear_1", (f"{CTE}.timestep_embedder.linear_1", None)),
    (f"{TTE}.guidance_embedder.linear_2", (f"{TTE}.guidance_embedder.linear_2", None)),
    ("x_embedder.proj", ("x_embedder.proj", None)),
    ("norm_out.linear", ("norm_out.linear", None)),
    ("proj_out", ("proj_out", None)),
]

TENCENT = [
    ("double_blocks.0.img_attn_qkv", (f"{TB}.0.attn.to_qkv", None)),
    ("double_blocks.1.txt_attn_qkv", (f"{TB}.1.attn.to_added_qkv", None)),
    ("double_blocks.0.img_attn_proj", (f"{TB}.0.attn.to_out.0", None)),
    ("double_blocks.0.txt_attn_proj", (f"{TB}.0.attn.to_add_out", None)),
    ("double_blocks.1.img_attn_q_norm", (f"{TB}.1.attn.norm_q", None)),
    ("double_blocks.1.img_attn_k_norm", (f"{TB}.1.attn.norm_k", None)),
    ("double_blocks.1.txt_attn_q_norm", (f"{TB}.1.attn.norm_added_q", None)),
    ("double_blocks.1.txt_attn_k_norm", (f"{TB}.1.attn.norm_added_k", None)),
    ("double_blocks.0.img_mlp.fc1", (f"{TB}.0.ff.net.0.proj", None)),
    ("double_blocks.0.img_mlp.fc2", (f"{TB}.0.ff.net.2", None)),
    ("double_blocks.0.txt_mlp.fc1", (f"{TB}.0.ff_context.net.0.proj", None)),
    ("double_blocks.0.txt_mlp.fc2", (f"{TB}.0.ff_context.net.2", None)),
    ("double_blocks.1.img_mod.linear", (f"{TB}.1.norm1.linear", None)),
    ("double_blocks.1.txt_mod.linear", (f"{TB}.1.norm1_context.linear", None)),
    ("single_blocks.1.linear1", (f"{STB}.1.to_qkv_mlp", None)),
    ("single_blocks.1.linear2", (f"{STB}.1.proj_out", None)),
    ("single_blocks.0.modulation.linear", (f"{STB}.0.norm.linear", None)),
    ("single_blocks.0.q_norm", (f"{STB}.0.attn.norm_q", None)),
    ("single_blocks.0.k_norm", (f"{STB}.0.attn.norm_k", None)),
    ("txt_in.individual_token_refiner.blocks.1.self_attn_qkv", (f"{RB}.1.attn.to_qkv", None)),
    ("txt_in.individual_token_refiner.blocks.1.self_attn_proj", (f"{RB}.1.attn.to_out.0", None)),
    ("txt_in.individual_token_refiner.blocks.0.mlp.fc1", (f"{RB}.0.ff.net.0.proj", None)),
    ("txt_in.individual_token_refiner.blocks.0.mlp.fc2", (f"{RB}.0.ff.net.2", None)),
    (
        "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1",
        (f"{RB}.0.norm_out.linear", None),
    ),
    ("txt_in.individual_token_refiner.blocks.0.norm2", (f"{RB}.0.norm2", None)),
    ("txt_in.t_embedder.mlp.0", (f"{CTE}.timestep_embedder.linear_1", None)),
    ("txt_in.t_embedder.mlp.2", (f"{CTE}.timestep_embedder.linear_2", None)),
    ("txt_in.c_embedder.linear_1", (f"{CTE}.text_embedder.linear_1", None)),
    ("txt_in.c_embedder.linear_2", (f"{CTE}.text_embedder.linear_2", None)),
    ("txt_in.input_embedder", ("context_embedder.proj_in", None)),
    ("time_in.mlp.0", (f"{TTE}.timestep_embedder.linear_1", None)),
    ("time_in.mlp.2", (f"{TTE}.timestep_embedder.linear_2", None)),
    ("guidance_in.mlp.0", (f"{TTE}.guidance_embedder.linear_1", None)),
    ("guidance_in.mlp.2", (f"{TTE}.guidance_embedder.linear_2", None)),
    ("vector_in.in_layer", (f"{TTE}.text_embedder.linear_1", None)),
    ("vector_in.out_layer", (f"{TTE}.text_embedder.linear_2", None)),
    ("img_in.proj", ("x_embedder.proj", None)),
    ("final_layer.linear", ("proj_out", None)),
    ("final_layer.adaLN_modulation.1", ("norm_out.linear", None)),
]


@pytest.fixture(scope="module")
def our_modules():
    cfg = HunyuanVideoArchConfig(
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=2,
        text_embed_dim=8,
        pooled_projection_dim=8,
        rope_axes_dim=(4, 6, 6),
        in_channels=4,
        out_channels=4,
    )
    return dict(HunyuanVideoTransformer(cfg, tp_rank=0, tp_size=1).named_modules())


@pytest.mark.parametrize(
    "name, expected", DIFFUSERS + TENCENT, ids=[n for n, _ in DIFFUSERS + TENCENT]
)
def test_resolves_to_our_module(name, expected, our_modules):
    assert HUNYUAN_VIDEO_NAME_MAP.resolve(name) == expected
    assert expected[0] in our_modules
    # ComfyUI / single-file wrappers are stripped
    assert HUNYUAN_VIDEO_NAME_MAP.resolve("model.diffusion_model." + name) == expected


def test_row_order_only_on_the_final_layer():
    assert HUNYUAN_VIDEO_NAME_MAP.row_order("final_layer.adaLN_modulation.1") == (1, 0)
    assert HUNYUAN_VIDEO_NAME_MAP.row_order("norm_out.linear") is None
    refiner_ada = "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1"
    assert HUNYUAN_VIDEO_NAME_MAP.row_order(refiner_ada) is None  # (gate_msa, gate_mlp): as ours


def test_param_names_keep_their_leaf():
    m = HUNYUAN_VIDEO_NAME_MAP
    assert m.resolve_param("single_blocks.3.q_norm.weight") == (f"{STB}.3.attn.norm_q.weight", None)
    assert m.resolve_param("transformer_blocks.2.attn.add_v_proj.bias") == (
        f"{TB}.2.attn.to_added_qkv.bias",
        "v",
    )
