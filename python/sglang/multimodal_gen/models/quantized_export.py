"""Write a floating-point transformer as a quantized checkpoint in the layouts the loader reads.

Real FP8 / NVFP4 exports come from NVIDIA ModelOpt (calibrated activation scales); this writer
makes the same on-disk layouts from any diffusers transformer folder, with max-calibrated weight
scales and unit activation scales, so that tests, benchmarks and users without ModelOpt get
checkpoints to load:

* ``modelopt-fp8``: ``weight`` e4m3, ``weight_scale`` = amax / 448 and ``input_scale`` (fp32
  scalars) per linear layer; ``quantization_config`` in ``config.json``.
* ``modelopt-nvfp4``: ``weight`` uint8 ``[N, K/2]`` (element ``2j`` in the low nibble),
  ``weight_scale`` e4m3 ``[N, K/16]`` = block amax / 6 / ``weight_scale_2``, ``weight_scale_2``
  = amax / (448 * 6), ``input_scale``; ``quantization_config`` in ``config.json``.
* ``comfyui-fp8``: one safetensors file with the ``scaled_fp8`` marker and per-layer
  ``scale_weight`` (ComfyUI's scaled FP8 files).

Which layers: every 2-D ``*.weight`` whose module does not match an ``ignore`` glob (default
:data:`DEFAULT_IGNORE`; NVFP4 also needs in-features divisible by 16).

Command line (:func:`main`): ``python -m sglang.multimodal_gen.models.quantized_export SRC DST
--format {modelopt-fp8,modelopt-nvfp4,comfyui-fp8} [--ignore GLOB ...] [--key-prefix P]``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
from collections.abc import Sequence

import torch
from safetensors.torch import load_file, save_file

from sglang.multimodal_gen.layers.quantization.fp8 import FP8_MAX
from sglang.multimodal_gen.layers.quantization.nvfp4 import E2M1_VALUES, NVFP4_BLOCK
from sglang.multimodal_gen.models.model_dir import find_weight_files

__all__ = [
    "DEFAULT_IGNORE",
    "FORMATS",
    "copy_with_transformer",
    "dequantized_state_dict",
    "export_quantized",
    "quantize_fp8",
    "quantize_nvfp4",
]

FORMATS = ("modelopt-fp8", "modelopt-nvfp4", "comfyui-fp8")
#: modules kept in full precision by default (embedders and output projections, as ModelOpt's
#: diffusers recipes leave them)
DEFAULT_IGNORE = ("proj_out", "norm_out*", "*embed*", "*_in", "*_in.*")
_E2M1_MAX = 6.0


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8: ``(q e4m3 [N, K], scale fp32 [])`` with ``w ~= q * scale``."""
    amax = w.float().abs().amax()
    scale = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(()).float()


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8 0..15) of each value of ``x`` (already in [-6, 6])."""
    mags = torch.tensor(E2M1_VALUES[:8])
    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)
    sign = (x < 0) & (idx > 0)
    return (idx + 8 * sign.long()).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of ``w`` ``[N, K]`` (``K % 16 == 0``): ``(packed uint8 [N, K/2], block scales e4m3
    [N, K/16], global scale fp32 [])`` with ``w ~= E2M1[code] * block * global``."""
    n, k = w.shape
    w32 = w.float()
    amax = w32.abs().amax()
    g = amax / (FP8_MAX * _E2M1_MAX) if amax > 0 else torch.tensor(1.0)
    blocks = w32.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    bs = (block_amax / _E2M1_MAX / g).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = bs.float() * g
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    x = (blocks / denom.unsqueeze(-1)).clamp(-_E2M1_MAX, _E2M1_MAX).reshape(n, k)
    codes = _e2m1_codes(x).reshape(n, k // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return packed, bs, g.reshape(()).float()


def _quantizable(name: str, t: torch.Tensor, ignore: Sequence[str], nvfp4: bool) -> bool:
    if not name.endswith(".weight") or t.dim() != 2 or not t.dtype.is_floating_point:
        return False
    module = name[: -len(".weight")]
    if any(fnmatch.fnmatchcase(module, p) for p in ignore):
        return False
    return not nvfp4 or t.shape[1] % NVFP4_BLOCK == 0


def export_quantized(
    src_dir: str,
    dst: str,
    fmt: str,
    ignore: Sequence[str] = DEFAULT_IGNORE,
    key_prefix: str = "",
) -> list[str]:
    """Quantize the transformer folder ``src_dir`` (diffusers layout) into ``dst``.

    Args:
        fmt: one of :data:`FORMATS`. ModelOpt formats write a folder ``dst`` (``config.json``
            with ``quantization_config`` + ``diffusion_pytorch_model.safetensors``);
            ``comfyui-fp8`` writes the single file ``dst``.
        ignore: module-name globs kept in full precision (written to ``quantization_config``,
            with, for NVFP4, every linear layer whose in-features are not a multiple of 16).
        key_prefix: prepended to every tensor name (``"model.diffusion_model."`` as ComfyUI
            files have it).

    Returns:
        The quantized module names.

    Raises:
        ValueError: an unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt {fmt!r} is not one of {FORMATS}")
    files, _ = find_weight_files(src_dir)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    nvfp4 = fmt == "modelopt-nvfp4"
    out: dict[str, torch.Tensor] = {}
    done = []
    ignore = list(ignore)
    for name, t in state.items():
        if not _quantizable(name, t, ignore, nvfp4):
            if nvfp4 and _quantizable(name, t, ignore, False):
                # kept in full precision for the block size: declared, as the loader requires
                ignore.append(key_prefix + name[: -len(".weight")])
            out[key_prefix + name] = t.contiguous()
            continue
        module = key_prefix + name[: -len(".weight")]
        done.append(name[: -len(".weight")])
        if nvfp4:
            packed, bs, g = quantize_nvfp4(t)
            out[f"{module}.weight"] = packed
            out[f"{module}.weight_scale"] = bs
            out[f"{module}.weight_scale_2"] = g
            out[f"{module}.input_scale"] = torch.tensor(1.0)
        else:
            q, s = quantize_fp8(t)
            out[f"{module}.weight"] = q
            if fmt == "comfyui-fp8":
                out[f"{module}.scale_weight"] = s
            else:
                out[f"{module}.weight_scale"] = s
                out[f"{module}.input_scale"] = torch.tensor(1.0)
    if fmt == "comfyui-fp8":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
        os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
        save_file(out, dst)
        return done
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4" if nvfp4 else "FP8",
        "ignore": list(ignore),
        **({"group_size": NVFP4_BLOCK} if nvfp4 else {}),
    }
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    save_file(out, os.path.join(dst, "diffusion_pytorch_model.safetensors"))
    return done


def dequantized_state_dict(quant_dir: str) -> dict[str, torch.Tensor]:
    """The full-precision (fp32) tensors a ModelOpt folder written by :func:`export_quantized`
    stands for (the reference a diffusers pipeline loads to compare with)."""
    from sglang.multimodal_gen.layers.quantization.nvfp4 import dequantize_nvfp4

    files, _ = find_weight_files(quant_dir)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    out = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight_scale", "weight_scale_2", "input_scale"):
            continue
        if leaf == "weight" and t.dtype == torch.float8_e4m3fn:
            out[name] = t.float() * state[f"{module}.weight_scale"].float()
        elif leaf == "weight" and t.dtype == torch.uint8:
            out[name] = dequantize_nvfp4(
                t, state[f"{module}.weight_scale"], state[f"{module}.weight_scale_2"]
            )
        else:
            out[name] = t.float()
    return out


def copy_with_transformer(model_dir: str, dst: str, transformer_dir: str) -> str:
    """A copy of the diffusers folder ``model_dir`` whose ``transformer/`` is ``transformer_dir``
    (a quantized repo as one ``--model-path``)."""
    shutil.copytree(model_dir, dst, ignore=shutil.ignore_patterns("transformer"))
    shutil.copytree(transformer_dir, os.path.join(dst, "transformer"))
    return dst


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sglang.multimodal_gen.models.quantized_export SRC DST --format F``: quantize
    the transformer folder ``SRC`` into ``DST`` (see :func:`export_quantized`).

    Returns:
        0, or 2 after one ``quantized_export: error: ...`` line on stderr (a missing or
        unreadable ``SRC``).
    """
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m sglang.multimodal_gen.models.quantized_export",
        description="Write a diffusers transformer folder as a quantized checkpoint "
        "(max-calibrated weight scales, unit input scales).",
    )
    p.add_argument("src", help="transformer folder (config.json + safetensors)")
    p.add_argument("dst", help="output folder (modelopt-*) or .safetensors file (comfyui-fp8)")
    p.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    p.add_argument(
        "--ignore",
        nargs="*",
        default=list(DEFAULT_IGNORE),
        metavar="GLOB",
        help="module-name globs kept in full precision (default: %(default)s; "
        "--ignore alone: none)",
    )
    p.add_argument(
        "--key-prefix",
        default="",
        help="prepended to every tensor name (ComfyUI files: model.diffusion_model.)",
    )
    args = p.parse_args(argv)
    try:
        done = export_quantized(args.src, args.dst, args.fmt, args.ignore, args.key_prefix)
    except (OSError, ValueError) as e:
        print(f"quantized_export: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.dst}: {len(done)} linear layers quantized ({args.fmt})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
