"""Our HunyuanVideo 1.5 DiT vs diffusers' HunyuanVideo15Transformer3DModel on the same weights
(fp32 and bf16, CPU), Tencent-checkpoint names, tensor parallelism (TP 2) and sequence
parallelism (Ulysses 2; ring 2 in the extended tier) in real gloo processes against one process.

The reference is a tiny ``HunyuanVideo15Transformer3DModel`` (4 heads x 16, two dual-stream
blocks, two refiner blocks, patch (1, 2, 2), 9 input channels, RoPE axes 4 + 6 + 6) with every
parameter perturbed by seeded noise, saved with ``save_pretrained`` and loaded by our loader from
the directory. Inputs: batch 2 with different Qwen (7 tokens, 5 and 3 real) and ByT5 (5 tokens, 2
and 1 real) padding; text-to-video (``image_embeds`` zeros, as the pipelines pass them) and
image-to-video (random SigLIP features).

Measured on this machine (torch 2.13 CPU), max |err| / max |ref|: fp32 t2v 6.9e-7, i2v 5.4e-7
(not bitwise: we drop the keys that are padding in every item, so the softmax sums fewer exact
zeros in another order), MeanFlow (``timestep_r``) 5.8e-7, bf16 against ``from_pretrained(
torch_dtype=bfloat16)`` 4.5e-3 (about one bf16 ulp); Tencent names 4.4e-7; TP 2 3.5e-7,
Ulysses 2 3.1e-7, ring 2 3.1e-7 against one process. Thresholds: parity and parallel 5e-6
(about 10x the measured values), bf16 2**-6. A nearby wrong case lands far outside: timestep
505 instead of 500 gives 0.73, the i2v request computed as t2v 0.10, a MeanFlow model without
its ``timestep_r`` 0.82, the final layer's ``(shift, scale)`` rows loaded unswapped 0.88.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.tiny_hunyuan_video_dit import hv_parallel_runs, hv_parallel_worst_err
from fixtures.tiny_models import rel_err
from sglang.multimodal_gen.configs.hunyuan_video import hunyuan_video_tp_divisors
from sglang.multimodal_gen.configs.hunyuan_video15 import (
    HUNYUAN_VIDEO15_TRANSFORMER_CLASS,
    HunyuanVideo15ArchConfig,
)
from sglang.multimodal_gen.distributed import ParallelLayout
from sglang.multimodal_gen.models.dits.hunyuan_video15 import HunyuanVideo15Transformer
from sglang.multimodal_gen.models.dits.hunyuan_video15_names import HUNYUAN_VIDEO15_NAME_MAP
from sglang.multimodal_gen.models.registry import DenoiserSpec

PARITY_REL_ERR = 5e-6  # measured 6.9e-7 (t2v), 5.4e-7 (i2v), 5.8e-7 (MeanFlow)
PARALLEL_REL_ERR = 5e-6  # measured 3.5e-7 (TP 2), 3.1e-7 (Ulysses 2), 3.1e-7 (ring 2)
BF16_REL_ERR = 2**-6  # measured 4.5e-3

TINY = dict(
    in_channels=9,
    out_channels=4,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=2,
    mlp_ratio=2.0,
    patch_size=2,
    patch_size_t=1,
    text_embed_dim=24,
    text_embed_2_dim=20,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
)
VIDEO = (3, 4, 6)  # latent (F, H, W): 3 x 2 x 3 = 18 video tokens

SPEC = DenoiserSpec(
    component="transformer",
    diffusers_classes=(HUNYUAN_VIDEO15_TRANSFORMER_CLASS,),
    config_class="sglang.multimodal_gen.configs.hunyuan_video15:HunyuanVideo15ArchConfig",
    model_class="sglang.multimodal_gen.models.dits.hunyuan_video15:HunyuanVideo15Transformer",
    name_map="sglang.multimodal_gen.models.dits.hunyuan_video15_names:HUNYUAN_VIDEO15_NAME_MAP",
)


def reference_dit(seed: int = 0, **overrides):
    """diffusers' model at the tiny shapes, every parameter perturbed (seeded)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    ref = HunyuanVideo15Transformer3DModel(**{**TINY, **overrides}).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return ref


def dit_inputs(i2v: bool, seed: int = 3, t: float = 500.0) -> dict:
    """Batch 2 with different padding per item; ``image_embeds`` zeros (t2v) or random (i2v)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, 5:], mask[1, 3:] = 0, 0
    mask_2 = torch.ones(2, 5, dtype=torch.long)
    mask_2[0, 2:], mask_2[1, 1:] = 0, 0
    image = torch.randn(2, 3, 12, generator=g) if i2v else torch.zeros(2, 3, 12)
    return dict(
        hidden_states=torch.randn(2, TINY["in_channels"], *VIDEO, generator=g),
        timestep=torch.tensor([t, t + 200.0]),
        encoder_hidden_states=torch.randn(2, 7, 24, generator=g),
        encoder_attention_mask=mask,
        encoder_hidden_states_2=torch.randn(2, 5, 20, generator=g),
        encoder_attention_mask_2=mask_2,
        image_embeds=image,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(ours loaded from the reference's save_pretrained directory, the reference)."""
    from sglang.multimodal_gen.models.loader import load_denoiser

    ref = reference_dit()
    path = tmp_path_factory.mktemp("hv15") / "transformer"
    ref.save_pretrained(path)
    ours = load_denoiser(str(path), SPEC, tp_rank=0, tp_size=1)
    return ours, ref, path


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
def test_transformer_matches_diffusers(models, i2v):
    ours, ref, _ = models
    inp = dit_inputs(i2v)
    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        got = ours(**inp)
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape == (2, 4, *VIDEO)
    assert expected.abs().max() > 0.5  # a real signal
    err = rel_err(got, expected)
    print(f"hv15 parity ({'i2v' if i2v else 't2v'}): rel err {err:.3g}")
    assert err <= PARITY_REL_ERR

    with torch.no_grad():  # the threshold discriminates: a nearby wrong case is far outside
        off = ours(**dit_inputs(i2v, t=505.0))
        assert rel_err(off, expected) > 1000 * PARITY_REL_ERR  # measured 0.73
        if i2v:  # the image tokens really take part
            as_t2v = ours(**dict(inp, image_embeds=torch.zeros_like(inp["image_embeds"])))
            assert rel_err(as_t2v, expected) > 1000 * PARITY_REL_ERR  # measured 0.10


def test_meanflow_timestep_r_matches_diffusers():
    ref = reference_dit(seed=5, use_meanflow=True, num_layers=1)
    from sglang.multimodal_gen.models.loader import denoiser_from_module

    ours = denoiser_from_module(ref, SPEC, tp_rank=0, tp_size=1)
    inp = dict(dit_inputs(False, seed=6), timestep_r=torch.tensor([300.0, 100.0]))
    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        got = ours(**inp)
        without_r = ours(**dict(inp, timestep_r=None))
    assert rel_err(got, expected) <= PARITY_REL_ERR
    assert rel_err(without_r, expected) > 1000 * PARITY_REL_ERR


def test_bf16_matches_diffusers_from_pretrained(models):
    from diffusers import HunyuanVideo15Transformer3DModel
    from sglang.multimodal_gen.models.loader import load_denoiser

    _, _, path = models
    ref16 = HunyuanVideo15Transformer3DModel.from_pretrained(path, torch_dtype=torch.bfloat16)
    ours16 = load_denoiser(str(path), SPEC, dtype=torch.bfloat16, tp_rank=0, tp_size=1)
    inp = dit_inputs(True)
    inp = {k: v.bfloat16() if v.is_floating_point() else v for k, v in inp.items()}
    with torch.no_grad():
        expected = ref16.eval()(**inp, return_dict=False)[0]
        got = ours16(**inp)
    assert got.dtype == torch.bfloat16
    err = rel_err(got, expected)
    print(f"hv15 bf16 parity: rel err {err:.3g}")
    assert err <= BF16_REL_ERR


def test_batch_item_equals_the_item_alone(models):
    """An item's output does not depend on the other items (their padding, their task): the
    i2v item of a mixed t2v + i2v batch equals the item run alone."""
    ours, _, _ = models
    t2v, i2v = dit_inputs(False), dit_inputs(True)
    mixed = dict(t2v, image_embeds=torch.stack([t2v["image_embeds"][0], i2v["image_embeds"][1]]))
    alone = {k: v[1:] for k, v in mixed.items()}
    with torch.no_grad():
        both, one = ours(**mixed), ours(**alone)
    assert rel_err(both[1:], one) <= PARITY_REL_ERR


# ------------------------------------------------------------------------------ Tencent names
def _tencent_state_dict(sd: dict) -> dict:
    """The reference's diffusers state dict in the original Tencent layout (the inverse of
    diffusers' ``convert_hyvideo15_transformer_to_diffusers``, written out by hand): fused refiner
    q/k/v, (shift, scale) final-layer rows, ComfyUI's ``model.diffusion_model.`` wrapper."""
    top = {
        "time_embed.timestep_embedder.linear_1": "time_in.mlp.0",
        "time_embed.timestep_embedder.linear_2": "time_in.mlp.2",
        "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
        "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
        "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
        "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
        "context_embedder.proj_in": "txt_in.input_embedder",
        "context_embedder_2.norm": "byt5_in.layernorm",
        "context_embedder_2.linear_1": "byt5_in.fc1",
        "context_embedder_2.linear_2": "byt5_in.fc2",
        "context_embedder_2.linear_3": "byt5_in.fc3",
        "image_embedder.norm_in": "vision_in.proj.0",
        "image_embedder.linear_1": "vision_in.proj.1",
        "image_embedder.linear_2": "vision_in.proj.3",
        "image_embedder.norm_out": "vision_in.proj.4",
        "x_embedder.proj": "img_in.proj",
        "cond_type_embed": "cond_type_embedding",
        "norm_out.linear": "final_layer.adaLN_modulation.1",
        "proj_out": "final_layer.linear",
    }
    block = {
        "norm1.linear": "img_mod.linear",
        "norm1_context.linear": "txt_mod.linear",
        "attn.to_q": "img_attn_q",
        "attn.to_k": "img_attn_k",
        "attn.to_v": "img_attn_v",
        "attn.norm_q": "img_attn_q_norm",
        "attn.norm_k": "img_attn_k_norm",
        "attn.to_out.0": "img_attn_proj",
        "attn.add_q_proj": "txt_attn_q",
        "attn.add_k_proj": "txt_attn_k",
        "attn.add_v_proj": "txt_attn_v",
        "attn.norm_added_q": "txt_attn_q_norm",
        "attn.norm_added_k": "txt_attn_k_norm",
        "attn.to_add_out": "txt_attn_proj",
        "ff.net.0.proj": "img_mlp.fc1",
        "ff.net.2": "img_mlp.fc2",
        "ff_context.net.0.proj": "txt_mlp.fc1",
        "ff_context.net.2": "txt_mlp.fc2",
    }
    refiner = {
        "norm1": "norm1",
        "norm2": "norm2",
        "attn.to_out.0": "self_attn_proj",
        "ff.net.0.proj": "mlp.fc1",
        "ff.net.2": "mlp.fc2",
        "norm_out.linear": "adaLN_modulation.1",
    }
    out = {}
    rb = "context_embedder.token_refiner.refiner_blocks."
    for key, value in sd.items():
        module, _, leaf = key.rpartition(".")
        if module in top:
            new = f"{top[module]}.{leaf}"
            if module == "norm_out.linear":
                scale, shift = value.chunk(2)
                value = torch.cat([shift, scale])
        elif module.startswith("transformer_blocks."):
            _, i, rest = module.split(".", 2)
            new = f"double_blocks.{i}.{block[rest]}.{leaf}"
        elif module.startswith(rb):
            i, rest = module[len(rb) :].split(".", 1)
            base = f"txt_in.individual_token_refiner.blocks.{i}"
            if rest in ("attn.to_q", "attn.to_k", "attn.to_v"):
                if rest != "attn.to_q":
                    continue  # fused below, with the q part
                parts = [sd[f"{rb}{i}.attn.to_{c}.{leaf}"] for c in "qkv"]
                new, value = f"{base}.self_attn_qkv.{leaf}", torch.cat(parts)
            else:
                new = f"{base}.{refiner[rest]}.{leaf}"
        else:
            raise AssertionError(f"no Tencent name for {key}")
        out["model.diffusion_model." + new] = value
    return out


def test_tencent_checkpoint_names_load_and_match(models):
    from sglang.multimodal_gen.models.loader import load_tensors_into

    ours_ref, ref, _ = models
    sd = ref.state_dict()
    tencent = _tencent_state_dict(sd)
    for name in (
        "double_blocks.1.img_attn_q.weight",
        "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight",
        "final_layer.adaLN_modulation.1.bias",
        "cond_type_embedding.weight",
        "vision_in.proj.4.weight",
    ):
        assert "model.diffusion_model." + name in tencent, name
    cfg = HunyuanVideo15ArchConfig.from_dict(dict(ref.config))
    ours = HunyuanVideo15Transformer(cfg, tp_rank=0, tp_size=1)
    n = load_tensors_into(
        ours, (("<tencent>", k, v) for k, v in tencent.items()), HUNYUAN_VIDEO15_NAME_MAP
    )
    assert n == len(tencent)
    inp = dit_inputs(True, seed=8)
    with torch.no_grad():
        expected = ref(**inp, return_dict=False)[0]
        assert rel_err(ours(**inp), expected) <= PARITY_REL_ERR
        # the (shift, scale) rows really need the swap: loaded as they are, far off
        w = ours.norm_out.linear
        for p, leaf in ((w.weight, "weight"), (w.bias, "bias")):
            p.copy_(tencent[f"model.diffusion_model.final_layer.adaLN_modulation.1.{leaf}"])
        assert rel_err(ours(**inp), expected) > 1000 * PARITY_REL_ERR  # measured 0.88


# ------------------------------------------------------------------------------ TP and SP
@pytest.fixture(scope="module")
def parallel_runs(models):
    ours, ref, _ = models
    return hv_parallel_runs(
        "1.5", ours, ref, [dit_inputs(False, seed=9), dit_inputs(True, seed=10)]
    )


def _parallel_case(parallel_runs, layout: ParallelLayout | None, label: str):
    worst = hv_parallel_worst_err(parallel_runs, layout)
    print(f"hv15 {label}: max rel err vs one process {worst:.3g}")
    assert worst <= PARALLEL_REL_ERR


@pytest.mark.slow
def test_tp2_equals_tp1(parallel_runs):
    """Heads of the blocks and of the token refiner and both feed-forward widths split over 2
    ranks; t2v and i2v inputs."""
    _parallel_case(parallel_runs, None, "TP 2")


@pytest.mark.slow
def test_ulysses2_equals_one_process(parallel_runs):
    """The 18 video tokens and the conditioning tokens (7 real tokens for one item, 4 for the other; t2v 7, i2v 10
    after trimming: uneven chunks, padding keys masked)
    split over 2 SP ranks, the key mask gathered with its keys."""
    _parallel_case(parallel_runs, ParallelLayout(ulysses_degree=2), "Ulysses 2")


@pytest.mark.slow
def test_ring2_equals_one_process(parallel_runs):
    """Ring attention over 2 ranks: key/value blocks and their mask passed around."""
    _parallel_case(parallel_runs, ParallelLayout(ring_degree=2), "ring 2")


# ------------------------------------------------------------------------------ config, inputs
def test_config_defaults_json_and_errors(tmp_path):
    default = HunyuanVideo15ArchConfig()  # the released 8.3B shapes
    assert (default.inner_dim, default.mlp_hidden, default.num_layers) == (2048, 8192, 54)
    assert (default.in_channels, default.out_channels, default.out_features) == (65, 32, 32)
    assert hunyuan_video_tp_divisors(default) == {
        "num_attention_heads": 16,
        "mlp_hidden": 8192,
        "refiner_mlp_hidden": 8192,
    }
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "_class_name": HUNYUAN_VIDEO15_TRANSFORMER_CLASS,
                **TINY,
                "rope_axes_dim": [4, 6, 6],
                "out_channels": None,
                "foo": 1,
            }
        )
    )
    cfg = HunyuanVideo15ArchConfig.from_json_file(path)
    assert cfg.rope_axes_dim == (4, 6, 6) and cfg.out_channels == 9 and cfg.extra == {"foo": 1}
    path.write_text(json.dumps({"_class_name": "HunyuanVideoTransformer3DModel"}))
    with pytest.raises(ValueError, match="not supported"):
        HunyuanVideo15ArchConfig.from_json_file(path)
    with pytest.raises(ValueError, match="qk_norm='layer_norm'"):
        HunyuanVideo15ArchConfig(qk_norm="layer_norm")
    with pytest.raises(ValueError, match=r"rope_axes_dim=\[16, 56, 58\]"):
        HunyuanVideo15ArchConfig(rope_axes_dim=(16, 56, 58))
    with pytest.raises(ValueError, match="num_attention_heads=0"):
        HunyuanVideo15ArchConfig(num_attention_heads=0)


def test_tp_size_not_dividing_heads_is_a_clear_error():
    cfg = HunyuanVideo15ArchConfig(**TINY)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp_size=3"):
        HunyuanVideo15Transformer(cfg, tp_rank=0, tp_size=3)


def test_forward_rejects_bad_inputs(models):
    ours, _, _ = models
    inp = dit_inputs(False)
    x = inp["hidden_states"]
    with pytest.raises(ValueError, match="hidden_states must be"):
        ours(**dict(inp, hidden_states=x[:, :-1]))
    with pytest.raises(ValueError, match="not divisible"):
        ours(**dict(inp, hidden_states=x[..., :5]))
    with pytest.raises(ValueError, match="encoder_hidden_states_2 must be"):
        ours(**dict(inp, encoder_hidden_states_2=inp["encoder_hidden_states_2"][..., :-1]))
    with pytest.raises(ValueError, match="encoder_attention_mask must be"):
        ours(**dict(inp, encoder_attention_mask=inp["encoder_attention_mask"][:, :-1]))
    with pytest.raises(ValueError, match="image_embeds must be"):
        ours(**dict(inp, image_embeds=inp["image_embeds"][..., :-1]))
    with pytest.raises(ValueError, match="timestep_r"):
        ours(**dict(inp, timestep_r=torch.tensor([1.0, 2.0])))
