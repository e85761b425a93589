"""Qwen-Image LoRA layouts not covered by the engine test: ComfyUI prefixes, ``.default.``
infixes, ``attn.to_out.0`` kept, and a file made for another family refused naming it.

Deltas are compared with ``scale * B @ A`` written out here with the row slices of our fused
``attn.to_qkv`` (``[q | k | v]``), never through our converter or name map.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.qwen_image import QwenImageArchConfig
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.qwen_image import QwenImageTransformer
from sglang.multimodal_gen.models.dits.qwen_image_names import QWEN_IMAGE_NAME_MAP
from sglang.multimodal_gen.models.families.tiny.qwen_image import TINY_TRANSFORMER

D, R = 64, 4


def _apply(tmp_path, sd):
    model = QwenImageTransformer(QwenImageArchConfig.from_dict(dict(TINY_TRANSFORMER)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    mgr = LoRAManager({"transformer": model}, QWEN_IMAGE_NAME_MAP, model_name="Qwen-Image")
    layers = mgr.layers("transformer")
    w0 = {n: layer.weight.detach().double().clone() for n, layer in layers.items()}
    save_file(sd, str(tmp_path / "l.safetensors"))
    mgr.set_lora("x", str(tmp_path / "l.safetensors"), merge_mode="merge")
    return {n: layer.weight.double() - w0[n] for n, layer in layers.items()}


def test_comfyui_prefix_default_infix_and_to_out(tmp_path):
    g = torch.Generator().manual_seed(1)
    ka, kb = torch.randn(R, D, generator=g), torch.randn(D, R, generator=g)
    oa, ob = torch.randn(R, D, generator=g), torch.randn(D, R, generator=g)
    sd = {
        "diffusion_model.transformer_blocks.1.attn.to_k.lora_A.default.weight": ka,
        "diffusion_model.transformer_blocks.1.attn.to_k.lora_B.default.weight": kb,
        "diffusion_model.transformer_blocks.0.attn.to_out.0.lora_A.default.weight": oa,
        "diffusion_model.transformer_blocks.0.attn.to_out.0.lora_B.default.weight": ob,
    }
    dw = _apply(tmp_path, sd)
    assert {n for n, d in dw.items() if bool(d.abs().max() > 0)} == {
        "transformer_blocks.1.attn.to_qkv",
        "transformer_blocks.0.attn.to_out.0",
    }
    qkv = torch.zeros(3 * D, D, dtype=torch.float64)
    qkv[D : 2 * D] = (kb @ ka).double()  # k rows; alpha = r (no alpha anywhere): scale 1
    torch.testing.assert_close(dw["transformer_blocks.1.attn.to_qkv"], qkv, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(
        dw["transformer_blocks.0.attn.to_out.0"], (ob @ oa).double(), atol=2e-6, rtol=1e-5
    )


def test_a_wan_file_is_refused_naming_wan(tmp_path):
    g = torch.Generator().manual_seed(2)
    sd = {
        "diffusion_model.blocks.0.self_attn.q.lora_A.weight": torch.randn(R, D, generator=g),
        "diffusion_model.blocks.0.self_attn.q.lora_B.weight": torch.randn(D, R, generator=g),
    }
    with pytest.raises(LoRAFormatError, match="Wan"):
        _apply(tmp_path, sd)
