"""Quantized transformers against diffusers: our pipelines and DiTs loaded from ModelOpt FP8 /
NVFP4 folders, ComfyUI scaled-FP8 files and online FP8, each compared with diffusers holding the
weights the checkpoint stands for (fp32, CPU).

The reference weights are decoded here, independently of the package (:func:`reference_weights`:
FP8 ``q * weight_scale``; NVFP4 codes decoded bit by bit as OCP MX v1.0 E2M1, low nibble first,
times the block scale and the global scale), so a decoding bug shared by the loader and
``quantized_export.dequantized_state_dict`` cannot pass.

Pipelines (Flux.1 [dev], Qwen-Image, Z-Image, Wan2.2 TI2V): uint8 pixels and the final latents of
our pipeline with the quantized ``transformer`` (``WeightOptions(transformer_path=...)``) against
diffusers' pipeline whose transformer holds the dequantized weights, and against the same pipeline
with the unquantized weights (the quantization error must show: a loader that ignored the scales
or the quantization could not pass). The latent PSNR is ``20 log10(max |ref| / rms error)``.

Measured (torch CPU, fp32, 2 steps; FP8 / NVFP4):

==============  ===============================  ==========================================
family          vs dequantized reference         vs unquantized reference
==============  ===============================  ==========================================
flux            latents 150.2 / 147.5 dB,        latents 62.6 / 47.0 dB,
                pixels inf / inf (83.0 seen)     pixels 58.6 / 49.0 dB
qwen-image      147.6 / 148.5 dB, inf / inf      64.9 / 52.9 dB, pixels 68.2 / 62.6 dB
zimage          146.5 / 146.7 dB, inf / inf      45.8 / 34.5 dB, pixels 45.7 / 36.4 dB
wan (TI2V, CFG) 135.2 / 137.7 dB, 90.0 / inf     55.6 / 46.9 dB, pixels 55.4 / 52.8 dB
==============  ===============================  ==========================================

The Flux DiT (ours vs diffusers on the same decoded weights, max |err| / max |ref|): ModelOpt FP8
3.0e-7, NVFP4 3.0e-7, online FP8 3.0e-7, ComfyUI FP8 3.0e-7 (diffusers names, bare or prefixed)
and 3.7e-7 (original layout); the unquantized weights are 0.018-0.064 away. TP 2 vs TP 1:
NVFP4 1.8e-7, FP8 2.4e-7, online FP8 2.1e-7.

Thresholds: latents >= :data:`MIN_LATENT_PSNR` against the dequantized reference and below
:data:`MAX_UNQUANTIZED_LATENT_PSNR` against the unquantized one (a 50 dB gap); pixels >=
:data:`MIN_PSNR` (the tiny VAEs hide much of the quantization error in uint8 pixels: 36-68 dB
against the unquantized weights, too near the 70 dB parity bar for pixels alone to tell them
apart).

Tiny configs and NVFP4: every quantized linear needs in-features divisible by 16 (the default
ignore globs keep the embedders, ``proj_out`` and ``norm_out`` unquantized). The shared tiny
Z-Image (dim 64) has FFN hidden ``int(64 * 8 / 3) = 170``: its ``feed_forward.w2`` cannot be
NVFP4 (the exporter leaves it unquantized without listing it in ``ignore``, and the loader then
refuses the folder, naming the tensor), so this file builds Z-Image with dim 96 (FFN 256).
Flux, Qwen-Image and Wan's tiny configs fit as they are.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from fixtures.tiny_flux import dit_inputs, reference_dit, reference_flux, with_guidance
from fixtures.tiny_models import TINY_TEXT_ENCODER, psnr, reference_pipeline, rel_err
from fixtures.tiny_models import TINY_TRANSFORMER as TINY_ZIMAGE
from fixtures.tiny_qwen_image import reference_qwen_image
from fixtures.tiny_wan import reference_wan
from safetensors.torch import load_file, save_file
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.layers.linear import ParallelLinear
from sglang.multimodal_gen.layers.quantization import (
    Fp8LinearMethod,
    Nvfp4LinearMethod,
    quantize_rows_fp8,
)
from sglang.multimodal_gen.models.families.tiny.zimage import build_zimage_dir
from sglang.multimodal_gen.models.loader import WeightOptions, load_denoiser
from sglang.multimodal_gen.models.quantized_export import export_quantized
from sglang.multimodal_gen.models.registry import get_family, resolve_object
from sglang.multimodal_gen.pipelines.flux import FluxPipeline
from sglang.multimodal_gen.pipelines.qwen_image import QwenImagePipeline
from sglang.multimodal_gen.pipelines.wan import WanPipeline
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline

MIN_PSNR = 70.0  # uint8 pixels vs the dequantized reference; measured inf (Flux NVFP4: 83.0)
MIN_LATENT_PSNR = 120.0  # measured 135-150 dB
MAX_UNQUANTIZED_LATENT_PSNR = 70.0  # measured 34.5-64.9 dB
DIT_REL_ERR = 1e-6  # DiT vs diffusers on the same decoded weights; measured 3.0e-7-3.7e-7
TP_REL_ERR = 2e-6  # TP 2 vs TP 1 (the all-reduce re-orders additions); measured <= 2.4e-7
FORMATS = ("modelopt-fp8", "modelopt-nvfp4")
PROMPT = "a paper boat on a lake"


# ------------------------------------------------------------------ the independent reference
def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8 0..15): sign bit 3, exponent bits 2-1 (bias 1), mantissa
    bit 0; exponent 0 is subnormal (``0.5 * m``). OCP Microscaling Formats v1.0, section 5.3.3."""
    c = codes.long()
    sign = 1.0 - 2.0 * ((c >> 3) & 1).float()
    exp = ((c >> 1) & 3).float()
    man = (c & 1).float()
    mag = torch.where(exp == 0, 0.5 * man, torch.exp2(exp - 1) * (1.0 + 0.5 * man))
    return sign * mag


def reference_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 tensors a ModelOpt / ComfyUI checkpoint ``state`` stands for, with diffusers
    names: FP8 ``weight * (weight_scale | scale_weight)``; NVFP4 ``E2M1(code) * weight_scale
    [n, k // 16] * weight_scale_2`` with element ``2j`` in the low nibble of byte ``j``."""
    scales = ("weight_scale", "weight_scale_2", "input_scale", "scale_weight", "scale_input")
    out = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf in scales or name == "scaled_fp8":
            continue
        if leaf == "weight" and t.dtype == torch.float8_e4m3fn:
            s = state.get(f"{module}.weight_scale", state.get(f"{module}.scale_weight"))
            out[name] = t.float() * s.float()
        elif leaf == "weight" and t.dtype == torch.uint8:
            n = t.shape[0]
            codes = torch.stack((t & 0x0F, t >> 4), dim=-1).reshape(n, -1)
            block = state[f"{module}.weight_scale"].float().repeat_interleave(16, dim=1)
            out[name] = _e2m1(codes) * block * state[f"{module}.weight_scale_2"].float()
        else:
            out[name] = t.float()
    return out


def folder_state(folder: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))


def latent_psnr(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``20 log10(max |ref| / rms(ours - ref))`` in dB (``inf`` when equal)."""
    a, b = ours.double().flatten(), ref.double().flatten()
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * np.log10(float(b.abs().max()) ** 2 / mse)


# ------------------------------------------------------------------ pipelines
def _diffusers_run(pipe, kw) -> tuple[np.ndarray, torch.Tensor]:
    """(uint8 pixels, final latents) of one diffusers call (the latents via its step callback)."""
    seen = {}

    def keep(_pipe, _i, _t, tensors):
        seen["latents"] = tensors["latents"].clone()
        return {}

    out = pipe(
        PROMPT, generator=torch.Generator().manual_seed(42), output_type="np",
        callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"], **kw,
    )  # fmt: skip
    pixels = out.frames if hasattr(out, "frames") else out.images
    return (np.asarray(pixels) * 255).round().astype("uint8"), seen["latents"]


def _our_run(pipe, kw) -> tuple[np.ndarray, torch.Tensor]:
    """(uint8 pixels, final latents) of one call of our pipeline (latents as the VAE gets them)."""
    seen = {}
    decode = pipe.decode_each

    def keep(latents, g):
        seen["latents"] = latents.clone()
        return decode(latents, g)

    pipe.decode_each = keep
    try:
        pixels = pipe(PROMPT, generator=torch.Generator().manual_seed(42), output_type="np", **kw)
    finally:
        del pipe.decode_each
    return np.asarray(pixels), seen["latents"]


def _zimage_dir(root: str) -> str:
    # dim 96 / 3 heads (head_dim 32 = 8 + 12 + 12): FFN hidden 256, NVFP4-able (see the docstring)
    t = dict(TINY_ZIMAGE, dim=96, n_heads=3, n_kv_heads=3)
    return build_zimage_dir(root, transformer=t, text_encoder=TINY_TEXT_ENCODER, seed=0)


# family: (model dir fixture, our pipeline class, diffusers pipeline, request)
FAMILIES = {
    "flux": ("tiny_flux_dev_dir", FluxPipeline, reference_flux,
             dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.5)),
    "qwen-image": ("tiny_qwen_image_dir", QwenImagePipeline, reference_qwen_image,
                   dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0)),
    "zimage": (None, ZImagePipeline, reference_pipeline,
               dict(height=32, width=32, num_inference_steps=2, guidance_scale=0.0)),
    "wan": ("tiny_wan_ti2v_dir", WanPipeline, reference_wan,
            dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=4.0,
                 negative_prompt="blurry")),
}  # fmt: skip


@pytest.fixture(scope="module")
def family_setups(request, tmp_path_factory):
    """Per family, built on first use: the model dir, the diffusers pipeline, its unquantized
    result and the two quantized transformer folders."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            fixture, _, make_ref, kw = FAMILIES[name]
            root = tmp_path_factory.mktemp(f"quant_{name}")
            model = (
                request.getfixturevalue(fixture) if fixture else _zimage_dir(str(root / "model"))
            )
            ref = make_ref(model)
            folders = {fmt: str(root / fmt) for fmt in FORMATS}
            for fmt, folder in folders.items():
                assert export_quantized(os.path.join(model, "transformer"), folder, fmt)
            cache[name] = dict(model=model, ref=ref, unquantized=_diffusers_run(ref, kw), **folders)
        return cache[name]

    return get


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_matches_diffusers_on_dequantized_weights(family_setups, family, fmt):
    setup = family_setups(family)
    _, ours_cls, _, kw = FAMILIES[family]
    folder = setup[fmt]
    ours = ours_cls.from_pretrained(setup["model"], weights=WeightOptions(transformer_path=folder))
    method = Nvfp4LinearMethod if fmt.endswith("nvfp4") else Fp8LinearMethod
    n_quant = sum(
        isinstance(getattr(m, "quant_method", None), method) for m in ours.transformer.modules()
    )
    assert n_quant >= 8, f"only {n_quant} quantized layers"

    pixels, latents = _our_run(ours, kw)
    ref = setup["ref"]
    missing, unexpected = ref.transformer.load_state_dict(
        reference_weights(folder_state(folder)), strict=True
    )
    assert not missing and not unexpected
    exp_pixels, exp_latents = _diffusers_run(ref, kw)
    unq_pixels, unq_latents = setup["unquantized"]

    assert exp_pixels.std() > 10
    got = pixels.reshape(exp_pixels.shape)
    lat, lat_unq = latent_psnr(latents, exp_latents), latent_psnr(latents, unq_latents)
    print(
        f"{family} {fmt}: latents {lat:.1f} dB (unquantized {lat_unq:.1f} dB), pixels "
        f"{psnr(got, exp_pixels):.1f} dB (unquantized {psnr(got, unq_pixels):.1f} dB)"
    )
    assert latents.shape == exp_latents.shape
    assert lat >= MIN_LATENT_PSNR
    assert psnr(got, exp_pixels) >= MIN_PSNR
    # the quantization error shows: the unquantized weights are far from what we ran
    assert lat_unq < MAX_UNQUANTIZED_LATENT_PSNR


# ------------------------------------------------------------------ the Flux DiT
FLUX = get_family("flux").denoiser("transformer")


@pytest.fixture(scope="module")
def flux_dit(tmp_path_factory):
    """A perturbed tiny diffusers Flux DiT saved as a transformer folder, its ModelOpt exports,
    its ComfyUI files (diffusers names, bare and with ComfyUI's ``model.diffusion_model.``
    prefix), and the DiT inputs."""
    root = tmp_path_factory.mktemp("quant_flux_dit")
    ref = reference_dit(True, seed=5)
    src = str(root / "transformer")
    ref.save_pretrained(src)
    out = dict(ref=ref, src=src, inputs=with_guidance(dit_inputs(seed=11), True, 4.0))
    for fmt in FORMATS:
        export_quantized(src, str(root / fmt), fmt)
        out[fmt] = str(root / fmt)
    for prefix in ("", "model.diffusion_model."):
        path = str(root / f"comfy{'-prefixed' if prefix else ''}.safetensors")
        export_quantized(src, path, "comfyui-fp8", key_prefix=prefix)
        out[f"comfy:{prefix}"] = path
    return out


def _diffusers_out(ref, state: dict[str, torch.Tensor], inputs) -> torch.Tensor:
    """The diffusers DiT's output on ``state`` (the reference's own weights are put back)."""
    own = {k: v.clone() for k, v in ref.state_dict().items()}
    ref.load_state_dict(state, strict=True)
    try:
        with torch.no_grad():
            return ref(**inputs, return_dict=False)[0]
    finally:
        ref.load_state_dict(own)


def _our_out(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)


def _check_dit(flux_dit, model, state, what: str) -> None:
    ref, inputs = flux_dit["ref"], flux_dit["inputs"]
    got = _our_out(model, inputs)
    expected = _diffusers_out(ref, state, inputs)
    with torch.no_grad():
        unquantized = ref(**inputs, return_dict=False)[0]
    err, err_unq = rel_err(got, expected), rel_err(got, unquantized)
    print(f"flux DiT {what}: rel err {err:.3g} (unquantized weights: {err_unq:.3g})")
    assert got.shape == expected.shape and expected.abs().max() > 0.5
    assert err <= DIT_REL_ERR
    assert err_unq > 1000 * DIT_REL_ERR  # the quantization error shows


@pytest.mark.parametrize("fmt", FORMATS)
def test_flux_dit_modelopt_matches_diffusers(flux_dit, fmt):
    model = load_denoiser(flux_dit[fmt], FLUX, tp_rank=0, tp_size=1)
    _check_dit(flux_dit, model, reference_weights(folder_state(flux_dit[fmt])), fmt)


def _rows_fp8_reference(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the weights of every module that loads into one of ``model``'s linear
    layers quantized per output row (``quantize_rows_fp8``) and dequantized: what online FP8
    stands for. Each source's rows are whole rows of our layer, so per-source = per-layer."""
    name_map = resolve_object(FLUX.name_map)
    linears = {n for n, m in model.named_modules() if isinstance(m, ParallelLinear)}
    out = dict(state)
    n = 0
    for key, t in state.items():
        module = key[: -len(".weight")]
        if key.endswith(".weight") and t.dim() == 2 and name_map.resolve(module)[0] in linears:
            q, s = quantize_rows_fp8(t)
            out[key] = q.float() * s[:, None]
            n += 1
    assert n >= 20
    return out


def test_flux_dit_online_fp8_matches_diffusers(flux_dit):
    model = load_denoiser(flux_dit["src"], FLUX, tp_rank=0, tp_size=1, quantization="fp8")
    linears = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    assert linears and all(isinstance(m.quant_method, Fp8LinearMethod) for m in linears)
    state = {k: v.detach().clone() for k, v in flux_dit["ref"].state_dict().items()}
    _check_dit(flux_dit, model, _rows_fp8_reference(model, state), "online fp8")


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusers", "comfy"])
def test_flux_dit_comfyui_fp8_matches_diffusers(flux_dit, prefix):
    """One ComfyUI scaled-FP8 file (``scaled_fp8`` marker, ``scale_weight``) read through
    ``weights_path``: diffusers names, bare and under ComfyUI's ``model.diffusion_model.``."""
    path = flux_dit[f"comfy:{prefix}"]
    model = load_denoiser(flux_dit["src"], FLUX, tp_rank=0, tp_size=1, weights_path=path)
    state = {k[len(prefix) :]: v for k, v in reference_weights(load_file(path)).items()}
    assert any(t.dtype == torch.float8_e4m3fn for t in load_file(path).values())
    _check_dit(flux_dit, model, state, f"comfyui fp8 {prefix or '(no prefix)'}")


# the original (BFL) layout of Flux.1 as ComfyUI files name it: (BFL module, diffusers modules
# whose output rows it concatenates); the q/k norms are not in it (see the test)
_BFL_TOP = [
    ("img_in", ["x_embedder"]), ("txt_in", ["context_embedder"]),
    ("time_in.in_layer", ["time_text_embed.timestep_embedder.linear_1"]),
    ("time_in.out_layer", ["time_text_embed.timestep_embedder.linear_2"]),
    ("vector_in.in_layer", ["time_text_embed.text_embedder.linear_1"]),
    ("vector_in.out_layer", ["time_text_embed.text_embedder.linear_2"]),
    ("guidance_in.in_layer", ["time_text_embed.guidance_embedder.linear_1"]),
    ("guidance_in.out_layer", ["time_text_embed.guidance_embedder.linear_2"]),
    ("final_layer.linear", ["proj_out"]),
]  # fmt: skip
_BFL_DOUBLE = [
    ("img_attn.qkv", ["attn.to_q", "attn.to_k", "attn.to_v"]),
    ("txt_attn.qkv", ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"]),
    ("img_attn.proj", ["attn.to_out.0"]), ("txt_attn.proj", ["attn.to_add_out"]),
    ("img_mlp.0", ["ff.net.0.proj"]), ("img_mlp.2", ["ff.net.2"]),
    ("txt_mlp.0", ["ff_context.net.0.proj"]), ("txt_mlp.2", ["ff_context.net.2"]),
    ("img_mod.lin", ["norm1.linear"]), ("txt_mod.lin", ["norm1_context.linear"]),
]  # fmt: skip
_BFL_SINGLE = [
    ("linear1", ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]),
    ("linear2", ["proj_out"]), ("modulation.lin", ["norm.linear"]),
]  # fmt: skip


def _bfl_groups(n_double: int, n_single: int) -> list[tuple[str, list[str]]]:
    groups = list(_BFL_TOP)
    for i in range(n_double):
        groups += [(f"double_blocks.{i}.{b}", [f"transformer_blocks.{i}.{d}" for d in ds])
                   for b, ds in _BFL_DOUBLE]  # fmt: skip
    for i in range(n_single):
        groups += [(f"single_blocks.{i}.{b}", [f"single_transformer_blocks.{i}.{d}" for d in ds])
                   for b, ds in _BFL_SINGLE]  # fmt: skip
    return groups


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """diffusers' ``norm_out.linear`` rows ``(scale, shift)`` <-> BFL's ``(shift, scale)``."""
    return torch.cat(t.chunk(2)[::-1]) if t.dim() and t.shape[0] > 1 else t


def to_bfl(state: dict[str, torch.Tensor], n_double: int, n_single: int) -> dict:
    """A diffusers Flux state dict in BFL names: fused modules concatenated along the rows,
    ``norm_out.linear`` -> ``final_layer.adaLN_modulation.1`` with its halves swapped; the
    tensors this map does not rename (the q/k norms) keep their diffusers names."""
    state, out = dict(state), {}
    for bfl, ds in _bfl_groups(n_double, n_single):
        for leaf in ("weight", "bias"):
            out[f"{bfl}.{leaf}"] = torch.cat([state.pop(f"{d}.{leaf}") for d in ds]).contiguous()
    for leaf in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = _swap_halves(
            state.pop(f"norm_out.linear.{leaf}")
        )
    assert all(".norm_" in k for k in state), sorted(state)
    return out | state


def from_bfl(state: dict[str, torch.Tensor], like: dict[str, torch.Tensor], n_double, n_single):
    """The inverse of :func:`to_bfl` (``like``: a diffusers state dict giving the row counts)."""
    state, out = dict(state), {}
    for bfl, ds in _bfl_groups(n_double, n_single):
        for leaf in ("weight", "bias"):
            rows = [like[f"{d}.{leaf}"].shape[0] for d in ds]
            out |= dict(zip([f"{d}.{leaf}" for d in ds], state.pop(f"{bfl}.{leaf}").split(rows)))
    for leaf in ("weight", "bias"):
        out[f"norm_out.linear.{leaf}"] = _swap_halves(
            state.pop(f"final_layer.adaLN_modulation.1.{leaf}")
        )
    return out | state


def test_flux_dit_comfyui_fp8_original_layout_matches_diffusers(flux_dit, tmp_path):
    """A ComfyUI scaled-FP8 file in the original (BFL) layout under ``model.diffusion_model.``:
    one ``scale_weight`` for each fused source (``img_attn.qkv``, ``linear1``: q, k, v and the
    MLP rows share it) and a per-tensor scale under ``final_layer.adaLN_modulation.1``, whose
    rows the loader swaps (its 0-d scale must pass through untouched).

    The q/k RMSNorm weights keep their diffusers names here (the whole BFL layout, norms
    included, is test_original_layouts.py's)."""
    ref = flux_dit["ref"]
    cfg = ref.config
    own = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    src = tmp_path / "bfl"
    src.mkdir()
    save_file(to_bfl(own, cfg.num_layers, cfg.num_single_layers),
              str(src / "diffusion_pytorch_model.safetensors"))  # fmt: skip
    path = str(tmp_path / "bfl-fp8.safetensors")
    prefix = "model.diffusion_model."
    done = export_quantized(str(src), path, "comfyui-fp8", key_prefix=prefix)
    assert "single_blocks.0.linear1" in done and "final_layer.adaLN_modulation.1" in done
    model = load_denoiser(flux_dit["src"], FLUX, tp_rank=0, tp_size=1, weights_path=path)
    bfl = {k[len(prefix) :]: v for k, v in reference_weights(load_file(path)).items()}
    state = from_bfl(bfl, own, cfg.num_layers, cfg.num_single_layers)
    _check_dit(flux_dit, model, state, "comfyui fp8, original layout")


# ------------------------------------------------------------------ TP 2 (gloo)
def _tp_rank_fn(rank, folder, quantization, inputs):
    model = load_denoiser(folder, FLUX, quantization=quantization)
    with torch.no_grad():
        out = model(**inputs)
    return out, model.transformer_blocks[0].attn.to_out[0].weight.shape, get_tp_world_size()


TP_CASES = [
    # the block scales of the row-parallel layers split along the input; q/k/v keep their own
    # global scales (default tier)
    pytest.param("modelopt-nvfp4", None, id="nvfp4"),
    pytest.param("modelopt-fp8", None, id="fp8"),  # extended tier
    pytest.param("src", "fp8", id="online-fp8"),  # extended tier: per-row scales of whole rows
]


@pytest.mark.slow
@pytest.mark.parametrize(("folder", "quantization"), TP_CASES)
def test_flux_tp2_equals_tp1(flux_dit, folder, quantization):
    path, inputs = flux_dit[folder], flux_dit["inputs"]
    tp1 = load_denoiser(path, FLUX, tp_rank=0, tp_size=1, quantization=quantization)
    out1 = _our_out(tp1, inputs)
    cols1 = tp1.transformer_blocks[0].attn.to_out[0].weight.shape[1]
    results = launch_processes(_tp_rank_fn, 2, args=(path, quantization, inputs), backend="gloo")
    for rank, (out, shape, world) in enumerate(results):
        assert world == 2 and shape[1] * 2 == cols1  # the row-parallel input really is split
        err = rel_err(out, out1)
        print(f"flux {folder} {quantization or ''} TP 2 rank {rank}: rel err vs TP 1 {err:.3g}")
        assert err <= TP_REL_ERR
