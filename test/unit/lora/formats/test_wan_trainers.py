"""Wan2.x LoRA files as the public trainers write them, on our tiny ``WanTransformer``.

One test per trainer layout (key names, alpha convention, dtype, metadata as the trainer's save
code writes them; the source is cited in each docstring). Each file is written at test size
(random non-zero tensors, rank 4), applied through the ``LoRAManager`` (merged, committed), and the
weight delta of EVERY layer is compared with ``strength * (alpha / r) * B @ A`` computed here from
the tensors written, placed by the hand table :data:`OURS` (the trainer's module name -> our
layer and row offset, written out from the architecture, never through our name map); every
other layer must be bit-identical. The layouts our layouts test (``test_wan_lora_formats``)
already covers (diffusers/PEFT, ComfyUI, lightx2v, musubi) are not repeated.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.wan import WanArchConfig
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.wan import WanTransformer
from sglang.multimodal_gen.models.dits.wan_names import WAN_NAME_MAP
from sglang.multimodal_gen.models.families.tiny.wan import TINY_TRANSFORMER

CFG = WanArchConfig.from_dict(dict(TINY_TRANSFORMER, in_channels=16, out_channels=16))
D, FFN, TEXT, FREQ, R = 32, 64, 32, 32, 4
OUT = 16 * 4  # proj_out: out_channels x prod(patch_size)
assert (CFG.inner_dim, CFG.ffn_dim) == (D, FFN)

# Wan's original module names (the Wan-AI checkpoint's, which VideoX-Fun, DiffSynth-Studio and
# ai-toolkit's saved files use) -> (our layer, first row, rows, in): our attn1.to_qkv is
# [q | k | v], attn2.to_kv is [k | v] (models/dits/wan.py).
BLOCK = {
    "self_attn.q": ("attn1.to_qkv", 0, D, D),
    "self_attn.k": ("attn1.to_qkv", D, D, D),
    "self_attn.v": ("attn1.to_qkv", 2 * D, D, D),
    "self_attn.o": ("attn1.to_out.0", 0, D, D),
    "cross_attn.q": ("attn2.to_q", 0, D, D),
    "cross_attn.k": ("attn2.to_kv", 0, D, D),
    "cross_attn.v": ("attn2.to_kv", D, D, D),
    "cross_attn.o": ("attn2.to_out.0", 0, D, D),
    "ffn.0": ("ffn.net.0.proj", 0, FFN, D),
    "ffn.2": ("ffn.net.2", 0, D, FFN),
}
TOP = {
    "text_embedding.0": ("condition_embedder.text_embedder.linear_1", 0, D, TEXT),
    "text_embedding.2": ("condition_embedder.text_embedder.linear_2", 0, D, D),
    "time_embedding.0": ("condition_embedder.time_embedder.linear_1", 0, D, FREQ),
    "time_embedding.2": ("condition_embedder.time_embedder.linear_2", 0, D, D),
    "time_projection.1": ("condition_embedder.time_proj", 0, 6 * D, D),
    "head.head": ("proj_out", 0, OUT, D),
}
OURS = {
    f"blocks.{i}.{k}": (f"blocks.{i}.{o}", *rest)
    for i in range(2)
    for k, (o, *rest) in BLOCK.items()
}
OURS.update(TOP)
FULL_ROWS = {"attn1.to_qkv": 3 * D, "attn2.to_kv": 2 * D}


def _pairs(names, seed, dtype=torch.float32, rank=R):
    """``{original name: (A, B)}``, random, in ``dtype`` (the reference uses these values)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in names:
        _, _, rows, cols = OURS[n]
        a = (torch.randn(rank, cols, generator=g) * 0.1).to(dtype)
        b = (torch.randn(rows, rank, generator=g) * 0.1).to(dtype)
        out[n] = (a, b)
    return out


def _expected(pairs, scale):
    """``{our layer: full delta}`` from the pairs written, each at ``scale``."""
    exp = {}
    for n, (a, b) in pairs.items():
        our, row, rows, cols = OURS[n]
        full = FULL_ROWS.get(our.split(".", 2)[-1], rows)
        d = exp.setdefault(our, torch.zeros(full, cols, dtype=torch.float64))
        d[row : row + rows] += scale * (b.double() @ a.double())
    return exp


def _apply(tmp_path, sd, metadata=None, strength=1.0):
    model = WanTransformer(CFG, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    mgr = LoRAManager({"transformer": model}, WAN_NAME_MAP, model_name="Wan2.x")
    layers = mgr.layers("transformer")
    w0 = {n: layer.weight.detach().double().clone() for n, layer in layers.items()}
    path = tmp_path / "lora.safetensors"
    save_file(sd, str(path), metadata=metadata)
    mgr.set_lora("x", str(path), strengths=strength, merge_mode="merge")
    info = mgr.list_loras()["loaded"][0]["targets"]["transformer"]
    mgr.commit_as_base()
    return {n: layer.weight.double() - w0[n] for n, layer in layers.items()}, info


def _check(dw, expected, atol=2e-7):
    changed = {n for n, d in dw.items() if bool(d.abs().max() > 0)}
    assert changed == set(expected)
    for n, e in expected.items():
        torch.testing.assert_close(dw[n], e, atol=atol, rtol=1e-5, msg=n)


def _flat(name: str) -> str:
    return name.replace(".", "_")


def test_videox_fun_lora_network(tmp_path):
    """VideoX-Fun's own LoRA network (``train_lora.py`` without ``--use_peft_lora``):
    ``LoRANetwork`` names each module ``lora_unet`` + "." + the (empty) name of the transformer
    root + "." + the module, flattened: ``lora_unet__blocks_0_self_attn_q`` (two underscores);
    ``lora_down``/``lora_up`` + an ``alpha`` buffer (network_alpha), all saved in the training
    dtype (bf16), header ``sshs_model_hash``/``sshs_legacy_hash``; with no ``target_name`` every
    Linear of the transformer. Source: aigc-apps/VideoX-Fun ``videox_fun/utils/lora_utils.py``
    (``LoRANetwork``, ``LoRAModule``, ``save_weights``), ``scripts/wan2.1/train_lora.py``. Refused
    before ("matched 0 of 26 modules")."""
    pairs = _pairs(list(OURS), seed=1, dtype=torch.bfloat16)
    sd = {}
    for n, (a, b) in pairs.items():
        k = "lora_unet__" + _flat(n)
        sd[f"{k}.lora_down.weight"] = a
        sd[f"{k}.lora_up.weight"] = b
        sd[f"{k}.alpha"] = torch.tensor(2.0, dtype=torch.bfloat16)  # network_alpha 2, rank 4
    meta = {"sshs_model_hash": "0" * 64, "sshs_legacy_hash": "0" * 8}
    dw, info = _apply(tmp_path, sd, meta, strength=0.8)
    _check(dw, _expected(pairs, 0.8 * 2.0 / R), atol=1e-6)
    assert info["matched_modules"] == 26 and info["target_layers"] == 20


def test_videox_fun_peft_checkpoint_and_its_comfyui_copy(tmp_path):
    """VideoX-Fun's default (``train_lora.sh``: ``--use_peft_lora --target_name
    q,k,v,ffn.0,ffn.2``): each checkpoint is saved twice, ``checkpoint-N.safetensors`` (peft's
    ``get_peft_model_state_dict``: ``blocks.0.self_attn.q.lora_A.weight``, header ``{"format":
    "pt"}``) and ``checkpoint-N-compatible_with_comfyui.safetensors``
    (``convert_peft_lora_to_kohya_lora``: ``lora_unet__blocks_0_self_attn_q.lora_down.weight``);
    neither stores an alpha, and VideoX-Fun's own ``merge_lora`` applies them at scale 1, as we
    do. Source: aigc-apps/VideoX-Fun ``scripts/wan2.1/train_lora.py`` (``save_model``),
    ``videox_fun/utils/lora_utils.py``."""
    names = [n for n in OURS if n.startswith("blocks.") and n.split(".", 2)[2] in
             ("self_attn.q", "self_attn.k", "self_attn.v", "cross_attn.q", "cross_attn.k",
              "cross_attn.v", "ffn.0", "ffn.2")]  # fmt: skip
    pairs = _pairs(names, seed=2, dtype=torch.bfloat16)
    peft = {}
    kohya = {}
    for n, (a, b) in pairs.items():
        peft[f"{n}.lora_A.weight"], peft[f"{n}.lora_B.weight"] = a, b
        k = "lora_unet__" + _flat(n)
        kohya[f"{k}.lora_down.weight"], kohya[f"{k}.lora_up.weight"] = a, b
    expected = _expected(pairs, 1.0)
    for sd in (peft, kohya):
        dw, info = _apply(tmp_path, sd, {"format": "pt"})
        _check(dw, expected, atol=1e-6)
        assert info["matched_modules"] == 16


def test_diffsynth_studio(tmp_path):
    """DiffSynth-Studio (``examples/wanvideo/model_training/lora/Wan2.1-T2V-1.3B.sh``:
    ``--lora_target_modules q,k,v,o,ffn.0,ffn.2 --remove_prefix_in_ckpt pipe.dit.``): peft's
    ``inject_adapter_in_model`` on DiffSynth's ``WanModel`` (original Wan names), the trainable
    parameters saved as they are named: ``blocks.0.self_attn.q.lora_A.default.weight``, bf16,
    no alpha, no metadata; DiffSynth's ``GeneralLoRALoader`` applies ``B @ A`` at scale 1. Source:
    modelscope/DiffSynth-Studio ``diffsynth/diffusion/training_module.py``
    (``add_lora_to_model``, ``export_trainable_state_dict``), ``diffsynth/diffusion/logger.py``
    (``save_model``), ``diffsynth/utils/lora/general.py``."""
    names = [n for n in OURS if n.startswith("blocks.")]
    pairs = _pairs(names, seed=3, dtype=torch.bfloat16)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"{n}.lora_A.default.weight"], sd[f"{n}.lora_B.default.weight"] = a, b
    dw, info = _apply(tmp_path, sd)
    _check(dw, _expected(pairs, 1.0), atol=1e-6)
    assert info["matched_modules"] == 20


def test_ai_toolkit(tmp_path):
    """ai-toolkit (ostris): peft-format LoRA (``lora_A``/``lora_B``, no alpha: alpha = rank) on
    the transformer blocks, renamed to the original Wan names under ``diffusion_model.`` before
    saving (``convert_to_original``: ``attn1`` -> ``self_attn``, ``to_out.0`` -> ``o``,
    ``ffn.net.0.proj`` -> ``ffn.0``), float16, header ``name``/``version``/``training_info``/
    ``software``/``format``/``sshs_*``. Wan2.2 A14B runs save one such file per expert
    (``_high_noise`` / ``_low_noise``, ``split_multistage_loras``), each loaded on its target.
    Source: ostris/ai-toolkit ``toolkit/models/wan21/wan_lora_convert.py``,
    ``toolkit/network_mixins.py`` (``get_state_dict``: peft_format), ``toolkit/metadata.py``,
    ``extensions_built_in/diffusion_models/wan22/wan22_14b_model.py`` (``save_lora``)."""
    names = [n for n in OURS if n.startswith("blocks.")]
    pairs = _pairs(names, seed=4, dtype=torch.float16)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"diffusion_model.{n}.lora_A.weight"] = a
        sd[f"diffusion_model.{n}.lora_B.weight"] = b
    meta = {
        "name": "my_wan_lora",
        "version": "1.0",
        "training_info": json.dumps({"step": 500, "epoch": 2}),
        "software": json.dumps(
            {"name": "ai-toolkit", "repo": "https://github.com/ostris/ai-toolkit"}
        ),
        "format": "pt",
        "sshs_model_hash": "1" * 64,
        "sshs_legacy_hash": "1" * 8,
    }
    dw, info = _apply(tmp_path, sd, meta)
    _check(dw, _expected(pairs, 1.0), atol=1e-6)
    assert info["matched_modules"] == 20


def test_simpletuner_peft_with_adapter_metadata(tmp_path):
    """SimpleTuner's LoRA (and the diffusers training scripts'): ``save_lora_weights`` of peft's
    state dict in diffusers names (``transformer.blocks.0.attn1.to_q.lora_A.weight``) with the
    adapter's ``LoraConfig`` in the header's ``lora_adapter_metadata``, every field prefixed
    ``transformer.`` (``_collate_lora_metadata``); here ``lora_alpha`` 8 at rank 4 (scale 2),
    which only the metadata says, and ``modelspec.*`` entries. Source: bghira/SimpleTuner
    ``simpletuner/helpers/training/save_hooks.py`` (``_save_lora``)."""
    diffusers_name = {
        "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
        "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
        "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj",
        "ffn.2": "ffn.net.2",
    }  # fmt: skip
    names = [n for n in OURS if n.startswith("blocks.")]
    pairs = _pairs(names, seed=5)
    sd = {}
    for n, (a, b) in pairs.items():
        i, m = n.split(".", 2)[1:]
        k = f"transformer.blocks.{i}.{diffusers_name[m]}"
        sd[f"{k}.lora_A.weight"], sd[f"{k}.lora_B.weight"] = a, b
    config = {"r": R, "lora_alpha": 8, "target_modules": sorted(set(diffusers_name.values()))}
    meta = {
        "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()}),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "wan-t2v/lora",
        "modelspec.title": "my lora",
    }
    dw, info = _apply(tmp_path, sd, meta)
    _check(dw, _expected(pairs, 8 / R))
    assert info["matched_modules"] == 20
