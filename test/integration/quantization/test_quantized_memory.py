"""Resident bytes of a quantized transformer against the same model in bf16, and no dequantized
copy of a quantized weight kept anywhere (before or after a forward pass).

The model: a Flux.1 DiT with hidden size 256 (4 heads x 64, MLP 1024) and 4 + 2 blocks, so that
the layers the default ignore globs keep in bf16 (embedders, ``norm_out``, ``proj_out``: about
3 % of the parameters) do not dominate. Bytes per weight element against bf16's 2: FP8 1 + a
4-byte row scale per row of 256 (ratio about 0.52); NVFP4 0.5 + 1/16 (block scales) + the row
scale (ratio about 0.31).

Measured (torch CPU): FP8 / bf16 = 0.523, NVFP4 / bf16 = 0.311 (the test prints both; the
bytes follow from the shapes alone).
"""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.layers.linear import ParallelLinear
from sglang.multimodal_gen.layers.quantization import UnquantizedLinearMethod
from sglang.multimodal_gen.models.loader import load_denoiser
from sglang.multimodal_gen.models.quantized_export import export_quantized
from sglang.multimodal_gen.models.registry import get_family

FLUX = get_family("flux").denoiser("transformer")
WIDE = dict(
    patch_size=1,
    in_channels=16,
    num_layers=4,
    num_single_layers=2,
    attention_head_dim=64,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(16, 24, 24),
    guidance_embeds=False,
)
MAX_RATIO = {"modelopt-fp8": 0.55, "modelopt-nvfp4": 0.32}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (each storage counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def float_full_weights(layer: ParallelLinear) -> list[str]:
    """Names of the floating-point tensors of ``layer`` (parameters, buffers, plain attributes)
    shaped like its whole local weight ``[out_local, in_local]``: a dequantized copy."""
    shape = (layer.output_size_per_partition, layer.input_size_per_partition)
    tensors = dict(layer.named_parameters(recurse=False)) | dict(layer.named_buffers(recurse=False))
    tensors |= {k: v for k, v in vars(layer).items() if isinstance(v, torch.Tensor)}
    for holder in (layer.quant_method,):
        tensors |= {f"quant_method.{k}": v for k, v in vars(holder).items()
                    if isinstance(v, torch.Tensor)}  # fmt: skip
    return [n for n, t in tensors.items() if t.dtype in _FLOATS and tuple(t.shape) == shape]


@pytest.fixture(scope="module")
def wide_flux(tmp_path_factory):
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("quant_memory")
    torch.manual_seed(0)
    src = str(root / "transformer")
    FluxTransformer2DModel(**WIDE).to(torch.bfloat16).save_pretrained(src)
    folders = {fmt: str(root / fmt) for fmt in MAX_RATIO}
    for fmt, folder in folders.items():
        export_quantized(src, folder, fmt)
    bf16 = load_denoiser(src, FLUX, dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    return src, folders, resident_bytes(bf16)


def _inputs(batch=1, tokens=4, n_txt=3):
    g = torch.Generator().manual_seed(0)
    bf = dict(dtype=torch.bfloat16)
    return dict(
        hidden_states=torch.randn(batch, tokens, 16, generator=g).to(**bf),
        encoder_hidden_states=torch.randn(batch, n_txt, 32, generator=g).to(**bf),
        pooled_projections=torch.randn(batch, 32, generator=g).to(**bf),
        timestep=torch.tensor([0.5]).to(**bf),
        img_ids=torch.zeros(tokens, 3),
        txt_ids=torch.zeros(n_txt, 3),
    )


@pytest.mark.parametrize("fmt", list(MAX_RATIO))
def test_quantized_transformer_memory(wide_flux, fmt):
    _, folders, bf16_bytes = wide_flux
    model = load_denoiser(folders[fmt], FLUX, dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    ratio = resident_bytes(model) / bf16_bytes
    print(f"{fmt}: {resident_bytes(model)} bytes, bf16 {bf16_bytes} bytes, ratio {ratio:.3f}")
    assert ratio <= MAX_RATIO[fmt]

    quantized = [
        (n, m) for n, m in model.named_modules()
        if isinstance(m, ParallelLinear) and not isinstance(m.quant_method, UnquantizedLinearMethod)
    ]  # fmt: skip
    assert len(quantized) == 4 * 10 + 2 * 3  # every linear of the blocks
    with torch.no_grad():
        out = model(**_inputs())
    assert torch.isfinite(out).all()
    for name, layer in quantized:
        assert layer.weight.dtype in (torch.float8_e4m3fn, torch.uint8), name
        assert not float_full_weights(layer), f"{name} keeps a dequantized weight"
    assert resident_bytes(model) / bf16_bytes == ratio  # nothing cached by the forward pass
