"""LTX-2.x name map: original (Lightricks) names <-> diffusers names <-> our fused modules.

The one place that says how LTX-2 / LTX-2.3 checkpoints and LoRA files name the DiT's modules;
used by the weight loader and by the LoRA format adapter alike.

Our modules (``models/dits/ltx2.py``) carry diffusers' names except the fused projections of each
block ``transformer_blocks.N``:

=========================================  ====================================================
ours                                       diffusers (shard id)
=========================================  ====================================================
``attn1.to_qkv``, ``audio_attn1.to_qkv``   ``<attn>.to_q|to_k|to_v`` (``"q"|"k"|"v"``)
``<attn>.to_kv`` for ``attn2``,            ``<attn>.to_k|to_v`` (``0|1``)
``audio_attn2``, ``audio_to_video_attn``,
``video_to_audio_attn``
=========================================  ====================================================

The original Lightricks checkpoint (the single-file ``ltx-2*.safetensors``, transformer tensors
under ``model.diffusion_model.``; LoRA files under ``diffusion_model.``) uses diffusers' block
layout with these renames (source: diffusers 0.42.1 ``convert_ltx2_transformer_to_diffusers`` in
``loaders/single_file_utils.py`` and ``_convert_non_diffusers_ltx2_lora_to_diffusers`` in
``loaders/lora_conversion_utils.py``):

* top level: ``patchify_proj`` -> ``proj_in``, ``audio_patchify_proj`` -> ``audio_proj_in``,
  ``adaln_single`` -> ``time_embed``, ``audio_adaln_single`` -> ``audio_time_embed``,
  ``av_ca_video_scale_shift_adaln_single`` -> ``av_cross_attn_video_scale_shift``,
  ``av_ca_a2v_gate_adaln_single`` -> ``av_cross_attn_video_a2v_gate``,
  ``av_ca_audio_scale_shift_adaln_single`` -> ``av_cross_attn_audio_scale_shift``,
  ``av_ca_v2a_gate_adaln_single`` -> ``av_cross_attn_audio_v2a_gate``, (LTX-2.3)
  ``prompt_adaln_single`` -> ``prompt_adaln``, ``audio_prompt_adaln_single`` ->
  ``audio_prompt_adaln``;
* in every attention: ``q_norm`` / ``k_norm`` -> ``norm_q`` / ``norm_k``;
* bare block parameters: ``scale_shift_table_a2v_ca_video`` ->
  ``video_a2v_cross_attn_scale_shift_table``, ``scale_shift_table_a2v_ca_audio`` ->
  ``audio_a2v_cross_attn_scale_shift_table`` (``name_map.ParamRename``: a module rule cannot
  rename a parameter's leaf).

The single file also holds the text connectors (``video_embeddings_connector`` /
``audio_embeddings_connector``, which diffusers moves to its ``connectors`` component) and the
VAEs; they are not the DiT's and are not mapped here (the loader of such a file must pick the
``model.diffusion_model.`` tensors that are not the connectors').

Each original name reaches our module in one rule, so the LoRA adapter's rule inversion finds it
at depth 1; the q/k/v rules are block-scoped (:class:`BlockRule`) so top-level names are never
touched by them.
"""

from __future__ import annotations

from sglang.multimodal_gen.models.name_map import BlockRule, NameMap, NameRule, ParamRename, ShardId

__all__ = ["LTX2_BLOCKS", "LTX2_NAME_MAP"]

LTX2_BLOCKS = "transformer_blocks"
LTX2_SELF_ATTNS = ("attn1", "audio_attn1")
LTX2_CROSS_ATTNS = ("attn2", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
LTX2_STRIP_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def _top(source: str, target: str) -> NameRule:
    return NameRule(source, target, prefix_only=True)


def _block(source: str, target: str, shard_id: ShardId = None) -> BlockRule:
    return BlockRule(source, target, shard_id, blocks=LTX2_BLOCKS)


def _rules() -> list[NameRule]:
    rules = [
        # ---- original top-level modules -> diffusers (longest names first: adaln_single is a
        # suffix of the others, and prefix-only rules match whole leading segments anyway)
        _top("patchify_proj", "proj_in"),
        _top("audio_patchify_proj", "audio_proj_in"),
        _top("adaln_single", "time_embed"),
        _top("audio_adaln_single", "audio_time_embed"),
        _top("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
        _top("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
        _top("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
        _top("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
        _top("prompt_adaln_single", "prompt_adaln"),
        _top("audio_prompt_adaln_single", "audio_prompt_adaln"),
    ]
    for attn in LTX2_SELF_ATTNS + LTX2_CROSS_ATTNS:
        rules += [
            _block(f"{attn}.q_norm", f"{attn}.norm_q"),
            _block(f"{attn}.k_norm", f"{attn}.norm_k"),
        ]
    for attn in LTX2_SELF_ATTNS:  # diffusers split projections -> our fused layers
        rules += [_block(f"{attn}.to_{s}", f"{attn}.to_qkv", s) for s in "qkv"]
    for attn in LTX2_CROSS_ATTNS:
        rules += [
            _block(f"{attn}.to_k", f"{attn}.to_kv", 0),
            _block(f"{attn}.to_v", f"{attn}.to_kv", 1),
        ]
    return rules


LTX2_NAME_MAP = NameMap(
    rules=_rules(),
    strip_prefixes=LTX2_STRIP_PREFIXES,
    param_renames=(
        ParamRename(
            r"transformer_blocks\.(\d+)\.scale_shift_table_a2v_ca_video",
            r"transformer_blocks.\1.video_a2v_cross_attn_scale_shift_table",
        ),
        ParamRename(
            r"transformer_blocks\.(\d+)\.scale_shift_table_a2v_ca_audio",
            r"transformer_blocks.\1.audio_a2v_cross_attn_scale_shift_table",
        ),
    ),
)
