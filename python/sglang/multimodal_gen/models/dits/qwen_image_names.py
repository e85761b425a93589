"""Qwen-Image name map: checkpoint (diffusers) names <-> our fused modules.

Qwen-Image was released in the diffusers layout, so its original checkpoint names *are* the
diffusers names (``transformer/diffusion_pytorch_model-*.safetensors``); ComfyUI-style single
files wrap them in ``model.diffusion_model.`` / ``diffusion_model.``, which are stripped.

Our modules (``models/dits/qwen_image.py``) carry diffusers' names except the two fused
projections of every block:

============================================  =================================================
ours                                          diffusers (shard id)
============================================  =================================================
``transformer_blocks.N.attn.to_qkv``          ``attn.to_q | to_k | to_v`` (``"q" | "k" | "v"``)
``transformer_blocks.N.attn.to_added_qkv``    ``attn.add_q_proj | add_k_proj | add_v_proj``
                                              (``"q" | "k" | "v"``)
============================================  =================================================

Everything else maps to itself (``attn.to_out.0``, ``attn.to_add_out``, ``attn.norm_q|norm_k|
norm_added_q|norm_added_k``, ``img_mod.1``, ``txt_mod.1``, ``img_mlp.net.0.proj|net.2``,
``txt_mlp...``, ``img_in``, ``txt_in``, ``txt_norm``, ``time_text_embed.timestep_embedder.
linear_1|linear_2``, ``norm_out.linear``, ``proj_out``). The rules are scoped to
``transformer_blocks.N.`` (:class:`~sglang.multimodal_gen.models.dits.flux_names.BlockRule`),
and our fused names resolve to themselves with shard ``None`` (the whole layer).
"""

from __future__ import annotations

from sglang.multimodal_gen.models.name_map import BlockRule, NameMap

__all__ = ["QWEN_IMAGE_NAME_MAP"]

BLOCKS = "transformer_blocks"


def _block(source: str, target: str, shard_id: str) -> BlockRule:
    return BlockRule(source, target, shard_id, blocks=BLOCKS)


QWEN_IMAGE_NAME_MAP = NameMap(
    rules=(
        # image stream: split q/k/v -> fused QKV
        _block("attn.to_q", "attn.to_qkv", "q"),
        _block("attn.to_k", "attn.to_qkv", "k"),
        _block("attn.to_v", "attn.to_qkv", "v"),
        # text stream: split added q/k/v -> fused QKV
        _block("attn.add_q_proj", "attn.to_added_qkv", "q"),
        _block("attn.add_k_proj", "attn.to_added_qkv", "k"),
        _block("attn.add_v_proj", "attn.to_added_qkv", "v"),
    ),
    strip_prefixes=("model.diffusion_model.", "diffusion_model."),
)
