"""LTX-2 / LTX-2.3 LoRA files as the public trainers write them, on our ``LTX2Transformer``.

One test per trainer layout (key names, alpha convention, dtype as the trainer's save code writes
them; the source is in each docstring). Each file is written at test size (random non-zero
tensors, rank 4), applied through the ``LoRAManager`` (merged, committed as the base), and the
weight delta of EVERY layer is compared with ``strength * (alpha / r) * B @ A`` placed by hand
(``fixtures/ltx2_lora.py``: the Lightricks names and the row blocks of our fused ``to_qkv`` /
``to_kv``, never our name map); every other layer must be bit-identical. The layouts whose
output ``test_ltx2.py`` compares with diffusers (diffusers/PEFT, Lightricks' trainer and
ai-toolkit, kohya ``lora_unet_``) are not repeated.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.ltx2_lora import original_name, split_rows
from fixtures.tiny_ltx2_dit import LAYOUTS
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.ltx2 import LTX2ArchConfig
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.ltx2 import LTX2Transformer
from sglang.multimodal_gen.models.dits.ltx2_names import LTX2_NAME_MAP

R = 4


class Applied:
    """A file applied (merged, committed) to a seeded random ``LTX2Transformer`` of ``layout``.

    Attributes:
        dw: ``{our layer: W_after - W_before}`` in float64.
        info: the conversion summary (``matched_modules``, ``source_format``, ...).
    """

    def __init__(self, layout, tmp_path, sd, strength, metadata=None):
        model = LTX2Transformer(LTX2ArchConfig.from_dict(LAYOUTS[layout]), dtype=torch.float32)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        mgr = LoRAManager({"transformer": model}, LTX2_NAME_MAP, model_name="LTX-2")
        layers = mgr.layers("transformer")
        w0 = {n: layer.weight.detach().double().clone() for n, layer in layers.items()}
        path = tmp_path / "lora.safetensors"
        save_file(sd, str(path), metadata=metadata)
        mgr.set_lora("x", str(path), strengths=strength, merge_mode="merge")
        self.info = mgr.list_loras()["loaded"][0]["targets"]["transformer"]
        mgr.commit_as_base()
        self.dw = {n: layer.weight.double() - w0[n] for n, layer in layers.items()}
        self.shapes = {n: tuple(w.shape) for n, w in w0.items()}


def modules(layout) -> dict[str, tuple[str, int, int, int]]:
    """``{diffusers module: (our layer, first row, rows, in features)}`` of every linear layer."""
    model = LTX2Transformer(LTX2ArchConfig.from_dict(LAYOUTS[layout]), device="meta")
    mgr = LoRAManager({"transformer": model}, LTX2_NAME_MAP, model_name="LTX-2")
    out = {}
    for ours, layer in mgr.layers("transformer").items():
        rows, cols = layer.weight.shape
        for name, r0, n in split_rows(ours, rows):
            out[name] = (ours, r0, n, cols)
    return out


def _pairs(mods, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {
        name: (
            (torch.randn(R, cols, generator=g) * 0.1).to(dtype),
            (torch.randn(n, R, generator=g) * 0.1).to(dtype),
        )
        for name, (_, _, n, cols) in mods.items()
    }


def _check(got: Applied, mods, pairs, scales, strength):
    expected = {}
    for name, (a, b) in pairs.items():
        ours, r0, n, _ = mods[name]
        e = expected.setdefault(ours, torch.zeros(got.shapes[ours], dtype=torch.float64))
        e[r0 : r0 + n] += strength * scales[name] * (b.double() @ a.double())
    changed = {n for n, d in got.dw.items() if bool(d.abs().max() > 0)}
    assert changed == set(expected)
    for n, e in expected.items():
        torch.testing.assert_close(got.dw[n], e, atol=2e-7, rtol=1e-5, msg=n)
    assert got.info["matched_modules"] == len(pairs) and got.info["ignored_keys"] == 0


def test_diffsynth_studio_bare_names_default_infix(tmp_path):
    """DiffSynth-Studio (``examples/ltx2/model_training``, ``--lora_target_modules
    "to_k,to_q,to_v,to_out.0"``, ``--remove_prefix_in_ckpt "pipe.dit."``): the PEFT state dict
    with its adapter name, ``transformer_blocks.N.<attn>.to_q.lora_A.default.weight``, no prefix,
    no alpha (scale 1); the suffixes match in every attention of both streams."""
    mods = {
        k: v
        for k, v in modules("ltx23").items()
        if k.startswith("transformer_blocks.")
        and k.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v")
        or k.endswith(".to_out.0")
    }
    assert any("video_to_audio_attn.to_k" in k for k in mods) and len(mods) == 2 * 6 * 4
    pairs = _pairs(mods, 1)
    sd = {}
    for name, (a, b) in pairs.items():
        sd[f"{name}.lora_A.default.weight"] = a
        sd[f"{name}.lora_B.default.weight"] = b
    got = Applied("ltx23", tmp_path, sd, 0.7)
    _check(got, mods, pairs, dict.fromkeys(pairs, 1.0), 0.7)


@pytest.mark.parametrize("strength", [0.5, 1.3])
def test_comfyui_down_up_alpha_on_diffusers_names(tmp_path, strength):
    """ComfyUI's spelling over diffusers' module names (``diffusion_model.<m>.lora_down/up.weight``
    + ``<m>.alpha``; ComfyUI's LTXAV key map takes both naming), every linear layer, alpha 2."""
    mods = modules("ltx23")
    pairs = _pairs(mods, 2)
    sd = {}
    for name, (a, b) in pairs.items():
        sd[f"diffusion_model.{name}.lora_down.weight"] = a
        sd[f"diffusion_model.{name}.lora_up.weight"] = b
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(2.0)
    got = Applied("ltx23", tmp_path, sd, strength)
    _check(got, mods, pairs, dict.fromkeys(pairs, 2.0 / R), strength)
    assert got.info["source_format"] == "comfyui"


def test_musubi_kohya_bf16_with_alpha_and_metadata(tmp_path):
    """kohya/musubi networks: ``lora_unet_<original name, . -> _>``, ``lora_down``/``lora_up`` in
    bf16, an fp32 ``alpha`` per module (here 8: scale 2), ``ss_*`` metadata; blocks only
    (the networks' default target is the transformer blocks)."""
    mods = {k: v for k, v in modules("ltx23").items() if k.startswith("transformer_blocks.")}
    pairs = _pairs(mods, 3, torch.bfloat16)
    sd = {}
    for name, (a, b) in pairs.items():
        flat = "lora_unet_" + original_name(name).replace(".", "_")
        sd[f"{flat}.lora_down.weight"] = a
        sd[f"{flat}.lora_up.weight"] = b
        sd[f"{flat}.alpha"] = torch.tensor(8.0)
    meta = {"ss_network_dim": str(R), "ss_network_alpha": "8.0", "ss_base_model_version": "ltx2"}
    got = Applied("ltx23", tmp_path, sd, 1.0, metadata=meta)
    _check(got, mods, pairs, dict.fromkeys(pairs, 8.0 / R), 1.0)
    assert got.info["source_format"] == "kohya"


def test_lightricks_layout_on_ltx20(tmp_path):
    """The Lightricks layout on an LTX-2.0 DiT (caption projections, no gates, no prompt
    modulation): ``diffusion_model.<original name>.lora_A/B.weight`` on every linear layer,
    ``caption_projection`` / ``audio_caption_projection`` and ``adaln_single`` included."""
    mods = modules("ltx20")
    assert "caption_projection.linear_1" in mods and not any("gate_logits" in k for k in mods)
    pairs = _pairs(mods, 4)
    sd = {}
    for name, (a, b) in pairs.items():
        sd[f"diffusion_model.{original_name(name)}.lora_A.weight"] = a
        sd[f"diffusion_model.{original_name(name)}.lora_B.weight"] = b
    got = Applied("ltx20", tmp_path, sd, 1.3)
    _check(got, mods, pairs, dict.fromkeys(pairs, 1.0), 1.3)


def test_simpletuner_lycoris_default_targets(tmp_path):
    """SimpleTuner's LTX-2 model (``helpers/models/ltxvideo2/model.py``): default targets
    ``to_k``, ``to_q``, ``to_v``, ``to_out.0`` plus the audio list (``audio_ff.net.0.proj``,
    ``audio_ff.net.2``, ``audio_proj_in``, ``audio_proj_out``); with ``lora_type: lycoris`` the
    LyCORIS names ``lycoris_<diffusers name, . -> _>`` + ``lora_down``/``lora_up`` + ``alpha``
    (its ``standard`` LoRA goes through ``save_lora_weights``: the diffusers/PEFT layout)."""
    suffixes = ("to_q", "to_k", "to_v", "to_out.0", "audio_ff.net.0.proj", "audio_ff.net.2")
    mods = {
        k: v
        for k, v in modules("ltx23").items()
        if k.endswith(suffixes) or k in ("audio_proj_in", "audio_proj_out")
    }
    pairs = _pairs(mods, 5)
    sd = {}
    for name, (a, b) in pairs.items():
        flat = "lycoris_" + name.replace(".", "_")
        sd[f"{flat}.lora_down.weight"] = a
        sd[f"{flat}.lora_up.weight"] = b
        sd[f"{flat}.alpha"] = torch.tensor(1.0)
    got = Applied("ltx23", tmp_path, sd, 0.9)
    _check(got, mods, pairs, dict.fromkeys(pairs, 1.0 / R), 0.9)
