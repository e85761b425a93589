"""Transformer checkpoints in the models' ORIGINAL (non-diffusers) layouts, as single files read
through ``weights_path`` (``--transformer-weights-path FILE``): unquantized, and as ComfyUI
scaled-FP8 files "as published" (``model.diffusion_model.`` prefix, one per-tensor
``scale_weight`` per 2-D weight, the ``scaled_fp8`` marker).

The oracle is diffusers' own single-file conversion (0.42.1, ``loaders/single_file_utils.py``):

* Flux.1: ``convert_flux_transformer_checkpoint_to_diffusers`` (BFL names). It hard-codes
  FLUX.1's width (``inner_dim = 3072``) to split ``single_blocks.N.linear1`` into q | k | v | mlp;
  :func:`_flux_converter` runs diffusers' source with that one constant set to the tiny model's.
* Wan2.2: ``convert_wan_transformer_to_diffusers`` (Wan-AI names), both tiny layouts (A14B
  experts, TI2V-5B).
* Z-Image: ``convert_z_image_transformer_checkpoint_to_diffusers`` (Tongyi names, fused
  ``attention.qkv``).
* Qwen-Image: diffusers' single-file mapping for ``QwenImageTransformer2DModel`` is the identity
  (ComfyUI's files carry diffusers' names; only the wrapper prefix differs), read from
  ``SINGLE_FILE_LOADABLE_CLASSES``.

Each family: a tiny diffusers transformer with every parameter perturbed; its state dict written
in the original layout by this file's inverse mapping (``to_original``), which is first proved
right by converting it back with diffusers' converter (every tensor equal). Then our DiT, loaded
from that file with ``load_denoiser(folder, spec, weights_path=FILE)``, must give diffusers'
output, and from the ComfyUI FP8 version of the file the output of diffusers holding the
converter's view of the dequantized weights (and be far from the unquantized weights').

Measured (fp32, CPU; max |ours - diffusers| / max |diffusers|, printed with ``-s``):

============  =====================  ==============================================
family        original layout        ComfyUI FP8 (vs the unquantized weights)
============  =====================  ==============================================
flux          3.6e-7                 3.7e-7 (0.047)
wan a14b      2.8e-7                 2.7e-7 (0.030)
wan ti2v      2.8e-7                 2.8e-7 (0.036)
zimage        1.9e-6                 1.1e-6 (0.14)
qwen-image    1.9e-7                 1.9e-7 (0.035)
============  =====================  ==============================================

(Z-Image's 1.9e-6 is its own: ours from the diffusers-layout folder is as far, bit for bit the
same output.) Z-Image's file carries the unused ``norm_final.weight`` its converter drops (the
name map's ``unused``). Not covered: Wan's I2V image branch (``img_emb``, ``k_img``), which our
Wan refuses in any layout.
"""

from __future__ import annotations

import copy
import inspect
import re

import pytest
import torch
from diffusers.loaders import single_file_utils as sfu
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
from fixtures import tiny_flux, tiny_qwen_image, tiny_wan
from fixtures.tiny_models import TINY_TRANSFORMER as TINY_ZIMAGE
from fixtures.tiny_models import rel_err
from safetensors.torch import save_file
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.models.loader import load_denoiser
from sglang.multimodal_gen.models.quantized_export import quantize_fp8
from sglang.multimodal_gen.models.registry import get_family

# ours vs diffusers on the same weights (fp32): Flux, Wan, Qwen-Image measured <= 4e-7; Z-Image
# 1.9e-6 from its own diffusers-layout folder as well (its refiners sum in another order; its
# parity test allows 1e-5). Ours from the original file vs ours from the diffusers folder: equal.
REL_ERR = {"zimage": 1e-5}
DEFAULT_REL_ERR = 1e-6
TP_REL_ERR = 2e-6  # TP 2 vs TP 1 (the all-reduce re-orders additions)
COMFY = "model.diffusion_model."
Tensors = dict[str, torch.Tensor]


# ------------------------------------------------------------------ original layouts (inverses)
def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    """Output rows ``(a, b)`` -> ``(b, a)`` (diffusers' ``(scale, shift)`` <-> BFL's
    ``(shift, scale)``)."""
    return torch.cat(t.chunk(2)[::-1])


# BFL module <- the diffusers modules whose output rows it concatenates, in order
_BFL_TOP = {
    "img_in": ["x_embedder"], "txt_in": ["context_embedder"],
    "time_in.in_layer": ["time_text_embed.timestep_embedder.linear_1"],
    "time_in.out_layer": ["time_text_embed.timestep_embedder.linear_2"],
    "vector_in.in_layer": ["time_text_embed.text_embedder.linear_1"],
    "vector_in.out_layer": ["time_text_embed.text_embedder.linear_2"],
    "guidance_in.in_layer": ["time_text_embed.guidance_embedder.linear_1"],
    "guidance_in.out_layer": ["time_text_embed.guidance_embedder.linear_2"],
    "final_layer.linear": ["proj_out"],
}  # fmt: skip
_BFL_DOUBLE = {
    "img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "img_attn.proj": ["attn.to_out.0"], "txt_attn.proj": ["attn.to_add_out"],
    "img_mlp.0": ["ff.net.0.proj"], "img_mlp.2": ["ff.net.2"],
    "txt_mlp.0": ["ff_context.net.0.proj"], "txt_mlp.2": ["ff_context.net.2"],
    "img_mod.lin": ["norm1.linear"], "txt_mod.lin": ["norm1_context.linear"],
}  # fmt: skip
_BFL_SINGLE = {
    "linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
    "linear2": ["proj_out"], "modulation.lin": ["norm.linear"],
}  # fmt: skip
# RMSNorm parameters: BFL ``<norm>.scale`` <- diffusers ``<norm>.weight``
_BFL_DOUBLE_NORMS = {
    "img_attn.norm.query_norm": "attn.norm_q", "img_attn.norm.key_norm": "attn.norm_k",
    "txt_attn.norm.query_norm": "attn.norm_added_q", "txt_attn.norm.key_norm": "attn.norm_added_k",
}  # fmt: skip
_BFL_SINGLE_NORMS = {"norm.query_norm": "attn.norm_q", "norm.key_norm": "attn.norm_k"}


def flux_to_original(state: Tensors) -> Tensors:
    """A diffusers Flux.1 state dict in BFL names: fused modules concatenated along the output
    rows, ``norm_out.linear`` -> ``final_layer.adaLN_modulation.1`` with its halves swapped, the
    q/k norms' ``weight`` -> ``scale``. Every tensor is used exactly once."""
    state, out = dict(state), {}
    n_double = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks."))
    n_single = 1 + max(
        int(k.split(".")[1]) for k in state if k.startswith("single_transformer_blocks.")
    )
    groups = list(_BFL_TOP.items())
    norms = []
    for i in range(n_double):
        groups += [(f"double_blocks.{i}.{b}", [f"transformer_blocks.{i}.{d}" for d in ds])
                   for b, ds in _BFL_DOUBLE.items()]  # fmt: skip
        norms += [(f"double_blocks.{i}.{b}", f"transformer_blocks.{i}.{d}")
                  for b, d in _BFL_DOUBLE_NORMS.items()]  # fmt: skip
    for i in range(n_single):
        groups += [(f"single_blocks.{i}.{b}", [f"single_transformer_blocks.{i}.{d}" for d in ds])
                   for b, ds in _BFL_SINGLE.items()]  # fmt: skip
        norms += [(f"single_blocks.{i}.{b}", f"single_transformer_blocks.{i}.{d}")
                  for b, d in _BFL_SINGLE_NORMS.items()]  # fmt: skip
    for bfl, ds in groups:
        for leaf in ("weight", "bias"):
            out[f"{bfl}.{leaf}"] = torch.cat([state.pop(f"{d}.{leaf}") for d in ds])
    for bfl, d in norms:
        out[f"{bfl}.scale"] = state.pop(f"{d}.weight")
    for leaf in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = _swap_halves(
            state.pop(f"norm_out.linear.{leaf}")
        )
    assert not state, sorted(state)
    return out


# Wan: (diffusers pattern, Wan-AI replacement) on whole parameter names, first match wins
_WAN_INVERSE = [
    (r"condition_embedder\.time_embedder\.linear_1\.", "time_embedding.0."),
    (r"condition_embedder\.time_embedder\.linear_2\.", "time_embedding.2."),
    (r"condition_embedder\.text_embedder\.linear_1\.", "text_embedding.0."),
    (r"condition_embedder\.text_embedder\.linear_2\.", "text_embedding.2."),
    (r"condition_embedder\.time_proj\.", "time_projection.1."),
    (r"proj_out\.", "head.head."),
    (r"scale_shift_table$", "head.modulation"),
    (r"(blocks\.\d+)\.scale_shift_table$", r"\1.modulation"),
    (r"(blocks\.\d+)\.norm2\.", r"\1.norm3."),  # the affine cross-attention norm
    (r"(blocks\.\d+)\.ffn\.net\.0\.proj\.", r"\1.ffn.0."),
    (r"(blocks\.\d+)\.ffn\.net\.2\.", r"\1.ffn.2."),
]
_WAN_ATTN = {"attn1": "self_attn", "attn2": "cross_attn"}
_WAN_PROJ = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o"}


def wan_to_original(state: Tensors) -> Tensors:
    """A diffusers Wan state dict in Wan-AI's names (``blocks.N.self_attn.q``, ``ffn.0``,
    ``norm3``, ``modulation``, ``head.head``, ``time_embedding.0``...)."""
    out = {}
    for name, t in state.items():
        new = name
        m = re.match(r"(blocks\.\d+)\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0|norm_q|norm_k)\.",
                     name)  # fmt: skip
        if m:
            proj = _WAN_PROJ.get(m.group(3), m.group(3))
            new = f"{m.group(1)}.{_WAN_ATTN[m.group(2)]}.{proj}.{name[m.end() :]}"
        else:
            for pat, rep in _WAN_INVERSE:
                new, n = re.subn("^" + pat, rep, name)
                if n:
                    break
        out[new] = t
    return out


def zimage_to_original(state: Tensors) -> Tensors:
    """A diffusers Z-Image state dict in Tongyi's names: ``attention.qkv`` (q | k | v rows),
    ``attention.out``, ``q_norm|k_norm``, ``x_embedder``, ``final_layer``, plus the unused
    ``norm_final.weight`` such files may carry (diffusers' converter drops it; random values
    here, so that loading it anywhere would show)."""
    state, out = dict(state), {}
    dim = state["cap_pad_token"].shape[-1]
    out["norm_final.weight"] = torch.randn(dim, generator=torch.Generator().manual_seed(7))
    for name in [k for k in state if k.endswith(".attention.to_q.weight")]:
        base = name[: -len("to_q.weight")]
        out[base + "qkv.weight"] = torch.cat([state.pop(f"{base}to_{s}.weight") for s in "qkv"])
    renames = [
        ("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
        (".attention.to_out.0.", ".attention.out."), (".attention.norm_q.", ".attention.q_norm."),
        (".attention.norm_k.", ".attention.k_norm."),
    ]  # fmt: skip
    for name, t in state.items():
        for a, b in renames:
            name = name.replace(a, b)
        out[name] = t
    return out


def _flux_converter(ref):
    """diffusers' BFL -> diffusers converter with its FLUX.1 width (``inner_dim = 3072``, used
    only to split ``linear1`` into q | k | v | mlp) set to the tiny model's; nothing else of
    its source is changed."""
    fn = sfu.convert_flux_transformer_checkpoint_to_diffusers
    src = inspect.getsource(fn)
    inner = ref.config.num_attention_heads * ref.config.attention_head_dim
    assert src.count("inner_dim = 3072") == 1 and "mlp_ratio = 4.0" in src
    ns = dict(vars(sfu))
    exec(src.replace("inner_dim = 3072", f"inner_dim = {inner}"), ns)
    return ns[fn.__name__]


def _qwen_converter(ref):
    return SINGLE_FILE_LOADABLE_CLASSES["QwenImageTransformer2DModel"]["checkpoint_mapping_fn"]


# ------------------------------------------------------------------ the families
def _zimage_ref():
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    ref = ZImageTransformer2DModel(**TINY_ZIMAGE).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in ref.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return ref


def _zimage_inputs():
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(16, 1, h, w, generator=g) for h, w in ((6, 8), (4, 6))]
    caps = [torch.randn(n, TINY_ZIMAGE["cap_feat_dim"], generator=g) for n in (9, 21)]
    return (x, torch.tensor([0.3, 0.8]), caps), {}


def _kw(inputs: dict):
    return (), inputs


FAMILIES = {
    "flux": dict(
        ref=lambda: tiny_flux.reference_dit(True, seed=5),
        inputs=lambda: _kw(tiny_flux.with_guidance(tiny_flux.dit_inputs(seed=11), True, 4.0)),
        to_original=flux_to_original,
        converter=_flux_converter,
    ),
    "wan-a14b": dict(
        family="wan",
        ref=lambda: tiny_wan.reference_dit("a14b", seed=5),
        inputs=lambda: _kw(tiny_wan.dit_inputs("a14b", seed=11)),
        to_original=wan_to_original,
        converter=lambda ref: sfu.convert_wan_transformer_to_diffusers,
    ),
    "wan-ti2v": dict(
        family="wan",
        ref=lambda: tiny_wan.reference_dit("ti2v", seed=5),
        inputs=lambda: _kw(tiny_wan.dit_inputs("ti2v", seed=11)),
        to_original=wan_to_original,
        converter=lambda ref: sfu.convert_wan_transformer_to_diffusers,
    ),
    "zimage": dict(
        ref=_zimage_ref,
        inputs=_zimage_inputs,
        to_original=zimage_to_original,
        converter=lambda ref: sfu.convert_z_image_transformer_checkpoint_to_diffusers,
    ),
    "qwen-image": dict(
        ref=lambda: tiny_qwen_image.reference_dit(seed=5),
        inputs=lambda: _kw(tiny_qwen_image.dit_inputs(seed=11)),
        to_original=dict,
        converter=_qwen_converter,
        converter_prefix="",  # diffusers' identity mapping: no wrapper prefix stripped
    ),
}


def _flat(out) -> torch.Tensor:
    """A DiT output (a tensor, or Z-Image's list of per-item tensors) as one flat tensor."""
    if isinstance(out, (list, tuple)):
        return torch.cat([o.flatten() for o in out])
    return out.flatten()


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    """One family: its perturbed diffusers DiT saved as a transformer folder (our config), its
    state dict in the original layout, diffusers' converter and the DiT inputs."""
    name = request.param
    f = FAMILIES[name]
    root = tmp_path_factory.mktemp(f"original_{name}")
    ref = f["ref"]()
    folder = str(root / "transformer")
    ref.save_pretrained(folder)
    state = {k: v.detach().clone().contiguous() for k, v in ref.state_dict().items()}
    args, kwargs = f["inputs"]()
    with torch.no_grad():
        expected = _flat(ref(*args, **kwargs, return_dict=False)[0])
    spec = get_family(f.get("family", name)).denoiser("transformer")
    from_folder = load_denoiser(folder, spec, tp_rank=0, tp_size=1)
    with torch.no_grad():
        ours_diffusers_layout = _flat(from_folder(*args, **kwargs))
    return dict(
        name=name, ref=ref, folder=folder, root=root, state=state,
        original=f["to_original"](state), converter=f["converter"](ref),
        spec=spec, args=args, kwargs=kwargs, expected=expected,
        ours_diffusers_layout=ours_diffusers_layout,
    )  # fmt: skip


def _convert(case, original: Tensors) -> Tensors:
    """diffusers' view of an original-layout state dict (the converter pops from its input)."""
    return case["converter"](dict(original))


def _ours(case, path: str) -> torch.Tensor:
    model = load_denoiser(case["folder"], case["spec"], tp_rank=0, tp_size=1, weights_path=path)
    with torch.no_grad():
        return _flat(model(*case["args"], **case["kwargs"])), model


def _diffusers(case, state: Tensors) -> torch.Tensor:
    ref = copy.deepcopy(case["ref"])
    ref.load_state_dict(state, strict=True)
    with torch.no_grad():
        return _flat(ref(*case["args"], **case["kwargs"], return_dict=False)[0])


def test_inverse_mapping_is_what_diffusers_converts_back(case):
    """The test's own original-layout writer, proved by diffusers: its converter turns the
    written names back into the diffusers state dict, every tensor equal (shape and values)."""
    original, prefix = case["original"], FAMILIES[case["name"]].get("converter_prefix", COMFY)
    back = _convert(case, {prefix + k: v for k, v in original.items()})
    assert sorted(back) == sorted(case["state"])
    for k, v in case["state"].items():
        assert back[k].shape == v.shape and torch.equal(back[k], v), k
    renamed = set(original) - set(case["state"])
    print(f"{case['name']}: {len(renamed)} of {len(original)} tensors named otherwise")
    assert renamed or case["name"] == "qwen-image"  # Qwen-Image's names are diffusers' own


@pytest.mark.parametrize("prefix", ["", COMFY], ids=["bare", "comfy"])
def test_original_layout_file_matches_diffusers(case, prefix):
    path = str(case["root"] / f"original{'-prefixed' if prefix else ''}.safetensors")
    save_file({prefix + k: v.contiguous() for k, v in case["original"].items()}, path)
    got, model = _ours(case, path)
    err = rel_err(got, case["expected"])
    print(f"{case['name']} original layout {prefix or '(bare)'}: rel err {err:.3g}")
    assert model.quantization is None
    assert got.shape == case["expected"].shape and case["expected"].abs().max() > 0.1
    # the same parameters as from the diffusers-layout folder: the same output, bit for bit
    assert torch.equal(got, case["ours_diffusers_layout"])
    assert err <= REL_ERR.get(case["name"], DEFAULT_REL_ERR)


def comfyui_fp8(original: Tensors) -> tuple[Tensors, Tensors]:
    """``(file tensors, dequantized original-layout tensors)``: every 2-D ``*.weight`` as e4m3
    with a per-tensor ``scale_weight`` (``quantize_fp8``: amax / 448), the ``scaled_fp8``
    marker, names under ``model.diffusion_model.`` (ComfyUI's published scaled-FP8 files)."""
    out, deq = {}, {}
    for k, t in original.items():
        if k.endswith(".weight") and t.dim() == 2:
            q, s = quantize_fp8(t)
            out[COMFY + k], out[COMFY + k[: -len("weight")] + "scale_weight"] = q, s
            deq[k] = q.float() * s
        else:
            out[COMFY + k], deq[k] = t.contiguous(), t
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out, deq


def _comfy_file(case) -> tuple[str, Tensors]:
    """The ComfyUI FP8 file of ``case`` (written once) and its dequantized original tensors."""
    if "comfy" not in case:
        file, deq = comfyui_fp8(case["original"])
        path = str(case["root"] / "comfy-fp8.safetensors")
        save_file(file, path)
        case["comfy"] = (path, deq)
    return case["comfy"]


def test_comfyui_scaled_fp8_original_layout_matches_diffusers(case):
    """The ComfyUI scaled-FP8 file of the original layout against diffusers holding the
    converter's view of the dequantized weights (one scale over a fused source such as BFL's
    ``img_attn.qkv`` / ``linear1`` or Z-Image's ``attention.qkv`` fills every shard's rows; the
    per-tensor scale of BFL's row-swapped ``final_layer.adaLN_modulation.1`` passes through)."""
    path, deq = _comfy_file(case)
    got, model = _ours(case, path)
    expected = _diffusers(case, _convert(case, deq))
    err, err_unq = rel_err(got, expected), rel_err(got, case["expected"])
    print(f"{case['name']} comfyui fp8: rel err {err:.3g} (unquantized weights: {err_unq:.3g})")
    assert model.quantization == "comfyui fp8"
    assert got.shape == expected.shape and expected.abs().max() > 0.1
    assert err <= REL_ERR.get(case["name"], DEFAULT_REL_ERR)
    assert err_unq > 1000 * DEFAULT_REL_ERR  # the quantization error shows


# ------------------------------------------------------------------ TP 2 (gloo)
def _tp_rank_fn(rank, family, folder, path, args, kwargs):
    spec = get_family(family).denoiser("transformer")
    model = load_denoiser(folder, spec, weights_path=path)
    with torch.no_grad():
        return _flat(model(*args, **kwargs)), get_tp_world_size()


@pytest.mark.slow
def test_comfyui_fp8_original_layout_tp2_equals_tp1(case):
    """TP 2 of the ComfyUI FP8 original-layout file: each rank takes its rows of a fused source
    (BFL ``img_attn.qkv`` / ``linear1``, Z-Image ``attention.qkv``) with the source's one
    per-tensor scale on them; both ranks give the TP 1 output (extended tier: about 20 s each)."""
    name = case["name"]
    if name not in ("flux", "zimage"):
        pytest.skip("TP 2 is checked on the families whose original layout fuses q | k | v")
    path, _ = _comfy_file(case)
    tp1, _ = _ours(case, path)
    family = FAMILIES[name].get("family", name)
    results = launch_processes(
        _tp_rank_fn, 2,
        args=(family, case["folder"], path, case["args"], case["kwargs"]), backend="gloo",
    )  # fmt: skip
    for rank, (out, world) in enumerate(results):
        err = rel_err(out, tp1)
        print(f"{name} comfyui fp8 TP 2 rank {rank}: rel err vs TP 1 {err:.3g}")
        assert world == 2 and err <= TP_REL_ERR
