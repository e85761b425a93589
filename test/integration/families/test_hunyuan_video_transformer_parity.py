"""Our HunyuanVideo 1.0 DiT vs diffusers' HunyuanVideoTransformer3DModel on the same weights
(fp32 and bf16, CPU), Tencent-checkpoint names, tensor parallelism (TP 2) and sequence parallelism
(Ulysses 2; ring 2 in the extended tier) in real gloo processes against one process.

The reference is a tiny ``HunyuanVideoTransformer3DModel`` (``fixtures/tiny_hunyuan_video_dit``:
4 heads x 16, two dual-stream, two single-stream and two refiner blocks, patch (1, 2, 2), RoPE
axes 4 + 6 + 6) with every parameter perturbed by seeded noise, saved with ``save_pretrained``
and loaded by our loader from the directory. Inputs: batch 2, 18 video tokens, 7 text tokens of
which 7 and 4 are real (right padding), guidance 6.0 passed as 6000 (as the pipeline does).

Measured on this machine (torch 2.13 CPU), max |err| / max |ref|: fp32 3.2e-7 with padding,
3.2e-7 without, 2.6e-7 / 3.0e-7 with padding positions dropped (batch 1 / 2); not bitwise: our
replicated linears use the row-invariant CPU GEMM, which rounds the one-row conditioning GEMMs
differently. Tencent names: bitwise equal to the diffusers-layout load. TP 2 2.1e-7, Ulysses 2
3.2e-7, ring 2 2.5e-7 against one process. Thresholds: parity and parallel 5e-6 (15x and more
above the measured values). Nearby wrong cases land far outside: RoPE applied to the text tokens
too (2.2e-2), guidance given unscaled (6 instead of 6000, i.e. not embedded as the model
expects), the text padding ignored, the final layer's ``(shift, scale)`` rows loaded unswapped.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.tiny_hunyuan_video_dit import (
    HV_TXT,
    TINY_HV_DIT,
    hv_dit_inputs,
    hv_parallel_runs,
    hv_parallel_worst_err,
    hv_spec,
    reference_hv_dit,
)
from fixtures.tiny_models import rel_err
from sglang.multimodal_gen.configs.hunyuan_video import (
    HUNYUAN_VIDEO_TRANSFORMER_CLASS,
    HunyuanVideoArchConfig,
    hunyuan_video_tp_divisors,
)
from sglang.multimodal_gen.distributed import ParallelLayout
from sglang.multimodal_gen.models.dits.hunyuan_video import HunyuanVideoTransformer
from sglang.multimodal_gen.models.dits.hunyuan_video_names import HUNYUAN_VIDEO_NAME_MAP

PARITY_REL_ERR = 5e-6  # measured 3.2e-7 (with and without padding)
BF16_REL_ERR = 2**-6  # measured 7.1e-3 (see test_bf16_matches_diffusers)
PARALLEL_REL_ERR = 5e-6  # measured 2.1e-7 (TP 2), 3.2e-7 (Ulysses 2), 2.5e-7 (ring 2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from sglang.multimodal_gen.models.loader import load_denoiser

    ref = reference_hv_dit()
    path = tmp_path_factory.mktemp("hv_dit")
    ref.save_pretrained(path)
    ours = load_denoiser(str(path), hv_spec(), tp_rank=0, tp_size=1)
    return ours, ref


def test_transformer_matches_diffusers(models):
    ours, ref = models
    inp = hv_dit_inputs()
    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        got = ours(**inp)
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape == (2, 4, 3, 4, 6)
    assert got.dtype == torch.float32 and expected.abs().max() > 0.5  # a real signal
    err = rel_err(got, expected)
    print(f"hunyuan video parity: rel err {err:.3g}")
    assert err <= PARITY_REL_ERR

    # batch 1 with 2 padded tokens (dropped: no mask left), another timestep; a batch padded
    # in both items (5 and 3 real: the last 2 positions dropped, the mask kept)
    one = {k: v[:1] for k, v in hv_dit_inputs(seed=5, n_valid=(5,), t=31.0).items()}
    both = hv_dit_inputs(seed=6, n_valid=(5, 3))
    with torch.no_grad():
        for case in (one, both):
            assert rel_err(ours(**case), ref(**case, return_dict=False)[0]) <= PARITY_REL_ERR

    # nearby wrong cases are far outside the threshold
    with torch.no_grad():
        unscaled = ours(**dict(inp, guidance=inp["guidance"] / 1000))
        no_mask = ours(**dict(inp, encoder_attention_mask=None))
    assert rel_err(unscaled, expected) > 1e3 * PARITY_REL_ERR
    assert rel_err(no_mask, expected) > 1e3 * PARITY_REL_ERR


def test_bf16_matches_diffusers(models):
    """bf16 weights and inputs on both sides (diffusers keeps no module of this model in fp32):
    the same dtype flow. Not bitwise on the CPU: our token GEMMs run with the row-invariant
    padding (``layers/batch_invariant.py``), which rounds bf16 rows differently from the
    reference's GEMM of another row count (measured: the single-stream blocks bitwise, a
    dual-stream block 3e-3, the whole model 7.1e-3, about two bf16 ulps)."""
    from sglang.multimodal_gen.models.loader import denoiser_from_module

    _, ref = models
    ref16 = reference_hv_dit().to(torch.bfloat16)
    ours16 = denoiser_from_module(ref16, hv_spec(), tp_rank=0, tp_size=1)
    assert ours16.dtype == torch.bfloat16
    inp = hv_dit_inputs()
    for k in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        inp[k] = inp[k].bfloat16()
    with torch.no_grad():
        expected = ref16(**inp, return_dict=False)[0]
        got = ours16(**inp)
    assert got.dtype == torch.bfloat16
    err = rel_err(got, expected)
    print(f"hunyuan video bf16 parity: rel err {err:.3g}")
    assert err <= BF16_REL_ERR


def test_rope_on_text_tokens_is_outside_the_threshold(models, monkeypatch):
    """Every token rotated (the text tokens with the video tables repeated, as a model that
    rotated the whole joint sequence would) instead of the video tokens only."""
    import sglang.multimodal_gen.layers.mmdit as mmdit
    from sglang.multimodal_gen.layers.rotary import apply_rope_real

    ours, ref = models
    inp = hv_dit_inputs()

    def rope_everything(x, rope):
        cos, sin = rope
        reps = -(-x.shape[1] // cos.shape[0])
        n = x.shape[1]
        return apply_rope_real(x, cos.repeat(reps, 1)[:n], sin.repeat(reps, 1)[:n])

    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        monkeypatch.setattr(mmdit, "apply_rope_prefix", rope_everything)
        wrong = ours(**inp)
    err = rel_err(wrong, expected)
    print(f"hunyuan video: RoPE on text tokens rel err {err:.3g}")
    assert err > 1e3 * PARITY_REL_ERR


def test_padded_text_tokens_do_not_matter(models):
    """Changing the features of padded text tokens changes neither output (the reference's
    masking, which ours follows)."""
    ours, ref = models
    inp = hv_dit_inputs()
    ctx = inp["encoder_hidden_states"].clone()
    ctx[1, 4:] = 100.0 * torch.randn(HV_TXT - 4, ctx.shape[-1])
    with torch.no_grad():
        a = ours(**inp)
        b = ours(**dict(inp, encoder_hidden_states=ctx))
        r = ref(**dict(inp, encoder_hidden_states=ctx), return_dict=False)[0]
    assert rel_err(b, a) <= PARITY_REL_ERR and rel_err(b, r) <= PARITY_REL_ERR


def test_inputs_checked(models):
    ours, _ = models
    inp = hv_dit_inputs()
    with pytest.raises(ValueError, match="guidance"):
        ours(**dict(inp, guidance=None))
    with pytest.raises(ValueError, match="not divisible by the patch"):
        ours(**dict(inp, hidden_states=inp["hidden_states"][..., :5]))
    with pytest.raises(ValueError, match="encoder_attention_mask"):
        ours(**dict(inp, encoder_attention_mask=inp["encoder_attention_mask"][:, :3]))
    with pytest.raises(ValueError, match="hidden_states"):
        ours(**dict(inp, hidden_states=inp["hidden_states"][:, :3]))


def test_module_names_and_tp_refusal(models):
    ours, _ = models
    assert ours.transformer_blocks[0].attn.to_qkv.output_shard_ids == ("q", "k", "v")
    assert ours.single_transformer_blocks[1].to_qkv_mlp.output_shard_ids == (0, 1, 2, 3)
    refiner = ours.context_embedder.token_refiner.refiner_blocks[1]
    assert refiner.attn.to_qkv.output_shard_ids == ("q", "k", "v")
    names = {n for n, _ in ours.named_parameters()}
    for n in (
        "x_embedder.proj.weight",
        "context_embedder.token_refiner.refiner_blocks.1.ff.net.0.proj.weight",
        "time_text_embed.guidance_embedder.linear_2.bias",
        "single_transformer_blocks.1.attn.norm_q.weight",
        "transformer_blocks.0.attn.norm_added_k.weight",
    ):
        assert n in names, n
    cfg = HunyuanVideoArchConfig(**TINY_HV_DIT)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp_size=3"):
        HunyuanVideoTransformer(cfg, tp_rank=0, tp_size=3)


# ------------------------------------------------------------------------------ Tencent names
def _tencent_state_dict(sd: dict) -> dict:
    """The diffusers state dict in Tencent's layout (``hyvideo/modules/models.py``; the inverse
    of diffusers' ``convert_hunyuan_video_transformer_to_diffusers``), ComfyUI-wrapped."""
    out, sd = {}, dict(sd)
    n_double = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    n_single = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_"))
    n_ref = 1 + max(
        int(k.split(".")[3]) for k in sd if k.startswith("context_embedder.token_refiner.")
    )
    for leaf in ("weight", "bias"):
        for i in range(n_double):
            p = f"transformer_blocks.{i}.attn."
            out[f"double_blocks.{i}.img_attn_qkv.{leaf}"] = torch.cat(
                [sd.pop(f"{p}to_{x}.{leaf}") for x in "qkv"]
            )
            out[f"double_blocks.{i}.txt_attn_qkv.{leaf}"] = torch.cat(
                [sd.pop(f"{p}add_{x}_proj.{leaf}") for x in "qkv"]
            )
        for i in range(n_single):
            p = f"single_transformer_blocks.{i}."
            out[f"single_blocks.{i}.linear1.{leaf}"] = torch.cat(
                [sd.pop(f"{p}attn.to_{x}.{leaf}") for x in "qkv"] + [sd.pop(f"{p}proj_mlp.{leaf}")]
            )
        for i in range(n_ref):
            p = f"context_embedder.token_refiner.refiner_blocks.{i}."
            out[f"txt_in.individual_token_refiner.blocks.{i}.self_attn_qkv.{leaf}"] = torch.cat(
                [sd.pop(f"{p}attn.to_{x}.{leaf}") for x in "qkv"]
            )
        scale, shift = sd.pop(f"norm_out.linear.{leaf}").chunk(2)
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = torch.cat([shift, scale])
    renames = [  # applied in order, first match wins
        ("context_embedder.token_refiner.refiner_blocks", "txt_in.individual_token_refiner.blocks"),
        ("context_embedder.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.mlp.0"),
        ("context_embedder.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.mlp.2"),
        ("context_embedder.time_text_embed.text_embedder", "txt_in.c_embedder"),
        ("context_embedder.proj_in", "txt_in.input_embedder"),
        ("time_text_embed.timestep_embedder.linear_1", "time_in.mlp.0"),
        ("time_text_embed.timestep_embedder.linear_2", "time_in.mlp.2"),
        ("time_text_embed.guidance_embedder.linear_1", "guidance_in.mlp.0"),
        ("time_text_embed.guidance_embedder.linear_2", "guidance_in.mlp.2"),
        ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
        ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
        ("x_embedder", "img_in"),
        ("proj_out", "final_layer.linear"),
        ("single_transformer_blocks", "single_blocks"),
        ("transformer_blocks", "double_blocks"),
    ]
    inner = {
        "double_blocks": [
            ("attn.to_out.0", "img_attn_proj"),
            ("attn.to_add_out", "txt_attn_proj"),
            ("attn.norm_q", "img_attn_q_norm"),
            ("attn.norm_k", "img_attn_k_norm"),
            ("attn.norm_added_q", "txt_attn_q_norm"),
            ("attn.norm_added_k", "txt_attn_k_norm"),
            ("ff.net.0.proj", "img_mlp.fc1"),
            ("ff.net.2", "img_mlp.fc2"),
            ("ff_context.net.0.proj", "txt_mlp.fc1"),
            ("ff_context.net.2", "txt_mlp.fc2"),
            ("norm1.linear", "img_mod.linear"),
            ("norm1_context.linear", "txt_mod.linear"),
        ],
        "single_blocks": [
            ("proj_out", "linear2"),
            ("norm.linear", "modulation.linear"),
            ("attn.norm_q", "q_norm"),
            ("attn.norm_k", "k_norm"),
        ],
        "txt_in.individual_token_refiner.blocks": [
            ("attn.to_out.0", "self_attn_proj"),
            ("ff.net.0.proj", "mlp.fc1"),
            ("ff.net.2", "mlp.fc2"),
            ("norm_out.linear", "adaLN_modulation.1"),
        ],
    }
    for k, v in sd.items():
        for a, b in renames:
            if k.startswith(a + "."):
                k = b + k[len(a) :]
                break
        for blocks, rules in inner.items():
            if k.startswith(blocks + "."):
                idx, rest = k[len(blocks) + 1 :].split(".", 1)
                for a, b in rules:
                    if rest.startswith(a + "."):
                        rest = b + rest[len(a) :]
                        break
                k = f"{blocks}.{idx}.{rest}"
        out[k] = v
    return {"model.diffusion_model." + k: v for k, v in out.items()}


def test_tencent_names_load_the_same_model(models):
    from sglang.multimodal_gen.models.loader import load_tensors_into

    ours_d, ref = models
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    tencent = _tencent_state_dict(sd)
    for name in (
        "double_blocks.1.img_attn_qkv.weight",
        "double_blocks.0.txt_mlp.fc2.bias",
        "single_blocks.1.linear1.weight",
        "single_blocks.0.q_norm.weight",
        "txt_in.individual_token_refiner.blocks.1.self_attn_qkv.weight",
        "txt_in.individual_token_refiner.blocks.0.adaLN_modulation.1.bias",
        "txt_in.t_embedder.mlp.2.weight",
        "txt_in.c_embedder.linear_1.weight",
        "txt_in.input_embedder.weight",
        "time_in.mlp.0.weight",
        "vector_in.in_layer.weight",
        "guidance_in.mlp.2.bias",
        "img_in.proj.weight",
        "final_layer.linear.weight",
        "final_layer.adaLN_modulation.1.weight",
    ):
        assert "model.diffusion_model." + name in tencent, name
    assert tencent["model.diffusion_model.img_in.proj.weight"].ndim == 5  # the Conv3d weight
    cfg = HunyuanVideoArchConfig.from_dict(dict(ref.config))
    ours = HunyuanVideoTransformer(cfg, tp_rank=0, tp_size=1)
    n = load_tensors_into(
        ours, (("<tencent>", k, v) for k, v in tencent.items()), HUNYUAN_VIDEO_NAME_MAP
    )
    assert n == len(tencent)
    inp = hv_dit_inputs(seed=8)
    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        got = ours(**inp)
        assert torch.equal(got, ours_d(**inp))  # the same parameters as the diffusers load
        assert rel_err(got, expected) <= PARITY_REL_ERR
        # the (shift, scale) rows really need the swap: loaded as they are, far off
        w = ours.norm_out.linear
        for p, leaf in ((w.weight, "weight"), (w.bias, "bias")):
            p.copy_(tencent[f"model.diffusion_model.final_layer.adaLN_modulation.1.{leaf}"])
        assert rel_err(ours(**inp), expected) > 1e3 * PARITY_REL_ERR


# ------------------------------------------------------------------------------ TP and SP
@pytest.fixture(scope="module")
def parallel_runs(models):
    ours, ref = models
    return hv_parallel_runs(
        "1.0", ours, ref, [hv_dit_inputs(seed=9), hv_dit_inputs(seed=10, n_valid=(3, 7))]
    )


def _parallel_case(parallel_runs, layout: ParallelLayout | None, label: str):
    worst = hv_parallel_worst_err(parallel_runs, layout)
    print(f"hunyuan video {label}: max rel err vs one process {worst:.3g}")
    assert worst <= PARALLEL_REL_ERR


@pytest.mark.slow
def test_tp2_equals_tp1(parallel_runs):
    """Heads of the blocks and of the token refiner and every FFN / MLP width split over 2
    ranks; two inputs with different padding."""
    _parallel_case(parallel_runs, None, "TP 2")


@pytest.mark.slow
def test_ulysses2_equals_one_process(parallel_runs):
    """The 18 video tokens and the 7 text tokens (uneven chunks) split over 2 SP ranks, the key
    mask gathered with its keys."""
    _parallel_case(parallel_runs, ParallelLayout(ulysses_degree=2), "Ulysses 2")


@pytest.mark.slow
def test_ring2_equals_one_process(parallel_runs):
    """Ring attention over 2 ranks: key/value blocks and their mask passed around."""
    _parallel_case(parallel_runs, ParallelLayout(ring_degree=2), "ring 2")


# ------------------------------------------------------------------------------ config
def test_config_defaults_json_and_errors(tmp_path):
    default = HunyuanVideoArchConfig()  # the released 13B shapes
    assert (default.inner_dim, default.mlp_hidden, default.num_layers) == (3072, 12288, 20)
    assert (default.num_single_layers, default.out_features, default.guidance_embeds) == (
        40,
        64,
        True,
    )
    assert hunyuan_video_tp_divisors(default) == {
        "num_attention_heads": 24,
        "mlp_hidden": 12288,
        "refiner_mlp_hidden": 12288,
    }
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "_class_name": HUNYUAN_VIDEO_TRANSFORMER_CLASS,
                **TINY_HV_DIT,
                "rope_axes_dim": [4, 6, 6],
                "out_channels": None,
                "foo": 1,
            }
        )
    )
    cfg = HunyuanVideoArchConfig.from_json_file(path)
    assert cfg.rope_axes_dim == (4, 6, 6) and cfg.out_channels == 4 and cfg.extra == {"foo": 1}
    assert HunyuanVideoArchConfig(image_condition_type="latent_concat", in_channels=33).in_channels
    for bad, field in (
        (dict(qk_norm="layer_norm"), "qk_norm"),
        (dict(image_condition_type="token_replace"), "image_condition_type"),
        (dict(rope_axes_dim=(4, 6, 8)), r"sum\(rope_axes_dim\)"),
        (dict(rope_axes_dim=(5, 5, 6)), "rope_axes_dim"),
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(num_single_layers=-1), "num_single_layers"),
        (dict(rope_theta=0), "rope_theta"),
    ):
        with pytest.raises(ValueError, match=field):
            HunyuanVideoArchConfig(**{**TINY_HV_DIT, **bad})
    path.write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(ValueError, match="not supported"):
        HunyuanVideoArchConfig.from_json_file(path)
