"""Z-Image name map: original checkpoint names <-> diffusers names <-> our fused modules.

The one place that says how Z-Image checkpoints and LoRA files name modules. Used by the
transformer's weight loader and by the LoRA format adapter alike.

Source for the original -> diffusers renames: diffusers'
``convert_z_image_transformer_checkpoint_to_diffusers`` (diffusers 0.42), which splits the
original fused ``attention.qkv`` into equal thirds and renames ``attention.out``, ``q_norm``/``k_norm``,
``x_embedder`` and ``final_layer``, and drops ``norm_final.weight`` when present. Single files in
the original layout may carry that norm (ComfyUI's Z-Image model declares it and reports it
missing otherwise); no forward uses it (the final layer has its own norm), so the map lists it as
``unused`` and the loader skips it.
"""

from __future__ import annotations

from sglang.multimodal_gen.models.name_map import NameMap, NameRule

ZIMAGE_NAME_MAP = NameMap(
    rules=(
        # original checkpoint layout -> diffusers layout
        NameRule("final_layer", "all_final_layer.2-1", prefix_only=True),
        NameRule("x_embedder", "all_x_embedder.2-1", prefix_only=True),
        NameRule("attention.out", "attention.to_out.0"),
        NameRule("attention.q_norm", "attention.norm_q"),
        NameRule("attention.k_norm", "attention.norm_k"),
        # diffusers split projections -> our fused layers
        NameRule("attention.to_q", "attention.to_qkv", "q"),
        NameRule("attention.to_k", "attention.to_qkv", "k"),
        NameRule("attention.to_v", "attention.to_qkv", "v"),
        NameRule("attention.qkv", "attention.to_qkv", None),
        NameRule("feed_forward.w1", "feed_forward.w13", 0),
        NameRule("feed_forward.w3", "feed_forward.w13", 1),
    ),
    strip_prefixes=("model.diffusion_model.",),
    unused=(r"norm_final\.weight",),
)
