"""Flux.1 LoRA files as the public trainers write them, on our tiny ``FluxTransformer``.

One test per trainer layout (key names, alpha convention, dtype, metadata as the trainer's save
code writes them; the source is cited in each docstring). Each file is written at test size
(random non-zero tensors), applied through the ``LoRAManager`` (merged, committed), and the
weight (and bias) delta of EVERY layer is compared with ``strength * (alpha / r) * B @ A``
computed here from the tensors written, placed by the hand tables :data:`DIFFUSERS` / :data:`BFL`
(the trainer's module name -> our layer, first row, rows, in; BFL's ``final_layer.adaLN_
modulation.1`` stores ``(shift, scale)`` where ours is ``(scale, shift)``), written out from the
architecture, never through our name map; every other layer must be bit-identical. Layouts the
layouts test (``test_flux_lora_formats``: kohya/BFL, ComfyUI, XLabs, diffusers/PEFT, LoKr)
already covers are not repeated.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.flux import FluxArchConfig
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.flux import FluxTransformer
from sglang.multimodal_gen.models.dits.flux_names import FLUX_NAME_MAP
from sglang.multimodal_gen.models.families.tiny.flux import TINY_TRANSFORMER

CFG = FluxArchConfig.from_dict(dict(TINY_TRANSFORMER, guidance_embeds=True))
D, MLP, TXT, POOLED, LAT = 64, 256, 32, 32, 16
assert (CFG.inner_dim, CFG.mlp_hidden) == (D, MLP)
R = 4
TB, STB = "transformer_blocks", "single_transformer_blocks"

# diffusers module names -> (our layer, first row, rows, in). Ours fuse [q|k|v] (to_qkv,
# to_added_qkv) and, in single blocks, [q|k|v|mlp] (to_qkv_mlp); see models/dits/flux.py.
_DOUBLE = {
    "attn.to_q": ("attn.to_qkv", 0, D, D),
    "attn.to_k": ("attn.to_qkv", D, D, D),
    "attn.to_v": ("attn.to_qkv", 2 * D, D, D),
    "attn.add_q_proj": ("attn.to_added_qkv", 0, D, D),
    "attn.add_k_proj": ("attn.to_added_qkv", D, D, D),
    "attn.add_v_proj": ("attn.to_added_qkv", 2 * D, D, D),
    "attn.to_out.0": ("attn.to_out.0", 0, D, D),
    "attn.to_add_out": ("attn.to_add_out", 0, D, D),
    "ff.net.0.proj": ("ff.net.0.proj", 0, MLP, D),
    "ff.net.2": ("ff.net.2", 0, D, MLP),
    "ff_context.net.0.proj": ("ff_context.net.0.proj", 0, MLP, D),
    "ff_context.net.2": ("ff_context.net.2", 0, D, MLP),
    "norm1.linear": ("norm1.linear", 0, 6 * D, D),
    "norm1_context.linear": ("norm1_context.linear", 0, 6 * D, D),
}
_SINGLE = {
    "attn.to_q": ("to_qkv_mlp", 0, D, D),
    "attn.to_k": ("to_qkv_mlp", D, D, D),
    "attn.to_v": ("to_qkv_mlp", 2 * D, D, D),
    "proj_mlp": ("to_qkv_mlp", 3 * D, MLP, D),
    "proj_out": ("proj_out", 0, D, D + MLP),
    "norm.linear": ("norm.linear", 0, 3 * D, D),
}
DIFFUSERS = {
    "x_embedder": ("x_embedder", 0, D, LAT),
    "context_embedder": ("context_embedder", 0, D, TXT),
    "time_text_embed.timestep_embedder.linear_1": ("time_text_embed.timestep_embedder.linear_1", 0, D, 256),
    "time_text_embed.text_embedder.linear_1": ("time_text_embed.text_embedder.linear_1", 0, D, POOLED),
    "norm_out.linear": ("norm_out.linear", 0, 2 * D, D),
    "proj_out": ("proj_out", 0, LAT, D),
}  # fmt: skip
for _i in range(2):
    DIFFUSERS.update({f"{TB}.{_i}.{k}": (f"{TB}.{_i}.{o}", *r) for k, (o, *r) in _DOUBLE.items()})
    DIFFUSERS.update({f"{STB}.{_i}.{k}": (f"{STB}.{_i}.{o}", *r) for k, (o, *r) in _SINGLE.items()})

# BFL (original Flux) module names -> (our layer, first row, rows, in, rows swapped in halves)
BFL = {
    "final_layer.linear": ("proj_out", 0, LAT, D, False),
    "final_layer.adaLN_modulation.1": ("norm_out.linear", 0, 2 * D, D, True),
}
for _i in range(2):
    for k, o, rows, cols in (
        ("img_attn.qkv", "attn.to_qkv", 3 * D, D),
        ("txt_attn.qkv", "attn.to_added_qkv", 3 * D, D),
        ("img_attn.proj", "attn.to_out.0", D, D),
        ("txt_attn.proj", "attn.to_add_out", D, D),
        ("img_mlp.0", "ff.net.0.proj", MLP, D),
        ("img_mlp.2", "ff.net.2", D, MLP),
        ("txt_mlp.0", "ff_context.net.0.proj", MLP, D),
        ("txt_mlp.2", "ff_context.net.2", D, MLP),
        ("img_mod.lin", "norm1.linear", 6 * D, D),
        ("txt_mod.lin", "norm1_context.linear", 6 * D, D),
    ):
        BFL[f"double_blocks.{_i}.{k}"] = (f"{TB}.{_i}.{o}", 0, rows, cols, False)
    for k, o, rows, cols in (
        ("linear1", "to_qkv_mlp", 3 * D + MLP, D),
        ("linear2", "proj_out", D, D + MLP),
        ("modulation.lin", "norm.linear", 3 * D, D),
    ):
        BFL[f"single_blocks.{_i}.{k}"] = (f"{STB}.{_i}.{o}", 0, rows, cols, False)
FULL_ROWS = {"attn.to_qkv": 3 * D, "attn.to_added_qkv": 3 * D, "to_qkv_mlp": 3 * D + MLP}


def _full_rows(our: str, rows: int) -> int:
    return next((n for k, n in FULL_ROWS.items() if our.endswith("." + k)), rows)


def _pairs(table, names, seed, dtype=torch.float32, rank=R):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in names:
        rows, cols = table[n][2], table[n][3]
        a = (torch.randn(rank, cols, generator=g) * 0.1).to(dtype)
        b = (torch.randn(rows, rank, generator=g) * 0.1).to(dtype)
        out[n] = (a, b)
    return out


def _expected(table, pairs, scales):
    """``{our layer: full delta}``: ``scales[name] * B @ A`` at the rows of the hand table (BFL's
    swapped halves put back in our order)."""
    exp = {}
    for n, (a, b) in pairs.items():
        our, row, rows, cols, *swap = table[n]
        d = exp.setdefault(our, torch.zeros(_full_rows(our, rows), cols, dtype=torch.float64))
        delta = scales[n] * (b.double() @ a.double())
        if swap and swap[0]:
            delta = torch.cat([delta[rows // 2 :], delta[: rows // 2]])
        d[row : row + rows] += delta
    return exp


class Applied:
    """A file applied to a fresh model, merged and committed: weight deltas (fp64), biases."""

    def __init__(self, tmp_path, sd, metadata=None, strength=1.0):
        model = FluxTransformer(CFG, dtype=torch.float32)
        g = torch.Generator().manual_seed(1000)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.mgr = LoRAManager({"transformer": model}, FLUX_NAME_MAP, model_name="Flux.1")
        layers = self.mgr.layers("transformer")
        w0 = {n: layer.weight.detach().double().clone() for n, layer in layers.items()}
        self.b0 = {n: layer.bias.detach().clone() for n, layer in layers.items()}
        path = tmp_path / "lora.safetensors"
        save_file(sd, str(path), metadata=metadata)
        self.mgr.set_lora("x", str(path), strengths=strength, merge_mode="merge")
        self.info = self.mgr.list_loras()["loaded"][0]["targets"]["transformer"]
        self.mgr.commit_as_base()
        self.dw = {n: layer.weight.double() - w0[n] for n, layer in layers.items()}
        self.db = {
            n: layer.bias.detach().double() - self.b0[n].double() for n, layer in layers.items()
        }

    def check(self, expected, atol=2e-7, pairs=None):
        changed = {n for n, d in self.dw.items() if bool(d.abs().max() > 0)}
        assert changed == set(expected)
        for n, e in expected.items():
            torch.testing.assert_close(self.dw[n], e, atol=atol, rtol=1e-5, msg=n)
        if pairs is not None:
            assert self.info["matched_modules"] == pairs


def _flat(name: str) -> str:
    return name.replace(".", "_")


def test_diffsynth_studio_opensource_format(tmp_path):
    """DiffSynth-Studio with ``--align_to_opensource_format`` (every Flux example script passes
    it): its fused-qkv DiT trained with peft, saved as kohya names over the BFL modules
    (``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``, ``lora_unet_single_blocks_0_
    linear1``), with an ``alpha`` of ``torch.tensor((r,))[0]``: an int64 scalar equal to the
    rank; tensors in the training dtype (bf16); no metadata. Source: modelscope/DiffSynth-Studio
    ``diffsynth/utils/lora/flux.py`` (``FluxLoRAConverter.align_to_opensource_format``),
    ``examples/flux/model_training/train.py``, ``examples/flux/model_training/lora/FLUX.1-dev.sh``."""
    names = [n for n in BFL if not n.startswith("final_layer")]
    pairs = _pairs(BFL, names, seed=1, dtype=torch.bfloat16)
    sd = {}
    for n, (a, b) in pairs.items():
        k = "lora_unet_" + _flat(n)
        sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = a, b
        sd[f"{k}.alpha"] = torch.tensor((b.shape[-1],))[0]
    assert sd["lora_unet_single_blocks_0_linear1.alpha"].dtype == torch.int64
    applied = Applied(tmp_path, sd)
    applied.check(_expected(BFL, pairs, dict.fromkeys(pairs, 1.0)), atol=1e-6, pairs=26)


@pytest.mark.parametrize("fmt", ["legacy", "comfy", "original"])
def test_onetrainer(tmp_path, fmt):
    """OneTrainer's LoRA output formats (``LoRASaverMixin``), alpha kept per module (here its
    default ``lora_alpha`` 1.0 at rank 4), header ``modelspec.*`` + ``ot_branch``/
    ``ot_revision``/``ot_config``:

    * LEGACY (``FluxLoRASaver._convert_legacy`` -> ``convert_to_mixture``): the diffusers body
      flattened under ``lora_transformer_`` (split q/k/v), ``lora_down``/``lora_up``/``alpha``, the
      CLIP-L LoRA under ``lora_te1_`` and bundled embeddings as ``bundle_emb.<token>.clip_l``
      (text-encoder side: skipped and reported, as every text-encoder key);
    * COMFY (``_save_comfy``): BFL names under ``diffusion_model.`` (fused qkv, ``linear1``, the
      final adaLN's halves swapped as BFL stores them), ``lora_A``/``lora_B``/``alpha``, text
      encoders under ``text_encoders.clip_l.transformer.``;
    * ORIGINAL (``_save_original``): the same BFL names with no prefix (no text encoder).

    Source: Nerogar/OneTrainer ``modules/modelSaver/mixin/LoRASaverMixin.py``,
    ``modules/util/convert_lora_util.py``, ``modules/modelSaver/flux/FluxLoRASaver.py``,
    ``modules/model/FluxModel.py`` (``diffusers_to_original``, ``lora_text_encoders``),
    ``modules/modelSaver/mixin/DtypeModelSaverMixin.py`` (``_create_safetensors_header``)."""
    meta = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "Flux.1-dev/lora",
        "modelspec.implementation": "https://github.com/black-forest-labs/flux",
        "modelspec.date": "2025-01-01",
        "ot_branch": "master",
        "ot_revision": "0" * 40,
        "ot_config": json.dumps({"lora_rank": R, "lora_alpha": 1.0}),
    }
    g = torch.Generator().manual_seed(9)
    te = {"q": torch.randn(R, 32, generator=g), "b": torch.randn(32, R, generator=g)}
    sd = {}
    if fmt == "legacy":
        table = DIFFUSERS
        pairs = _pairs(table, list(table), seed=2, dtype=torch.bfloat16)
        for n, (a, b) in pairs.items():
            k = "lora_transformer_" + _flat(n)
            sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = a, b
            sd[f"{k}.alpha"] = torch.tensor(1.0)
        k = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
        sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = te["q"], te["b"]
        sd[f"{k}.alpha"] = torch.tensor(1.0)
        sd["bundle_emb.ohwx.clip_l"] = torch.randn(1, 32, generator=g)
        ignored = 4
    else:
        table = BFL
        pairs = _pairs(table, list(table), seed=3, dtype=torch.bfloat16)
        prefix = "diffusion_model." if fmt == "comfy" else ""
        for n, (a, b) in pairs.items():
            sd[f"{prefix}{n}.lora_A.weight"], sd[f"{prefix}{n}.lora_B.weight"] = a, b
            sd[f"{prefix}{n}.alpha"] = torch.tensor(1.0)
        ignored = 0
        if fmt == "comfy":
            k = "text_encoders.clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj"
            sd[f"{k}.lora_A.weight"], sd[f"{k}.lora_B.weight"] = te["q"], te["b"]
            sd[f"{k}.alpha"] = torch.tensor(1.0)
            ignored = 3
    applied = Applied(tmp_path, sd, meta, strength=0.5)
    applied.check(_expected(table, pairs, dict.fromkeys(pairs, 0.5 / R)), atol=1e-6)
    assert applied.info["matched_modules"] == len(pairs)
    assert applied.info["ignored_keys"] == ignored


def test_simpletuner_peft_with_embedder_rank_above_its_width(tmp_path):
    """SimpleTuner (``--flux_lora_target all+ffs+embedder``, rank 32): diffusers'
    ``save_lora_weights`` of the peft state dict (``transformer.x_embedder.lora_A.weight``...) with
    the ``LoraConfig`` in ``lora_adapter_metadata`` (fields prefixed ``transformer.``; ``lora_alpha``
    16: scale 1/2) and ``modelspec.*`` entries. The target list puts rank 32 on ``x_embedder``
    (16 inputs here, 64 in Flux.1) and on the top ``proj_out`` (16 outputs): those are stored
    exactly at rank 16. Source: bghira/SimpleTuner ``simpletuner/helpers/models/flux/model.py``
    (``all+ffs+embedder`` targets), ``simpletuner/helpers/training/save_hooks.py``
    (``_save_lora``)."""
    targets = ["x_embedder", "to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_q_proj",
               "add_v_proj", "to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
               "ff_context.net.2", "proj_mlp", "proj_out"]  # fmt: skip
    names = [n for n in DIFFUSERS if any(n == t or n.endswith("." + t) for t in targets)]
    rank = 32
    pairs = _pairs(DIFFUSERS, names, seed=4, dtype=torch.bfloat16, rank=rank)
    sd = {}
    for n, (a, b) in pairs.items():
        sd[f"transformer.{n}.lora_A.weight"], sd[f"transformer.{n}.lora_B.weight"] = a, b
    config = {"r": rank, "lora_alpha": 16, "target_modules": sorted(targets), "use_dora": False}
    meta = {
        "lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()}),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "flux-1-dev/lora",
    }
    applied = Applied(tmp_path, sd, meta)
    applied.check(_expected(DIFFUSERS, pairs, dict.fromkeys(pairs, 16 / rank)), atol=2e-6)
    assert applied.info["matched_modules"] == len(names) == 2 + 2 * 12 + 2 * 5


def test_simpletuner_lycoris_lora(tmp_path):
    """SimpleTuner with LyCORIS (``--lora_type lycoris``, a config of ``algo: lora``): LyCORIS'
    ``LycorisNetwork`` names modules ``lycoris_`` + the flattened diffusers path
    (``lycoris_transformer_blocks_0_attn_to_q``), ``lora_down``/``lora_up`` + ``alpha``, saved in
    the network's dtype with the config in the header's ``lycoris_config``. Source:
    bghira/SimpleTuner ``simpletuner/helpers/training/save_hooks.py`` (``_save_lycoris``);
    KohakuBlueleaf/LyCORIS ``lycoris/wrapper.py`` (``LORA_PREFIX``, ``create_modules``)."""
    names = [n for n in DIFFUSERS if n.startswith((TB, STB)) and ".norm" not in n]
    pairs = _pairs(DIFFUSERS, names, seed=5, dtype=torch.bfloat16)
    sd = {}
    for n, (a, b) in pairs.items():
        k = "lycoris_" + _flat(n)
        sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = a, b
        sd[f"{k}.alpha"] = torch.tensor(2.0, dtype=torch.bfloat16)
    config = {"algo": "lora", "multiplier": 1.0, "linear_dim": R, "linear_alpha": 2}
    applied = Applied(tmp_path, sd, {"lycoris_config": json.dumps(config)})
    applied.check(_expected(DIFFUSERS, pairs, dict.fromkeys(pairs, 2.0 / R)), atol=1e-6)
    assert applied.info["matched_modules"] == len(names) == 2 * 12 + 2 * 5


def test_fal_kontext_trainer(tmp_path):
    """fal's Flux Kontext LoRA trainer: peft's ``get_peft_model`` over the BFL module names
    (``base_model.model.double_blocks.0.img_attn.qkv.lora_A.weight``, ``single_blocks.0.
    linear1``, ``final_layer.linear``), no alpha (scale 1), with peft's ``lora_B.bias`` on some
    modules (the bias moves by ``strength * bias``). Source: the layout diffusers converts,
    huggingface/diffusers ``src/diffusers/loaders/lora_conversion_utils.py``
    (``_convert_fal_kontext_lora_to_diffusers``)."""
    names = [n for n in BFL if n != "final_layer.adaLN_modulation.1"]
    pairs = _pairs(BFL, names, seed=6)
    g = torch.Generator().manual_seed(60)
    sd, biases = {}, {}
    for n, (a, b) in pairs.items():
        k = f"base_model.model.{n}"
        sd[f"{k}.lora_A.weight"], sd[f"{k}.lora_B.weight"] = a, b
        if n.endswith(("img_attn.qkv", "linear2")):
            biases[n] = sd[f"{k}.lora_B.bias"] = torch.randn(b.shape[0], generator=g) * 0.1
    applied = Applied(tmp_path, sd, strength=0.7)
    applied.check(_expected(BFL, pairs, dict.fromkeys(pairs, 0.7)), atol=1e-6, pairs=len(names))
    for n, bias in biases.items():
        our = BFL[n][0]
        torch.testing.assert_close(applied.db[our], 0.7 * bias.double(), atol=1e-6, rtol=1e-5)
    assert sum(bool(d.abs().max() > 0) for d in applied.db.values()) == len(biases)


def test_videox_fun(tmp_path):
    """VideoX-Fun's Flux LoRA (``scripts/flux/train_lora.sh``: ``--use_peft_lora --target_name
    to_q,to_k,to_v,...``) in its ComfyUI copy: ``convert_peft_lora_to_kohya_lora`` flattens the
    diffusers names under ``lora_unet__`` (two underscores) with no alpha (scale 1), bf16, header
    ``{"format": "pt"}``. Source: aigc-apps/VideoX-Fun ``scripts/flux/train_lora.py``,
    ``videox_fun/utils/lora_utils.py``."""
    names = [n for n in DIFFUSERS if n.endswith(("attn.to_q", "attn.to_k", "attn.to_v"))]
    pairs = _pairs(DIFFUSERS, names, seed=7, dtype=torch.bfloat16)
    sd = {}
    for n, (a, b) in pairs.items():
        k = "lora_unet__" + _flat(n)
        sd[f"{k}.lora_down.weight"], sd[f"{k}.lora_up.weight"] = a, b
    applied = Applied(tmp_path, sd, {"format": "pt"})
    applied.check(_expected(DIFFUSERS, pairs, dict.fromkeys(pairs, 1.0)), atol=1e-6, pairs=12)
