"""Flux.1 name map: original (BFL) names <-> diffusers names <-> our fused modules.

The one place that says how Flux.1 checkpoints and LoRA files name the DiT's modules; used by the
weight loader and by the LoRA format adapter alike.

Our modules (``models/dits/flux.py``) carry diffusers' names except the fused projections:

=====================================================  ===========================================
ours                                                   diffusers (shard id) / BFL (fused, ``None``)
=====================================================  ===========================================
``transformer_blocks.N.attn.to_qkv``                   ``attn.to_q|to_k|to_v`` (``"q"|"k"|"v"``) /
                                                       ``double_blocks.N.img_attn.qkv``
``transformer_blocks.N.attn.to_added_qkv``             ``attn.add_q_proj|add_k_proj|add_v_proj``
                                                       (``"q"|"k"|"v"``) / ``txt_attn.qkv``
``single_transformer_blocks.N.to_qkv_mlp``             ``attn.to_q|to_k|to_v``, ``proj_mlp``
                                                       (``0|1|2|3``) / ``single_blocks.N.linear1``
=====================================================  ===========================================

The other BFL renames (source: diffusers 0.42.1 ``convert_flux_transformer_checkpoint_to_diffusers``
in ``loaders/single_file_utils.py``, which is the inverse of these rules):

* double blocks: ``img_attn.proj`` -> ``attn.to_out.0``, ``txt_attn.proj`` -> ``attn.to_add_out``,
  ``img_mlp.0|2`` -> ``ff.net.0.proj|ff.net.2``, ``txt_mlp.0|2`` -> ``ff_context...``,
  ``img_mod.lin`` -> ``norm1.linear``, ``txt_mod.lin`` -> ``norm1_context.linear``,
  ``img_attn.norm.query_norm|key_norm`` -> ``attn.norm_q|norm_k``, ``txt_attn.norm...`` ->
  ``attn.norm_added_q|norm_added_k``;
* single blocks: ``linear2`` -> ``proj_out``, ``modulation.lin`` -> ``norm.linear``,
  ``norm.query_norm|key_norm`` -> ``attn.norm_q|norm_k``;
* top level: ``img_in`` -> ``x_embedder``, ``txt_in`` -> ``context_embedder``, ``time_in``,
  ``vector_in``, ``guidance_in`` (``in_layer|out_layer``) -> ``time_text_embed.timestep_embedder``,
  ``.text_embedder``, ``.guidance_embedder`` (``linear_1|linear_2``), ``final_layer.linear`` ->
  ``proj_out``, ``final_layer.adaLN_modulation.1`` -> ``norm_out.linear``.

XLabs LoRA files (x-flux; facts from diffusers 0.42.1 ``_convert_xlabs_flux_lora_to_diffusers``)
name LoRA processors: ``double_blocks.N.processor.qkv_lora1|qkv_lora2`` (image | text fused qkv),
``proj_lora1|proj_lora2`` (``attn.to_out.0`` | ``attn.to_add_out``); single blocks
``processor.qkv_lora`` (the q|k|v rows of ``linear1``, shard group ``(0, 1, 2)``, no mlp rows) and
``processor.proj_lora`` (``linear2`` -> ``proj_out``).

What a rename cannot do, so BFL names need more:

* ``final_layer.adaLN_modulation.1`` stores its output rows as ``(shift, scale)``, diffusers'
  ``norm_out.linear`` as ``(scale, shift)``: its rule carries ``row_order=(1, 0)``, and whoever
  loads output-row data under that name (weight/bias rows, a LoRA ``B`` and bias; never a LoRA
  ``A``) swaps the halves (the LoRA adapter does, through ``NameMap.row_order``).
* BFL q/k norms call their parameter ``scale`` (``query_norm.scale``), ours ``weight``: a module
  rule keeps the leaf, so these six parameters are :class:`~sglang.multimodal_gen.models.name_map.
  ParamRename` entries (``double_blocks.N.img_attn.norm.query_norm.scale`` ->
  ``transformer_blocks.N.attn.norm_q.weight``, ``txt_attn`` -> ``norm_added_q|k``, single blocks'
  ``norm.query_norm|key_norm.scale`` -> ``attn.norm_q|norm_k.weight``). Only full BFL checkpoints
  have them (ComfyUI's single files included); no LoRA targets a norm.

Rule order (``NameMap.resolve`` applies every rule in turn to the renamed name): first the BFL
block prefixes (``double_blocks`` -> ``transformer_blocks``, ``single_blocks`` ->
``single_transformer_blocks``) and the top-level BFL names, then the block-internal rules, which
are *scoped* to one block family (:class:`BlockRule`): both block kinds have ``attn.to_q``, which
goes to ``attn.to_qkv`` shard ``"q"`` in a double block and to ``to_qkv_mlp`` shard ``0`` in a
single block, and a plain :class:`NameRule` cannot see which block it is in.
"""

from __future__ import annotations

from sglang.multimodal_gen.models.name_map import (
    BlockRule,
    NameMap,
    NameRule,
    ParamRename,
    ShardId,
)

DOUBLE_BLOCKS = "transformer_blocks"
SINGLE_BLOCKS = "single_transformer_blocks"


def _double(source: str, target: str, shard_id: ShardId = None) -> BlockRule:
    return BlockRule(source, target, shard_id, blocks=DOUBLE_BLOCKS)


def _single(source: str, target: str, shard_id: ShardId = None) -> BlockRule:
    return BlockRule(source, target, shard_id, blocks=SINGLE_BLOCKS)


def _top(source: str, target: str, row_order: tuple[int, ...] | None = None) -> NameRule:
    return NameRule(source, target, prefix_only=True, row_order=row_order)


FLUX_NAME_MAP = NameMap(
    rules=(
        # ---- original BFL layout -> diffusers layout: block families and top-level modules
        _top("double_blocks", DOUBLE_BLOCKS),
        _top("single_blocks", SINGLE_BLOCKS),
        _top("img_in", "x_embedder"),
        _top("txt_in", "context_embedder"),
        _top("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
        _top("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
        _top("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
        _top("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
        _top("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
        _top("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
        _top("final_layer.linear", "proj_out"),
        # BFL rows are (shift, scale), diffusers' (scale, shift): output rows swapped in halves
        _top("final_layer.adaLN_modulation.1", "norm_out.linear", row_order=(1, 0)),
        # ---- double blocks, BFL -> ours (fused layers stay whole: shard None)
        _double("img_attn.qkv", "attn.to_qkv"),
        _double("txt_attn.qkv", "attn.to_added_qkv"),
        _double("img_attn.proj", "attn.to_out.0"),
        _double("txt_attn.proj", "attn.to_add_out"),
        _double("img_attn.norm.query_norm", "attn.norm_q"),
        _double("img_attn.norm.key_norm", "attn.norm_k"),
        _double("txt_attn.norm.query_norm", "attn.norm_added_q"),
        _double("txt_attn.norm.key_norm", "attn.norm_added_k"),
        _double("img_mlp.0", "ff.net.0.proj"),
        _double("img_mlp.2", "ff.net.2"),
        _double("txt_mlp.0", "ff_context.net.0.proj"),
        _double("txt_mlp.2", "ff_context.net.2"),
        _double("img_mod.lin", "norm1.linear"),
        _double("txt_mod.lin", "norm1_context.linear"),
        # ---- double blocks, diffusers split projections -> our fused layers
        _double("attn.to_q", "attn.to_qkv", "q"),
        _double("attn.to_k", "attn.to_qkv", "k"),
        _double("attn.to_v", "attn.to_qkv", "v"),
        _double("attn.add_q_proj", "attn.to_added_qkv", "q"),
        _double("attn.add_k_proj", "attn.to_added_qkv", "k"),
        _double("attn.add_v_proj", "attn.to_added_qkv", "v"),
        # ---- double blocks, XLabs LoRA processors (x-flux ``DoubleStreamBlockLoraProcessor``:
        # ``qkv_lora1``/``proj_lora1`` on the image stream, ``qkv_lora2``/``proj_lora2`` on text)
        _double("processor.qkv_lora1", "attn.to_qkv"),
        _double("processor.qkv_lora2", "attn.to_added_qkv"),
        _double("processor.proj_lora1", "attn.to_out.0"),
        _double("processor.proj_lora2", "attn.to_add_out"),
        # ---- single blocks, BFL -> ours
        _single("linear1", "to_qkv_mlp"),
        _single("linear2", "proj_out"),
        _single("modulation.lin", "norm.linear"),
        _single("norm.query_norm", "attn.norm_q"),
        _single("norm.key_norm", "attn.norm_k"),
        # ---- single blocks, diffusers split projections -> our fused [q | k | v | mlp]
        _single("attn.to_q", "to_qkv_mlp", 0),
        _single("attn.to_k", "to_qkv_mlp", 1),
        _single("attn.to_v", "to_qkv_mlp", 2),
        _single("proj_mlp", "to_qkv_mlp", 3),
        # ---- single blocks, XLabs LoRA processors (``SingleStreamBlockLoraProcessor``): qkv_lora
        # adds to the q|k|v rows of linear1 only (not the mlp rows), proj_lora to linear2
        _single("processor.qkv_lora", "to_qkv_mlp", (0, 1, 2)),
        _single("processor.proj_lora", "proj_out"),
    ),
    # BFL RMSNorm parameters are called ``scale`` (ours ``weight``): whole-parameter renames
    param_renames=(
        ParamRename(
            r"double_blocks\.(\d+)\.img_attn\.norm\.query_norm\.scale",
            rf"{DOUBLE_BLOCKS}.\1.attn.norm_q.weight",
        ),
        ParamRename(
            r"double_blocks\.(\d+)\.img_attn\.norm\.key_norm\.scale",
            rf"{DOUBLE_BLOCKS}.\1.attn.norm_k.weight",
        ),
        ParamRename(
            r"double_blocks\.(\d+)\.txt_attn\.norm\.query_norm\.scale",
            rf"{DOUBLE_BLOCKS}.\1.attn.norm_added_q.weight",
        ),
        ParamRename(
            r"double_blocks\.(\d+)\.txt_attn\.norm\.key_norm\.scale",
            rf"{DOUBLE_BLOCKS}.\1.attn.norm_added_k.weight",
        ),
        ParamRename(
            r"single_blocks\.(\d+)\.norm\.query_norm\.scale",
            rf"{SINGLE_BLOCKS}.\1.attn.norm_q.weight",
        ),
        ParamRename(
            r"single_blocks\.(\d+)\.norm\.key_norm\.scale",
            rf"{SINGLE_BLOCKS}.\1.attn.norm_k.weight",
        ),
    ),
    # ComfyUI / original single-file checkpoints wrap the names (the LoRA adapter strips these
    # itself as well; listing them here lets the base-weight loader read such files too)
    strip_prefixes=("model.diffusion_model.", "diffusion_model."),
)
