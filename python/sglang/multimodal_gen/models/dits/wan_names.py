"""Wan2.x name map: original (Wan-AI) names <-> diffusers names <-> our fused modules.

The one place that says how Wan2.1 / Wan2.2 checkpoints and LoRA files name the DiT's modules;
used by the weight loader and by the LoRA format adapter alike.

Our modules (``models/dits/wan.py``) carry diffusers' names except the fused projections:

==============================  ===================================  ==========================
ours                            diffusers (shard id)                 original Wan (shard id)
==============================  ===================================  ==========================
``blocks.N.attn1.to_qkv``       ``attn1.to_q|to_k|to_v``              ``self_attn.q|k|v``
                                (``"q"|"k"|"v"``)                    (``"q"|"k"|"v"``)
``blocks.N.attn2.to_kv``        ``attn2.to_k|to_v`` (``0|1``)         ``cross_attn.k|v``
                                                                     (``0|1``)
==============================  ===================================  ==========================

(``attn1.to_qkv`` and ``attn2.to_kv`` are also the names diffusers gives these layers after
``fuse_projections()``: they resolve to themselves, whole layer.)

The other original -> diffusers renames (source: diffusers 0.42.1
``convert_wan_transformer_to_diffusers`` in ``loaders/single_file_utils.py`` and
``_convert_non_diffusers_wan_lora_to_diffusers`` in ``loaders/lora_conversion_utils.py``):

* in each block: ``self_attn.o`` -> ``attn1.to_out.0``, ``cross_attn.q|o`` -> ``attn2.to_q|
  to_out.0``, ``self_attn.norm_q|norm_k`` -> ``attn1.norm_q|norm_k`` (likewise ``cross_attn`` ->
  ``attn2``), ``ffn.0|2`` -> ``ffn.net.0.proj|ffn.net.2``, ``norm3`` -> ``norm2`` (the original
  calls the affine cross-attention norm ``norm3`` and the FFN norm ``norm2``; diffusers swaps
  them; neither ``norm1`` nor the FFN norm has parameters, so only ``norm3`` needs a rule), and
  the parameter ``modulation`` -> ``scale_shift_table``;
* top level: ``patch_embedding`` (same), ``text_embedding.0|2`` ->
  ``condition_embedder.text_embedder.linear_1|linear_2``, ``time_embedding.0|2`` ->
  ``condition_embedder.time_embedder.linear_1|linear_2``, ``time_projection.1`` ->
  ``condition_embedder.time_proj``, ``head.head`` -> ``proj_out``, and the parameter
  ``head.modulation`` -> ``scale_shift_table``;
* wrappers ``model.diffusion_model.`` / ``diffusion_model.`` (ComfyUI and most Wan LoRA files)
  are stripped.

Two renames are of *parameters*, not modules (``blocks.N.modulation`` is a bare ``[1, 6, D]``
parameter of the block, ``head.modulation`` a ``[1, 2, D]`` one of the head), which a module
:class:`NameRule` cannot express because ``resolve_param`` only renames the module part. They are
:class:`~sglang.multimodal_gen.models.name_map.ParamRename` entries of the map, applied by its
``resolve_param``. No LoRA
targets them (they are not linear layers).

Not mapped (the model refuses these configs): the I2V image branch ``cross_attn.k_img|v_img|
norm_k_img`` (diffusers ``attn2.add_k_proj|add_v_proj|norm_added_k``) and ``img_emb.*``.

Rules are scoped to the ``blocks`` family with :class:`BlockRule` (the name right after the
block index is matched), so e.g. a top-level ``proj_out`` is never touched by a block rule.
Each original name reaches our module in one rule (``self_attn.q`` -> ``attn1.to_qkv`` ``"q"``
directly), so the LoRA adapter's rule inversion finds it at depth 1.
"""

from __future__ import annotations

from sglang.multimodal_gen.models.name_map import BlockRule, NameMap, NameRule, ParamRename, ShardId

__all__ = ["WAN_BLOCKS", "WAN_NAME_MAP"]

WAN_BLOCKS = "blocks"


def _block(source: str, target: str, shard_id: ShardId = None) -> BlockRule:
    return BlockRule(source, target, shard_id, blocks=WAN_BLOCKS)


def _top(source: str, target: str) -> NameRule:
    return NameRule(source, target, prefix_only=True)


WAN_NAME_MAP = NameMap(
    rules=(
        # ---- original top-level modules -> diffusers
        _top("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
        _top("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
        _top("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
        _top("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
        _top("time_projection.1", "condition_embedder.time_proj"),
        _top("head.head", "proj_out"),
        # ---- original block modules -> ours (one step each)
        _block("self_attn.q", "attn1.to_qkv", "q"),
        _block("self_attn.k", "attn1.to_qkv", "k"),
        _block("self_attn.v", "attn1.to_qkv", "v"),
        _block("self_attn.o", "attn1.to_out.0"),
        _block("self_attn.norm_q", "attn1.norm_q"),
        _block("self_attn.norm_k", "attn1.norm_k"),
        _block("cross_attn.q", "attn2.to_q"),
        _block("cross_attn.k", "attn2.to_kv", 0),
        _block("cross_attn.v", "attn2.to_kv", 1),
        _block("cross_attn.o", "attn2.to_out.0"),
        _block("cross_attn.norm_q", "attn2.norm_q"),
        _block("cross_attn.norm_k", "attn2.norm_k"),
        _block("ffn.0", "ffn.net.0.proj"),
        _block("ffn.2", "ffn.net.2"),
        _block("norm3", "norm2"),
        # ---- diffusers split projections -> our fused layers
        _block("attn1.to_q", "attn1.to_qkv", "q"),
        _block("attn1.to_k", "attn1.to_qkv", "k"),
        _block("attn1.to_v", "attn1.to_qkv", "v"),
        _block("attn2.to_k", "attn2.to_kv", 0),
        _block("attn2.to_v", "attn2.to_kv", 1),
    ),
    strip_prefixes=("model.diffusion_model.", "diffusion_model."),
    param_renames=(
        ParamRename(r"blocks\.(\d+)\.modulation", r"blocks.\1.scale_shift_table"),
        ParamRename(r"head\.modulation", "scale_shift_table"),
    ),
)
