"""Z-Image names against hand-written tables (not against the name map itself).

``ZIMAGE_NAME_MAP`` is shared by the weight loader and the LoRA loader, so a wrong rule (``w1`` sent
to shard 1, say) is invisible to any test whose expected values come from the same map. Here the
expected values are written out by hand:

* ``RESOLVE_TABLE``: checkpoint / LoRA module name -> ``(our module, shard id)``, for the diffusers
  layout, the original Z-Image layout and the wrappers files put around it.

A LoRA file merged onto our fused layers at the rows of a hand-written table (``ROWS``):
``test/unit/lora/formats/test_zimage.py``.
"""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP

RESOLVE_TABLE = [
    # diffusers layout: split q/k/v and w1/w3 land in sections of our fused layers
    ("layers.0.attention.to_q", ("layers.0.attention.to_qkv", "q")),
    ("layers.0.attention.to_k", ("layers.0.attention.to_qkv", "k")),
    ("layers.0.attention.to_v", ("layers.0.attention.to_qkv", "v")),
    ("layers.0.feed_forward.w1", ("layers.0.feed_forward.w13", 0)),
    ("layers.0.feed_forward.w3", ("layers.0.feed_forward.w13", 1)),
    ("layers.0.feed_forward.w2", ("layers.0.feed_forward.w2", None)),
    ("layers.29.feed_forward.w3", ("layers.29.feed_forward.w13", 1)),
    ("noise_refiner.1.feed_forward.w1", ("noise_refiner.1.feed_forward.w13", 0)),
    ("context_refiner.0.attention.to_v", ("context_refiner.0.attention.to_qkv", "v")),
    ("layers.0.attention.to_out.0", ("layers.0.attention.to_out.0", None)),
    ("layers.0.adaLN_modulation.0", ("layers.0.adaLN_modulation.0", None)),
    ("all_x_embedder.2-1", ("all_x_embedder.2-1", None)),
    ("all_final_layer.2-1.linear", ("all_final_layer.2-1.linear", None)),
    ("t_embedder.mlp.0", ("t_embedder.mlp.0", None)),
    ("cap_embedder.1", ("cap_embedder.1", None)),
    # our own fused names are fixed points
    ("layers.0.attention.to_qkv", ("layers.0.attention.to_qkv", None)),
    ("layers.0.feed_forward.w13", ("layers.0.feed_forward.w13", None)),
    # the original Z-Image checkpoint layout
    ("layers.3.attention.qkv", ("layers.3.attention.to_qkv", None)),
    ("layers.3.attention.out", ("layers.3.attention.to_out.0", None)),
    ("layers.3.attention.q_norm", ("layers.3.attention.norm_q", None)),
    ("layers.3.attention.k_norm", ("layers.3.attention.norm_k", None)),
    ("x_embedder", ("all_x_embedder.2-1", None)),
    ("final_layer.linear", ("all_final_layer.2-1.linear", None)),
    ("final_layer.adaLN_modulation.1", ("all_final_layer.2-1.adaLN_modulation.1", None)),
    # the wrapper prefix of original checkpoints is stripped
    ("model.diffusion_model.layers.1.feed_forward.w1", ("layers.1.feed_forward.w13", 0)),
    ("model.diffusion_model.layers.1.attention.to_k", ("layers.1.attention.to_qkv", "k")),
    # near misses: rules match whole dotted segments only
    ("layers.0.attention.to_qx", ("layers.0.attention.to_qx", None)),
    ("layers.0.feed_forward.w10", ("layers.0.feed_forward.w10", None)),
    ("my_x_embedder", ("my_x_embedder", None)),
]


@pytest.mark.parametrize("name,expected", RESOLVE_TABLE)
def test_name_map_resolves_as_the_hand_table(name, expected):
    assert ZIMAGE_NAME_MAP.resolve(name) == expected


def test_resolve_param_keeps_the_parameter_suffix():
    assert ZIMAGE_NAME_MAP.resolve_param("layers.0.feed_forward.w3.weight") == (
        "layers.0.feed_forward.w13.weight",
        1,
    )
    assert ZIMAGE_NAME_MAP.resolve_param("layers.2.attention.to_v.bias") == (
        "layers.2.attention.to_qkv.bias",
        "v",
    )
    assert ZIMAGE_NAME_MAP.resolve_param("final_layer.linear.weight") == (
        "all_final_layer.2-1.linear.weight",
        None,
    )
