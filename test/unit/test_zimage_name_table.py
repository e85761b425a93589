"""Z-Image names against hand-written tables (not against the name map itself).

``ZIMAGE_NAME_MAP`` is shared by the weight loader and the LoRA loader, so a wrong rule (``w1`` sent
to shard 1, say) is invisible to any test whose expected values come from the same map. Here the
expected values are written out by hand:

* ``RESOLVE_TABLE``: checkpoint / LoRA module name -> ``(our module, shard id)``, for the diffusers
  layout, the original Z-Image layout and the wrappers files put around it;
* ``ROWS``: our fused module -> diffusers module -> the rows it occupies in the fused weight, used to
  check a LoRA file converted and merged onto our layers (at TP 1 and TP 2, whose rank rows are
  also spelled out here) against ``W + strength * (alpha / r) * B @ A`` computed by hand.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from sglang.multimodal_gen.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from sglang.multimodal_gen.layers.lora import wrap_with_lora
from sglang.multimodal_gen.lora import LoRAModelSpec, convert_to_canonical, load_lora_state_dict
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP
from torch import nn

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


# ------------------------------------------------------------------ a LoRA file onto our layers
DIM, HEAD, HEADS, KV_HEADS, FFN = 32, 8, 4, 2, 24  # GQA: k and v sections are half of q
# our fused module -> {diffusers module: (first row, rows)} in the full fused weight
ROWS = {
    "layers.0.attention.to_qkv": {
        "layers.0.attention.to_q": (0, 32),
        "layers.0.attention.to_k": (32, 16),
        "layers.0.attention.to_v": (48, 16),
    },
    "layers.0.feed_forward.w13": {
        "layers.0.feed_forward.w1": (0, 24),
        "layers.0.feed_forward.w3": (24, 24),
    },
}
# rows of the full fused weight that rank r of 2 holds (q: heads 0-1 / 2-3, kv: head 0 / 1)
RANK_ROWS = {
    "layers.0.attention.to_qkv": {
        0: [*range(0, 16), *range(32, 40), *range(48, 56)],
        1: [*range(16, 32), *range(40, 48), *range(56, 64)],
    },
    "layers.0.feed_forward.w13": {
        0: [*range(0, 12), *range(24, 36)],
        1: [*range(12, 24), *range(36, 48)],
    },
}


class _Block(nn.Module):
    def __init__(self, tp_rank, tp_size):
        super().__init__()
        kw = dict(bias=False, tp_rank=tp_rank, tp_size=tp_size)
        self.attention = nn.Module()
        self.attention.to_qkv = QKVParallelLinear(DIM, HEAD, HEADS, KV_HEADS, **kw)
        self.feed_forward = nn.Module()
        self.feed_forward.w13 = MergedColumnParallelLinear(DIM, [FFN, FFN], **kw)


def _model(tp_rank, tp_size, full):
    model = nn.Module()
    model.layers = nn.ModuleList([_Block(tp_rank, tp_size)])
    for name, w in full.items():
        layer = model.get_submodule(name)
        layer.weight_loader(layer.weight, w)
    return model


@pytest.mark.parametrize("tp_size", [1, 2])
def test_lora_file_merges_into_the_hand_table_rows(tmp_path, tp_size):
    """A diffusers-format file with alpha (peft metadata) for q/k/v and w1/w3, converted and
    merged at strength 0.6: every rank's weight is its rows of ``W + 0.6 (alpha / r) B @ A``."""
    g = torch.Generator().manual_seed(31)
    rank, alpha, strength = 4, 6.0, 0.6
    full = {m: torch.randn(64 if "qkv" in m else 48, DIM, generator=g) for m in ROWS}
    expected = {m: w.double().clone() for m, w in full.items()}
    sd = {}
    for our, members in ROWS.items():
        for diffusers_name, (start, rows) in members.items():
            a = torch.randn(rank, DIM, generator=g)
            b = torch.randn(rows, rank, generator=g)
            sd[f"transformer.{diffusers_name}.lora_A.weight"] = a
            sd[f"transformer.{diffusers_name}.lora_B.weight"] = b
            delta = (alpha / rank) * (b.double() @ a.double())
            expected[our][start : start + rows] += strength * delta
    path = tmp_path / "lora.safetensors"
    config = {"transformer.r": rank, "transformer.lora_alpha": alpha}  # as diffusers writes it
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps(config)})
    state, metadata = load_lora_state_dict(path)
    for r in range(tp_size):
        model = _model(r, tp_size, full)
        spec = LoRAModelSpec.from_module(model, ZIMAGE_NAME_MAP, "Z-Image")
        canon = convert_to_canonical(state, metadata, spec)
        assert canon.matched_modules == 5
        for our in ROWS:
            layer = wrap_with_lora(model.get_submodule(our))
            layer.add_adapter("x", canon.modules[our])
            layer.set_active([("x", strength)])
            layer.merge()
            rows = list(range(expected[our].shape[0])) if tp_size == 1 else RANK_ROWS[our][r]
            torch.testing.assert_close(
                layer.weight.double(), expected[our][rows], atol=1e-5, rtol=1e-5
            )
