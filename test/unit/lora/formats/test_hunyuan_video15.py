"""HunyuanVideo 1.5 LoRA layouts, converted for our ``HunyuanVideo15Transformer``: every layout of
one adapter gives the same delta ``scale * B @ A`` on every (layer, shard) of our DiT (compared
as its factors ``A`` and ``scale * B``).

The adapter covers EVERY linear layer of a tiny 1.5 DiT (2 dual-stream blocks, 1 refiner block,
the ByT5 / image / timestep / text embedders, the final layer); rank 4, random non-zero ``A`` /
``B``, the q/k/v of each attention sharing ``A`` so the fused layouts can hold it. Layouts
(``fixtures/hunyuan_video_lora.py`` writes them from hand-written name tables, never our name map):

* diffusers/PEFT ``transformer.<diffusers name>.lora_A/B.weight``, alpha 8 in the header (scale
  2): the reference, placed by hand on our fused layers (``expected_deltas``);
* Tencent's names ``diffusion_model.double_blocks.N.img_attn_q...`` (split q/k/v in the blocks,
  the refiner's fused ``self_attn_qkv``, ``final_layer.adaLN_modulation.1`` rows ``(shift,
  scale)``), no alpha: musubi-tuner's ``convert_lora.py --target other``, diffusion-pipe;
  diffusers 0.42 has no LoRA loader for 1.5 names (only ``load_lora_adapter`` on its own names);
* musubi-tuner ``lora_unet_<Tencent name, . -> _>`` + ``lora_down/up`` + an alpha per module;
* ComfyUI's own names ``diffusion_model.double_blocks.N.img_attn.qkv`` (fused), ``img_mod.lin``,
  ``img_mlp.0``, ``txt_in.t_embedder.in_layer``..., ``lora_down/up`` + ``alpha``.

Measured: every layout equals the reference to float64 rounding (max abs difference 0: the
alphas and scales are powers of two). Nearby wrong case: one module's alpha misread (twice its value)
is caught on that module.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from fixtures.hunyuan_video_lora import (
    canonical_deltas,
    expected_deltas,
    file_name,
    peft_state_dict,
    random_adapter,
    write_layout,
)
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.formats import convert_to_canonical
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec

R, ALPHA = 4, 8.0
SCALE = ALPHA / R
TINY = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8,
            num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16,
            text_embed_2_dim=12, image_embed_dim=10, rope_axes_dim=(2, 2, 4))  # fmt: skip
HEADER = {
    "safetensors_metadata": {
        "lora_adapter_metadata": json.dumps({"transformer.r": R, "transformer.lora_alpha": ALPHA})
    }
}


@pytest.fixture(scope="module")
def setup():
    """(our LoRA surface, the adapter ``{diffusers name: (A, B)}``) of the tiny 1.5 DiT."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from sglang.multimodal_gen.configs.hunyuan_video15 import HunyuanVideo15ArchConfig
    from sglang.multimodal_gen.models.dits.hunyuan_video15 import HunyuanVideo15Transformer
    from sglang.multimodal_gen.models.dits.hunyuan_video15_names import HUNYUAN_VIDEO15_NAME_MAP

    with torch.device("meta"):
        ref = HunyuanVideo15Transformer3DModel(**TINY)
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in ref.named_modules()
        if isinstance(m, nn.Linear)
    }
    cfg = HunyuanVideo15ArchConfig.from_dict(dict(ref.config))
    ours = HunyuanVideo15Transformer(cfg, tp_rank=0, tp_size=1, device="meta")
    spec = LoRAModelSpec.from_module(ours, HUNYUAN_VIDEO15_NAME_MAP, "HunyuanVideo 1.5")
    adapter = random_adapter(shapes, R, seed=3, naming_version="1.5")
    # the hand placement covers exactly our LoRA surface
    placed = set(expected_deltas(adapter, 1.0, "1.5"))
    assert placed == {(m, s) for m, shards in spec.module_shapes.items() for s in shards}
    return spec, adapter


def _check(spec, sd, adapter, header=None, fmt=None) -> None:
    canon = convert_to_canonical(sd, header, spec)
    got, expected = canonical_deltas(canon), expected_deltas(adapter, SCALE, "1.5")
    assert set(got) == set(expected)
    for key, e in expected.items():
        torch.testing.assert_close(got[key], e, rtol=0, atol=1e-12, msg=str(key))
    assert canon.ignored_keys == []
    if fmt is not None:
        assert canon.source_format == fmt, canon.source_format


def test_diffusers_peft_layout_places_every_shard(setup):
    spec, adapter = setup
    _check(spec, peft_state_dict(adapter), adapter, HEADER, "diffusers")


@pytest.mark.parametrize("layout", ["tencent", "tencent-transformer"])
def test_tencent_names_give_the_same_deltas(setup, layout):
    """Split ``img_attn_q|k|v`` / ``txt_attn_q|k|v``, the refiner's fused ``self_attn_qkv`` (``A``
    shared, ``B`` split by rows), the final layer's swapped halves; no alpha (scale in ``B``)."""
    spec, adapter = setup
    sd = write_layout(adapter, layout, SCALE, "1.5")
    assert "diffusion_model.double_blocks.1.txt_attn_k.lora_B.weight" in sd or layout != "tencent"
    assert any(".individual_token_refiner.blocks.0.self_attn_qkv." in k for k in sd)
    _check(spec, sd, adapter)


def test_musubi_flattened_names_honour_each_alpha(setup):
    """``lora_unet_double_blocks_0_img_attn_q.lora_down.weight`` + ``.alpha`` varying per module
    (1 .. 16 for r 4; ``B`` written so the delta is the reference's): each alpha is read."""
    spec, adapter = setup
    fnames = sorted({file_name(n, "tencent", "1.5") for n in adapter})
    alphas = {f: float(2 ** (i % 5)) for i, f in enumerate(fnames)}
    sd = write_layout(adapter, "musubi", SCALE, "1.5", alphas=alphas, rank=R)
    assert "lora_unet_txt_in_individual_token_refiner_blocks_0_self_attn_qkv.alpha" in sd
    _check(spec, sd, adapter, fmt="kohya")
    # the nearby wrong case: one module's alpha misread (twice its value) is a visible error
    key = "lora_unet_double_blocks_1_img_mlp_fc2.alpha"
    wrong = dict(sd, **{key: 2 * sd[key]})
    with pytest.raises(AssertionError):
        _check(spec, wrong, adapter)


@pytest.mark.parametrize("layout", ["comfyui", "comfyui-flat"])
def test_comfyui_names_give_the_same_deltas(setup, layout):
    """ComfyUI's module names (fused ``img_attn.qkv``, ``img_mod.lin``, ``img_mlp.0``, the
    refiner's ``self_attn.qkv`` / ``mlp.0``, ``MLPEmbedder`` ``in_layer`` / ``out_layer``), dotted
    under ``diffusion_model.`` or flattened under ``lora_unet_``, with ``alpha``."""
    spec, adapter = setup
    sd = write_layout(adapter, layout, SCALE, "1.5", rank=R)
    stem = "diffusion_model." if layout == "comfyui" else "lora_unet_"
    sep = "." if layout == "comfyui" else "_"
    assert f"{stem}txt_in{sep}c_embedder{sep}in_layer.lora_down.weight" in sd
    assert f"{stem}double_blocks{sep}0{sep}img_attn{sep}qkv.lora_up.weight" in sd
    _check(spec, sd, adapter)


def test_a_1_0_file_is_refused_naming_its_modules(setup):
    """A HunyuanVideo 1.0 file (fused ``img_attn_qkv`` in Tencent's dotted names, single blocks)
    on the 1.5 DiT: refused naming a module 1.5 does not have."""
    spec, adapter = setup
    a, b = adapter["transformer_blocks.0.attn.to_q"]
    sd = {
        "diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight": a,
        "diffusion_model.double_blocks.0.img_attn_qkv.lora_B.weight": torch.cat([b] * 3),
        "diffusion_model.single_blocks.0.linear2.lora_A.weight": torch.randn(R, 48),
        "diffusion_model.single_blocks.0.linear2.lora_B.weight": torch.randn(16, R),
    }
    with pytest.raises(LoRAFormatError, match=r"single_blocks\.0\.linear2"):
        convert_to_canonical(sd, None, spec)
