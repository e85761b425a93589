"""Quantized transformers on the CPU: per-step DiT time and resident weight bytes of FP8 and NVFP4
checkpoints against the bf16 model they were made from.

One Flux.1-layout DiT (diffusers' ``FluxTransformer2DModel``, random weights with the
constant-initialised parameters re-drawn so the output is not zero) is saved in bf16, written
as ModelOpt FP8 and ModelOpt NVFP4 folders by ``models.quantized_export.export_quantized``
(default ``ignore`` globs: embedders, ``norm_out`` and ``proj_out`` stay bf16) and loaded four
ways through the engine's loader (``models.loader.load_denoiser``, compute dtype bf16):

* ``bf16``: the floating-point folder (the reference);
* ``fp8-modelopt``: the ModelOpt FP8 folder (e4m3 weight, per-tensor ``weight_scale`` stored
  per row, static ``input_scale``);
* ``fp8-online``: the bf16 folder with ``quantization="fp8"`` (``--quantization fp8``: every
  linear layer, embedders included, per-output-channel scales);
* ``nvfp4-modelopt``: the ModelOpt NVFP4 folder (packed E2M1, e4m3 scale per 16 columns, fp32
  global scale).

On a CPU every quantized layer is weight-only: its weight is dequantized to bf16 for each GEMM
(``torch._scaled_mm`` needs a CUDA GPU of compute capability 8.9 or higher, and no FP4 kernel is
wired), so the quantized models are *slower* than bf16 here; the point is the memory and the
cost of the dequantization. ``scripts/gpu_check.sh quant`` times the FP8 tensor-core GEMM.

Shapes (the default; FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128 = 3072, MLP
12288, 4096 image + 512 text tokens at 1024x1024, joint_attention_dim 4096): 2 double + 4
single blocks, 8 heads x 128 = 1024, MLP 4096 (ratio 4 as Flux), 1024 image tokens (a 32x32
packed grid: 512x512 pixels) + 128 text tokens, in_channels 64, joint_attention_dim 1024,
pooled 768, RoPE axes (16, 56, 56) as FLUX.1, guidance embedding, batch 1 (one DiT call per
step: FLUX.1-dev has no CFG batch).

Timing: one warm-up forward per model, then ``--repeats`` rounds, each timing one forward of
every model in turn (interleaved, so a noisy neighbour hits all of them alike); ms/step is the
median per model and the ratio is against bf16's median of the same run. ``weights MiB`` counts
every parameter and buffer of the loaded model (quantized weights with their scales, bf16
everything else). ``rel err`` is max |y - y_bf16| / max |y_bf16| of the first output: the
quantization error, a sanity check that each model computes what it should.

``--gemm``: one linear layer per FLUX.1 projection shape instead of the whole DiT, on
``--device`` (the ``quant`` part of ``scripts/gpu_check.sh`` runs it on a GPU). Input ``x``
``[tokens, in]`` bf16 (default 4608 tokens: 4096 image + 512 text, what a single-stream block
sees at 1024x1024), weight ``[out, in]`` (std about 0.02, rows and tokens of varied magnitude: see
:func:`random_operands`), a bias; shapes ``in:out`` (FLUX.1,
hidden 3072, MLP 12288): 3072:9216 (fused q/k/v), 3072:12288 (MLP up), 12288:3072 (MLP down),
3072:21504 (single block's fused q/k/v + MLP up), 15360:3072 (single block's output). Timed per
shape (median of ``--iters`` samples of ``--inner`` calls, CUDA-synchronised):

* ``bf16``: ``F.linear`` with the bf16 weight;
* ``fp8``: a ``ReplicatedLinear`` with ``Fp8LinearMethod`` as loaded from a ModelOpt checkpoint
  (``weight_scale`` per output row, the finest grain a fused layer's per-source scales take;
  calibrated static ``input_scale = amax(x) / 448``): on a CUDA GPU of compute capability 8.9+
  ``torch._scaled_mm`` with row-wise scales;
* ``fp8-dyn``: the same weights with per-token activation scales (``--quantization fp8``'s path);
* ``fp8-w``: the weight-only fallback (``SGLANG_DIFFUSION_FP8_GEMM=0``);
* ``nvfp4``: ``Nvfp4LinearMethod`` (weight-only on every device).

Checks, per shape, of the ``torch._scaled_mm`` path (called directly, so a CPU exercises the
same argument layout): ``err/emu``, ``||y - y_emu|| / ||y_emu||`` against a float64 emulation of
the same FP8 operands (``(xq * s_x) @ (wq * s_w)^T + b``: only the output rounding and the
accumulation order differ; reversed weight or token scales, or activations quantized at twice
their scale, gave 0.27-0.69), must stay under 1e-2; ``err/deq`` against the bf16 GEMM with the
dequantized weight (the activation quantization error, ~2-3% for Gaussian inputs), must stay
under 5e-2; on a GPU with FP8 tensor cores the layer's own forward must return the
``_scaled_mm`` result (the dispatch takes that path). An fp16 input is tried once (row-wise scaling with an fp16 output needs a recent torch). Exit status 1
when a check fails. ``--small`` divides every width and the token count by 12 (a CPU rehearsal:
``GPU_CHECK_DRY=1 bash scripts/gpu_check.sh quant``).

Usage::

    python benchmarks/bench_quantized.py --repeats 5 --threads 1     # stable ratios on a shared CPU
    python benchmarks/bench_quantized.py --hidden 3072 --heads 24 --double 1 --single 1 --threads 16
    python benchmarks/bench_quantized.py --gemm --device cuda     # FLUX.1 shapes, one H200
    python benchmarks/bench_quantized.py --gemm --small           # the same on a CPU, small
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

METHODS = ("bf16", "fp8-modelopt", "fp8-online", "nvfp4-modelopt")


def build_source(path: str, args) -> str:
    """Save a random-weight Flux.1-layout ``FluxTransformer2DModel`` in bf16 at ``path``."""
    from diffusers import FluxTransformer2DModel
    from diffusers.utils import logging as diffusers_logging
    from sglang.multimodal_gen.models.families.tiny.common import redraw_constant_params

    torch.manual_seed(0)
    dit = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=args.double,
        num_single_layers=args.single,
        attention_head_dim=args.hidden // args.heads,
        num_attention_heads=args.heads,
        joint_attention_dim=args.joint_dim,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=args.rope_axes,
    ).eval()
    redraw_constant_params(dit, torch.Generator().manual_seed(1), 0.02)
    diffusers_logging.set_verbosity_error()  # the note on casting a model with .to()
    dit.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def inputs(args) -> dict:
    """One step's DiT inputs (bf16 activations, Flux's ids: image ``(0, row, col)``, text 0)."""
    g = torch.Generator().manual_seed(2)
    side = int(round(args.image_tokens**0.5))
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    bf = torch.bfloat16
    return dict(
        hidden_states=torch.randn(1, side * side, 64, generator=g).to(bf),
        encoder_hidden_states=torch.randn(1, args.text_tokens, args.joint_dim, generator=g).to(bf),
        pooled_projections=torch.randn(1, 768, generator=g).to(bf),
        timestep=torch.tensor([0.7], dtype=bf),
        img_ids=img_ids,
        txt_ids=torch.zeros(args.text_tokens, 3),
        guidance=torch.tensor([3.5], dtype=bf),
    )


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def load_models(root: str) -> dict[str, torch.nn.Module]:
    """The four models of :data:`METHODS`, loaded from folders under ``root``."""
    from sglang.multimodal_gen.models.families.flux import FLUX
    from sglang.multimodal_gen.models.loader import load_denoiser
    from sglang.multimodal_gen.models.quantized_export import export_quantized

    src = os.path.join(root, "bf16")
    export_quantized(src, os.path.join(root, "fp8"), "modelopt-fp8")
    export_quantized(src, os.path.join(root, "nvfp4"), "modelopt-nvfp4")
    spec = FLUX.denoiser()
    kw = dict(dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    return {
        "bf16": load_denoiser(src, spec, **kw),
        "fp8-modelopt": load_denoiser(os.path.join(root, "fp8"), spec, **kw),
        "fp8-online": load_denoiser(src, spec, quantization="fp8", **kw),
        "nvfp4-modelopt": load_denoiser(os.path.join(root, "nvfp4"), spec, **kw),
    }


# ------------------------------------------------------------------------- --gemm: one layer
GEMM_SHAPES = ("3072:9216", "3072:12288", "12288:3072", "3072:21504", "15360:3072")
GEMM_TOKENS = 4608
SMALL_DIVISOR = 12
EMU_REL_ERR = 1e-2  # the _scaled_mm result vs the float64 emulation of its operands
DEQ_REL_ERR = 5e-2  # vs the bf16 GEMM with the dequantized weight (activation rounding)
PATH_REL_ERR = 1e-3  # the layer's forward vs a direct _scaled_mm call (the same kernel)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device: torch.device, iters: int, inner: int) -> float:
    """Median milliseconds of one ``fn()`` over ``iters`` samples of ``inner`` calls each."""
    fn()
    _sync(device)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """``||y - ref|| / ||ref||`` in fp32."""
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def gemm_layers(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, device: torch.device):
    """The FP8 (static input scale), FP8 (per-token) and NVFP4 ``ReplicatedLinear`` layers of
    the bf16 weight ``w`` ``[out, in]`` and bias ``b``, quantized on the CPU: FP8 with one
    scale per output row (a fused layer's per-source scales, taken to the finest grain so that a
    misplaced ``scale_b`` shows), NVFP4 as ``models.quantized_export`` writes it; the static
    input scale calibrated on ``x``."""
    from sglang.multimodal_gen.layers.linear import ReplicatedLinear
    from sglang.multimodal_gen.layers.quantization import Fp8LinearMethod, Nvfp4LinearMethod
    from sglang.multimodal_gen.layers.quantization.fp8 import FP8_MAX, quantize_rows_fp8
    from sglang.multimodal_gen.models.quantized_export import quantize_nvfp4

    n, k = w.shape
    kw = dict(params_dtype=torch.bfloat16, device=device, tp_rank=0, tp_size=1)
    fp8 = ReplicatedLinear(k, n, quant_method=Fp8LinearMethod(), **kw)
    q, s = quantize_rows_fp8(w)
    fp8.weight_loader(fp8.weight, q)
    fp8.weight_loader(fp8.weight_scale, s)
    fp8.weight_loader(fp8.input_scale, (x.float().abs().amax() / FP8_MAX).cpu())
    dyn = ReplicatedLinear(k, n, quant_method=Fp8LinearMethod(static_input_scale=False), **kw)
    dyn.weight_loader(dyn.weight, q)
    dyn.weight_loader(dyn.weight_scale, s)
    nv = ReplicatedLinear(k, n, quant_method=Nvfp4LinearMethod(), **kw)
    packed, bs, g = quantize_nvfp4(w)
    for name, t in (("weight", packed), ("weight_scale", bs), ("weight_scale_2", g)):
        nv.weight_loader(getattr(nv, name), t)
    nv.weight_loader(nv.input_scale, torch.tensor(1.0))
    for layer in (fp8, dyn, nv):
        layer.weight_loader(layer.bias, b)
    return fp8, dyn, nv


def random_operands(n: int, k: int, tokens: int, g: torch.Generator):
    """bf16 ``w`` ``[n, k]`` (std about 0.02) and ``x`` ``[tokens, k]`` (std about 1) whose rows
    differ in magnitude (factors ``exp(N(0, 0.5))``), so per-row and per-token scales differ."""
    w = 0.02 * torch.randn(n, k, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    x = torch.randn(tokens, k, generator=g) * torch.exp(0.5 * torch.randn(tokens, 1, generator=g))
    return w.to(torch.bfloat16), x.to(torch.bfloat16)


def emulate_fp8(layer, x: torch.Tensor) -> torch.Tensor:
    """``(xq * s_x) @ (wq * s_w)^T + b`` in float64 with the operands ``Fp8LinearMethod._scaled_mm``
    feeds ``torch._scaled_mm`` (static per-tensor or per-token activation scales)."""
    from sglang.multimodal_gen.layers.quantization.fp8 import FP8_MAX

    x32 = x.float()
    if layer.quant_method.static_input_scale:
        s = layer.input_scale.max().float()
    else:
        s = x32.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    xq = (x32 / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double() * s.double()
    wq = layer.weight.double() * layer.weight_scale.double()[:, None]
    return xq @ wq.t() + layer.bias.double()  # float64: no TF32 or blocking question


def gemm_case(spec: str, tokens: int, device: torch.device, args) -> tuple[str, list[str]]:
    """Time and check one ``in:out`` shape; returns the table row and the failed checks."""
    import torch.nn.functional as F
    from sglang.multimodal_gen.layers.quantization.fp8 import FP8_GEMM_ENV, fp8_gemm_available

    k, n = (int(v) for v in spec.split(":"))
    g = torch.Generator().manual_seed(k * 31 + n)
    w, x = random_operands(n, k, tokens, g)
    b = (0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)
    x = x.to(device)
    fp8, dyn, nv = gemm_layers(w, b, x, device)
    wd, bd = w.to(device), b.to(device)
    timing = (device, args.iters, args.inner)
    t_bf16 = time_ms(lambda: F.linear(x, wd, bd), *timing)
    t_fp8 = time_ms(lambda: fp8(x), *timing)
    t_dyn = time_ms(lambda: dyn(x), *timing)
    previous = os.environ.get(FP8_GEMM_ENV)
    os.environ[FP8_GEMM_ENV] = "0"
    try:
        t_w = time_ms(lambda: fp8(x), *timing)
    finally:
        if previous is None:
            del os.environ[FP8_GEMM_ENV]
        else:
            os.environ[FP8_GEMM_ENV] = previous
    t_nv = time_ms(lambda: nv(x), *timing)

    failed = []
    errs = []
    for layer, tag in ((fp8, "fp8"), (dyn, "fp8-dyn")):
        y = layer.quant_method._scaled_mm(layer, x, layer.bias)
        if y is None:
            failed.append(f"{spec} {tag}: _scaled_mm declined the shape")
            errs += [float("nan")] * 2
            continue
        e_emu = rel_err(y, emulate_fp8(layer, x))
        deq = F.linear(x, layer.quant_method.dequantize(layer, torch.bfloat16), layer.bias)
        e_deq = rel_err(y, deq)
        errs += [e_emu, e_deq]
        if not e_emu <= EMU_REL_ERR:
            failed.append(f"{spec} {tag}: err/emu {e_emu:.3g} > {EMU_REL_ERR}")
        if not e_deq <= DEQ_REL_ERR:
            failed.append(f"{spec} {tag}: err/deq {e_deq:.3g} > {DEQ_REL_ERR}")
        # the forward's dispatch: its output is _scaled_mm's (weight-only would differ by err/deq)
        if fp8_gemm_available(device) and not rel_err(layer(x)[0], y) <= PATH_REL_ERR:
            failed.append(f"{spec} {tag}: the layer's forward did not take the _scaled_mm path")
    flops = 2 * tokens * k * n
    row = (
        f"{spec:>11} | {t_bf16:8.3f} {flops / t_bf16 / 1e6:7.1f} | {t_fp8:8.3f} "
        f"{t_bf16 / t_fp8:6.2f} | {t_dyn:8.3f} {t_bf16 / t_dyn:6.2f} | {t_w:8.3f} "
        f"{t_bf16 / t_w:6.2f} | {t_nv:8.3f} {t_bf16 / t_nv:6.2f} | "
        + " ".join(f"{e:8.2e}" for e in errs)
    )
    return row, failed


def fp16_case(spec: str, tokens: int, device: torch.device) -> list[str]:
    """An fp16 input through the ``_scaled_mm`` path (row-wise scales, fp16 output)."""
    k, n = (int(v) for v in spec.split(":"))
    w, x = random_operands(n, k, tokens, torch.Generator().manual_seed(7))
    x = x.to(torch.float16).to(device)
    fp8, _, _ = gemm_layers(w, torch.zeros(n), x, device)
    fp8.bias.data = fp8.bias.data.to(torch.float16)
    try:
        y = fp8.quant_method._scaled_mm(fp8, x, fp8.bias)
    except RuntimeError as e:  # torch's check for the output dtype of row-wise scaling
        return [f"{spec} fp16 input: torch._scaled_mm raised: {str(e).splitlines()[0]}"]
    e = rel_err(y, emulate_fp8(fp8, x))
    print(f"fp16 input {spec}: out dtype {y.dtype}, err/emu {e:.2e}")
    return [] if e <= EMU_REL_ERR else [f"{spec} fp16 input: err/emu {e:.3g} > {EMU_REL_ERR}"]


def gemm_main(args) -> int:
    device = torch.device(args.device)
    shapes, tokens = list(args.shapes), args.tokens
    if args.small:
        scale = lambda v: str(int(v) // SMALL_DIVISOR)  # noqa: E731
        shapes = [":".join(map(scale, s.split(":"))) for s in shapes]
        tokens //= SMALL_DIVISOR
    if device.type == "cuda":
        from sglang.multimodal_gen.layers.quantization.fp8 import fp8_gemm_available

        cap = torch.cuda.get_device_capability(device)
        print(
            f"{torch.cuda.get_device_name(device)} sm{cap[0]}{cap[1]} torch={torch.__version__} "
            f"fp8 path: {'torch._scaled_mm' if fp8_gemm_available(device) else 'weight-only'}"
        )
    else:
        print(
            f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} "
            "(layer forwards weight-only; the _scaled_mm checks call it directly)"
        )
    print(f"tokens={tokens} bf16; times in ms; x = t_bf16 / t (speedup over bf16)")
    header = (
        f"{'in:out':>11} | {'bf16':>8} {'TFLOPS':>7} | {'fp8':>8} {'x':>6} | {'fp8-dyn':>8} "
        f"{'x':>6} | {'fp8-w':>8} {'x':>6} | {'nvfp4':>8} {'x':>6} | "
        f"{'err/emu':>8} {'err/deq':>8} {'dyn/emu':>8} {'dyn/deq':>8}"
    )
    print(header.replace("TFLOPS", "GFLOPS") if device.type != "cuda" else header)
    print("-" * len(header))
    failed = []
    for spec in shapes:
        row, bad = gemm_case(spec, tokens, device, args)
        if device.type == "cuda":  # TFLOPS: the GFLOPS column / 1000
            head, _, rest = row.partition("|")
            mid, _, tail = rest.partition("|")
            t, gf = mid.split()
            row = f"{head}| {t:>8} {float(gf) / 1e3:7.1f} |{tail}"
        print(row, flush=True)
        failed += bad
    failed += fp16_case(shapes[0], tokens, device)
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed))
        return 1
    print(f"checks passed: err/emu <= {EMU_REL_ERR}, err/deq <= {DEQ_REL_ERR}")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--hidden", type=int, default=1024, help="heads x head_dim (FLUX.1: 3072)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (FLUX.1: 24)")
    p.add_argument("--double", type=int, default=2, help="double-stream blocks (FLUX.1: 19)")
    p.add_argument("--single", type=int, default=4, help="single-stream blocks (FLUX.1: 38)")
    p.add_argument("--image-tokens", type=int, default=1024, help="a square (FLUX.1: 4096)")
    p.add_argument("--text-tokens", type=int, default=128, help="(FLUX.1: 512)")
    p.add_argument("--joint-dim", type=int, default=1024, help="text width (FLUX.1: 4096)")
    p.add_argument("--rope-axes", type=int, nargs=3, default=[16, 56, 56])
    g = p.add_argument_group("--gemm: one linear layer per shape")
    g.add_argument("--gemm", action="store_true", help="time single layers (see above)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--shapes", nargs="+", default=list(GEMM_SHAPES), help="in:out widths")
    g.add_argument("--tokens", type=int, default=GEMM_TOKENS)
    g.add_argument("--small", action="store_true", help="widths and tokens / 12 (CPU rehearsal)")
    g.add_argument("--iters", type=int, default=10)
    g.add_argument("--inner", type=int, default=None, help="calls per sample (10 on cuda, else 1)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    if args.gemm:
        args.inner = args.inner or (10 if args.device.startswith("cuda") else 1)
        return gemm_main(args)
    if args.hidden % args.heads or sum(args.rope_axes) != args.hidden // args.heads:
        p.error("--hidden must be --heads x head_dim with head_dim = sum(--rope-axes)")
    if int(round(args.image_tokens**0.5)) ** 2 != args.image_tokens:
        p.error("--image-tokens must be a square (a packed latent grid)")
    print(
        f"threads={torch.get_num_threads()} torch={torch.__version__} hidden={args.hidden} "
        f"heads={args.heads} mlp={4 * args.hidden} blocks={args.double}+{args.single} "
        f"tokens={args.image_tokens}+{args.text_tokens} bf16 compute "
        f"load average={os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as root:
        build_source(os.path.join(root, "bf16"), args)
        models = load_models(root)
    x = inputs(args)
    outs = {name: m(**x) for name, m in models.items()}  # warm-up, and the outputs compared
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, m in models.items():
            t0 = time.perf_counter()
            m(**x)
            times[name].append((time.perf_counter() - t0) * 1e3)
    ref = outs["bf16"].float()
    t_ref = statistics.median(times["bf16"])
    b_ref = resident_bytes(models["bf16"])
    header = (
        f"{'method':<15} {'ms/step':>9} {'vs bf16':>8} {'weights MiB':>12} {'vs bf16':>8} "
        f"{'rel err':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, m in models.items():
        t = statistics.median(times[name])
        b = resident_bytes(m)
        err = (outs[name].float() - ref).abs().max() / ref.abs().max()
        print(
            f"{name:<15} {t:9.1f} {t / t_ref:8.2f} {b / 2**20:12.1f} {b / b_ref:8.2f} "
            f"{float(err):9.2e}"
        )
    print(
        f"ms/step: median of {args.repeats} interleaved forwards (batch 1, one call per step); "
        f"load average at the end {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
