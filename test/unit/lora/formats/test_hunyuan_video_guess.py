"""The LoRA-family guess (``lora.key_grammar.guess_architecture``, from the families'
``lora_signature``) on HunyuanVideo 1.0 / 1.5 files in every published layout, against Flux's
files: Flux's original (BFL) names say ``double_blocks`` / ``single_blocks`` too, and ComfyUI
spells HunyuanVideo's blocks with Flux's very names.

What decides (``best_architecture``: the most matching keys, then the longest matched piece, then
the name): every HunyuanVideo signature counts the block keys as Flux's does but with a shorter
piece, so a file with no HunyuanVideo-only name stays Flux's; Tencent's names (``img_mod.linear``,
``img_mlp.fc1``, ``modulation.linear``, dotted ``img_attn_qkv``), the token refiner, ``txt_in`` /
``context_embedder``, a double block past Flux's 19 or a single block past its 38 are longer
pieces only HunyuanVideo has; 1.5's split ``img_attn_q|k|v``, its ByT5 / SigLIP / time embedders
and its double blocks past 1.0's 20 are 1.5's only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from fixtures.hunyuan_video_lora import peft_state_dict, random_adapter, write_layout
from fixtures.tiny_hunyuan_video_dit import TINY_HV_DIT
from sglang.multimodal_gen.lora.key_grammar import guess_architecture

R = 4
TINY_15 = dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8,
               num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16,
               text_embed_2_dim=12, image_embed_dim=10, rope_axes_dim=(2, 2, 4))  # fmt: skip


def _linear_shapes(model) -> dict[str, tuple[int, int]]:
    return {
        n: (m.out_features, m.in_features)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    }


@pytest.fixture(scope="module")
def adapters():
    """Random adapters on every linear layer of tiny diffusers 1.0 and 1.5 DiTs (meta device)."""
    from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel

    with torch.device("meta"):
        hv10 = HunyuanVideoTransformer3DModel(**TINY_HV_DIT)
        hv15 = HunyuanVideo15Transformer3DModel(**TINY_15)
    return (
        random_adapter(_linear_shapes(hv10), R, seed=5),
        random_adapter(_linear_shapes(hv15), R, seed=1, naming_version="1.5"),
    )


def _keys(adapter, layout, version="1.0", keep=lambda n: True):
    return list(write_layout({n: p for n, p in adapter.items() if keep(n)}, layout, 1.0, version))


def _blocks_only(n: str) -> bool:
    return "blocks." in n and "refiner" not in n


@pytest.mark.parametrize("layout", ["tencent", "tencent-transformer", "musubi"])
def test_tencent_names_are_hunyuan_video_not_flux(adapters, layout):
    """Tencent's names (whole files, block-only files as musubi trains by default, double blocks
    only) are HunyuanVideo's, not Flux's, though both say ``double_blocks`` / ``single_blocks``."""
    adapter = adapters[0]
    for keep in (lambda n: True, _blocks_only, lambda n: n.startswith("transformer_blocks.")):
        assert guess_architecture(_keys(adapter, layout, keep=keep)) == "HunyuanVideo"


def test_diffusers_and_comfyui_names(adapters):
    """diffusers' and ComfyUI's names: HunyuanVideo when the file has a module Flux has not (the
    token refiner, ``txt_in`` / ``context_embedder``, a double block past Flux's 19 or a single
    block past its 38); a block-only file in these spellings is Flux's spelling exactly (the
    same module names), so it is guessed as Flux."""
    adapter = adapters[0]
    peft = list(peft_state_dict(adapter))
    assert guess_architecture(peft) == "HunyuanVideo"
    assert guess_architecture(_keys(adapter, "comfyui")) == "HunyuanVideo"
    assert guess_architecture(_keys(adapter, "comfyui-flat")) == "HunyuanVideo"
    # Flux's own files stay Flux's (BFL dotted, kohya flattened, diffusers)
    flux = [
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight",
        "diffusion_model.double_blocks.0.img_mod.lin.lora_down.weight",
        "diffusion_model.double_blocks.3.txt_mlp.0.lora_down.weight",
        "diffusion_model.single_blocks.7.linear1.lora_down.weight",
        "diffusion_model.single_blocks.7.modulation.lin.lora_down.weight",
    ]
    assert guess_architecture(flux) == "Flux"
    kohya = [
        "lora_unet_" + k.removeprefix("diffusion_model.").removesuffix(".lora_down.weight")
        .replace(".", "_") + ".lora_down.weight"
        for k in flux
    ]  # fmt: skip
    assert kohya[0] == "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"
    assert guess_architecture(kohya) == "Flux"
    assert guess_architecture(_keys(adapter, "comfyui", keep=_blocks_only)) == "Flux"
    # real block counts: a double block 19 or single block 38 / 39 is HunyuanVideo's
    deep = [k.replace("double_blocks.0.", "double_blocks.19.") for k in flux[:3]]
    assert guess_architecture(flux + deep) == "HunyuanVideo"


def test_1_0_and_1_5_told_apart(adapters):
    """1.5's Tencent names split ``img_attn_q|k|v`` and add ``byt5_in`` / ``vision_in``; 1.0's
    fuse ``img_attn_qkv`` and have single blocks; diffusers' 1.5 names add
    ``context_embedder_2`` / ``image_embedder`` / ``time_embed``."""
    a15 = adapters[1]
    for layout in ("tencent", "musubi", "comfyui"):
        assert guess_architecture(_keys(a15, layout, "1.5")) == "HunyuanVideo 1.5", layout
    for layout in ("tencent", "musubi"):  # double blocks only: the split q/k/v tell
        keys = _keys(a15, layout, "1.5", keep=lambda n: n.startswith("transformer_blocks."))
        assert guess_architecture(keys) == "HunyuanVideo 1.5", layout
    assert guess_architecture(list(peft_state_dict(a15))) == "HunyuanVideo 1.5"
    # ComfyUI names of 1.5's deep blocks (past 1.0's 20)
    comfy = [f"diffusion_model.double_blocks.{i}.img_attn.qkv.lora_down.weight" for i in range(54)]
    assert guess_architecture(comfy) == "HunyuanVideo 1.5"


# ------------------------------------------------ a file of one family on another's DiT
def _spec(version: str):
    """Our LoRA surface of the tiny 1.0 / 1.5 DiT or of a tiny Flux DiT (meta device)."""
    from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec

    if version == "flux":
        from fixtures.tiny_flux import TINY_DIT
        from sglang.multimodal_gen.configs.flux import FluxArchConfig
        from sglang.multimodal_gen.models.dits.flux import FluxTransformer
        from sglang.multimodal_gen.models.dits.flux_names import FLUX_NAME_MAP

        model = FluxTransformer(FluxArchConfig(**TINY_DIT), tp_rank=0, tp_size=1, device="meta")
        return LoRAModelSpec.from_module(model, FLUX_NAME_MAP, "FLUX.1")
    if version == "1.0":
        from sglang.multimodal_gen.configs.hunyuan_video import HunyuanVideoArchConfig as Cfg
        from sglang.multimodal_gen.models.dits.hunyuan_video import HunyuanVideoTransformer as M
        from sglang.multimodal_gen.models.dits.hunyuan_video_names import (
            HUNYUAN_VIDEO_NAME_MAP as MAP,
        )

        cfg = Cfg.from_dict(TINY_HV_DIT)
    else:
        from sglang.multimodal_gen.configs.hunyuan_video15 import HunyuanVideo15ArchConfig as Cfg
        from sglang.multimodal_gen.models.dits.hunyuan_video15 import (
            HunyuanVideo15Transformer as M,
        )
        from sglang.multimodal_gen.models.dits.hunyuan_video15_names import (
            HUNYUAN_VIDEO15_NAME_MAP as MAP,
        )

        cfg = Cfg.from_dict(TINY_15)
    model = M(cfg, tp_rank=0, tp_size=1, device="meta")
    return LoRAModelSpec.from_module(model, MAP, f"HunyuanVideo {version}")


@pytest.mark.parametrize(
    "version, target, guess",
    [
        ("1.0", "1.5", "HunyuanVideo"),  # single blocks, fused img_attn_qkv
        ("1.5", "1.0", "HunyuanVideo 1.5"),  # split img_attn_q, ByT5 / SigLIP embedders
        ("1.0", "flux", "HunyuanVideo"),  # img_mod.linear, mlp.fc1, the refiner
    ],
)
def test_a_file_on_another_family_is_refused_naming_the_guess(adapters, version, target, guess):
    """musubi files (Tencent's names, flattened): some names are the other model's too (the
    refusal is of a partial load, not of an unknown file), and the error names what the keys
    seem to target."""
    from sglang.multimodal_gen.errors import LoRAFormatError
    from sglang.multimodal_gen.lora.formats import convert_to_canonical

    adapter = adapters[0] if version == "1.0" else adapters[1]
    sd = write_layout(adapter, "musubi", 1.0, version, rank=R)
    with pytest.raises(LoRAFormatError, match=f"do not exist in .*target {guess}\\)$"):
        convert_to_canonical(sd, None, _spec(target))


def test_a_flux_file_on_hunyuan_video_names_flux(adapters):
    """XLabs' Flux processors match no HunyuanVideo module: refused naming Flux."""
    from sglang.multimodal_gen.errors import LoRAFormatError
    from sglang.multimodal_gen.lora.formats import convert_to_canonical

    sd = {
        "double_blocks.0.processor.qkv_lora1.down.weight": torch.randn(R, 64),
        "double_blocks.0.processor.qkv_lora1.up.weight": torch.randn(192, R),
        "double_blocks.0.processor.proj_lora2.down.weight": torch.randn(R, 64),
        "double_blocks.0.processor.proj_lora2.up.weight": torch.randn(64, R),
    }
    with pytest.raises(LoRAFormatError, match="matched 0 of 2 modules.*seem to target Flux"):
        convert_to_canonical(sd, None, _spec("1.0"))
