"""Our Wan2.x DiT vs diffusers' WanTransformer3DModel on the same weights (fp32 and bf16, CPU),
original-checkpoint names, and tensor parallelism (TP 2 and 4, real gloo processes) against TP 1.

Two tiny layouts of the two Wan2.2 variants:

* ``a14b``: the A14B experts' (= Wan2.1 14B's) layout scaled down: 16 latent channels in and
  out, patch (1, 2, 2), one timestep per item (``timestep [B]``);
* ``ti2v``: TI2V-5B's layout scaled down: in = out channels (12 here, 48 in the real model),
  patch (1, 2, 2), per-token timesteps (``timestep [B, S]``) built as diffusers' WanPipeline
  builds them with ``expand_timesteps`` and an image-conditioned first frame (its tokens at 0).

4 heads each (so TP 4 holds one head per rank), two blocks; every parameter of the reference is
perturbed with seeded noise, so none sits at a constant (the RMSNorm / LayerNorm weights would
all be 1, biases 0) where a loading mistake could hide.

Measured on this machine (torch 2.13 CPU): ours vs diffusers max |err| / max |ref| = 0.0
(bitwise equal) for both layouts in fp32, and in bf16 against a reference loaded with
``from_pretrained(torch_dtype=bfloat16)`` (fp32-kept modules on both sides). TP vs TP 1:
TP 2 2.3e-7 (a14b), 2.0e-7 / 2.2e-7 (ti2v: pipeline-style / random per-token timesteps); TP 4
1.8e-7 (a14b), 2.0e-7 / 2.7e-7 (ti2v) -- the all-reduces re-order fp32 additions, including the
sum of squares of the q/k RMSNorm across heads. Thresholds: parity 1e-6 (10x below the 1e-5
acceptance bound; nonzero because GEMM kernels on other CPUs may block the fused projections
differently), TP 2e-6 (about 8x the largest measured value). Timestep 505 instead of 500 gives
0.13 (a14b) / 0.16 (ti2v); normalising q/k per rank instead of across all heads (the TP bug the
test guards against) gives 0.42 (2 ranks) / 0.49 (4 ranks) on the norm alone and 1.5e-2 on the
a14b model's output at TP 2 (checked once by patching the norm in the workers): far outside.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from fixtures.tiny_models import rel_err
from fixtures.tiny_wan import DIT_LAYOUTS, DIT_VIDEO, dit_inputs, reference_dit
from sglang.multimodal_gen.configs.wan import WAN_TRANSFORMER_CLASS, WanArchConfig
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.layers.norm import RMSNormAcrossHeads
from sglang.multimodal_gen.models.dits.wan import (
    WanTransformer,
    wan_from_diffusers_module,
)
from sglang.multimodal_gen.models.dits.wan_names import WAN_NAME_MAP

PARITY_REL_ERR = 1e-6  # measured 0.0 (bitwise equal), both layouts
TP_REL_ERR = 2e-6  # measured 1.8e-7 .. 2.7e-7 (TP 2 and TP 4, both layouts)
BF16_REL_ERR = 2**-8  # measured 0.0; one bf16 ulp of max |ref| as the margin


@pytest.fixture(scope="module", params=list(DIT_LAYOUTS))
def models(request):
    ref = reference_dit(request.param)
    ours = wan_from_diffusers_module(ref, tp_rank=0, tp_size=1)
    return ours, ref, request.param


def test_transformer_matches_diffusers(models):
    ours, ref, layout = models
    inp = dit_inputs(layout)
    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        got = ours(**inp)
    c = DIT_LAYOUTS[layout]["out_channels"]
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape == (2, c, *DIT_VIDEO)
    assert expected.abs().max() > 0.5  # a real signal
    err = rel_err(got, expected)
    print(f"wan parity ({layout}): rel err {err:.3g}")
    assert err <= PARITY_REL_ERR

    # the threshold discriminates: timestep 505 instead of 500 is far outside it
    with torch.no_grad():
        off = ours(**dict(inp, timestep=dit_inputs(layout, t=505.0)["timestep"]))
    off_err = rel_err(off, expected)
    print(f"wan ({layout}): timestep 505 vs 500 rel err {off_err:.3g}")  # 0.13 / 0.16
    assert off_err > 1e4 * PARITY_REL_ERR


def test_bf16_matches_diffusers_from_pretrained(models, tmp_path):
    """bf16 against diffusers' own bf16 loading: ``from_pretrained(torch_dtype=bfloat16)`` keeps
    the time embedder, the scale_shift_tables and norm2 in fp32 (``_keep_in_fp32_modules``);
    ours keeps the same parameters in fp32."""
    from diffusers import WanTransformer3DModel

    _, ref, layout = models
    ref.save_pretrained(tmp_path)
    ref16 = WanTransformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    ours16 = wan_from_diffusers_module(ref16)
    assert ours16.dtype == torch.bfloat16
    fp32_ref = {n for n, p in ref16.named_parameters() if p.dtype == torch.float32}
    fp32_ours = {n for n, p in ours16.named_parameters() if p.dtype == torch.float32}
    assert fp32_ours == fp32_ref and "blocks.1.norm2.weight" in fp32_ours
    inp = dit_inputs(layout)
    inp = dict(
        inp,
        hidden_states=inp["hidden_states"].bfloat16(),
        encoder_hidden_states=inp["encoder_hidden_states"].bfloat16(),
    )
    with torch.no_grad():
        expected = ref16(**inp, return_dict=False)[0]
        got = ours16(**inp)
    assert got.dtype == torch.bfloat16
    err = rel_err(got, expected)
    print(f"wan bf16 parity ({layout}): rel err {err:.3g}")
    assert err <= BF16_REL_ERR


def test_other_shapes_and_random_per_token_timesteps(models):
    """Batch 1, another grid (2 x 8 x 4 latents: 16 tokens), 5 text tokens; for both layouts a
    random timestep per token as well as a ``[1]`` timestep broadcast to the batch."""
    ours, ref, layout = models
    cfg = DIT_LAYOUTS[layout]
    g = torch.Generator().manual_seed(21)
    x = torch.randn(1, cfg["in_channels"], 2, 8, 4, generator=g)
    ctx = torch.randn(1, 5, cfg["text_dim"], generator=g)
    for timestep in (torch.rand(1, 16, generator=g) * 1000, torch.tensor([321.0])):
        with torch.no_grad():
            expected = ref(x, timestep, ctx, return_dict=False)[0]
            got = ours(x, timestep, ctx)
        assert rel_err(got, expected) <= PARITY_REL_ERR, list(timestep.shape)


def test_constant_per_token_timestep_equals_one_per_item():
    """Text-to-video with TI2V-5B: diffusers' pipeline passes ``[B, S]`` filled with ``t``; the
    same model given ``[B]`` computes the same output with one embedding per item instead of
    one per token (measured 2.0e-7: the time-embedding GEMMs run on B*S rows instead of B, which
    the kernel blocks differently; not bitwise)."""
    ref = reference_dit("ti2v")
    ours = wan_from_diffusers_module(ref, tp_rank=0, tp_size=1)
    inp = dit_inputs("ti2v")
    s = inp["timestep"].shape[1]
    with torch.no_grad():
        per_token = ours(**dict(inp, timestep=torch.full((2, s), 640.0)))
        per_item = ours(**dict(inp, timestep=torch.full((2,), 640.0)))
    assert rel_err(per_item, per_token) <= PARITY_REL_ERR


def test_cross_attn_norm_off_matches_diffusers():
    ref = reference_dit("a14b", seed=4, cross_attn_norm=False, num_layers=1)
    ours = wan_from_diffusers_module(ref, tp_rank=0, tp_size=1)
    assert isinstance(ours.blocks[0].norm2, torch.nn.Identity)
    inp = dit_inputs("a14b", seed=5)
    with torch.no_grad():
        assert rel_err(ours(**inp), ref(**inp, return_dict=False)[0]) <= PARITY_REL_ERR


# ------------------------------------------------------------------------------ original names
_TO_ORIGINAL = [
    # diffusers -> original Wan-AI names (inverse of WAN_NAME_MAP, written out by hand)
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".to_out.0.", ".o."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    (".norm2.", ".norm3."),
    ("scale_shift_table", "modulation"),
]


def _original_name(name: str) -> str:
    if name.startswith("proj_out."):
        return "head.head." + name[len("proj_out.") :]
    if name == "scale_shift_table":
        return "head.modulation"
    for a, b in _TO_ORIGINAL:
        name = name.replace(a, b)
    return name


def test_original_checkpoint_names_load_and_match():
    """A state dict in the original Wan layout (``model.diffusion_model.`` wrapped, ComfyUI
    style) loads through WAN_NAME_MAP and gives the reference's output. The original names used
    here are checked against diffusers' own converter, which must map them back exactly."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    ref = reference_dit("a14b", seed=6)
    sd = ref.state_dict()
    original = {"model.diffusion_model." + _original_name(k): v for k, v in sd.items()}
    assert "model.diffusion_model.blocks.1.norm3.weight" in original
    assert "model.diffusion_model.blocks.0.self_attn.q.weight" in original
    assert set(convert_wan_transformer_to_diffusers(dict(original))) == set(sd)

    from sglang.multimodal_gen.models.loader import load_tensors_into

    ours = WanTransformer(WanArchConfig.from_dict(dict(ref.config)), tp_rank=0, tp_size=1)
    n = load_tensors_into(ours, (("<orig>", k, v) for k, v in original.items()), WAN_NAME_MAP)
    assert n == len(sd)
    inp = dit_inputs("a14b", seed=7)
    with torch.no_grad():
        assert rel_err(ours(**inp), ref(**inp, return_dict=False)[0]) <= PARITY_REL_ERR


# ------------------------------------------------------------------------------ structure, TP
def test_fused_module_names_and_shards(models):
    ours, _, layout = models
    blk = ours.blocks[1]
    assert blk.attn1.to_qkv.output_shard_ids == ("q", "k", "v")
    assert blk.attn2.to_kv.output_shard_ids == (0, 1)
    names = {n for n, _ in ours.named_parameters()}
    for n in (
        "blocks.1.attn1.to_qkv.weight",
        "blocks.1.attn1.to_out.0.bias",
        "blocks.1.attn2.to_q.weight",
        "blocks.1.attn2.to_kv.bias",
        "blocks.1.attn2.norm_k.weight",
        "blocks.1.ffn.net.0.proj.weight",
        "blocks.1.ffn.net.2.weight",
        "blocks.1.scale_shift_table",
        "scale_shift_table",
        "patch_embedding.weight",
        "condition_embedder.time_proj.weight",
    ):
        assert n in names, n
    assert isinstance(ours.patch_embedding, torch.nn.Conv3d)


@pytest.mark.parametrize("n", [2, 4])
def test_rank_holds_its_heads_of_every_split_layer(n):
    """Rank r of n holds heads [r*H/n, (r+1)*H/n) of q, k, v (self and cross), the matching
    columns of the output projections and the matching slice of the q/k norm weights; indices
    written out here."""
    cfg = WanArchConfig(**DIT_LAYOUTS["a14b"])
    d, f = cfg.inner_dim, cfg.ffn_dim
    g = torch.Generator().manual_seed(0)
    w_q, w_k, w_v = (torch.randn(d, d, generator=g) for _ in range(3))
    w_o, w_ff2 = torch.randn(d, d, generator=g), torch.randn(d, f, generator=g)
    w_norm = torch.randn(d, generator=g)
    for r in range(n):
        blk = WanTransformer(cfg, tp_rank=r, tp_size=n).blocks[0]
        rows = slice(r * d // n, (r + 1) * d // n)
        qkv = blk.attn1.to_qkv
        for sid, w in zip("qkv", (w_q, w_k, w_v)):
            qkv.weight_loader(qkv.weight, w, sid)
        assert torch.equal(qkv.weight, torch.cat([w_q[rows], w_k[rows], w_v[rows]]))
        kv = blk.attn2.to_kv
        kv.weight_loader(kv.weight, w_k, 0)
        kv.weight_loader(kv.weight, w_v, 1)
        assert torch.equal(kv.weight, torch.cat([w_k[rows], w_v[rows]]))
        out = blk.attn2.to_out[0]
        out.weight_loader(out.weight, w_o)
        assert torch.equal(out.weight, w_o[:, rows])
        ff2 = blk.ffn.net[2]
        ff2.weight_loader(ff2.weight, w_ff2)
        assert torch.equal(ff2.weight, w_ff2[:, r * f // n : (r + 1) * f // n])
        for norm in (blk.attn1.norm_q, blk.attn2.norm_k):
            norm.weight_loader(norm.weight, w_norm)
            assert torch.equal(norm.weight, w_norm[rows])


@pytest.mark.parametrize("n", [2, 4])
def test_rms_norm_across_heads_sums_squares_over_ranks(n):
    """The sharded q/k norm, with the all-reduce done by hand (the local sums of squares added),
    equals torch's RMSNorm over the full width; normalising each rank's heads on their own (what a
    per-rank RMSNorm would do under TP) is far off."""
    d, eps = 64, 1e-6
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, d, generator=g) * torch.linspace(0.2, 3.0, d)  # uneven per head
    w = 1 + 0.1 * torch.randn(d, generator=g)
    full = F.rms_norm(x, (d,), w, eps)
    norms = [RMSNormAcrossHeads(d, eps, tp_rank=r, tp_size=n) for r in range(n)]
    parts = [x[..., r * d // n : (r + 1) * d // n] for r in range(n)]
    for norm in norms:
        norm.weight_loader(norm.weight, w)
    total = sum(norm.local_sum_sq(p) for norm, p in zip(norms, parts))
    sharded = torch.cat([norm.normalize(p, total) for norm, p in zip(norms, parts)], dim=-1)
    assert rel_err(sharded, full) <= 1e-6  # measured 4.7e-8 (2 ranks), 9.4e-8 (4 ranks)
    per_rank = torch.cat(
        [F.rms_norm(p, (d // n,), norm.weight, eps) for norm, p in zip(norms, parts)], dim=-1
    )
    assert rel_err(per_rank, full) > 0.1  # measured 0.42 / 0.49


def test_tp_size_not_dividing_heads_or_ffn_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp_size=3"):
        WanTransformer(WanArchConfig(**DIT_LAYOUTS["a14b"]), tp_rank=0, tp_size=3)
    cfg = WanArchConfig(**dict(DIT_LAYOUTS["a14b"], ffn_dim=98))
    with pytest.raises(ValueError, match=r"ffn_dim=98 is not divisible by tp_size=4"):
        WanTransformer(cfg, tp_rank=0, tp_size=4)


def _rank_fn(rank, runs):
    """Every layout's TP model on this rank: ``[(output per input, local qkv rows), ...]``."""
    from sglang.multimodal_gen.models.loader import load_tensors_into

    results = []
    for config, state_dict, inputs in runs:
        model = WanTransformer(WanArchConfig.from_dict(config), dtype=torch.float32)
        load_tensors_into(model, (("<sd>", k, v) for k, v in state_dict.items()), WAN_NAME_MAP)
        with torch.no_grad():
            outs = [model(**inp) for inp in inputs]
        results.append((outs, model.blocks[0].attn1.to_qkv.weight.shape[0]))
    return results, get_tp_world_size()


@pytest.mark.slow
def test_tp2_and_tp4_equal_tp1():
    """Both layouts (a14b: one timestep per item; ti2v: per-token timesteps) under TP 2 and 4
    in real gloo process groups: heads, FFN and the q/k RMSNorm's sum of squares split/reduced
    over the ranks."""
    runs, expected = [], []
    for i, layout in enumerate(DIT_LAYOUTS):
        ref = reference_dit(layout, seed=10 + i)
        inputs = [dit_inputs(layout, seed=11 + i)]
        if layout == "ti2v":
            g = torch.Generator().manual_seed(12)
            inputs.append(dict(inputs[0], timestep=torch.rand(2, 18, generator=g) * 1000))
        tp1 = wan_from_diffusers_module(ref, tp_rank=0, tp_size=1)
        with torch.no_grad():
            outs1 = [tp1(**inp) for inp in inputs]
        runs.append((dict(ref.config), {k: v.clone() for k, v in ref.state_dict().items()}, inputs))
        expected.append((outs1, tp1.blocks[0].attn1.to_qkv.weight.shape[0]))
    for n in (2, 4):
        results = launch_processes(_rank_fn, n, args=(runs,), backend="gloo")
        for rank, (per_layout, world) in enumerate(results):
            assert world == n
            for layout, (outs, rows), (outs1, rows1) in zip(DIT_LAYOUTS, per_layout, expected):
                assert rows * n == rows1  # heads really are split
                for j, (out, out1) in enumerate(zip(outs, outs1)):
                    err = rel_err(out, out1)
                    print(f"wan TP {n} rank {rank} {layout} input {j}: rel err vs TP 1 {err:.3g}")
                    assert err <= TP_REL_ERR, f"{layout} tp {n} rank {rank} input {j}: {err}"


# ------------------------------------------------------------------------------ config, inputs
def test_config_from_dict_and_json(tmp_path):
    cfg = WanArchConfig.from_dict(
        {
            "_class_name": WAN_TRANSFORMER_CLASS,
            "_diffusers_version": "0.42.1",
            **DIT_LAYOUTS["ti2v"],
            "patch_size": [1, 2, 2],
            "foo": 1,
        }
    )
    assert cfg.patch_size == (1, 2, 2) and cfg.inner_dim == 48 and cfg.out_features == 48
    assert cfg.rope_dims == (4, 4, 4) and cfg.extra == {"foo": 1}
    default = WanArchConfig()  # Wan2.1 14B / Wan2.2 A14B expert
    assert (default.inner_dim, default.ffn_dim, default.num_layers) == (5120, 13824, 40)
    assert default.rope_dims == (44, 42, 42) and default.out_channels == 16
    ti2v = WanArchConfig(
        num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48
    )
    assert ti2v.inner_dim == 3072 and ti2v.out_features == 192
    assert WanArchConfig(in_channels=36, out_channels=None).out_channels == 36

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": WAN_TRANSFORMER_CLASS, **DIT_LAYOUTS["a14b"]}))
    assert WanArchConfig.from_json_file(path).inner_dim == 64
    path.write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(ValueError, match="not supported"):
        WanArchConfig.from_json_file(path)
    path.write_text(json.dumps({"_class_name": WAN_TRANSFORMER_CLASS, "image_dim": 1280}))
    with pytest.raises(ValueError, match=r"config.json: .*image_dim=1280.*not implemented"):
        WanArchConfig.from_json_file(path)
    with pytest.raises(FileNotFoundError):
        WanArchConfig.from_json_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="added_kv_proj_dim=5120"):
        WanArchConfig(added_kv_proj_dim=5120)
    with pytest.raises(ValueError, match="qk_norm='rms_norm'"):
        WanArchConfig(qk_norm="rms_norm")
    with pytest.raises(ValueError, match="patch_size"):
        WanArchConfig(patch_size=(2, 2))


def test_forward_rejects_bad_inputs(models):
    ours, _, layout = models
    inp = dit_inputs(layout)
    x = inp["hidden_states"]
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        ours(**dict(inp, hidden_states=x[..., :5]))
    with pytest.raises(ValueError, match=r"timestep must be \[2\] or \[2, 18\]"):
        ours(**dict(inp, timestep=torch.zeros(2, 17)))
    with pytest.raises(ValueError, match="encoder_hidden_states must be"):
        ours(**dict(inp, encoder_hidden_states=inp["encoder_hidden_states"][..., :-1]))
    with pytest.raises(ValueError, match="hidden_states must be"):
        ours(**dict(inp, hidden_states=x[:, :-1]))
