"""Qwen-Image LoRA files as the public trainers write them, on our tiny ``QwenImageTransformer``.

One test per trainer layout (key names, alpha convention, dtype, metadata as the trainer's save
code writes them; the source is cited in each docstring). Each file is written at test size
(random non-zero tensors, rank 4), applied through the ``LoRAManager`` (merged, committed), and the
weight delta of EVERY layer is compared with ``strength * (alpha / r) * B @ A`` computed here from
the tensors written, placed by the hand table :data:`OURS` (diffusers module name -> our layer,
first row, rows, in; ours fuse ``attn.to_qkv`` = ``[q | k | v]`` and ``attn.to_added_qkv`` =
``[add_q | add_k | add_v]``, models/dits/qwen_image.py), never through our name map; every other
layer must be bit-identical.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.qwen_image import QwenImageArchConfig
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.qwen_image import QwenImageTransformer
from sglang.multimodal_gen.models.dits.qwen_image_names import QWEN_IMAGE_NAME_MAP
from sglang.multimodal_gen.models.families.tiny.qwen_image import TINY_TRANSFORMER

D, MLP, TXT, LAT, R = 64, 256, 32, 16, 4
TB = "transformer_blocks"
_BLOCK = {
    "attn.to_q": ("attn.to_qkv", 0, D, D),
    "attn.to_k": ("attn.to_qkv", D, D, D),
    "attn.to_v": ("attn.to_qkv", 2 * D, D, D),
    "attn.add_q_proj": ("attn.to_added_qkv", 0, D, D),
    "attn.add_k_proj": ("attn.to_added_qkv", D, D, D),
    "attn.add_v_proj": ("attn.to_added_qkv", 2 * D, D, D),
    "attn.to_out.0": ("attn.to_out.0", 0, D, D),
    "attn.to_add_out": ("attn.to_add_out", 0, D, D),
    "img_mod.1": ("img_mod.1", 0, 6 * D, D),
    "txt_mod.1": ("txt_mod.1", 0, 6 * D, D),
    "img_mlp.net.0.proj": ("img_mlp.net.0.proj", 0, MLP, D),
    "img_mlp.net.2": ("img_mlp.net.2", 0, D, MLP),
    "txt_mlp.net.0.proj": ("txt_mlp.net.0.proj", 0, MLP, D),
    "txt_mlp.net.2": ("txt_mlp.net.2", 0, D, MLP),
}
OURS = {
    "img_in": ("img_in", 0, D, LAT),
    "txt_in": ("txt_in", 0, D, TXT),
    "time_text_embed.timestep_embedder.linear_1": ("time_text_embed.timestep_embedder.linear_1", 0, D, 256),
    "time_text_embed.timestep_embedder.linear_2": ("time_text_embed.timestep_embedder.linear_2", 0, D, D),
    "norm_out.linear": ("norm_out.linear", 0, 2 * D, D),
    "proj_out": ("proj_out", 0, LAT, D),
}  # fmt: skip
for _i in range(2):
    OURS.update({f"{TB}.{_i}.{k}": (f"{TB}.{_i}.{o}", *r) for k, (o, *r) in _BLOCK.items()})
BLOCKS = [n for n in OURS if n.startswith(TB)]


def _pairs(names, seed, dtype=torch.float32, rank=R):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in names:
        _, _, rows, cols = OURS[n]
        a = (torch.randn(rank, cols, generator=g) * 0.1).to(dtype)
        b = (torch.randn(rows, rank, generator=g) * 0.1).to(dtype)
        out[n] = (a, b)
    return out


def _expected(pairs, scale):
    exp = {}
    for n, (a, b) in pairs.items():
        our, row, rows, cols = OURS[n]
        full = 3 * D if our.endswith(("to_qkv", "to_added_qkv")) else rows
        d = exp.setdefault(our, torch.zeros(full, cols, dtype=torch.float64))
        d[row : row + rows] += scale * (b.double() @ a.double())
    return exp


def _apply(tmp_path, sd, metadata=None, strength=1.0):
    model = QwenImageTransformer(QwenImageArchConfig.from_dict(dict(TINY_TRANSFORMER)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    mgr = LoRAManager({"transformer": model}, QWEN_IMAGE_NAME_MAP, model_name="Qwen-Image")
    layers = mgr.layers("transformer")
    w0 = {n: layer.weight.detach().double().clone() for n, layer in layers.items()}
    save_file(sd, str(tmp_path / "l.safetensors"), metadata=metadata)
    mgr.set_lora("x", str(tmp_path / "l.safetensors"), strengths=strength, merge_mode="merge")
    info = mgr.list_loras()["loaded"][0]["targets"]["transformer"]
    mgr.commit_as_base()
    return {n: layer.weight.double() - w0[n] for n, layer in layers.items()}, info


def _check(dw, expected, atol=1e-6):
    changed = {n for n, d in dw.items() if bool(d.abs().max() > 0)}
    assert changed == set(expected)
    for n, e in expected.items():
        torch.testing.assert_close(dw[n], e, atol=atol, rtol=1e-5, msg=n)


def _flat(name: str) -> str:
    return name.replace(".", "_")


def test_diffsynth_studio(tmp_path):
    """DiffSynth-Studio (``examples/qwen_image/model_training/lora/Qwen-Image.sh``:
    ``--lora_target_modules to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,
    img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1 --remove_prefix_in_ckpt pipe.dit.``): peft's
    ``inject_adapter_in_model`` on DiffSynth's ``QwenImageDiT`` (diffusers' module names), saved
    as named: ``transformer_blocks.0.attn.to_q.lora_A.default.weight``, bf16, no alpha (its
    ``GeneralLoRALoader`` applies ``B @ A`` at scale 1), no metadata. Source:
    modelscope/DiffSynth-Studio ``diffsynth/diffusion/training_module.py``,
    ``diffsynth/diffusion/logger.py``, ``diffsynth/models/qwen_image_dit.py``."""
    targets = ("attn.to_q", "attn.to_k", "attn.to_v", "add_q_proj", "add_k_proj", "add_v_proj",
               "to_out.0", "to_add_out", "img_mlp.net.2", "img_mod.1", "txt_mlp.net.2",
               "txt_mod.1")  # fmt: skip
    names = [n for n in BLOCKS if n.endswith(targets)]
    pairs = _pairs(names, seed=1, dtype=torch.bfloat16)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"{n}.lora_A.default.weight"], sd[f"{n}.lora_B.default.weight"] = a, b
    dw, info = _apply(tmp_path, sd)
    _check(dw, _expected(pairs, 1.0))
    assert info["matched_modules"] == 24


def test_ai_toolkit(tmp_path):
    """ai-toolkit (ostris): peft-format LoRA (no alpha: alpha = rank) on every linear of the
    transformer blocks, ``transformer.`` renamed to ``diffusion_model.`` before saving
    (``QwenImageModel.convert_lora_weights_before_save``), float16, header ``name``/``version``/
    ``training_info``/``software``/``format``/``sshs_*``. Source: ostris/ai-toolkit
    ``extensions_built_in/diffusion_models/qwen_image/qwen_image.py``,
    ``toolkit/network_mixins.py`` (``get_state_dict``), ``toolkit/metadata.py``."""
    pairs = _pairs(BLOCKS, seed=2, dtype=torch.float16)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"diffusion_model.{n}.lora_A.weight"] = a
        sd[f"diffusion_model.{n}.lora_B.weight"] = b
    meta = {
        "name": "my_qwen_lora",
        "version": "1.0",
        "training_info": json.dumps({"step": 1000}),
        "software": json.dumps({"name": "ai-toolkit"}),
        "format": "pt",
        "sshs_model_hash": "2" * 64,
    }
    dw, info = _apply(tmp_path, sd, meta, strength=1.5)
    _check(dw, _expected(pairs, 1.5))
    assert info["matched_modules"] == 28


def test_musubi_tuner(tmp_path):
    """musubi-tuner (``networks.lora_qwen_image``): kohya's ``LoRANetwork`` over the
    ``QwenImageTransformerBlock`` modules, modulation excluded (``.*(_mod_).*``), names
    ``lora_unet_`` + the flattened diffusers path (``lora_unet_transformer_blocks_0_attn_to_q``),
    ``lora_down``/``lora_up`` + ``alpha`` (network_alpha 1 at rank 4: scale 1/4), bf16, ``ss_*``
    header. Source: kohya-ss/musubi-tuner ``src/musubi_tuner/networks/lora_qwen_image.py``,
    ``src/musubi_tuner/networks/lora.py`` (``LoRANetwork``, ``LoRAModule``)."""
    names = [n for n in BLOCKS if "_mod." not in n]
    pairs = _pairs(names, seed=3, dtype=torch.bfloat16)
    sd = {}
    for n, (a, b) in pairs.items():
        k = "lora_unet_" + _flat(n)
        sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = a, b
        sd[f"{k}.alpha"] = torch.tensor(1.0, dtype=torch.bfloat16)
    meta = {
        "ss_network_module": "networks.lora_qwen_image",
        "ss_network_dim": str(R),
        "ss_network_alpha": "1.0",
        "ss_architecture": "qwen_image",
    }
    dw, info = _apply(tmp_path, sd, meta)
    _check(dw, _expected(pairs, 1.0 / R))
    assert info["matched_modules"] == 24


@pytest.mark.parametrize("fmt", ["legacy", "kohya", "comfy"])
def test_onetrainer(tmp_path, fmt):
    """OneTrainer's LoRA output formats for Qwen-Image (``LoRASaverMixin``; alpha kept, here its
    default 1.0 at rank 4; header ``modelspec.*`` + ``ot_*``), each with the text encoder's LoRA,
    which is skipped and reported:

    * LEGACY (``QwenLoRASaver._convert_legacy``: the canonical dict unchanged):
      ``transformer.transformer_blocks.0.attn.to_q.lora_down.weight``, ``...to_q.alpha``, the
      text encoder under ``text_encoder.``;
    * KOHYA (``_save_kohya``): ``lora_unet_transformer_blocks_0_attn_to_q`` flattened, the text
      encoder under ``lora_te_``;
    * COMFY (``_save_comfy``): ``diffusion_model.`` + ``lora_A``/``lora_B``/``alpha``, the text
      encoder under ``text_encoders.qwen25_7b.transformer.``.

    Source: Nerogar/OneTrainer ``modules/modelSaver/mixin/LoRASaverMixin.py``,
    ``modules/modelSaver/qwen/QwenLoRASaver.py``, ``modules/model/QwenModel.py``
    (``lora_text_encoders``), ``modules/util/convert_lora_util.py``."""
    pairs = _pairs(list(OURS), seed=4, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(40)
    te_a, te_b = torch.randn(R, 32, generator=g), torch.randn(32, R, generator=g)
    te = "model.layers.0.self_attn.q_proj"
    sd = {}
    for n, (a, b) in list(pairs.items()) + [(f"TE.{te}", (te_a, te_b))]:
        is_te = n.startswith("TE.")
        n = n.removeprefix("TE.")
        if fmt == "legacy":
            k = f"{'text_encoder' if is_te else 'transformer'}.{n}"
            down, up = "lora_down.weight", "lora_up.weight"
        elif fmt == "kohya":
            k = ("lora_te_" if is_te else "lora_unet_") + _flat(n)
            down, up = "lora_down.weight", "lora_up.weight"
        else:
            k = ("text_encoders.qwen25_7b.transformer." if is_te else "diffusion_model.") + n
            down, up = "lora_A.weight", "lora_B.weight"
        sd[f"{k}.{down}"], sd[f"{k}.{up}"], sd[f"{k}.alpha"] = a, b, torch.tensor(1.0)
    meta = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "Qwen-Image/lora",
        "ot_branch": "master",
        "ot_revision": "0" * 40,
    }
    dw, info = _apply(tmp_path, sd, meta)
    _check(dw, _expected(pairs, 1.0 / R))
    assert info["matched_modules"] == len(OURS) and info["ignored_keys"] == 3


def test_videox_fun_lora_network(tmp_path):
    """VideoX-Fun's own LoRA network (``train_lora.py`` without ``--use_peft_lora``) on
    ``QwenImageTransformer2DModel``: ``lora_unet__`` (two underscores: the transformer root's
    empty name) + the flattened diffusers path, ``lora_down``/``lora_up`` + ``alpha``, every
    Linear of the transformer, saved in the training dtype (bf16), header ``sshs_*``. Source:
    aigc-apps/VideoX-Fun ``videox_fun/utils/lora_utils.py`` (``LoRANetwork``),
    ``scripts/qwenimage/train_lora.py``."""
    pairs = _pairs(list(OURS), seed=5, dtype=torch.bfloat16)
    sd = {}
    for n, (a, b) in pairs.items():
        k = "lora_unet__" + _flat(n)
        sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = a, b
        sd[f"{k}.alpha"] = torch.tensor(8.0, dtype=torch.bfloat16)
    dw, info = _apply(tmp_path, sd, {"sshs_model_hash": "3" * 64, "sshs_legacy_hash": "3" * 8})
    _check(dw, _expected(pairs, 8.0 / R))
    assert info["matched_modules"] == len(OURS) == 34


def test_simpletuner_peft_with_adapter_metadata(tmp_path):
    """SimpleTuner's LoRA: diffusers' ``save_lora_weights`` of the peft state dict
    (``transformer.transformer_blocks.0.attn.to_q.lora_A.weight``) with the ``LoraConfig`` in
    ``lora_adapter_metadata`` (fields prefixed ``transformer.``: ``lora_alpha`` 2 at rank 4, scale
    1/2, which only the metadata says). Source: bghira/SimpleTuner
    ``simpletuner/helpers/training/save_hooks.py`` (``_save_lora``)."""
    pairs = _pairs(BLOCKS, seed=6)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"transformer.{n}.lora_A.weight"], sd[f"transformer.{n}.lora_B.weight"] = a, b
    config = {"r": R, "lora_alpha": 2, "lora_dropout": 0.0, "use_dora": False}
    meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
    dw, info = _apply(tmp_path, sd, meta)
    _check(dw, _expected(pairs, 2 / R), atol=2e-7)
    assert info["matched_modules"] == 28
