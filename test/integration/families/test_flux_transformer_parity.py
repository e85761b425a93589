"""Our Flux.1 DiT vs diffusers' FluxTransformer2DModel on the same weights (fp32, CPU), and
tensor parallelism (TP 2 and 4, real gloo processes) against TP 1.

The reference is a tiny ``FluxTransformer2DModel`` (D = 4 heads x 16 = 64, MLP 256, RoPE axes
4 + 6 + 6) with every parameter perturbed by seeded noise, so no weight sits at a value where it
could be ignored (the q/k RMSNorm weights would otherwise all be 1).

Measured on this machine (torch 2.13 CPU): ours vs diffusers max |err| / max |ref| = 0.0 exactly
(bitwise equal) with and without guidance, in fp32 and in bf16; TP 2 / TP 4 vs TP 1: 2.4e-7 /
2.1e-7 (the all-reduce re-orders the additions). Thresholds: parity 1e-6 relative (10x below the
1e-5 acceptance bound; nonzero because GEMM kernels on other CPUs may block the fused projections
differently), TP 2e-6 (about 10x the measured value). A timestep off by 0.01 gives 0.14, guidance
3.6 instead of 3.5 gives 0.25: far outside.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.tiny_flux import TINY_DIT, dit_inputs, reference_dit, with_guidance
from fixtures.tiny_models import rel_err
from sglang.multimodal_gen.configs.flux import FLUX_TRANSFORMER_CLASS, FluxArchConfig
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.models.dits.flux import FluxTransformer, flux_from_diffusers_module
from sglang.multimodal_gen.models.dits.flux_names import FLUX_NAME_MAP

PARITY_REL_ERR = 1e-6  # measured 0.0 (bitwise equal)
TP_REL_ERR = 2e-6  # measured 2.4e-7 (TP 2), 2.1e-7 (TP 4)
BF16_REL_ERR = 2**-8  # measured 0.0; one bf16 ulp of max |ref| as the margin


@pytest.fixture(scope="module", params=[False, True], ids=["schnell-like", "guidance"])
def models(request):
    ref = reference_dit(request.param)
    ours = flux_from_diffusers_module(ref, tp_rank=0, tp_size=1)
    return ours, ref, request.param


def test_transformer_matches_diffusers(models):
    ours, ref, ge = models
    inp = with_guidance(dit_inputs(), ge)
    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        got = ours(**inp)
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape == (2, 15, 16)
    assert expected.abs().max() > 0.5  # a real signal
    err = rel_err(got, expected)
    print(f"flux parity (guidance_embeds={ge}): rel err {err:.3g}")
    assert err <= PARITY_REL_ERR

    # the threshold discriminates: a nearby wrong timestep / guidance is far outside it
    with torch.no_grad():
        t_off = ours(**dict(inp, timestep=inp["timestep"] + torch.tensor([0.01, 0.0])))
        assert rel_err(t_off, expected) > 100 * PARITY_REL_ERR
        if ge:
            g_off = ours(**with_guidance(dit_inputs(), ge, value=3.6))
            assert rel_err(g_off, expected) > 100 * PARITY_REL_ERR


def test_bf16_matches_diffusers(models):
    """Same dtype flow as the reference in bf16 (fp32 RoPE tables, torch RMSNorm, sinusoid cast
    to the pooled dtype)."""
    _, ref, ge = models
    ref16 = reference_dit(ge).to(torch.bfloat16)
    ours16 = flux_from_diffusers_module(ref16)
    assert ours16.dtype == torch.bfloat16
    inp = with_guidance(dit_inputs(), ge)
    inp = {
        k: v.to(torch.bfloat16) if k not in ("img_ids", "txt_ids") and v is not None else v
        for k, v in inp.items()
    }
    with torch.no_grad():
        expected = ref16(**inp, return_dict=False)[0]
        got = ours16(**inp)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, expected) <= BF16_REL_ERR


def test_batch_one_non_square_and_3d_ids(models):
    """Another shape (1 item, 4x2 grid, 5 text tokens, non-zero text ids); ``[B, S, 3]`` ids are
    accepted like diffusers (first item used)."""
    ours, ref, ge = models
    inp = with_guidance(dit_inputs(batch=1, grid=(4, 2), n_txt=5, seed=8), ge, 2.0)
    inp["txt_ids"] = torch.arange(15.0).reshape(5, 3) % 4
    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        got = ours(**dict(inp, img_ids=inp["img_ids"][None], txt_ids=inp["txt_ids"][None]))
    assert rel_err(got, expected) <= PARITY_REL_ERR


def test_guidance_argument_checked(models):
    ours, _, ge = models
    inp = with_guidance(dit_inputs(), not ge)
    with pytest.raises(ValueError, match="guidance"):
        ours(**inp)


def test_fused_module_names_and_shards(models):
    ours, _, _ = models
    blk = ours.transformer_blocks[0]
    assert blk.attn.to_qkv.output_shard_ids == ("q", "k", "v")
    assert blk.attn.to_added_qkv.output_shard_ids == ("q", "k", "v")
    single = ours.single_transformer_blocks[1]
    assert single.to_qkv_mlp.output_shard_ids == (0, 1, 2, 3)
    assert single.proj_out.input_size == 64 + 256
    names = {n for n, _ in ours.named_parameters()}
    assert "single_transformer_blocks.1.attn.norm_q.weight" in names
    assert "transformer_blocks.0.ff_context.net.2.bias" in names


# ------------------------------------------------------------------------------ single-block proj_out
@pytest.mark.parametrize("n", [1, 2, 4])
def test_single_block_proj_out_holds_attn_and_mlp_columns_of_its_rank(n):
    """Rank r of n holds the columns ``[attn cols of r | mlp cols of r]`` of the full
    ``proj_out`` weight, and rows ``[q_r | k_r | v_r | mlp_r]`` of the fused input projection;
    indices computed here by hand."""
    cfg = FluxArchConfig(**TINY_DIT)
    d, m = 64, 256
    g = torch.Generator().manual_seed(0)
    w_out = torch.randn(d, d + m, generator=g)
    b_out = torch.randn(d, generator=g)
    w_in = torch.randn(3 * d + m, d, generator=g)
    for r in range(n):
        block = FluxTransformer(cfg, tp_rank=r, tp_size=n).single_transformer_blocks[0]
        po = block.proj_out
        po.weight_loader(po.weight, w_out)
        po.weight_loader(po.bias, b_out)
        a, k = d // n, m // n
        cols = list(range(r * a, (r + 1) * a)) + list(range(d + r * k, d + (r + 1) * k))
        assert po.weight.shape == (d, a + k)
        assert torch.equal(po.weight, w_out[:, cols])
        assert torch.equal(po.bias, b_out)  # added on rank 0 only, in the forward
        fused = block.to_qkv_mlp
        fused.weight_loader(fused.weight, w_in)
        rows = [i for s in range(3) for i in range(s * d + r * a, s * d + (r + 1) * a)]
        rows += list(range(3 * d + r * k, 3 * d + (r + 1) * k))
        assert torch.equal(fused.weight, w_in[rows])


def test_tp_size_not_dividing_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp_size=3"):
        FluxTransformer(FluxArchConfig(**TINY_DIT), tp_rank=0, tp_size=3)


# ------------------------------------------------------------------------------ TP (gloo)
def _rank_fn(rank, config, state_dict, inputs):
    from sglang.multimodal_gen.models.loader import load_tensors_into

    cfg = FluxArchConfig.from_dict(config)
    model = FluxTransformer(cfg, dtype=torch.float32)
    load_tensors_into(model, (("<sd>", k, v) for k, v in state_dict.items()), FLUX_NAME_MAP)
    with torch.no_grad():
        out = model(**inputs)
    rows = model.transformer_blocks[0].attn.to_qkv.weight.shape[0]
    return out, rows, get_tp_world_size()


@pytest.mark.slow
def test_tp2_and_tp4_equal_tp1():
    ref = reference_dit(True, seed=5)
    config = dict(ref.config)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    inp = with_guidance(dit_inputs(seed=11), True, 4.0)
    tp1 = flux_from_diffusers_module(ref, tp_rank=0, tp_size=1)
    with torch.no_grad():
        out1 = tp1(**inp)
    rows1 = tp1.transformer_blocks[0].attn.to_qkv.weight.shape[0]
    for n in (2, 4):
        results = launch_processes(_rank_fn, n, args=(config, state, inp), backend="gloo")
        for rank, (out, rows, world) in enumerate(results):
            assert world == n and rows * n == rows1  # heads really are split
            err = rel_err(out, out1)
            print(f"flux TP {n} rank {rank}: rel err vs TP 1 {err:.3g}")
            assert err <= TP_REL_ERR, f"tp {n} rank {rank}: rel err {err}"


# ------------------------------------------------------------------------------ config
def test_config_from_dict_and_json(tmp_path):
    cfg = FluxArchConfig.from_dict(
        {
            "_class_name": FLUX_TRANSFORMER_CLASS,
            "_diffusers_version": "0.42.1",
            **TINY_DIT,
            "foo": 1,
        }
    )
    assert cfg.out_channels == 16 and cfg.inner_dim == 64 and cfg.mlp_hidden == 256
    assert cfg.extra == {"foo": 1}
    assert cfg.out_features == 16
    default = FluxArchConfig()
    assert (default.inner_dim, default.mlp_hidden, default.out_channels) == (3072, 12288, 64)
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"_class_name": FLUX_TRANSFORMER_CLASS, **TINY_DIT, "out_channels": 8})
    )
    assert FluxArchConfig.from_json_file(path).out_channels == 8
    path.write_text(json.dumps({"_class_name": "ZImageTransformer2DModel"}))
    with pytest.raises(ValueError, match="not supported"):
        FluxArchConfig.from_json_file(path)
    with pytest.raises(ValueError, match=r"sum\(axes_dims_rope\)=18"):
        FluxArchConfig(**dict(TINY_DIT, axes_dims_rope=(6, 6, 6)))
    with pytest.raises(FileNotFoundError):
        FluxArchConfig.from_json_file(tmp_path / "missing.json")
