"""``LoRAModelSpec`` (``lora/model_spec.py``): the modules and shard shapes a LoRA file may address,
read from our parallel layers (fused q/k/v and gate/up) through the family's name map."""

from __future__ import annotations

import pytest
import torch
from fixtures.lora_formats import zimage_spec
from sglang.multimodal_gen.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.lora import LoRAModelSpec, convert_to_canonical
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP


@pytest.fixture(scope="module")
def spec():
    return zimage_spec()


class _OurBlock(torch.nn.Module):
    """A block built from our parallel layers (fused qkv and gate/up), as our DiT will be."""

    def __init__(self):
        super().__init__()
        kw = dict(tp_rank=0, tp_size=1)
        self.attention = torch.nn.Module()
        self.attention.to_qkv = QKVParallelLinear(64, 16, 4, 2, bias=False, **kw)
        self.attention.to_out = torch.nn.ModuleList([RowParallelLinear(64, 64, bias=False, **kw)])
        self.feed_forward = torch.nn.Module()
        self.feed_forward.w13 = MergedColumnParallelLinear(64, [170, 170], bias=False, **kw)
        self.adaLN_modulation = torch.nn.ModuleList([ReplicatedLinear(64, 256, **kw)])


def test_spec_from_our_parallel_layers(tmp_path):
    """A model of our fused layers: split q/k/v (GQA) and w1/w3 files land in their shards."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_OurBlock()])
    spec = LoRAModelSpec.from_module(model, ZIMAGE_NAME_MAP, "ours")
    assert spec.module_shapes["layers.0.attention.to_qkv"] == {
        "q": (64, 64),
        "k": (32, 64),
        "v": (32, 64),
    }
    assert spec.module_shapes["layers.0.feed_forward.w13"] == {0: (170, 64), 1: (170, 64)}
    g = torch.Generator().manual_seed(11)
    sizes = {"to_q": 64, "to_k": 32, "to_v": 32, "to_out.0": 64}
    sd, ref = {}, {}
    for n, out in sizes.items():
        a, b = torch.randn(2, 64, generator=g), torch.randn(out, 2, generator=g)
        sd[f"lora_unet_layers_0_attention_{n.replace('.', '_')}.lora_down.weight"] = a
        sd[f"lora_unet_layers_0_attention_{n.replace('.', '_')}.lora_up.weight"] = b
        ref[n] = b @ a
    canon = convert_to_canonical(sd, None, spec)
    qkv = canon.modules["layers.0.attention.to_qkv"]
    for s in "qkv":
        torch.testing.assert_close(qkv[s].delta_weight(), ref[f"to_{s}"])
    torch.testing.assert_close(
        canon.modules["layers.0.attention.to_out.0"][None].delta_weight(), ref["to_out.0"]
    )


def test_spec_of_our_zimage_dit_equals_diffusers_spec(spec):
    """Our DiT (fused to_qkv / w13) and the diffusers model through the name map agree."""
    from sglang.multimodal_gen.configs.zimage import ZImageArchConfig
    from sglang.multimodal_gen.models.dits.zimage import ZImageTransformer

    cfg = ZImageArchConfig(
        in_channels=4,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        cap_feat_dim=32,
        axes_dims=(4, 6, 6),
        axes_lens=(32, 32, 32),
    )
    ours = LoRAModelSpec.from_module(ZImageTransformer(cfg), ZIMAGE_NAME_MAP, "Z-Image")
    assert ours.module_shapes == spec.module_shapes
