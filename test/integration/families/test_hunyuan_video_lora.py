"""HunyuanVideo 1.0 with a LoRA in every published layout: our DiT's OUTPUT with the adapter
loaded by our runtime (``LoRAManager``) equals diffusers' ``HunyuanVideoTransformer3DModel`` with
the same adapter through peft (``load_lora_adapter`` + ``set_adapters(weights=strength)``), at
two strengths.

One random adapter (rank 4, alpha 8: scale 2) on EVERY linear layer of the tiny DiT
(``fixtures/tiny_hunyuan_video_dit.py``: dual-stream, single-stream and token-refiner blocks, the
embedders, the final layer), the members of each fused group of the other layouts sharing ``A``.
The reference loads it in diffusers' own names with the alpha in the adapter config; our runtime
reads the same numbers from each layout's file (``fixtures/hunyuan_video_lora.py``): diffusers/PEFT
(alpha in the ``lora_adapter_metadata`` header), Tencent's names under ``diffusion_model.`` (no
alpha: scale folded into ``B``), musubi-tuner ``lora_unet_`` with an alpha per module (1 .. 16,
``B`` written to the same delta), ComfyUI's names with ``alpha``. Merged and dynamic for the
PEFT file, dynamic for the others (``test/unit/lora/formats/test_hunyuan_video.py`` shows every
layout converts to the same shard deltas). TP 2 (gloo): the musubi file, dynamic, in the
extended tier (Flux's TP 2 engine test covers LoRA on the same shared MM-DiT blocks).

HunyuanVideo 1.5 (one test): the ComfyUI and the Tencent files of an adapter on every linear
layer of a tiny 1.5 DiT (ByT5 / image / time embedders included), image to video with text and
ByT5 padding, against diffusers + peft the same way (diffusers reads neither file for 1.5).

Measured (torch 2.13 CPU, fp32), max |ours - ref| / max |ref|: <= 4.8e-7 for every layout,
strength and merge mode, 3.9e-7 at TP 2, 1.5 <= 3.7e-7 (threshold 2e-6). Nearby wrong cases far outside: the
other strength's reference 0.54 .. 0.59, no LoRA 0.35 .. 0.90, one module's alpha ignored (musubi,
the refiner block 1's ``mlp.fc2``) 9.2e-3.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from fixtures.hunyuan_video_lora import file_name, peft_state_dict, random_adapter, write_layout
from fixtures.tiny_hunyuan_video_dit import hv_dit_inputs, hv_spec, reference_hv_dit
from fixtures.tiny_models import rel_err
from safetensors.torch import save_file
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.hunyuan_video_names import HUNYUAN_VIDEO_NAME_MAP
from sglang.multimodal_gen.models.loader import denoiser_from_module

R, ALPHA = 4, 8.0
SCALE = ALPHA / R
STRENGTHS = (0.5, 1.3)
PARITY_REL_ERR = 2e-6  # measured <= 4.8e-7


def _alphas(adapter) -> dict[str, float]:
    """musubi: an alpha per file module, 1 .. 16 for r 4."""
    fnames = sorted({file_name(n, "tencent") for n in adapter})
    return {f: float(2 ** (i % 5)) for i, f in enumerate(fnames)}


@pytest.fixture(scope="module")
def setup():
    """(diffusers reference, inputs, adapter, outputs without LoRA and at each strength)."""
    ref = reference_hv_dit(seed=2)
    inputs = hv_dit_inputs(seed=4)
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in ref.named_modules()
        if isinstance(m, nn.Linear)
    }
    adapter = random_adapter(shapes, R, seed=7)
    with torch.no_grad():
        plain = ref(**inputs, return_dict=False)[0]
    model = copy.deepcopy(ref)
    # the adapter config as a pipeline's save_lora_weights writes it (fields prefixed)
    meta = {"transformer.r": R, "transformer.lora_alpha": ALPHA}
    meta["transformer.target_modules"] = sorted(shapes)
    model.load_lora_adapter(
        peft_state_dict(adapter), prefix="transformer", adapter_name="x", metadata=meta
    )
    assert sum("lora_A" in n for n, _ in model.named_parameters()) == len(shapes)
    refs = []
    with torch.no_grad():
        for s in STRENGTHS:
            model.set_adapters(["x"], weights=[s])
            refs.append(model(**inputs, return_dict=False)[0])
    return ref, inputs, adapter, plain, refs


def _layout_file(adapter, layout: str, tmp_path) -> tuple[str, dict | None]:
    """``(path, header)`` of the adapter written in ``layout``."""
    header = None
    if layout == "peft":
        sd = peft_state_dict(adapter)
        cfg = {"transformer.r": R, "transformer.lora_alpha": ALPHA}
        header = {"lora_adapter_metadata": json.dumps(cfg)}
    elif layout == "musubi":
        sd = write_layout(adapter, layout, SCALE, alphas=_alphas(adapter), rank=R)
    else:
        sd = write_layout(adapter, layout, SCALE, rank=R)
    path = str(tmp_path / f"{layout}.safetensors")
    save_file(sd, path, metadata=header)
    return path, header


@pytest.fixture(scope="module")
def ours(setup):
    """Our DiT with the reference's weights and its ``LoRAManager`` (shared: each test loads its
    adapter under its own name and unloads it; merged tests run last)."""
    model = denoiser_from_module(setup[0], hv_spec(), tp_rank=0, tp_size=1)
    return model, LoRAManager({"transformer": model}, HUNYUAN_VIDEO_NAME_MAP, model_name="HV")


def _unload(mgr, nickname: str) -> None:
    mgr.unset_lora()
    mgr.unload_adapter(nickname)


@pytest.mark.parametrize(
    "layout, modes",
    [
        ("tencent", ("dynamic",)),
        ("musubi", ("dynamic",)),
        ("comfyui", ("dynamic",)),
        ("peft", ("dynamic", "merge")),
    ],
)
def test_layout_matches_diffusers_with_peft(setup, ours, tmp_path, layout, modes):
    _, inputs, adapter, plain, refs = setup
    path, _ = _layout_file(adapter, layout, tmp_path)
    model, mgr = ours
    for mode in modes:
        for i, s in enumerate(STRENGTHS):
            mgr.set_lora(layout, path, strengths=s, merge_mode=mode)
            info = mgr.list_loras()["loaded"][0]["targets"]["transformer"]
            assert info["ignored_keys"] == 0, info
            with torch.no_grad():
                got = model(**inputs)
            err, other, none = (rel_err(got, e) for e in (refs[i], refs[1 - i], plain))
            print(
                f"hv lora {layout} ({info['source_format']}) {mode} strength {s}: rel err "
                f"{err:.3g} (other strength {other:.3g}, no LoRA {none:.3g})"
            )
            assert err <= PARITY_REL_ERR, (layout, mode, s, err)
            assert other > 100 * PARITY_REL_ERR and none > 100 * PARITY_REL_ERR
    _unload(mgr, layout)


def test_one_alpha_ignored_is_far(setup, ours, tmp_path):
    """The nearby wrong case: the musubi file with one module's alpha dropped (scale 1 instead of
    alpha / r) lands far outside the threshold."""
    _, inputs, adapter, _, refs = setup
    alphas = _alphas(adapter)
    name = "txt_in.individual_token_refiner.blocks.1.mlp.fc2"
    assert alphas[name] != R
    sd = write_layout(adapter, "musubi", SCALE, alphas=alphas, rank=R)
    del sd["lora_unet_" + name.replace(".", "_") + ".alpha"]
    path = str(tmp_path / "wrong.safetensors")
    save_file(sd, path)
    model, mgr = ours
    mgr.set_lora("wrong", path, strengths=STRENGTHS[1], merge_mode="dynamic")
    with torch.no_grad():
        err = rel_err(model(**inputs), refs[1])
    _unload(mgr, "wrong")
    print(f"hv lora musubi, one alpha ignored: rel err {err:.3g}")
    assert err > 100 * PARITY_REL_ERR


def _tp_rank_fn(rank, config, state, inputs, path, strength):
    from sglang.multimodal_gen.configs.hunyuan_video import HunyuanVideoArchConfig
    from sglang.multimodal_gen.distributed import get_tp_world_size
    from sglang.multimodal_gen.models.dits.hunyuan_video import HunyuanVideoTransformer
    from sglang.multimodal_gen.models.loader import load_tensors_into

    model = HunyuanVideoTransformer(HunyuanVideoArchConfig.from_dict(config))
    load_tensors_into(model, (("<sd>", k, v) for k, v in state.items()), HUNYUAN_VIDEO_NAME_MAP)
    mgr = LoRAManager({"transformer": model}, HUNYUAN_VIDEO_NAME_MAP, model_name="HV")
    mgr.set_lora("x", path, strengths=strength, merge_mode="dynamic")
    with torch.no_grad():
        out = model(**inputs)
    return out, get_tp_world_size()


def test_tp2_musubi_matches_diffusers(setup, tmp_path):
    from sglang.multimodal_gen.distributed import launch_processes

    ref, inputs, adapter, _, refs = setup
    path, _ = _layout_file(adapter, "musubi", tmp_path)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    args = (dict(ref.config), state, inputs, path, STRENGTHS[1])
    results = launch_processes(_tp_rank_fn, 2, args=args, backend="gloo")
    for rank, (out, world) in enumerate(results):
        err = rel_err(out, refs[1])
        print(f"hv lora musubi TP 2 rank {rank}: rel err {err:.3g}")
        assert world == 2 and err <= PARITY_REL_ERR, (rank, err)


# ------------------------------------------------------------------------ HunyuanVideo 1.5
TINY_15 = dict(in_channels=9, out_channels=4, num_attention_heads=4, attention_head_dim=16,
               num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
               text_embed_dim=24, text_embed_2_dim=20, image_embed_dim=12,
               rope_axes_dim=(4, 6, 6))  # fmt: skip


def _inputs_15(seed: int = 3) -> dict:
    """Batch 2, image to video, different text / ByT5 padding per item."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:], mask[1, 3:] = 0, 0
    mask_2 = torch.ones(2, 5, dtype=torch.long)
    mask_2[1, 2:] = 0
    return dict(
        hidden_states=torch.randn(2, 9, 3, 4, 6, generator=g),
        timestep=torch.tensor([500.0, 700.0]),
        encoder_hidden_states=torch.randn(2, 7, 24, generator=g),
        encoder_attention_mask=mask,
        encoder_hidden_states_2=torch.randn(2, 5, 20, generator=g),
        encoder_attention_mask_2=mask_2,
        image_embeds=torch.randn(2, 3, 12, generator=g),
    )


def test_hv15_comfyui_and_tencent_layouts_match_diffusers_with_peft(tmp_path):
    """HunyuanVideo 1.5 (every linear layer, the ByT5 / image / time embedders included): the
    ComfyUI file (fused ``img_attn.qkv``, ``img_mod.lin``, ``in_layer``...) and the Tencent file
    (split ``img_attn_q``, the refiner's fused ``self_attn_qkv``, the final layer's swapped
    rows), neither of which diffusers reads for 1.5, equal diffusers + peft with the adapter in
    diffusers' names, at both strengths."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from sglang.multimodal_gen.models.dits.hunyuan_video15_names import HUNYUAN_VIDEO15_NAME_MAP
    from sglang.multimodal_gen.models.registry import DenoiserSpec

    torch.manual_seed(0)
    ref = HunyuanVideo15Transformer3DModel(**TINY_15).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    inputs = _inputs_15()
    shapes = {
        n: (m.out_features, m.in_features)
        for n, m in ref.named_modules()
        if isinstance(m, nn.Linear)
    }
    adapter = random_adapter(shapes, R, seed=9, naming_version="1.5")
    model = copy.deepcopy(ref)
    meta = {"transformer.r": R, "transformer.lora_alpha": ALPHA}
    meta["transformer.target_modules"] = sorted(shapes)
    model.load_lora_adapter(
        peft_state_dict(adapter), prefix="transformer", adapter_name="x", metadata=meta
    )
    with torch.no_grad():
        plain = ref(**inputs, return_dict=False)[0]
        refs = []
        for s in STRENGTHS:
            model.set_adapters(["x"], weights=[s])
            refs.append(model(**inputs, return_dict=False)[0])
    pkg = "sglang.multimodal_gen"
    spec = DenoiserSpec(
        component="transformer",
        diffusers_classes=("HunyuanVideo15Transformer3DModel",),
        config_class=f"{pkg}.configs.hunyuan_video15:HunyuanVideo15ArchConfig",
        model_class=f"{pkg}.models.dits.hunyuan_video15:HunyuanVideo15Transformer",
        name_map=f"{pkg}.models.dits.hunyuan_video15_names:HUNYUAN_VIDEO15_NAME_MAP",
    )
    ours = denoiser_from_module(ref, spec, tp_rank=0, tp_size=1)
    mgr = LoRAManager({"transformer": ours}, HUNYUAN_VIDEO15_NAME_MAP, model_name="HV15")
    for layout in ("comfyui", "tencent"):
        path = str(tmp_path / f"{layout}15.safetensors")
        save_file(write_layout(adapter, layout, SCALE, "1.5", rank=R), path)
        for i, s in enumerate(STRENGTHS):
            mgr.set_lora(layout, path, strengths=s, merge_mode="dynamic")
            with torch.no_grad():
                got = ours(**inputs)
            err, other, none = (rel_err(got, e) for e in (refs[i], refs[1 - i], plain))
            print(
                f"hv15 lora {layout} strength {s}: rel err {err:.3g} (other strength "
                f"{other:.3g}, no LoRA {none:.3g})"
            )
            assert err <= PARITY_REL_ERR, (layout, s, err)
            assert other > 100 * PARITY_REL_ERR and none > 100 * PARITY_REL_ERR
        _unload(mgr, layout)
