"""QWEN_IMAGE_NAME_MAP against a hand-written table: checkpoint (diffusers) module names ->
(our module, shard id). The expected targets are written out here, not derived from the rules."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.configs.qwen_image import QwenImageArchConfig
from sglang.multimodal_gen.models.dits.qwen_image import QwenImageTransformer
from sglang.multimodal_gen.models.dits.qwen_image_names import QWEN_IMAGE_NAME_MAP

TB = "transformer_blocks"

TABLE = [
    # image stream: split q/k/v -> fused QKV
    ("transformer_blocks.0.attn.to_q", (f"{TB}.0.attn.to_qkv", "q")),
    ("transformer_blocks.13.attn.to_k", (f"{TB}.13.attn.to_qkv", "k")),
    ("transformer_blocks.59.attn.to_v", (f"{TB}.59.attn.to_qkv", "v")),
    # text stream: split added q/k/v -> fused QKV
    ("transformer_blocks.0.attn.add_q_proj", (f"{TB}.0.attn.to_added_qkv", "q")),
    ("transformer_blocks.7.attn.add_k_proj", (f"{TB}.7.attn.to_added_qkv", "k")),
    ("transformer_blocks.59.attn.add_v_proj", (f"{TB}.59.attn.to_added_qkv", "v")),
    # block modules under their own names
    ("transformer_blocks.0.attn.to_out.0", (f"{TB}.0.attn.to_out.0", None)),
    ("transformer_blocks.0.attn.to_add_out", (f"{TB}.0.attn.to_add_out", None)),
    ("transformer_blocks.1.attn.norm_q", (f"{TB}.1.attn.norm_q", None)),
    ("transformer_blocks.1.attn.norm_k", (f"{TB}.1.attn.norm_k", None)),
    ("transformer_blocks.1.attn.norm_added_q", (f"{TB}.1.attn.norm_added_q", None)),
    ("transformer_blocks.1.attn.norm_added_k", (f"{TB}.1.attn.norm_added_k", None)),
    ("transformer_blocks.2.img_mod.1", (f"{TB}.2.img_mod.1", None)),
    ("transformer_blocks.2.txt_mod.1", (f"{TB}.2.txt_mod.1", None)),
    ("transformer_blocks.3.img_mlp.net.0.proj", (f"{TB}.3.img_mlp.net.0.proj", None)),
    ("transformer_blocks.3.img_mlp.net.2", (f"{TB}.3.img_mlp.net.2", None)),
    ("transformer_blocks.3.txt_mlp.net.0.proj", (f"{TB}.3.txt_mlp.net.0.proj", None)),
    ("transformer_blocks.3.txt_mlp.net.2", (f"{TB}.3.txt_mlp.net.2", None)),
    # top level
    ("img_in", ("img_in", None)),
    ("txt_in", ("txt_in", None)),
    ("txt_norm", ("txt_norm", None)),
    (
        "time_text_embed.timestep_embedder.linear_1",
        ("time_text_embed.timestep_embedder.linear_1", None),
    ),
    (
        "time_text_embed.timestep_embedder.linear_2",
        ("time_text_embed.timestep_embedder.linear_2", None),
    ),
    ("norm_out.linear", ("norm_out.linear", None)),
    ("proj_out", ("proj_out", None)),
    # our own fused names resolve to themselves, whole layer
    ("transformer_blocks.4.attn.to_qkv", (f"{TB}.4.attn.to_qkv", None)),
    ("transformer_blocks.4.attn.to_added_qkv", (f"{TB}.4.attn.to_added_qkv", None)),
    # wrapper prefixes of single-file / ComfyUI checkpoints
    ("model.diffusion_model.transformer_blocks.2.attn.to_k", (f"{TB}.2.attn.to_qkv", "k")),
    ("diffusion_model.transformer_blocks.5.attn.add_q_proj", (f"{TB}.5.attn.to_added_qkv", "q")),
    ("diffusion_model.proj_out", ("proj_out", None)),
]


@pytest.mark.parametrize("name,expected", TABLE, ids=[n for n, _ in TABLE])
def test_resolve(name, expected):
    assert QWEN_IMAGE_NAME_MAP.resolve(name) == expected


def test_resolve_param_keeps_the_leaf():
    assert QWEN_IMAGE_NAME_MAP.resolve_param("transformer_blocks.3.attn.add_v_proj.bias") == (
        "transformer_blocks.3.attn.to_added_qkv.bias",
        "v",
    )
    assert QWEN_IMAGE_NAME_MAP.resolve_param("txt_norm.weight") == ("txt_norm.weight", None)


def test_every_target_is_a_module_of_ours_with_that_shard():
    """Each resolved name exists in a model with 60 blocks (the real depth, tiny width), and the
    shard id is one of that layer's shards."""
    cfg = QwenImageArchConfig(
        in_channels=8,
        out_channels=2,
        num_layers=60,
        num_attention_heads=2,
        attention_head_dim=8,
        axes_dims_rope=(2, 2, 4),
        joint_attention_dim=8,
    )
    with torch.device("meta"):
        model = QwenImageTransformer(cfg, tp_rank=0, tp_size=1, device="meta")
    modules = dict(model.named_modules())
    for name, (ours, shard) in TABLE:
        assert ours in modules, name
        if shard is not None:
            assert shard in modules[ours].output_shard_ids, name
