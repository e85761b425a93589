"""Our Qwen-Image DiT vs diffusers' QwenImageTransformer2DModel on the same weights (fp32, CPU),
and tensor parallelism (TP 2 and 4, real gloo processes) against TP 1.

The reference is a tiny ``QwenImageTransformer2DModel`` (D = 4 heads x 16 = 64, FFN 256, RoPE
axes 4 + 6 + 6, text width 32, 16 input channels = 2x2 patches of 4 latent channels) with every
parameter perturbed by seeded noise, so no weight sits at a value where it could be ignored (the
RMSNorm weights of ``txt_norm`` and the q/k norms would otherwise all be 1).

Measured on this machine (torch 2.13 CPU, diffusers 0.42.1): ours vs diffusers max |err| /
max |ref| = 0.0 exactly (bitwise equal) for a padded batch with a mask (text lengths 7 and 4),
the same batch without a mask, a single unpadded item on an odd non-square grid, and two images
(edit-style ``img_shapes``); bf16 also 0.0. TP 2 / TP 4 vs TP 1: 1.9e-7 / 1.4e-7 (the all-reduce
re-orders the additions); the padded item vs the same item alone, unpadded: 1.9e-7. Thresholds:
parity 1e-6 relative (10x below the 1e-5 acceptance bound; nonzero because GEMM kernels on other
CPUs may block the fused QKV projections differently). Nearby wrong inputs are far outside: a
timestep off by 0.01 gives 0.14, dropping the mask of the padded batch 2.4e-2 on its short item.
TP threshold 2e-6 (about 10x the measured value).
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.tiny_models import rel_err
from fixtures.tiny_qwen_image import TINY_DIT, dit_inputs, reference_dit
from sglang.multimodal_gen.configs.qwen_image import (
    QWEN_IMAGE_TRANSFORMER_CLASS,
    QwenImageArchConfig,
)
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.models.dits.qwen_image import (
    QwenImageTransformer,
    qwen_image_from_diffusers_module,
)
from sglang.multimodal_gen.models.dits.qwen_image_names import QWEN_IMAGE_NAME_MAP

PARITY_REL_ERR = 1e-6  # measured 0.0 (bitwise equal)
TP_REL_ERR = 2e-6  # measured 1.9e-7 (TP 2), 1.4e-7 (TP 4)
BF16_REL_ERR = 2**-8  # measured 0.0; one bf16 ulp of max |ref| as the margin


@pytest.fixture(scope="module")
def models():
    ref = reference_dit()
    return qwen_image_from_diffusers_module(ref, tp_rank=0, tp_size=1), ref


def _both(ours, ref, inp):
    with torch.no_grad():
        return ours(**inp), ref(**inp, return_dict=False)[0]


def test_padded_batch_with_mask_matches_diffusers(models):
    ours, ref = models
    inp = dit_inputs()
    got, expected = _both(ours, ref, inp)
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape == (2, 15, 16)
    assert expected.abs().max() > 0.5  # a real signal
    err = rel_err(got, expected)
    print(f"qwen-image parity (padded + mask): rel err {err:.3g}")
    assert err <= PARITY_REL_ERR

    # the threshold discriminates: a nearby wrong timestep, or ignoring the mask, is far outside
    with torch.no_grad():
        t_off = ours(**dict(inp, timestep=inp["timestep"] + torch.tensor([0.01, 0.0])))
        no_mask = ours(**dict(inp, encoder_hidden_states_mask=None))
    assert rel_err(t_off, expected) > 100 * PARITY_REL_ERR
    assert rel_err(no_mask[1], expected[1]) > 100 * PARITY_REL_ERR


def test_padding_is_invisible(models):
    """The short item of the padded batch equals the same item run alone, unpadded (RoPE uses
    the padded length, but text positions do not depend on it)."""
    ours, _ = models
    inp = dit_inputs()
    alone = {
        "hidden_states": inp["hidden_states"][1:],
        "encoder_hidden_states": inp["encoder_hidden_states"][1:, :4],
        "encoder_hidden_states_mask": None,
        "timestep": inp["timestep"][1:],
        "img_shapes": inp["img_shapes"][1:],
    }
    with torch.no_grad():
        batched, single = ours(**inp)[1], ours(**alone)[0]
    assert rel_err(batched, single) <= 2e-6  # measured 1.9e-7 (other SDPA shape, sums reorder)


@pytest.mark.parametrize(
    "case",
    [
        dict(lengths=(7, 4)),  # padded batch, mask dropped: all text tokens attend
        dict(lengths=(5,), grid=(5, 2), seed=8),  # one unpadded item, odd non-square grid
        dict(lengths=(6, 6), images=[(1, 3, 4), (1, 2, 3)], seed=9),  # two images (edit-style)
    ],
    ids=["unmasked", "single-odd-grid", "two-images"],
)
def test_other_shapes_match_diffusers(models, case):
    ours, ref = models
    inp = dit_inputs(**case)
    inp["encoder_hidden_states_mask"] = None
    got, expected = _both(ours, ref, inp)
    err = rel_err(got, expected)
    print(f"qwen-image parity ({case}): rel err {err:.3g}")
    assert err <= PARITY_REL_ERR


def test_mask_of_ones_and_bool_mask(models):
    """A float 1/0 mask and a bool mask are the same; an all-ones mask equals the reference too."""
    ours, ref = models
    inp = dit_inputs()
    bool_inp = dict(inp, encoder_hidden_states_mask=inp["encoder_hidden_states_mask"].bool())
    ones = dict(inp, encoder_hidden_states_mask=torch.ones(2, 7))
    with torch.no_grad():
        assert torch.equal(ours(**bool_inp), ours(**inp))
    got, expected = _both(ours, ref, ones)
    assert rel_err(got, expected) <= PARITY_REL_ERR


def test_bf16_matches_diffusers():
    ref16 = reference_dit().to(torch.bfloat16)
    ours16 = qwen_image_from_diffusers_module(ref16)
    assert ours16.dtype == torch.bfloat16
    inp = dit_inputs()
    for k in ("hidden_states", "encoder_hidden_states", "timestep"):
        inp[k] = inp[k].to(torch.bfloat16)
    got, expected = _both(ours16, ref16, inp)
    assert got.dtype == torch.bfloat16
    err = rel_err(got, expected)
    print(f"qwen-image bf16 parity: rel err {err:.3g}")
    assert err <= BF16_REL_ERR


def test_argument_errors(models):
    ours, _ = models
    inp = dit_inputs()
    with pytest.raises(ValueError, match="encoder_hidden_states_mask shape"):
        ours(**dict(inp, encoder_hidden_states_mask=torch.ones(2, 6)))
    with pytest.raises(ValueError, match="image tokens"):
        ours(**dict(inp, img_shapes=[[(1, 3, 4)]] * 2))
    with pytest.raises(ValueError, match="img_shapes is required"):
        ours(**dict(inp, img_shapes=None))
    with pytest.raises(ValueError, match="guidance"):
        ours(**dict(inp, guidance=torch.ones(2)))


def test_fused_module_names_and_shards(models):
    ours, _ = models
    blk = ours.transformer_blocks[1]
    assert blk.attn.to_qkv.output_shard_ids == ("q", "k", "v")
    assert blk.attn.to_added_qkv.output_shard_ids == ("q", "k", "v")
    names = {n for n, _ in ours.named_parameters()}
    for name in (
        "transformer_blocks.1.attn.to_qkv.weight",
        "transformer_blocks.1.attn.to_added_qkv.bias",
        "transformer_blocks.1.attn.to_out.0.weight",
        "transformer_blocks.1.attn.to_add_out.weight",
        "transformer_blocks.1.attn.norm_added_k.weight",
        "transformer_blocks.1.img_mod.1.weight",
        "transformer_blocks.1.txt_mlp.net.0.proj.weight",
        "transformer_blocks.1.img_mlp.net.2.bias",
        "txt_norm.weight",
        "time_text_embed.timestep_embedder.linear_2.weight",
        "norm_out.linear.weight",
    ):
        assert name in names, name


def test_tp_size_not_dividing_heads_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp_size=3"):
        QwenImageTransformer(QwenImageArchConfig(**TINY_DIT), tp_rank=0, tp_size=3)


# ------------------------------------------------------------------- zero_cond_t (Edit-2511)
# output grid 3 x 4 and two condition images (2 x 3, 2 x 2), a padded batch with a text mask
ZERO_COND_IMAGES = [(1, 3, 4), (1, 2, 3), (1, 2, 2)]


def reference_zero_cond_dit(seed: int = 0):
    """diffusers' ``QwenImageTransformer2DModel(zero_cond_t=True)`` with :func:`reference_dit`'s
    perturbed weights (the switch adds no parameter)."""
    from diffusers import QwenImageTransformer2DModel

    ref = QwenImageTransformer2DModel(**TINY_DIT, zero_cond_t=True).eval()
    ref.load_state_dict(reference_dit(seed).state_dict())
    assert ref.zero_cond_t
    return ref


def test_zero_cond_t_with_two_condition_images_matches_diffusers():
    """Measured: rel err 2.1e-7 (the plain model's on this machine: 2.5e-7). The same weights
    without ``zero_cond_t`` give 0.15, the index reversed (output tokens at timestep 0) 0.20:
    far outside."""
    ref = reference_zero_cond_dit(seed=2)
    ours = qwen_image_from_diffusers_module(ref, tp_rank=0, tp_size=1)
    assert ours.cfg.zero_cond_t
    inp = dit_inputs(lengths=(7, 4), images=ZERO_COND_IMAGES, seed=9)
    got, expected = _both(ours, ref, inp)
    assert got.shape == expected.shape == (2, 22, 16)
    err = rel_err(got, expected)
    print(f"qwen-image zero_cond_t parity: rel err {err:.3g}")
    assert err <= PARITY_REL_ERR
    # the condition images' timestep matters: the plain path on the same weights is far off,
    # on the output tokens too
    ours.cfg.zero_cond_t = False
    try:
        with torch.no_grad():
            plain = ours(**inp)
    finally:
        ours.cfg.zero_cond_t = True
    print(f"zero_cond_t off: rel err {rel_err(plain, expected):.3g}")
    assert rel_err(plain[:, :12], expected[:, :12]) > 100 * PARITY_REL_ERR
    # one img_shapes list per batch item is required to place each item's output tokens
    with pytest.raises(ValueError, match="one entry per batch item"):
        ours(**dict(inp, img_shapes=[ZERO_COND_IMAGES]))


# ------------------------------------------------------------------------------ TP (gloo)
def _rank_fn(rank, config, state_dict, inputs):
    from sglang.multimodal_gen.models.loader import load_tensors_into

    cfg = QwenImageArchConfig.from_dict(config)
    model = QwenImageTransformer(cfg, dtype=torch.float32)
    load_tensors_into(model, (("<sd>", k, v) for k, v in state_dict.items()), QWEN_IMAGE_NAME_MAP)
    with torch.no_grad():
        out = model(**inputs)
    rows = model.transformer_blocks[0].attn.to_qkv.weight.shape[0]
    return out, rows, get_tp_world_size()


@pytest.mark.slow
def test_tp2_and_tp4_equal_tp1():
    ref = reference_dit(seed=5)
    config = dict(ref.config)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    inp = dit_inputs(seed=11)
    tp1 = qwen_image_from_diffusers_module(ref, tp_rank=0, tp_size=1)
    with torch.no_grad():
        out1 = tp1(**inp)
    rows1 = tp1.transformer_blocks[0].attn.to_qkv.weight.shape[0]
    for n in (2, 4):
        results = launch_processes(_rank_fn, n, args=(config, state, inp), backend="gloo")
        for rank, (out, rows, world) in enumerate(results):
            assert world == n and rows * n == rows1  # heads really are split
            err = rel_err(out, out1)
            print(f"qwen-image TP {n} rank {rank}: rel err vs TP 1 {err:.3g}")
            assert err <= TP_REL_ERR, f"tp {n} rank {rank}: rel err {err}"


# ------------------------------------------------------------------------------ config
def test_config_from_dict_and_json(tmp_path):
    cfg = QwenImageArchConfig.from_dict(
        {
            "_class_name": QWEN_IMAGE_TRANSFORMER_CLASS,
            "_diffusers_version": "0.42.1",
            **TINY_DIT,
            "foo": 1,
        }
    )
    assert (cfg.inner_dim, cfg.mlp_hidden, cfg.out_features) == (64, 256, 16)
    assert cfg.extra == {"foo": 1}
    default = QwenImageArchConfig()
    assert (default.inner_dim, default.mlp_hidden, default.out_channels) == (3072, 12288, 16)
    assert (default.num_layers, default.joint_attention_dim, default.out_features) == (60, 3584, 64)
    assert QwenImageArchConfig(out_channels=None).out_channels == 64
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": QWEN_IMAGE_TRANSFORMER_CLASS, **TINY_DIT}))
    assert QwenImageArchConfig.from_json_file(path).num_layers == 2
    path.write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(ValueError, match="not supported"):
        QwenImageArchConfig.from_json_file(path)
    with pytest.raises(ValueError, match=r"sum\(axes_dims_rope\)=18"):
        QwenImageArchConfig(**dict(TINY_DIT, axes_dims_rope=(6, 6, 6)))
    with pytest.raises(ValueError, match="use_additional_t_cond"):
        QwenImageArchConfig(**dict(TINY_DIT, use_additional_t_cond=True))
    assert QwenImageArchConfig(**dict(TINY_DIT, zero_cond_t=True)).zero_cond_t
