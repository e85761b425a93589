"""Wan2.x LoRA layouts (the Wan rows of the shared LoRA-format cases), on our tiny ``WanTransformer``.

Each file is written at test size (random non-zero tensors, rank 4, alpha != r where the layout
has an alpha), applied through the ``LoRAManager`` (merged, then committed so bias deltas land in
the biases), and the delta of EVERY layer is compared with ``scale * B @ A`` written out here with
explicit row slices of our fused layers (``attn1.to_qkv`` = ``[q | k | v]``, ``attn2.to_kv`` =
``[k | v]``), never through our converter or name map; every other layer must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.wan import WanArchConfig
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.wan import WanTransformer
from sglang.multimodal_gen.models.dits.wan_names import WAN_NAME_MAP
from sglang.multimodal_gen.models.families.tiny.wan import TINY_TRANSFORMER

CFG = WanArchConfig.from_dict(dict(TINY_TRANSFORMER, in_channels=16, out_channels=16))
D, FFN, R = 32, 64, 4
assert (CFG.inner_dim, CFG.ffn_dim) == (D, FFN)


def _rand(g, *shape):
    return torch.randn(*shape, generator=g) * 0.1


def _apply(tmp_path, sd, strength=1.0):
    model = WanTransformer(CFG, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    mgr = LoRAManager({"transformer": model}, WAN_NAME_MAP, model_name="Wan2.x")
    layers = mgr.layers("transformer")
    w0 = {n: layer.weight.detach().double().clone() for n, layer in layers.items()}
    b0 = {n: layer.bias.detach().clone() for n, layer in layers.items()}
    path = tmp_path / "lora.safetensors"
    save_file(sd, str(path))
    mgr.set_lora("x", str(path), strengths=strength, merge_mode="merge")
    info = mgr.list_loras()["loaded"][0]["targets"]["transformer"]
    mgr.commit_as_base()
    dw = {n: layer.weight.double() - w0[n] for n, layer in layers.items()}
    biases = {n: (b0[n], layer.bias.detach()) for n, layer in layers.items()}  # (before, after)
    return dw, biases, info


def _check(dw, expected):
    changed = {n for n, d in dw.items() if bool(d.abs().max() > 0)}
    assert changed == set(expected)
    for n, e in expected.items():
        torch.testing.assert_close(dw[n], e.double(), atol=2e-7, rtol=1e-5, msg=n)


def _zeros(rows_total, cols):
    return torch.zeros(rows_total, cols, dtype=torch.float64)


def test_comfyui_no_alpha_starting_at_block_1(tmp_path):
    """``diffusion_model.blocks.1.self_attn.q.lora_A`` (no alpha: scale 1) -> rows [0, D) of
    ``blocks.1.attn1.to_qkv``; ``cross_attn.v`` -> rows [D, 2D) of ``attn2.to_kv``."""
    g = torch.Generator().manual_seed(1)
    qa, qb, va, vb = _rand(g, R, D), _rand(g, D, R), _rand(g, R, D), _rand(g, D, R)
    sd = {
        "diffusion_model.blocks.1.self_attn.q.lora_A.weight": qa,
        "diffusion_model.blocks.1.self_attn.q.lora_B.weight": qb,
        "diffusion_model.blocks.1.cross_attn.v.lora_A.weight": va,
        "diffusion_model.blocks.1.cross_attn.v.lora_B.weight": vb,
    }
    dw, _, info = _apply(tmp_path, sd)
    qkv, kv = _zeros(3 * D, D), _zeros(2 * D, D)
    qkv[:D] = (qb @ qa).double()
    kv[D:] = (vb @ va).double()
    _check(dw, {"blocks.1.attn1.to_qkv": qkv, "blocks.1.attn2.to_kv": kv})
    assert info["matched_modules"] == 2


def test_lightx2v_alpha_and_diff_b(tmp_path):
    """``lora_down``/``lora_up`` with ``.alpha`` (scale alpha / r = 1/4) on ``ffn.0`` and
    ``self_attn.o``, plus a ``.diff_b`` bias delta on ``self_attn.k`` (k rows of the fused bias)."""
    g = torch.Generator().manual_seed(2)
    fa, fb, oa, ob = _rand(g, R, D), _rand(g, FFN, R), _rand(g, R, D), _rand(g, D, R)
    kb = _rand(g, D)
    sd = {
        "blocks.0.ffn.0.lora_down.weight": fa, "blocks.0.ffn.0.lora_up.weight": fb,
        "blocks.0.ffn.0.alpha": torch.tensor(1.0),
        "blocks.0.self_attn.o.lora_down.weight": oa, "blocks.0.self_attn.o.lora_up.weight": ob,
        "blocks.0.self_attn.o.alpha": torch.tensor(1.0),
        "blocks.0.self_attn.k.diff_b": kb,
    }  # fmt: skip
    dw, db, _ = _apply(tmp_path, sd, strength=0.5)
    _check(dw, {
        "blocks.0.ffn.net.0.proj": 0.5 * 0.25 * (fb @ fa).double(),
        "blocks.0.attn1.to_out.0": 0.5 * 0.25 * (ob @ oa).double(),
    })  # fmt: skip
    delta = torch.zeros(3 * D)
    delta[D : 2 * D] = 0.5 * kb
    before, after = db["blocks.0.attn1.to_qkv"]
    assert torch.equal(after, before + delta)  # exactly strength * diff_b on the k rows
    assert all(torch.equal(a, b) for n, (b, a) in db.items() if n != "blocks.0.attn1.to_qkv")


def test_musubi_attention_only(tmp_path):
    """``lora_unet_blocks_0_self_attn_q`` (kohya/musubi flattening) with alpha 2 (scale 1/2)."""
    g = torch.Generator().manual_seed(3)
    a, b = _rand(g, R, D), _rand(g, D, R)
    sd = {
        "lora_unet_blocks_0_self_attn_q.lora_down.weight": a,
        "lora_unet_blocks_0_self_attn_q.lora_up.weight": b,
        "lora_unet_blocks_0_self_attn_q.alpha": torch.tensor(2.0),
    }
    dw, _, info = _apply(tmp_path, sd)
    qkv = _zeros(3 * D, D)
    qkv[:D] = 0.5 * (b @ a).double()
    _check(dw, {"blocks.0.attn1.to_qkv": qkv})
    assert info["matched_modules"] == 1


def test_diffusers_peft_with_alpha_key(tmp_path):
    """``transformer.blocks.0.attn1.to_q.lora_A.weight`` + ``...to_q.alpha`` (alpha honoured)."""
    g = torch.Generator().manual_seed(4)
    a, b = _rand(g, R, D), _rand(g, D, R)
    sd = {
        "transformer.blocks.0.attn1.to_q.lora_A.weight": a,
        "transformer.blocks.0.attn1.to_q.lora_B.weight": b,
        "transformer.blocks.0.attn1.to_q.alpha": torch.tensor(8.0),
    }
    dw, _, _ = _apply(tmp_path, sd)
    qkv = _zeros(3 * D, D)
    qkv[:D] = 2.0 * (b @ a).double()
    _check(dw, {"blocks.0.attn1.to_qkv": qkv})


def test_full_weight_diffs_refused_naming_the_keys(tmp_path):
    g = torch.Generator().manual_seed(5)
    sd = {
        "blocks.0.self_attn.q.lora_down.weight": _rand(g, R, D),
        "blocks.0.self_attn.q.lora_up.weight": _rand(g, D, R),
        "blocks.0.self_attn.norm_q.diff": _rand(g, D),
    }
    with pytest.raises(LoRAFormatError, match=r"norm_q\.diff"):
        _apply(tmp_path, sd)


def test_lora_for_a_wider_model_is_a_shape_error(tmp_path):
    g = torch.Generator().manual_seed(6)
    sd = {
        "diffusion_model.blocks.0.self_attn.q.lora_A.weight": _rand(g, R, 2 * D),
        "diffusion_model.blocks.0.self_attn.q.lora_B.weight": _rand(g, 2 * D, R),
    }
    with pytest.raises(LoRAFormatError, match=r"attn1"):
        _apply(tmp_path, sd)
