"""LTX-2.3 LoRA layouts on our ``LTX2Transformer``: the DiT's OUTPUT (video and audio) with the
adapter loaded by our runtime equals diffusers' ``LTX2VideoTransformer3DModel`` with the same
adapter, at two strengths.

Every file covers EVERY linear layer of the tiny LTX-2.3 DiT (``fixtures/tiny_ltx2_dit.py``,
``ltx23``): both streams' self-attention (``attn1``, ``audio_attn1``), text cross-attention
(``attn2``, ``audio_attn2``), the audio-video cross-attentions (``audio_to_video_attn``,
``video_to_audio_attn``), the per-head gate logits (``to_gate_logits``) of each, both feed-forwards
(``ff``, ``audio_ff``), the patch projections, every adaLN / timestep embedder (the cross-attention
and prompt modulations included) and both output projections. Rank 4, random non-zero ``A`` / ``B``.

References, both computed outside our runtime:

* diffusers/PEFT (``transformer.<diffusers name>``, alpha in the ``lora_adapter_metadata``
  header) and Lightricks' layout (``diffusion_model.<original name>``, as the LTX-2 trainer and
  ai-toolkit save it) are loaded into the reference through diffusers itself:
  ``LTX2LoraLoaderMixin.lora_state_dict`` (which renames the original names) and
  ``load_lora_adapter`` + ``set_adapters(weights=strength)``;
* kohya ``lora_unet_`` flattened names (which diffusers' LTX-2 loader drops without a word, shown
  below) against the reference with merged weights ``W + strength * alpha / r * B @ A``.

The trainers' own spellings (DiffSynth-Studio, ComfyUI ``lora_down``/``lora_up``, musubi bf16, the
LTX-2.0 layout) are checked layer by layer in ``test_ltx2_trainers.py``.

Measured (torch 2.13 CPU, fp32), max |ours - ref| / max |ref| over video and audio: <= 3.7e-7 for
every layout and strength, dynamic and merged (threshold 2e-6). Nearby wrong cases far outside:
the other strength's reference 0.34 .. 0.7, no LoRA 0.22 .. 1.1, one module's alpha ignored
(kohya, block 1's ``audio_ff.net.2``) 4.1e-3.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from fixtures.ltx2_lora import original_name
from fixtures.tiny_ltx2_dit import dit_inputs, reference_dit
from fixtures.tiny_models import rel_err
from safetensors.torch import save_file
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.ltx2 import ltx2_from_diffusers_module
from sglang.multimodal_gen.models.dits.ltx2_names import LTX2_NAME_MAP

R = 4
STRENGTHS = (0.5, 1.3)
PARITY_REL_ERR = 2e-6  # measured <= 4e-7

# every stream-specific module kind the file must reach
MUST_COVER = (
    "attn1.to_q", "audio_attn1.to_v", "audio_attn2.to_k", "audio_to_video_attn.to_k",
    "video_to_audio_attn.to_out.0", "audio_ff.net.0.proj", "audio_ff.net.2",
    "audio_attn1.to_gate_logits", "video_to_audio_attn.to_gate_logits", "attn2.to_gate_logits",
)  # fmt: skip


@pytest.fixture(scope="module")
def base():
    """(diffusers reference, its output without LoRA, inputs, {diffusers linear name: (A, B)})."""
    ref = reference_dit("ltx23")
    inputs = dit_inputs("ltx23")
    with torch.no_grad():
        plain = ref(**inputs, return_dict=False)
    g = torch.Generator().manual_seed(11)
    pairs = {}
    for name, m in ref.named_modules():
        if isinstance(m, nn.Linear):
            a = torch.randn(R, m.in_features, generator=g) * 0.1
            b = torch.randn(m.out_features, R, generator=g) * 0.1
            pairs[name] = (a, b)
    assert all(any(n.endswith(k) for n in pairs) for k in MUST_COVER)
    return ref, plain, inputs, pairs


class Ours:
    """Our DiT built from the reference's weights, its ``LoRAManager`` and the file on disk."""

    def __init__(self, ref, tmp_path, sd, metadata=None):
        self.model = ltx2_from_diffusers_module(ref, tp_rank=0, tp_size=1)
        self.mgr = LoRAManager({"transformer": self.model}, LTX2_NAME_MAP, model_name="LTX-2")
        self.path = str(tmp_path / "lora.safetensors")
        save_file(sd, self.path, metadata=metadata)

    def set(self, strength, merge_mode="dynamic") -> dict:
        """Load (first call) or re-weight the adapter; returns its conversion summary."""
        self.mgr.set_lora("x", self.path, strengths=strength, merge_mode=merge_mode)
        return self.mgr.list_loras()["loaded"][0]["targets"]["transformer"]


def _merged_reference(ref, inputs, pairs, scales, strength):
    """The reference with ``W + strength * scale * B @ A`` written into each linear layer."""
    model = copy.deepcopy(ref)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for name, (a, b) in pairs.items():
            w = mods[name].weight
            w += (strength * scales[name] * (b.double() @ a.double())).to(w.dtype)
        return model(**inputs, return_dict=False)


def _diffusers_reference(ref, inputs, state_dict, metadata, strengths):
    """The reference with the file loaded through diffusers (``LTX2LoraLoaderMixin``'s
    conversion, ``load_lora_adapter``), one output per strength (``set_adapters``)."""
    from diffusers.loaders.lora_pipeline import LTX2LoraLoaderMixin

    converted = LTX2LoraLoaderMixin.lora_state_dict(dict(state_dict))
    converted = {k: v for k, v in converted.items() if k.startswith("transformer.")}
    assert converted, "diffusers read nothing of the file"
    model = copy.deepcopy(ref)
    model.load_lora_adapter(converted, prefix="transformer", adapter_name="x", metadata=metadata)
    outs = []
    with torch.no_grad():
        for s in strengths:
            model.set_adapters(["x"], weights=[s])
            outs.append(model(**inputs, return_dict=False))
    return outs


def _err(got, expected) -> float:
    return max(rel_err(got[0], expected[0]), rel_err(got[1], expected[1]))


def _check(
    ref, inputs, plain, tmp_path, sd, expected, n_modules, metadata=None, modes=("dynamic",)
):
    """Ours at each strength (and merge mode) equals ``expected[i]``; the other strength's
    reference and the plain output are far."""
    ours = Ours(ref, tmp_path, sd, metadata)
    for mode in modes:
        for i, s in enumerate(STRENGTHS):
            info = ours.set(s, mode)
            assert info["matched_modules"] == n_modules and info["ignored_keys"] == 0, info
            with torch.no_grad():
                got = ours.model(**inputs)
            err, other, none = (_err(got, e) for e in (expected[i], expected[1 - i], plain))
            print(
                f"ltx2 lora {info['source_format']} {mode} strength {s}: rel err {err:.3g} "
                f"(other strength {other:.3g}, no LoRA {none:.3g})"
            )
            assert err <= PARITY_REL_ERR, (mode, s, err)
            assert other > 100 * PARITY_REL_ERR and none > 1e-2


def test_diffusers_peft_layout_with_alpha_in_the_header_matches_diffusers(base, tmp_path):
    """``transformer.<diffusers name>.lora_A/B.weight`` (``LTX2Pipeline.save_lora_weights``, as
    SimpleTuner saves) with ``transformer.lora_alpha`` 8 for r 4 (scale 2) in the header."""
    ref, plain, inputs, pairs = base
    sd = {}
    for name, (a, b) in pairs.items():
        sd[f"transformer.{name}.lora_A.weight"] = a
        sd[f"transformer.{name}.lora_B.weight"] = b
    # as a pipeline's save_lora_weights writes it: every field prefixed with the component
    cfg = {"transformer.r": R, "transformer.lora_alpha": 2 * R}
    cfg["transformer.target_modules"] = sorted(pairs)
    expected = _diffusers_reference(ref, inputs, sd, cfg, STRENGTHS)
    meta = {"lora_adapter_metadata": json.dumps(cfg)}
    _check(ref, inputs, plain, tmp_path, sd, expected, len(pairs), meta)


def test_lightricks_layout_original_names_matches_diffusers(base, tmp_path):
    """``diffusion_model.<original name>.lora_A/B.weight``, no alpha (scale 1): what Lightricks'
    LTX-2 trainer writes (``ltx_trainer/trainer.py`` ``_save_checkpoint``: PEFT state dict,
    ``base_model.model.`` -> ``diffusion_model.``) and the official distilled / IC / camera LoRAs
    use; ai-toolkit's ``convert_lora_diffusers_to_original`` writes the same."""
    ref, plain, inputs, pairs = base
    sd = {}
    for name, (a, b) in pairs.items():
        sd[f"diffusion_model.{original_name(name)}.lora_A.weight"] = a
        sd[f"diffusion_model.{original_name(name)}.lora_B.weight"] = b
    assert "diffusion_model.adaln_single.linear.lora_A.weight" in sd
    assert "diffusion_model.av_ca_v2a_gate_adaln_single.linear.lora_B.weight" in sd
    expected = _diffusers_reference(ref, inputs, sd, None, STRENGTHS)
    _check(ref, inputs, plain, tmp_path, sd, expected, len(pairs))


def test_kohya_flattened_names_load_where_diffusers_drops_them(base, tmp_path):
    """``lora_unet_<original name, . -> _>.lora_down/up.weight`` + ``.alpha`` (kohya/musubi
    networks; alpha differs per module): diffusers' LTX-2 loader converts only
    ``diffusion_model.`` keys and keeps ``transformer.`` ones, so it loads none of these (shown
    here); ours un-flattens each name against the model's vocabulary."""
    from diffusers.loaders.lora_pipeline import LTX2LoraLoaderMixin

    ref, plain, inputs, pairs = base
    sd, scales = {}, {}
    for i, (name, (a, b)) in enumerate(pairs.items()):
        flat = "lora_unet_" + original_name(name).replace(".", "_")
        alpha = float(1 + i % 7)
        sd[f"{flat}.lora_down.weight"] = a
        sd[f"{flat}.lora_up.weight"] = b
        sd[f"{flat}.alpha"] = torch.tensor(alpha)
        scales[name] = alpha / R
    assert "lora_unet_transformer_blocks_1_audio_to_video_attn_to_gate_logits.alpha" in sd
    seen_by_diffusers = LTX2LoraLoaderMixin.lora_state_dict(dict(sd))
    assert not any(k.startswith("transformer.") for k in seen_by_diffusers)
    expected = [_merged_reference(ref, inputs, pairs, scales, s) for s in STRENGTHS]
    _check(ref, inputs, plain, tmp_path, sd, expected, len(pairs), modes=("dynamic", "merge"))
    # one module's alpha ignored is a visible error (the nearby wrong case)
    wrong = dict(scales, **{"transformer_blocks.1.audio_ff.net.2": 1.0})
    off = _merged_reference(ref, inputs, pairs, wrong, STRENGTHS[1])
    print(f"ltx2 lora kohya, one alpha ignored: {_err(off, expected[1]):.3g}")
    assert _err(off, expected[1]) > 100 * PARITY_REL_ERR


def test_connector_and_text_projection_keys_are_refused_naming_them(base, tmp_path):
    """A file with LoRA on the text path (``text_embedding_projection.*``, which diffusers' LTX-2
    loader sends to its ``connectors`` component; ``video_embeddings_connector.*`` of the
    single-file checkpoint; diffusers' own ``connectors.`` keys) targets modules our DiT does not
    hold: refused naming the keys, never half loaded."""
    ref, _, _, pairs = base
    a, b = pairs["transformer_blocks.0.attn1.to_q"]
    for extra in (
        "text_embedding_projection.aggregate_embed",
        "diffusion_model.video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q",
        "connectors.video_connector.transformer_blocks.0.attn1.to_q",  # diffusers' component
    ):
        sd = {
            "diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight": a,
            "diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight": b,
            f"{extra}.lora_A.weight": torch.randn(R, 32),
            f"{extra}.lora_B.weight": torch.randn(32, R),
        }
        module = extra.removeprefix("diffusion_model.")
        with pytest.raises(LoRAFormatError, match=module.replace(".", r"\.")):
            Ours(ref, tmp_path, sd).set(1.0)


def test_wrong_width_and_other_family_refused(base, tmp_path):
    """An LTX-2 file for a wider model is a shape error naming the module; a Wan file on LTX-2
    names Wan as the architecture it seems to target."""
    ref, _, _, _ = base
    sd = {
        "diffusion_model.transformer_blocks.0.audio_attn1.to_q.lora_A.weight": torch.randn(R, 64),
        "diffusion_model.transformer_blocks.0.audio_attn1.to_q.lora_B.weight": torch.randn(64, R),
    }
    with pytest.raises(LoRAFormatError, match=r"audio_attn1\.to_q"):
        Ours(ref, tmp_path, sd).set(1.0)
    wan = {
        "diffusion_model.blocks.0.self_attn.q.lora_A.weight": torch.randn(R, 32),
        "diffusion_model.blocks.0.self_attn.q.lora_B.weight": torch.randn(32, R),
    }
    with pytest.raises(LoRAFormatError, match="Wan"):
        Ours(ref, tmp_path, wan).set(1.0)
