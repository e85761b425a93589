"""HunyuanVideo 1.0 name map: original (Tencent) names <-> diffusers names <-> our fused modules.

The one place that says how HunyuanVideo 1.0 checkpoints and LoRA files name the DiT's modules;
used by the weight loader and by the LoRA format adapter alike.

Our modules (``models/dits/hunyuan_video.py``, ``hunyuan_video_layers.py``) carry diffusers' names
except the fused projections:

==========================================================  ======================================
ours                                                        diffusers (shard id) / Tencent (whole)
==========================================================  ======================================
``transformer_blocks.N.attn.to_qkv``                        ``attn.to_q|to_k|to_v`` (``"q"|"k"|
                                                            "v"``) / ``double_blocks.N.
                                                            img_attn_qkv``
``transformer_blocks.N.attn.to_added_qkv``                  ``attn.add_q_proj|add_k_proj|
                                                            add_v_proj`` / ``txt_attn_qkv``
``single_transformer_blocks.N.to_qkv_mlp``                  ``attn.to_q|to_k|to_v``, ``proj_mlp``
                                                            (``0|1|2|3``) / ``single_blocks.N.
                                                            linear1``
``context_embedder.token_refiner.refiner_blocks.N.attn.``   ``attn.to_q|to_k|to_v`` / ``txt_in.
``to_qkv``                                                  individual_token_refiner.blocks.N.
                                                            self_attn_qkv``
==========================================================  ======================================

The Tencent -> diffusers renames (source: diffusers 0.42.1
``convert_hunyuan_video_transformer_to_diffusers`` in ``loaders/single_file_utils.py``; Tencent's
``hyvideo/modules/models.py``):

* top level: ``img_in`` -> ``x_embedder`` (``img_in.proj``: the Conv3d, whose 5-D weight our
  ``x_embedder.proj`` flattens when loading), ``time_in.mlp.0|2`` ->
  ``time_text_embed.timestep_embedder.linear_1|2``, ``guidance_in.mlp.0|2`` ->
  ``time_text_embed.guidance_embedder.linear_1|2``, ``vector_in.in_layer|out_layer`` ->
  ``time_text_embed.text_embedder.linear_1|2``, ``final_layer.linear`` -> ``proj_out``,
  ``final_layer.adaLN_modulation.1`` -> ``norm_out.linear`` (Tencent stores its rows as
  ``(shift, scale)``, diffusers as ``(scale, shift)``: the rule carries ``row_order=(1, 0)``,
  which the weight loader and the LoRA adapter apply);
* the token refiner ``txt_in`` -> ``context_embedder``: ``t_embedder.mlp.0|2`` ->
  ``time_text_embed.timestep_embedder.linear_1|2``, ``c_embedder.linear_1|2`` ->
  ``time_text_embed.text_embedder.linear_1|2``, ``input_embedder`` -> ``proj_in``,
  ``individual_token_refiner.blocks.N`` -> ``token_refiner.refiner_blocks.N`` with
  ``self_attn_qkv`` -> ``attn.to_qkv``, ``self_attn_proj`` -> ``attn.to_out.0``,
  ``mlp.fc1|fc2`` -> ``ff.net.0.proj|ff.net.2``, ``adaLN_modulation.1`` -> ``norm_out.linear``
  (``norm1``/``norm2`` keep their names);
* ``double_blocks.N`` -> ``transformer_blocks.N``: ``img_mod.linear|txt_mod.linear`` ->
  ``norm1.linear|norm1_context.linear``, ``img_attn_qkv|txt_attn_qkv`` -> the fused layers above,
  ``img_attn_q_norm|k_norm`` -> ``attn.norm_q|norm_k``, ``txt_attn_q_norm|k_norm`` ->
  ``attn.norm_added_q|norm_added_k``, ``img_attn_proj`` -> ``attn.to_out.0``, ``txt_attn_proj``
  -> ``attn.to_add_out``, ``img_mlp.fc1|fc2`` -> ``ff.net.0.proj|ff.net.2``, ``txt_mlp.fc1|fc2``
  -> ``ff_context.net.0.proj|ff_context.net.2``;
* ``single_blocks.N`` -> ``single_transformer_blocks.N``: ``linear1`` -> ``to_qkv_mlp``,
  ``linear2`` -> ``proj_out``, ``modulation.linear`` -> ``norm.linear``, ``q_norm|k_norm`` ->
  ``attn.norm_q|norm_k``;
* wrappers ``model.diffusion_model.`` / ``diffusion_model.`` (ComfyUI single files, many LoRA
  files) are stripped.

ComfyUI's own module names (``comfy/ldm/hunyuan_video/model.py`` builds the model on Flux's
block classes), which LoRA files saved by ComfyUI use, are mapped too: ``double_blocks.N.
img_attn.qkv`` / ``txt_attn.qkv`` (fused, whole layer), ``img_attn.proj``, ``img_mod.lin``,
``img_mlp.0|2`` (and ``txt_*``), ``single_blocks.N.modulation.lin``, the refiner's
``self_attn.qkv`` / ``self_attn.proj`` / ``mlp.0|2``, ``MLPEmbedder``'s ``in_layer`` /
``out_layer`` for ``time_in``, ``guidance_in``, ``txt_in.t_embedder`` and ``txt_in.c_embedder``.
These are Flux's BFL names as well: a block-only Flux file fits this model's names (and, at the
real sizes, its shapes).

Rules are applied in order: first the block-family and top-level prefixes, then the rules scoped
to one block family (:class:`BlockRule`), so the dual-stream, single-stream and refiner blocks'
``attn.to_q`` each reach their own fused layer.
"""

from __future__ import annotations

from sglang.multimodal_gen.models.name_map import BlockRule, NameMap, NameRule, ShardId

__all__ = [
    "HUNYUAN_VIDEO_NAME_MAP",
    "HV_DOUBLE_BLOCKS",
    "HV_REFINER_BLOCKS",
    "HV_SINGLE_BLOCKS",
]

HV_DOUBLE_BLOCKS = "transformer_blocks"
HV_SINGLE_BLOCKS = "single_transformer_blocks"
HV_REFINER_BLOCKS = "context_embedder.token_refiner.refiner_blocks"


def _top(source: str, target: str, row_order: tuple[int, ...] | None = None) -> NameRule:
    return NameRule(source, target, prefix_only=True, row_order=row_order)


def _double(source: str, target: str, shard_id: ShardId = None) -> BlockRule:
    return BlockRule(source, target, shard_id, blocks=HV_DOUBLE_BLOCKS)


def _single(source: str, target: str, shard_id: ShardId = None) -> BlockRule:
    return BlockRule(source, target, shard_id, blocks=HV_SINGLE_BLOCKS)


def _refiner(source: str, target: str, shard_id: ShardId = None) -> BlockRule:
    return BlockRule(source, target, shard_id, blocks=HV_REFINER_BLOCKS)


HUNYUAN_VIDEO_NAME_MAP = NameMap(
    rules=(
        # ---- Tencent layout -> diffusers layout: block families and top-level modules
        _top("double_blocks", HV_DOUBLE_BLOCKS),
        _top("single_blocks", HV_SINGLE_BLOCKS),
        _top("txt_in.individual_token_refiner.blocks", HV_REFINER_BLOCKS),
        _top("img_in", "x_embedder"),
        _top("time_in.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
        _top("time_in.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
        _top("guidance_in.mlp.0", "time_text_embed.guidance_embedder.linear_1"),
        _top("guidance_in.mlp.2", "time_text_embed.guidance_embedder.linear_2"),
        _top("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
        _top("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
        _top(
            "txt_in.t_embedder.mlp.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"
        ),
        _top(
            "txt_in.t_embedder.mlp.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"
        ),
        _top("txt_in.c_embedder", "context_embedder.time_text_embed.text_embedder"),
        _top("txt_in.input_embedder", "context_embedder.proj_in"),
        _top("final_layer.linear", "proj_out"),
        # Tencent rows are (shift, scale), diffusers' (scale, shift): output rows swapped in halves
        _top("final_layer.adaLN_modulation.1", "norm_out.linear", row_order=(1, 0)),
        # ---- dual-stream blocks, Tencent -> ours (fused layers stay whole: shard None)
        _double("img_attn_qkv", "attn.to_qkv"),
        _double("txt_attn_qkv", "attn.to_added_qkv"),
        _double("img_attn_proj", "attn.to_out.0"),
        _double("txt_attn_proj", "attn.to_add_out"),
        _double("img_attn_q_norm", "attn.norm_q"),
        _double("img_attn_k_norm", "attn.norm_k"),
        _double("txt_attn_q_norm", "attn.norm_added_q"),
        _double("txt_attn_k_norm", "attn.norm_added_k"),
        _double("img_mlp.fc1", "ff.net.0.proj"),
        _double("img_mlp.fc2", "ff.net.2"),
        _double("txt_mlp.fc1", "ff_context.net.0.proj"),
        _double("txt_mlp.fc2", "ff_context.net.2"),
        _double("img_mod.linear", "norm1.linear"),
        _double("txt_mod.linear", "norm1_context.linear"),
        # ---- dual-stream blocks, diffusers split projections -> our fused layers
        _double("attn.to_q", "attn.to_qkv", "q"),
        _double("attn.to_k", "attn.to_qkv", "k"),
        _double("attn.to_v", "attn.to_qkv", "v"),
        _double("attn.add_q_proj", "attn.to_added_qkv", "q"),
        _double("attn.add_k_proj", "attn.to_added_qkv", "k"),
        _double("attn.add_v_proj", "attn.to_added_qkv", "v"),
        # ---- single-stream blocks, Tencent -> ours
        _single("linear1", "to_qkv_mlp"),
        _single("linear2", "proj_out"),
        _single("modulation.linear", "norm.linear"),
        _single("q_norm", "attn.norm_q"),
        _single("k_norm", "attn.norm_k"),
        # ---- single-stream blocks, diffusers split projections -> our fused [q | k | v | mlp]
        _single("attn.to_q", "to_qkv_mlp", 0),
        _single("attn.to_k", "to_qkv_mlp", 1),
        _single("attn.to_v", "to_qkv_mlp", 2),
        _single("proj_mlp", "to_qkv_mlp", 3),
        # ---- token refiner blocks, Tencent -> ours
        _refiner("self_attn_qkv", "attn.to_qkv"),
        _refiner("self_attn_proj", "attn.to_out.0"),
        _refiner("mlp.fc1", "ff.net.0.proj"),
        _refiner("mlp.fc2", "ff.net.2"),
        _refiner("adaLN_modulation.1", "norm_out.linear"),
        # ---- token refiner blocks, diffusers split projections -> our fused qkv
        _refiner("attn.to_q", "attn.to_qkv", "q"),
        _refiner("attn.to_k", "attn.to_qkv", "k"),
        _refiner("attn.to_v", "attn.to_qkv", "v"),
        # ---- ComfyUI's own names (``comfy/ldm/hunyuan_video/model.py``, Flux's block classes:
        # fused ``img_attn.qkv``, ``*_mod.lin``, ``*_mlp.0|2``, ``modulation.lin``,
        # ``MLPEmbedder`` ``in_layer`` / ``out_layer``), as LoRA files saved by ComfyUI spell
        # them; after the renames above
        _double("img_mod.lin", "norm1.linear"),
        _double("txt_mod.lin", "norm1_context.linear"),
        _double("img_attn.qkv", "attn.to_qkv"),
        _double("txt_attn.qkv", "attn.to_added_qkv"),
        _double("img_attn.proj", "attn.to_out.0"),
        _double("txt_attn.proj", "attn.to_add_out"),
        _double("img_mlp.0", "ff.net.0.proj"),
        _double("img_mlp.2", "ff.net.2"),
        _double("txt_mlp.0", "ff_context.net.0.proj"),
        _double("txt_mlp.2", "ff_context.net.2"),
        _single("modulation.lin", "norm.linear"),
        _refiner("self_attn.qkv", "attn.to_qkv"),
        _refiner("self_attn.proj", "attn.to_out.0"),
        _refiner("mlp.0", "ff.net.0.proj"),
        _refiner("mlp.2", "ff.net.2"),
        _top("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
        _top("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
        _top("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
        _top("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
        _top(
            "txt_in.t_embedder.in_layer",
            "context_embedder.time_text_embed.timestep_embedder.linear_1",
        ),
        _top(
            "txt_in.t_embedder.out_layer",
            "context_embedder.time_text_embed.timestep_embedder.linear_2",
        ),
        _top(
            "context_embedder.time_text_embed.text_embedder.in_layer",
            "context_embedder.time_text_embed.text_embedder.linear_1",
        ),
        _top(
            "context_embedder.time_text_embed.text_embedder.out_layer",
            "context_embedder.time_text_embed.text_embedder.linear_2",
        ),
    ),
    strip_prefixes=("model.diffusion_model.", "diffusion_model."),
)
