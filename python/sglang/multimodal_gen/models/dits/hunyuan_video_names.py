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

The rules that HunyuanVideo 1.5 shares (its dual-stream blocks but for Tencent's split q/k/v, its
token refiner, the ``MLPEmbedder`` timestep embedders, ``img_in`` and the final layer) come from
the builders here (:func:`dual_block_rules`, :func:`refiner_rules`, :func:`embedder_rules`,
:func:`final_layer_rules`), which ``hunyuan_video15_names.py`` calls with its prefixes.
"""

from __future__ import annotations

from sglang.multimodal_gen.models.name_map import BlockRule, NameMap, NameRule, ShardId

__all__ = [
    "HUNYUAN_VIDEO_NAME_MAP",
    "HV_DOUBLE_BLOCKS",
    "HV_REFINER_BLOCKS",
    "HV_SINGLE_BLOCKS",
    "dual_block_rules",
    "embedder_rules",
    "final_layer_rules",
    "refiner_rules",
    "top_rule",
]

HV_DOUBLE_BLOCKS = "transformer_blocks"
HV_SINGLE_BLOCKS = "single_transformer_blocks"
HV_REFINER_BLOCKS = "context_embedder.token_refiner.refiner_blocks"


def top_rule(source: str, target: str, row_order: tuple[int, ...] | None = None) -> NameRule:
    """A rename at the start of the name (a top-level module or a block family's prefix)."""
    return NameRule(source, target, prefix_only=True, row_order=row_order)


def _block_rule(blocks: str):
    def rule(source: str, target: str, shard_id: ShardId = None) -> BlockRule:
        return BlockRule(source, target, shard_id, blocks=blocks)

    return rule


def embedder_rules(source: str, target: str) -> tuple[NameRule, ...]:
    """An ``MLPEmbedder`` (linear, SiLU, linear) at ``source``: Tencent's ``mlp.0|2`` and
    ComfyUI's ``in_layer|out_layer`` -> our (diffusers') ``<target>.linear_1|2``."""
    return (
        top_rule(f"{source}.mlp.0", f"{target}.linear_1"),
        top_rule(f"{source}.mlp.2", f"{target}.linear_2"),
        top_rule(f"{source}.in_layer", f"{target}.linear_1"),
        top_rule(f"{source}.out_layer", f"{target}.linear_2"),
    )


def final_layer_rules() -> tuple[NameRule, ...]:
    """``img_in`` -> ``x_embedder`` and the final layer (``final_layer.linear`` -> ``proj_out``;
    ``adaLN_modulation.1`` -> ``norm_out.linear``, whose Tencent rows are ``(shift, scale)`` where
    diffusers' are ``(scale, shift)``: ``row_order=(1, 0)``)."""
    return (
        top_rule("img_in", "x_embedder"),
        top_rule("final_layer.linear", "proj_out"),
        # Tencent rows are (shift, scale), diffusers' (scale, shift): output rows swapped in halves
        top_rule("final_layer.adaLN_modulation.1", "norm_out.linear", row_order=(1, 0)),
    )


def dual_block_rules(blocks: str, tencent_split_qkv: bool) -> tuple[NameRule, ...]:
    """The dual-stream blocks at ``blocks`` (ours, diffusers' ``transformer_blocks``): Tencent's
    ``double_blocks`` prefix and names, diffusers' split q/k/v -> our fused layers, ComfyUI's
    names. ``tencent_split_qkv``: Tencent's q/k/v are ``img_attn_q|k|v`` (1.5) rather than one
    fused ``img_attn_qkv`` (1.0); likewise ``txt_*``."""
    rule = _block_rule(blocks)
    if tencent_split_qkv:
        tencent_qkv = tuple(
            rule(f"{stream}_attn_{s}", target, s)
            for stream, target in (("img", "attn.to_qkv"), ("txt", "attn.to_added_qkv"))
            for s in ("q", "k", "v")
        )
    else:  # fused layers stay whole: shard None
        tencent_qkv = (
            rule("img_attn_qkv", "attn.to_qkv"),
            rule("txt_attn_qkv", "attn.to_added_qkv"),
        )
    return (
        top_rule("double_blocks", blocks),
        # ---- Tencent -> ours
        *tencent_qkv,
        rule("img_attn_proj", "attn.to_out.0"),
        rule("txt_attn_proj", "attn.to_add_out"),
        rule("img_attn_q_norm", "attn.norm_q"),
        rule("img_attn_k_norm", "attn.norm_k"),
        rule("txt_attn_q_norm", "attn.norm_added_q"),
        rule("txt_attn_k_norm", "attn.norm_added_k"),
        rule("img_mlp.fc1", "ff.net.0.proj"),
        rule("img_mlp.fc2", "ff.net.2"),
        rule("txt_mlp.fc1", "ff_context.net.0.proj"),
        rule("txt_mlp.fc2", "ff_context.net.2"),
        rule("img_mod.linear", "norm1.linear"),
        rule("txt_mod.linear", "norm1_context.linear"),
        # ---- diffusers split projections -> our fused layers
        rule("attn.to_q", "attn.to_qkv", "q"),
        rule("attn.to_k", "attn.to_qkv", "k"),
        rule("attn.to_v", "attn.to_qkv", "v"),
        rule("attn.add_q_proj", "attn.to_added_qkv", "q"),
        rule("attn.add_k_proj", "attn.to_added_qkv", "k"),
        rule("attn.add_v_proj", "attn.to_added_qkv", "v"),
        # ---- ComfyUI's own names (``comfy/ldm/hunyuan_video/model.py``, Flux's block classes:
        # fused ``img_attn.qkv``, ``*_mod.lin``, ``*_mlp.0|2``), as LoRA files saved by ComfyUI
        # spell them
        rule("img_mod.lin", "norm1.linear"),
        rule("txt_mod.lin", "norm1_context.linear"),
        rule("img_attn.qkv", "attn.to_qkv"),
        rule("txt_attn.qkv", "attn.to_added_qkv"),
        rule("img_attn.proj", "attn.to_out.0"),
        rule("txt_attn.proj", "attn.to_add_out"),
        rule("img_mlp.0", "ff.net.0.proj"),
        rule("img_mlp.2", "ff.net.2"),
        rule("txt_mlp.0", "ff_context.net.0.proj"),
        rule("txt_mlp.2", "ff_context.net.2"),
    )


def refiner_rules() -> tuple[NameRule, ...]:
    """The token refiner ``txt_in`` -> ``context_embedder`` (the same in 1.0 and 1.5): its
    timestep and pooled-text embedders, ``proj_in``, and its blocks (Tencent's fused
    ``self_attn_qkv`` whole, diffusers' split q/k/v, ComfyUI's ``self_attn.qkv|proj``,
    ``mlp.0|2``). In order: the ``c_embedder`` rename before ComfyUI's ``in_layer|out_layer`` of
    the renamed module, the block prefix before the block rules."""
    rule = _block_rule(HV_REFINER_BLOCKS)
    text = "context_embedder.time_text_embed.text_embedder"
    return (
        top_rule("txt_in.individual_token_refiner.blocks", HV_REFINER_BLOCKS),
        *embedder_rules("txt_in.t_embedder", "context_embedder.time_text_embed.timestep_embedder"),
        top_rule("txt_in.c_embedder", text),
        top_rule(f"{text}.in_layer", f"{text}.linear_1"),
        top_rule(f"{text}.out_layer", f"{text}.linear_2"),
        top_rule("txt_in.input_embedder", "context_embedder.proj_in"),
        # ---- Tencent -> ours (the fused qkv stays whole: shard None)
        rule("self_attn_qkv", "attn.to_qkv"),
        rule("self_attn_proj", "attn.to_out.0"),
        rule("mlp.fc1", "ff.net.0.proj"),
        rule("mlp.fc2", "ff.net.2"),
        rule("adaLN_modulation.1", "norm_out.linear"),
        # ---- diffusers split projections -> our fused qkv
        rule("attn.to_q", "attn.to_qkv", "q"),
        rule("attn.to_k", "attn.to_qkv", "k"),
        rule("attn.to_v", "attn.to_qkv", "v"),
        # ---- ComfyUI's names
        rule("self_attn.qkv", "attn.to_qkv"),
        rule("self_attn.proj", "attn.to_out.0"),
        rule("mlp.0", "ff.net.0.proj"),
        rule("mlp.2", "ff.net.2"),
    )


_single = _block_rule(HV_SINGLE_BLOCKS)

HUNYUAN_VIDEO_NAME_MAP = NameMap(
    rules=(
        *final_layer_rules(),
        *embedder_rules("time_in", "time_text_embed.timestep_embedder"),
        *embedder_rules("guidance_in", "time_text_embed.guidance_embedder"),
        top_rule("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
        top_rule("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
        *refiner_rules(),
        *dual_block_rules(HV_DOUBLE_BLOCKS, tencent_split_qkv=False),
        # ---- single-stream blocks, Tencent -> ours
        top_rule("single_blocks", HV_SINGLE_BLOCKS),
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
        # ---- single-stream blocks, ComfyUI's name
        _single("modulation.lin", "norm.linear"),
    ),
    strip_prefixes=("model.diffusion_model.", "diffusion_model."),
)
