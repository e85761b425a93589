"""HunyuanVideo 1.5 name map: original (Tencent) names <-> diffusers names <-> our fused modules.

The one place that says how HunyuanVideo 1.5 checkpoints and LoRA files name the DiT's modules;
used by the weight loader and by the LoRA format adapter alike.

Our modules (``models/dits/hunyuan_video15.py``) carry diffusers' names except the fused
projections:

=========================================================  =======================================
ours                                                       diffusers (shard id) / Tencent
=========================================================  =======================================
``transformer_blocks.N.attn.to_qkv``                       ``attn.to_q|to_k|to_v`` (``"q"|"k"|"v"``)
                                                           / ``double_blocks.N.img_attn_q|k|v``
``transformer_blocks.N.attn.to_added_qkv``                 ``attn.add_q_proj|add_k_proj|
                                                           add_v_proj`` / ``txt_attn_q|k|v``
``context_embedder.token_refiner.refiner_blocks.N.attn.``  ``attn.to_q|to_k|to_v`` / Tencent's
``to_qkv``                                                 fused ``self_attn_qkv`` (whole layer)
=========================================================  =======================================

The Tencent -> diffusers renames (source: diffusers' ``scripts/convert_hunyuan_video1_5_to_
diffusers.py``, ``convert_hyvideo15_transformer_to_diffusers``):

* top level: ``img_in`` -> ``x_embedder``, ``time_in.mlp.0|2`` ->
  ``time_embed.timestep_embedder.linear_1|2``, ``cond_type_embedding`` -> ``cond_type_embed``,
  ``byt5_in.layernorm|fc1|fc2|fc3`` -> ``context_embedder_2.norm|linear_1|linear_2|linear_3``,
  ``vision_in.proj.0|1|3|4`` -> ``image_embedder.norm_in|linear_1|linear_2|norm_out``,
  ``final_layer.linear`` -> ``proj_out``, ``final_layer.adaLN_modulation.1`` -> ``norm_out.linear``
  (Tencent stores its rows as ``(shift, scale)``, diffusers as ``(scale, shift)``: the rule carries
  ``row_order=(1, 0)``, which the weight loader and the LoRA adapter apply);
* the text refiner ``txt_in`` -> ``context_embedder``: ``t_embedder.mlp.0|2`` ->
  ``time_text_embed.timestep_embedder.linear_1|2``, ``c_embedder.linear_1|2`` ->
  ``time_text_embed.text_embedder.linear_1|2``, ``input_embedder`` -> ``proj_in``,
  ``individual_token_refiner.blocks.N`` -> ``token_refiner.refiner_blocks.N`` with
  ``self_attn_qkv`` -> ``attn.to_qkv`` (already fused), ``self_attn_proj`` -> ``attn.to_out.0``,
  ``mlp.fc1|fc2`` -> ``ff.net.0.proj|ff.net.2``, ``adaLN_modulation.1`` -> ``norm_out.linear``
  (``norm1``/``norm2`` keep their names);
* ``double_blocks.N`` -> ``transformer_blocks.N`` with ``img_mod.linear|txt_mod.linear`` ->
  ``norm1.linear|norm1_context.linear``, ``img_attn_q|k|v`` / ``txt_attn_q|k|v`` -> the fused
  layers above, ``img_attn_q_norm|k_norm`` -> ``attn.norm_q|norm_k``, ``txt_attn_q_norm|k_norm``
  -> ``attn.norm_added_q|norm_added_k``, ``img_attn_proj`` -> ``attn.to_out.0``,
  ``txt_attn_proj`` -> ``attn.to_add_out``, ``img_mlp.fc1|fc2`` -> ``ff.net.0.proj|ff.net.2``,
  ``txt_mlp.fc1|fc2`` -> ``ff_context.net.0.proj|ff_context.net.2``;
* wrappers ``model.diffusion_model.`` / ``diffusion_model.`` (ComfyUI single files and most LoRA
  files) are stripped.

ComfyUI's own module names (``comfy/ldm/hunyuan_video/model.py`` builds both versions on Flux's
block classes), which LoRA files saved by ComfyUI use, are mapped too: ``double_blocks.N.
img_attn.qkv`` / ``txt_attn.qkv`` (fused, whole layer), ``img_attn.proj``, ``img_mod.lin``,
``img_mlp.0|2`` (and ``txt_*``), the refiner's ``self_attn.qkv`` / ``self_attn.proj`` /
``mlp.0|2``, ``MLPEmbedder``'s ``in_layer`` / ``out_layer`` for ``time_in``, ``txt_in.t_embedder``
and ``txt_in.c_embedder``.

Not mapped: the MeanFlow reference-timestep embedder of a ``use_meanflow`` model has no Tencent
name in diffusers' converter (diffusers-layout checkpoints of it load through the identity).

Rules are applied in order: first the block-family and top-level prefixes, then the rules scoped
to one block family (:class:`BlockRule`), so e.g. the dual-stream blocks' ``attn.to_q`` and the
refiner blocks' ``attn.to_q`` each reach their own fused layer.

The dual-stream blocks (with Tencent's split q/k/v), the token refiner, the timestep embedder
and the final layer are 1.0's rules (the builders of ``hunyuan_video_names.py``); the rules here
are 1.5's own modules (``cond_type_embed``, the ByT5 and image projections).
"""

from __future__ import annotations

from sglang.multimodal_gen.models.dits.hunyuan_video_names import (
    HV_DOUBLE_BLOCKS,
    dual_block_rules,
    embedder_rules,
    final_layer_rules,
    refiner_rules,
    top_rule,
)
from sglang.multimodal_gen.models.name_map import NameMap

__all__ = ["HUNYUAN_VIDEO15_NAME_MAP"]

HUNYUAN_VIDEO15_NAME_MAP = NameMap(
    rules=(
        *final_layer_rules(),
        *embedder_rules("time_in", "time_embed.timestep_embedder"),
        top_rule("cond_type_embedding", "cond_type_embed"),
        top_rule("byt5_in.layernorm", "context_embedder_2.norm"),
        top_rule("byt5_in.fc1", "context_embedder_2.linear_1"),
        top_rule("byt5_in.fc2", "context_embedder_2.linear_2"),
        top_rule("byt5_in.fc3", "context_embedder_2.linear_3"),
        top_rule("vision_in.proj.0", "image_embedder.norm_in"),
        top_rule("vision_in.proj.1", "image_embedder.linear_1"),
        top_rule("vision_in.proj.3", "image_embedder.linear_2"),
        top_rule("vision_in.proj.4", "image_embedder.norm_out"),
        *refiner_rules(),
        *dual_block_rules(HV_DOUBLE_BLOCKS, tencent_split_qkv=True),
    ),
    strip_prefixes=("model.diffusion_model.", "diffusion_model."),
)
