"""Flux.1 LoRA layouts, one test per layout users share (kohya, BFL/ComfyUI, XLabs, PEFT, LoKr...).

Each test writes the row's key layout as a safetensors file at test size (random non-zero tensors,
rank 4, alpha != r), applies it to our tiny ``FluxTransformer`` through the ``LoRAManager``
(merged and committed, so weight and bias deltas can be read off the layers), and checks:

* the weight delta of EVERY layer: the expected ``scale * B @ A`` of each patched module is written
  out here from the file's own tensors with explicit row slices of our fused layers (``[q|k|v]``,
  ``[q|k|v|mlp]``), never through our converter or name map; every other layer is bit-identical;
* rows the file does not cover (a missing ``to_v``, the mlp rows under an XLabs ``qkv_lora``) are
  exactly unchanged;
* the count of patched modules (and of LoRA pairs matched, keys ignored);
* bias deltas (``diff_b``) exactly: ``bias + strength * diff_b`` bit for bit.

Where diffusers' own converter works at test size (XLabs; the kohya embedders / final layer) its
result is compared as a second, independent oracle.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.flux import FluxArchConfig
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.flux import FluxTransformer
from sglang.multimodal_gen.models.dits.flux_names import FLUX_NAME_MAP
from sglang.multimodal_gen.models.families.tiny.flux import TINY_TRANSFORMER

CFG = FluxArchConfig.from_dict(dict(TINY_TRANSFORMER, guidance_embeds=True))
D, MLP = 64, 256  # inner dim (4 heads x 16) and single-block MLP width of the tiny model
assert (CFG.inner_dim, CFG.mlp_hidden) == (D, MLP)
R = 4
TB, STB = "transformer_blocks", "single_transformer_blocks"


# ------------------------------------------------------------------------------------ helpers
class _Gen:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * 0.1


def _model(tp_rank: int = 0, tp_size: int = 1) -> FluxTransformer:
    model = FluxTransformer(CFG, tp_rank=tp_rank, tp_size=tp_size, dtype=torch.float32)
    g = torch.Generator().manual_seed(1000 + tp_rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


class Applied:
    """A file applied to a fresh model, merged and committed: weight deltas (fp64), biases."""

    def __init__(self, tmp_path, sd, strength=1.0, metadata=None, tp_rank=0, tp_size=1):
        self.model = _model(tp_rank, tp_size)
        self.mgr = LoRAManager({"transformer": self.model}, FLUX_NAME_MAP, model_name="Flux.1")
        self.layers = self.mgr.layers("transformer")
        w0 = {n: layer.weight.detach().clone() for n, layer in self.layers.items()}
        self.bias0 = {n: layer.bias.detach().clone() for n, layer in self.layers.items()}
        path = tmp_path / f"lora_{tp_rank}.safetensors"
        save_file(sd, str(path), metadata=metadata)
        self.mgr.set_lora("x", str(path), strengths=strength, merge_mode="merge")
        self.info = self.mgr.list_loras()["loaded"][0]["targets"]["transformer"]
        self.mgr.commit_as_base()  # folds bias deltas into the biases
        self.dw = {n: layer.weight.double() - w0[n].double() for n, layer in self.layers.items()}
        self.bias = {n: layer.bias.detach() for n, layer in self.layers.items()}

    def assert_weights(self, expected: dict[str, torch.Tensor], pairs: int, layers=None) -> None:
        """``expected``: ``{our module: full (local) weight delta}``; every other layer unchanged.
        ``pairs``: file modules matched; ``layers``: our layers patched (default: ``expected``'s
        count; more when some only get a bias delta)."""
        changed = {n for n, d in self.dw.items() if bool(d.abs().max() > 0)}
        assert changed == set(expected)
        for n, e in expected.items():
            e = e.double()
            torch.testing.assert_close(self.dw[n], e, atol=2e-7, rtol=1e-5, msg=n)
            assert bool((self.dw[n][e == 0] == 0).all()), f"{n}: rows the file leaves alone moved"
        assert self.info["target_layers"] == (len(expected) if layers is None else layers)
        assert self.info["matched_modules"] == pairs

    def assert_biases(self, expected: dict[str, torch.Tensor]) -> None:
        """``expected``: ``{our module: exact bias delta}`` (fp32); every other bias unchanged."""
        for n in self.layers:
            want = self.bias0[n] + expected[n] if n in expected else self.bias0[n]
            assert torch.equal(self.bias[n], want), n


def _kohya(sd, name, a, b, alpha=None):
    sd[f"{name}.lora_down.weight"] = a
    sd[f"{name}.lora_up.weight"] = b
    if alpha is not None:
        sd[f"{name}.alpha"] = torch.tensor(float(alpha))


def _peft(sd, name, a, b):
    sd[f"{name}.lora_A.weight"] = a
    sd[f"{name}.lora_B.weight"] = b


def _cols(*blocks):
    """Rows stacked in the order given (the row layout of our fused layers)."""
    return torch.cat(blocks, dim=0)


# ------------------------------------------------------------------ row 1: kohya fused + alpha
def _row1_file(seed=1):
    g = _Gen(seed)
    sd, t = {}, {}
    for key, a_in, b_out, alpha in (
        ("lora_unet_double_blocks_0_img_attn_qkv", D, 3 * D, 1.0),
        ("lora_unet_double_blocks_1_txt_attn_qkv", D, 3 * D, 2.0),
        ("lora_unet_double_blocks_0_img_mlp_0", D, MLP, 3.0),
        ("lora_unet_double_blocks_1_txt_mod_lin", D, 6 * D, 1.0),
        ("lora_unet_single_blocks_0_linear1", D, 3 * D + MLP, 1.0),
        ("lora_unet_single_blocks_1_linear2", D + MLP, D, 3.0),
        ("lora_unet_single_blocks_1_modulation_lin", D, 3 * D, 2.0),
    ):
        t[key] = (g(R, a_in), g(b_out, R), alpha / R)
        _kohya(sd, key, t[key][0], t[key][1], alpha)
    ignored = []
    for i in range(2):  # CLIP-L text-encoder LoRA: counted and reported, not applied
        k = f"lora_te1_text_model_encoder_layers_{i}_self_attn_q_proj"
        _kohya(sd, k, g(R, 32), g(32, R), 4.0)
        ignored += [f"{k}.lora_down.weight", f"{k}.lora_up.weight", f"{k}.alpha"]
    return sd, t, ignored


def _row1_expected(t):
    def d(key):
        a, b, s = t[key]
        return s * b.double() @ a.double()

    return {
        # the fused qkv B is [q | k | v] rows, our to_qkv's rows are q | k | v: the whole product
        f"{TB}.0.attn.to_qkv": d("lora_unet_double_blocks_0_img_attn_qkv"),
        f"{TB}.1.attn.to_added_qkv": d("lora_unet_double_blocks_1_txt_attn_qkv"),
        f"{TB}.0.ff.net.0.proj": d("lora_unet_double_blocks_0_img_mlp_0"),
        f"{TB}.1.norm1_context.linear": d("lora_unet_double_blocks_1_txt_mod_lin"),
        # linear1 = [q | k | v | mlp], our to_qkv_mlp's rows in the same order
        f"{STB}.0.to_qkv_mlp": d("lora_unet_single_blocks_0_linear1"),
        # linear2 input [attn | mlp] = proj_out's input
        f"{STB}.1.proj_out": d("lora_unet_single_blocks_1_linear2"),
        f"{STB}.1.norm.linear": d("lora_unet_single_blocks_1_modulation_lin"),
    }


def test_row1_kohya_fused_qkv_linear1_linear2_with_alpha(tmp_path):
    sd, t, ignored = _row1_file()
    got = Applied(tmp_path, sd)
    got.assert_weights(_row1_expected(t), pairs=7)
    assert got.info["ignored_keys"] == len(ignored) == 6
    assert got.info["source_format"] == "kohya"
    # q, k, v each got their third of B with the shared A (per-shard view of the same numbers)
    a, b, s = t["lora_unet_double_blocks_0_img_attn_qkv"]
    dq = got.dw[f"{TB}.0.attn.to_qkv"]
    for i in range(3):
        rows = slice(i * D, (i + 1) * D)
        torch.testing.assert_close(dq[rows], s * b[rows].double() @ a.double(), atol=2e-7, rtol=0)


def test_row1_under_tp2_each_rank_holds_its_rows_and_columns(tmp_path):
    """The same file at TP 2: each rank's local weight delta is its slice of the full delta,
    written out by hand (column layers: each section's rows split in two; row-parallel
    ``proj_out``: each input section ``[attn | mlp]`` split in two)."""
    sd, t, _ = _row1_file(seed=2)
    full = _row1_expected(t)

    def col(delta, sections, r):
        out, start = [], 0
        for n in sections:
            out.append(delta[start + r * n // 2 : start + (r + 1) * n // 2])
            start += n
        return torch.cat(out)

    def row(delta, sections, r):
        out, start = [], 0
        for n in sections:
            out.append(delta[:, start + r * n // 2 : start + (r + 1) * n // 2])
            start += n
        return torch.cat(out, dim=1)

    for rank in range(2):
        local = {
            f"{TB}.0.attn.to_qkv": col(full[f"{TB}.0.attn.to_qkv"], [D] * 3, rank),
            f"{TB}.1.attn.to_added_qkv": col(full[f"{TB}.1.attn.to_added_qkv"], [D] * 3, rank),
            f"{TB}.0.ff.net.0.proj": col(full[f"{TB}.0.ff.net.0.proj"], [MLP], rank),
            f"{TB}.1.norm1_context.linear": full[f"{TB}.1.norm1_context.linear"],  # replicated
            f"{STB}.0.to_qkv_mlp": col(full[f"{STB}.0.to_qkv_mlp"], [D, D, D, MLP], rank),
            f"{STB}.1.proj_out": row(full[f"{STB}.1.proj_out"], [D, MLP], rank),
            f"{STB}.1.norm.linear": full[f"{STB}.1.norm.linear"],
        }
        Applied(tmp_path, sd, tp_rank=rank, tp_size=2).assert_weights(local, pairs=7)


# --------------------------------------------------------------- row 2: diffusers/PEFT split
def _row2_tensors(seed=3):
    g = _Gen(seed)
    return {
        f"{TB}.0.attn.to_q": (g(4, D), g(D, 4)),
        f"{TB}.0.attn.to_k": (g(8, D), g(D, 8)),  # another rank, and no to_v at all
        f"{TB}.1.attn.add_v_proj": (g(4, D), g(D, 4)),
        f"{STB}.0.attn.to_q": (g(4, D), g(D, 4)),
        f"{STB}.0.proj_mlp": (g(6, D), g(MLP, 6)),
        "norm_out.linear": (g(4, D), g(2 * D, 4)),  # diffusers' own (scale, shift): no swap
        "proj_out": (g(4, D), g(16, 4)),
    }


def _row2_expected(t, scales):
    def d(n):
        a, b = t[n]
        return scales.get(n, 1.0) * b.double() @ a.double()

    z = torch.zeros(D, D, dtype=torch.float64)
    return {
        f"{TB}.0.attn.to_qkv": _cols(d(f"{TB}.0.attn.to_q"), d(f"{TB}.0.attn.to_k"), z),
        f"{TB}.1.attn.to_added_qkv": _cols(z, z, d(f"{TB}.1.attn.add_v_proj")),
        f"{STB}.0.to_qkv_mlp": _cols(d(f"{STB}.0.attn.to_q"), z, z, d(f"{STB}.0.proj_mlp")),
        "norm_out.linear": d("norm_out.linear"),
        "proj_out": d("proj_out"),
    }


@pytest.mark.parametrize("variant", ["plain", "default_infix", "alpha", "weight_alpha", "metadata"])
def test_row2_diffusers_split_ranks_apart_missing_v_zero(tmp_path, variant):
    t = _row2_tensors()
    sd, scales, metadata = {}, {}, None
    for n, (a, b) in t.items():
        if variant == "default_infix":
            sd[f"transformer.{n}.lora_A.default.weight"] = a
            sd[f"transformer.{n}.lora_B.default.weight"] = b
        else:
            _peft(sd, f"transformer.{n}", a, b)
    q, k = f"{TB}.0.attn.to_q", f"{TB}.0.attn.to_k"
    if variant == "alpha":
        sd[f"transformer.{q}.alpha"] = torch.tensor(1.0)
        sd[f"transformer.{k}.alpha"] = torch.tensor(2.0)
        scales = {q: 1.0 / 4, k: 2.0 / 8}
    elif variant == "weight_alpha":
        sd[f"transformer.{q}.lora_A.weight.alpha"] = torch.tensor(1.0)
        sd[f"transformer.{k}.lora_A.weight.alpha"] = torch.tensor(2.0)
        scales = {q: 1.0 / 4, k: 2.0 / 8}
    elif variant == "metadata":  # diffusers' header config: alpha 2 for all, ranks by pattern
        cfg = {"r": 4, "lora_alpha": 2.0, "rank_pattern": {"to_k": 8, "proj_mlp": 6}}
        metadata = {"lora_adapter_metadata": json.dumps(cfg)}
        scales = {n: 2.0 / a.shape[0] for n, (a, _) in t.items()}
    got = Applied(tmp_path, sd, metadata=metadata)
    got.assert_weights(_row2_expected(t, scales), pairs=len(t))
    assert got.info["ignored_keys"] == 0


# ------------------------------------------------------------ row 3: ComfyUI + diff_b bias deltas
def _row3_file(seed=4):
    g = _Gen(seed)
    qkv = "diffusion_model.double_blocks.0.img_attn.qkv"
    mlp = "diffusion_model.double_blocks.1.img_mlp.0"
    t = {
        "qkv": (g(R, D), g(3 * D, R), g(3 * D)),
        "mlp": (g(R, D), g(MLP, R)),
        "linear1_b": g(3 * D + MLP),
        "linear2_b": g(D),
        "final_b": g(2 * D),
    }
    sd = {}
    _kohya(sd, qkv, t["qkv"][0], t["qkv"][1], alpha=1.0)
    sd[f"{qkv}.diff_b"] = t["qkv"][2]
    _kohya(sd, mlp, *t["mlp"])  # no .alpha: scale 1, no KeyError
    sd["diffusion_model.single_blocks.0.linear1.diff_b"] = t["linear1_b"]  # a bias delta alone
    sd["diffusion_model.single_blocks.1.linear2.diff_b"] = t["linear2_b"]  # row-parallel layer
    sd["diffusion_model.final_layer.adaLN_modulation.1.diff_b"] = t["final_b"]  # (shift, scale)
    return sd, t


@pytest.mark.parametrize("strength", [1.0, 0.7])
def test_row3_comfyui_qkv_with_diff_b_and_bias_only_modules(tmp_path, strength):
    sd, t = _row3_file()
    got = Applied(tmp_path, sd, strength=strength)
    a, b, _ = t["qkv"]
    am, bm = t["mlp"]
    got.assert_weights(
        {
            f"{TB}.0.attn.to_qkv": strength * 0.25 * b.double() @ a.double(),
            f"{TB}.1.ff.net.0.proj": strength * bm.double() @ am.double(),
        },
        pairs=5,  # 2 LoRA pairs + 3 bias-only modules
        layers=5,
    )
    fb = t["final_b"]
    got.assert_biases(
        {  # diff_b is added at the strength, without alpha; BFL final rows (shift, scale) swapped
            f"{TB}.0.attn.to_qkv": t["qkv"][2] * strength,
            f"{STB}.0.to_qkv_mlp": t["linear1_b"] * strength,
            f"{STB}.1.proj_out": t["linear2_b"] * strength,
            "norm_out.linear": torch.cat([fb[D:], fb[:D]]) * strength,
        }
    )
    assert got.info["source_format"] == "comfyui"


def test_row3_diff_b_dynamic_forward_and_tp2(tmp_path):
    """Unmerged: the layer adds ``strength * diff_b`` on top of ``x (W + dW)^T + b``; at TP 2 each
    rank's committed bias delta is its own rows of ``diff_b`` (column layers)."""
    sd, t = _row3_file(seed=5)
    path = tmp_path / "row3.safetensors"
    save_file(sd, str(path))
    model = _model()
    mgr = LoRAManager({"transformer": model}, FLUX_NAME_MAP)
    layer = mgr.layers("transformer")[f"{TB}.0.attn.to_qkv"]
    w, bias = layer.weight.detach().clone().double(), layer.bias.detach().clone().double()
    mgr.set_lora("x", str(path), strengths=0.7, merge_mode="dynamic")
    a, b, db = t["qkv"]
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(6))
    want = F.linear(x.double(), w + 0.7 * 0.25 * b.double() @ a.double(), bias + 0.7 * db.double())
    torch.testing.assert_close(layer(x)[0].double(), want, atol=1e-5, rtol=1e-5)

    for rank in range(2):
        got = Applied(tmp_path, sd, tp_rank=rank, tp_size=2)
        h = D // 2
        qkv_rows = torch.cat([db[s * D + rank * h : s * D + (rank + 1) * h] for s in range(3)])
        sections = [(0, D), (D, D), (2 * D, D), (3 * D, MLP)]
        lin1 = t["linear1_b"]
        lin1_rows = torch.cat(
            [lin1[o + rank * n // 2 : o + (rank + 1) * n // 2] for o, n in sections]
        )
        fb = t["final_b"]
        got.assert_biases(
            {
                f"{TB}.0.attn.to_qkv": qkv_rows,
                f"{STB}.0.to_qkv_mlp": lin1_rows,
                # row-parallel: every rank keeps the full bias, only rank 0 adds it (and the delta)
                f"{STB}.1.proj_out": t["linear2_b"],
                "norm_out.linear": torch.cat([fb[D:], fb[:D]]),
            }
        )


def test_row3_full_weight_diff_refused_listing_keys(tmp_path):
    sd, _ = _row3_file()
    g = _Gen(7)
    bad = [
        "diffusion_model.double_blocks.0.img_attn.norm.query_norm.diff",
        "diffusion_model.double_blocks.0.img_attn.norm.key_norm.diff",
    ]
    for k in bad:
        sd[k] = g(16)
    path = tmp_path / "diff.safetensors"
    save_file(sd, str(path))
    model = _model()
    mgr = LoRAManager({"transformer": model}, FLUX_NAME_MAP)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoRAFormatError) as e:
        mgr.set_lora("x", str(path))
    msg = str(e.value)
    assert "full weight difference" in msg and all(k in msg for k in bad) and "2 such keys" in msg
    assert e.value.status_code == 400
    assert mgr.loaded_nicknames == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------- row 4: embedders and the final layer
def test_row4_embedders_and_final_layer_b_halves_swapped(tmp_path):
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    g = _Gen(8)
    mods = {  # kohya name: (in, out, alpha, our module)
        "lora_unet_img_in": (16, D, 1.0, "x_embedder"),
        "lora_unet_txt_in": (32, D, 2.0, "context_embedder"),
        "lora_unet_time_in_in_layer": (256, D, 1.0, "time_text_embed.timestep_embedder.linear_1"),
        "lora_unet_time_in_out_layer": (D, D, 3.0, "time_text_embed.timestep_embedder.linear_2"),
        "lora_unet_vector_in_in_layer": (32, D, 1.0, "time_text_embed.text_embedder.linear_1"),
        "lora_unet_vector_in_out_layer": (D, D, 1.0, "time_text_embed.text_embedder.linear_2"),
        "lora_unet_guidance_in_in_layer": (
            256, D, 2.0, "time_text_embed.guidance_embedder.linear_1",
        ),
        "lora_unet_guidance_in_out_layer": (
            D, D, 1.0, "time_text_embed.guidance_embedder.linear_2",
        ),
        "lora_unet_final_layer_adaLN_modulation_1": (D, 2 * D, 1.0, "norm_out.linear"),
        "lora_unet_final_layer_linear": (D, 16, 2.0, "proj_out"),
    }  # fmt: skip
    sd, expected, t = {}, {}, {}
    for key, (i, o, alpha, ours) in mods.items():
        a, b = g(R, i), g(o, R)
        t[key] = (a, b)
        _kohya(sd, key, a, b, alpha)
        expected[ours] = alpha / R * b.double() @ a.double()
    a, b = t["lora_unet_final_layer_adaLN_modulation_1"]
    # BFL rows are (shift, scale), ours (scale, shift): B's halves swapped, A untouched
    expected["norm_out.linear"] = 0.25 * torch.cat([b[D:], b[:D]]).double() @ a.double()
    got = Applied(tmp_path, sd)
    got.assert_weights(expected, pairs=len(mods))
    unswapped = 0.25 * b.double() @ a.double()
    assert (got.dw["norm_out.linear"] - unswapped).abs().max() > 1e-3

    # diffusers' converter (it handles these names at any width) agrees on the swap and on every
    # embedder (alpha folded into A); it drops the alpha of both final-layer modules (its "TODO:
    # alphas", the known failure), so there its delta is ours times r / alpha
    conv = _convert_kohya_flux_lora_to_diffusers(dict(sd))
    for key, (_, _, alpha, ours) in mods.items():
        theirs = conv[f"{ours}.lora_B.weight"].double() @ conv[f"{ours}.lora_A.weight"].double()
        if key.startswith("lora_unet_final_layer"):
            theirs = theirs * alpha / R
        torch.testing.assert_close(got.dw[ours], theirs, atol=2e-7, rtol=1e-5, msg=ours)


# ------------------------------------------------------------ row 5: BFL names, lora_A / lora_B
def test_row5_original_names_with_A_B_suffixes_alpha_r(tmp_path):
    g = _Gen(9)
    t = {
        "double_blocks.0.img_attn.qkv": (g(R, D), g(3 * D, R)),
        "double_blocks.1.txt_attn.qkv": (g(R, D), g(3 * D, R)),
        "single_blocks.1.linear1": (g(R, D), g(3 * D + MLP, R)),
        "double_blocks.1.txt_attn.proj": (g(R, D), g(D, R)),
    }
    sd = {}
    for n, (a, b) in t.items():
        _peft(sd, f"diffusion_model.{n}", a, b)

    def d(n):
        a, b = t[n]
        return b.double() @ a.double()  # no alpha: alpha = r, scale 1

    got = Applied(tmp_path, sd)
    got.assert_weights(
        {
            f"{TB}.0.attn.to_qkv": d("double_blocks.0.img_attn.qkv"),
            f"{TB}.1.attn.to_added_qkv": d("double_blocks.1.txt_attn.qkv"),
            f"{STB}.1.to_qkv_mlp": d("single_blocks.1.linear1"),
            f"{TB}.1.attn.to_add_out": d("double_blocks.1.txt_attn.proj"),
        },
        pairs=4,
    )


# ----------------------------------------------------------------------------- row 6: XLabs
def test_row6_xlabs_processors_without_block_0(tmp_path):
    from diffusers.loaders.lora_conversion_utils import _convert_xlabs_flux_lora_to_diffusers

    g = _Gen(10)
    t = {  # only block 1: detection must not depend on block 0 existing
        "double_blocks.1.processor.qkv_lora1": (g(R, D), g(3 * D, R)),
        "double_blocks.1.processor.qkv_lora2": (g(R, D), g(3 * D, R)),
        "double_blocks.1.processor.proj_lora1": (g(R, D), g(D, R)),
        "double_blocks.1.processor.proj_lora2": (g(R, D), g(D, R)),
        "single_blocks.1.processor.qkv_lora": (g(R, D), g(3 * D, R)),
        "single_blocks.1.processor.proj_lora": (g(R, D + MLP), g(D, R)),
    }
    sd = {}
    for n, (a, b) in t.items():
        sd[f"{n}.down.weight"] = a
        sd[f"{n}.up.weight"] = b

    def d(n):
        a, b = t[n]
        return b.double() @ a.double()  # no alpha: scale 1

    got = Applied(tmp_path, sd)
    got.assert_weights(
        {
            f"{TB}.1.attn.to_qkv": d("double_blocks.1.processor.qkv_lora1"),  # image stream
            f"{TB}.1.attn.to_added_qkv": d("double_blocks.1.processor.qkv_lora2"),  # text
            f"{TB}.1.attn.to_out.0": d("double_blocks.1.processor.proj_lora1"),
            f"{TB}.1.attn.to_add_out": d("double_blocks.1.processor.proj_lora2"),
            # q|k|v rows of linear1 only; the mlp rows stay exactly as they were
            f"{STB}.1.to_qkv_mlp": _cols(
                d("single_blocks.1.processor.qkv_lora"), torch.zeros(MLP, D, dtype=torch.float64)
            ),
            f"{STB}.1.proj_out": d("single_blocks.1.processor.proj_lora"),
        },
        pairs=6,
    )
    assert got.info["source_format"] == "xlabs"

    # diffusers' XLabs converter (even splits, so it works at test size) gives the same deltas
    conv = _convert_xlabs_flux_lora_to_diffusers(dict(sd))

    def theirs(*names):
        return torch.cat(
            [
                conv[f"transformer.{n}.lora_B.weight"].double()
                @ conv[f"transformer.{n}.lora_A.weight"].double()
                for n in names
            ]
        )

    pairs = {
        f"{TB}.1.attn.to_qkv": [f"{TB}.1.attn.to_{s}" for s in "qkv"],
        f"{TB}.1.attn.to_added_qkv": [f"{TB}.1.attn.add_{s}_proj" for s in "qkv"],
        f"{TB}.1.attn.to_out.0": [f"{TB}.1.attn.to_out.0"],
        f"{TB}.1.attn.to_add_out": [f"{TB}.1.attn.to_add_out"],
        f"{STB}.1.proj_out": [f"{STB}.1.proj_out"],
    }
    for ours, names in pairs.items():
        torch.testing.assert_close(got.dw[ours], theirs(*names), atol=2e-7, rtol=1e-5)
    torch.testing.assert_close(
        got.dw[f"{STB}.1.to_qkv_mlp"][: 3 * D], theirs(*[f"{STB}.1.attn.to_{s}" for s in "qkv"])
    )


# ------------------------------------------------------------------------ row 7: LoKr and DoRA
def test_row7_lokr_lycoris_names_alpha_rule(tmp_path):
    g = _Gen(11)
    q = "lycoris_transformer_blocks_0_attn_to_q"
    mlp = "lycoris_single_transformer_blocks_0_proj_mlp"
    w1, w2a, w2b = g(4, 4), g(16, 2), g(2, 16)
    f1, f2 = g(64, 1), g(4, 64)  # both factors full: kron is [256, 64] of rank 4
    sd = {
        f"{q}.lokr_w1": w1,
        f"{q}.lokr_w2_a": w2a,
        f"{q}.lokr_w2_b": w2b,
        f"{q}.alpha": torch.tensor(1.0),
        f"{mlp}.lokr_w1": f1,
        f"{mlp}.lokr_w2": f2,
        f"{mlp}.alpha": torch.tensor(3.0),
    }
    # LyCORIS: alpha / rank (rank = lokr_w2_b rows = 2) when a factor is decomposed, 1 when both
    # factors are full (the alpha is then not used)
    dq = 0.5 * torch.kron(w1.double(), w2a.double() @ w2b.double())
    dm = torch.kron(f1.double(), f2.double())
    z = torch.zeros(D, D, dtype=torch.float64)
    got = Applied(tmp_path, sd)
    got.assert_weights(
        {f"{TB}.0.attn.to_qkv": _cols(dq, z, z), f"{STB}.0.to_qkv_mlp": _cols(z, z, z, dm)},
        pairs=2,
    )
    assert got.info["source_format"] == "lokr"


@pytest.mark.parametrize(
    "key",
    [
        "lora_unet_double_blocks_0_img_attn_qkv.dora_scale",
        "transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector",
    ],
)
def test_row7_dora_refused_never_plain_lora(tmp_path, key):
    g = _Gen(12)
    sd = {}
    _kohya(sd, "lora_unet_double_blocks_0_img_attn_qkv", g(R, D), g(3 * D, R), 1.0)
    _peft(sd, "transformer.transformer_blocks.0.attn.to_q", g(R, D), g(D, R))
    sd[key] = g(1, D)
    path = tmp_path / "dora.safetensors"
    save_file(sd, str(path))
    model = _model()
    mgr = LoRAManager({"transformer": model}, FLUX_NAME_MAP)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoRAFormatError) as e:
        mgr.set_lora("x", str(path))
    assert "DoRA" in str(e.value) and key in str(e.value)
    assert e.value.status_code == 400
    assert mgr.loaded_nicknames == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_text_encoder_only_file_is_an_error_that_counts_them(tmp_path):
    g = _Gen(13)
    sd = {}
    _kohya(sd, "lora_te1_text_model_encoder_layers_0_self_attn_q_proj", g(R, 32), g(32, R), 4.0)
    _peft(sd, "text_encoder.text_model.encoder.layers.0.mlp.fc1", g(R, 32), g(64, R))
    path = tmp_path / "te.safetensors"
    save_file(sd, str(path))
    mgr = LoRAManager({"transformer": _model()}, FLUX_NAME_MAP, model_name="Flux.1")
    with pytest.raises(LoRAFormatError, match="matched 0 modules of Flux.1.*5 ignored keys"):
        mgr.set_lora("x", str(path))
