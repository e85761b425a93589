"""HunyuanVideo 1.0 LoRA layouts, converted for our ``HunyuanVideoTransformer``: every layout of one
adapter gives the same delta ``scale * B @ A`` on every (layer, shard) of our DiT (compared as its
factors ``A`` and ``scale * B``). The LoRA-family guess: ``test_hunyuan_video_guess.py``.

The adapter covers EVERY linear layer of the tiny 1.0 DiT (``fixtures/tiny_hunyuan_video_dit.py``:
2 dual-stream, 2 single-stream, 2 refiner blocks, the guidance / pooled-text / timestep
embedders, the final layer); rank 4, random non-zero, the members of each fused group sharing
``A``. Layouts (``fixtures/hunyuan_video_lora.py``, hand-written name tables, never our name map):

* diffusers/PEFT ``transformer.<diffusers name>.lora_A/B.weight``, alpha 8 in the header (scale
  2): the reference, placed by hand on our fused layers (``expected_deltas``);
* Tencent's names (``double_blocks.N.img_attn_qkv``, ``single_blocks.N.linear1`` =
  ``[q | k | v | mlp]``, the refiner's ``self_attn_qkv``, ``final_layer.adaLN_modulation.1``
  rows ``(shift, scale)``) under ``diffusion_model.`` (musubi's ``convert_lora.py --target
  other``, diffusion-pipe) or ``transformer.``, no alpha. The tables are checked against
  diffusers' own ``_convert_hunyuan_video_lora_to_diffusers`` where that converts right (below);
* musubi-tuner ``lora_unet_<Tencent name, . -> _>`` + ``lora_down/up`` + an alpha per module
  (diffusers' loader mangles these: shown below);
* ComfyUI's own names ``diffusion_model.double_blocks.N.img_attn.qkv``, ``img_mod.lin``,
  ``img_mlp.0``, ``single_blocks.N.modulation.lin``, ``time_in.in_layer``... with ``alpha``,
  dotted or flattened (diffusers keeps none of the dotted ones: shown below).

Measured: every layout equals the reference to float64 rounding (max abs difference 0: the
alphas and scales are powers of two). Nearby wrong case: one module's alpha misread (twice its
value) is caught on that module.
"""

from __future__ import annotations

import json
import re

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
from fixtures.tiny_hunyuan_video_dit import TINY_HV_DIT
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.formats import convert_to_canonical
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec

R, ALPHA = 4, 8.0
SCALE = ALPHA / R
HEADER = {
    "safetensors_metadata": {
        "lora_adapter_metadata": json.dumps({"transformer.r": R, "transformer.lora_alpha": ALPHA})
    }
}


@pytest.fixture(scope="module")
def setup():
    """(our LoRA surface, the adapter ``{diffusers name: (A, B)}``) of the tiny 1.0 DiT."""
    from diffusers import HunyuanVideoTransformer3DModel
    from sglang.multimodal_gen.configs.hunyuan_video import HunyuanVideoArchConfig
    from sglang.multimodal_gen.models.dits.hunyuan_video import HunyuanVideoTransformer
    from sglang.multimodal_gen.models.dits.hunyuan_video_names import HUNYUAN_VIDEO_NAME_MAP

    with torch.device("meta"):
        ref = HunyuanVideoTransformer3DModel(**TINY_HV_DIT)
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in ref.named_modules()
        if isinstance(m, nn.Linear)
    }
    cfg = HunyuanVideoArchConfig.from_dict(dict(ref.config))
    ours = HunyuanVideoTransformer(cfg, tp_rank=0, tp_size=1, device="meta")
    spec = LoRAModelSpec.from_module(ours, HUNYUAN_VIDEO_NAME_MAP, "HunyuanVideo")
    adapter = random_adapter(shapes, R, seed=5)
    placed = set(expected_deltas(adapter, 1.0))
    # every linear layer of ours but the patch embedding (a Conv3d in diffusers and in the files)
    ours_all = {(m, s) for m, shards in spec.module_shapes.items() for s in shards}
    assert placed == ours_all - {("x_embedder.proj", None)}
    return spec, adapter


def _check(spec, sd, adapter, header=None, fmt=None) -> None:
    canon = convert_to_canonical(sd, header, spec)
    got, expected = canonical_deltas(canon), expected_deltas(adapter, SCALE)
    assert set(got) == set(expected)
    for key, (a, b) in expected.items():
        torch.testing.assert_close(got[key][0], a, rtol=0, atol=1e-12, msg=str(key))
        torch.testing.assert_close(got[key][1], b, rtol=0, atol=1e-12, msg=str(key))
    assert canon.ignored_keys == []
    if fmt is not None:
        assert canon.source_format == fmt, canon.source_format


def test_diffusers_peft_layout_places_every_shard(setup):
    spec, adapter = setup
    _check(spec, peft_state_dict(adapter), adapter, HEADER, "diffusers")


@pytest.mark.parametrize("layout", ["tencent", "tencent-transformer"])
def test_tencent_names_give_the_same_deltas(setup, layout):
    """Fused ``img_attn_qkv`` / ``txt_attn_qkv`` / ``self_attn_qkv`` and ``linear1`` (``A``
    shared, ``B`` split by rows into our shards), the final layer's swapped halves."""
    spec, adapter = setup
    sd = write_layout(adapter, layout, SCALE)
    stem = "diffusion_model." if layout == "tencent" else "transformer."
    assert f"{stem}single_blocks.1.linear1.lora_B.weight" in sd
    assert f"{stem}txt_in.individual_token_refiner.blocks.1.self_attn_qkv.lora_A.weight" in sd
    _check(spec, sd, adapter)


def test_tencent_tables_agree_with_diffusers_conversion(setup):
    """diffusers' ``_convert_hunyuan_video_lora_to_diffusers`` turns our Tencent-layout file back
    into the PEFT keys and tensors, for every module it converts right: not the single blocks'
    ``linear1`` (it splits at a hard-coded hidden size of 3072) nor the refiner's
    ``self_attn_qkv``, whose ``lora_A`` it chunks in three along the rank (a diffusers bug; ours
    shares ``A``, as every other fused module); the final layer's ``lora_A`` it swaps in halves
    along the rank as it swaps ``B``'s rows (a bug too: only ``B`` stores rows)."""
    from diffusers.loaders.lora_conversion_utils import _convert_hunyuan_video_lora_to_diffusers

    _, adapter = setup
    sd = write_layout(adapter, "tencent", 1.0)
    skip = (".linear1.", ".self_attn_qkv.")
    theirs = _convert_hunyuan_video_lora_to_diffusers(
        {k: v for k, v in sd.items() if not any(s in k for s in skip)}
    )
    unconverted = re.compile(
        r"single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp)\.|refiner_blocks\.\d+\.attn\.to_[qkv]\."
    )
    covered = {k: v for k, v in peft_state_dict(adapter).items() if not unconverted.search(k)}
    assert set(theirs) == set(covered), sorted(set(theirs) ^ set(covered))[:6]
    final_a = "transformer.norm_out.linear.lora_A.weight"
    for k, v in covered.items():
        if k != final_a:
            assert torch.equal(theirs[k], v), k
    # diffusers swaps the halves of the final layer's lora_A too (its rank, not rows: a bug that
    # changes the delta); we swap B's rows only
    assert torch.equal(theirs[final_a], torch.cat(covered[final_a].chunk(2)[::-1]))


def test_musubi_flattened_names_honour_each_alpha(setup):
    """``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`` + ``.alpha`` varying per
    module (1 .. 16 for r 4; ``B`` written so the delta is the reference's). diffusers' loader
    takes these for original names (they contain ``img_attn_qkv``) and mangles them (shown)."""
    from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin

    spec, adapter = setup
    fnames = sorted({file_name(n, "tencent") for n in adapter})
    alphas = {f: float(2 ** (i % 5)) for i, f in enumerate(fnames)}
    sd = write_layout(adapter, "musubi", SCALE, alphas=alphas, rank=R)
    assert "lora_unet_single_blocks_0_modulation_linear.alpha" in sd
    _check(spec, sd, adapter, fmt="kohya")
    try:  # diffusers: no key comes out as a module of its model
        theirs = HunyuanVideoLoraLoaderMixin.lora_state_dict(dict(sd))
        assert not any(k.endswith(("lora_A.weight", "lora_B.weight")) for k in theirs)
    except Exception as e:  # or it fails outright on the alphas / fused shapes
        print(f"diffusers on a musubi file: {type(e).__name__}: {e}"[:200])
    # the nearby wrong case: one module's alpha misread (twice its value) is caught
    key = "lora_unet_double_blocks_1_txt_mlp_fc2.alpha"
    with pytest.raises(AssertionError):
        _check(spec, dict(sd, **{key: 2 * sd[key]}), adapter)


@pytest.mark.parametrize("layout", ["comfyui", "comfyui-flat"])
def test_comfyui_names_give_the_same_deltas(setup, layout):
    """ComfyUI's module names (Flux's block classes: fused ``img_attn.qkv``, ``img_mod.lin``,
    ``img_mlp.0``, ``single_blocks.N.modulation.lin``, the refiner's ``self_attn.qkv`` /
    ``mlp.0``, ``MLPEmbedder`` ``in_layer`` / ``out_layer``), dotted under ``diffusion_model.``
    (diffusers keeps none of them: shown) or flattened under ``lora_unet_``, with ``alpha``."""
    from diffusers.loaders.lora_pipeline import HunyuanVideoLoraLoaderMixin

    spec, adapter = setup
    sd = write_layout(adapter, layout, SCALE, rank=R)
    stem, sep = ("diffusion_model.", ".") if layout == "comfyui" else ("lora_unet_", "_")
    assert f"{stem}txt_in{sep}c_embedder{sep}in_layer.lora_down.weight" in sd
    assert f"{stem}single_blocks{sep}1{sep}modulation{sep}lin.alpha" in sd
    _check(spec, sd, adapter)
    if layout == "comfyui":
        theirs = HunyuanVideoLoraLoaderMixin.lora_state_dict(dict(sd))
        assert not any(k.startswith("transformer.") for k in theirs)  # load_lora_weights: none


def test_conv_lora_on_the_patch_embedding_is_refused_naming_it(setup):
    """PEFT on diffusers' ``x_embedder.proj`` (a ``Conv3d``; Tencent's ``img_in.proj``) writes a
    5-D ``lora_A``: refused naming the module (our patch embedding is a linear layer; a conv LoRA
    is not read as one)."""
    spec, _ = setup
    sd = {
        "diffusion_model.img_in.proj.lora_A.weight": torch.randn(R, 4, 1, 2, 2),
        "diffusion_model.img_in.proj.lora_B.weight": torch.randn(64, R, 1, 1, 1),
    }
    with pytest.raises(LoRAFormatError, match=r"img_in\.proj.*conv"):
        convert_to_canonical(sd, None, spec)
