"""Sequence parallelism (Ulysses, ring, USP) and its composition with TP, for every family's DiT,
on real gloo processes against the single-process DiT (which equals diffusers bitwise, see the
``*_transformer_parity`` tests).

Each case uses seeded random weights (every parameter perturbed) and inputs whose token counts no
SP degree divides (uneven chunks), with padded batches where the family has them (Z-Image's
caption/image lengths, Qwen-Image's text mask), per-token timesteps (Wan TI2V) and Qwen-Image-Edit-
2511's per-token choice of the timestep (``zero_cond_t``: the index is sharded with the tokens).

Measured (torch 2.13 CPU, fp32): relative error vs one process <= 1.2e-6 in every layout and family
(SP only re-orders the softmax sums). Threshold 1e-5; a timestep moved by 1e-3 changes every
family's output by more than 1e-3 relative, far outside.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import tiny_flux, tiny_qwen_image, tiny_wan
from fixtures.tiny_models import rel_err
from sglang.multimodal_gen.distributed import (
    ParallelLayout,
    get_sp_world_size,
    get_tp_world_size,
    launch_processes,
)
from sglang.multimodal_gen.models.loader import denoiser_from_module, load_tensors_into
from sglang.multimodal_gen.models.registry import get_family, resolve_object

MAX_REL_ERR = 1e-5

ZIMAGE_TINY = dict(
    all_patch_size=[2],
    all_f_patch_size=[1],
    in_channels=16,
    dim=64,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=4,  # TP 2 x Ulysses 2 leaves one head per rank
    n_kv_heads=4,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=32,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[4, 6, 6],
    axes_lens=[1024, 64, 64],
)


def _perturbed(ref):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return ref.eval()


def _zimage_case(**arch):
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    ref = _perturbed(ZImageTransformer2DModel(**dict(ZIMAGE_TINY, **arch)))
    g = torch.Generator().manual_seed(123)
    # image tokens 15 and 4 (padded to 32 each), captions 9 and 40 tokens (padded to 32 / 64)
    x = [torch.randn(16, 1, h, w, generator=g) for h, w in ((6, 10), (4, 4))]
    caps = [torch.randn(n, 32, generator=g) for n in (9, 40)]
    return "zimage", ref, [dict(x=x, t=torch.tensor([0.25, 0.8]), cap=caps)]


def _flux_case():
    ref = tiny_flux.reference_dit(True, seed=5)
    return "flux", ref, [tiny_flux.with_guidance(tiny_flux.dit_inputs(seed=11), True, 4.0)]


def _wan_cases():
    out = []
    for layout in ("a14b", "ti2v"):
        ref = tiny_wan.reference_dit(layout, seed=10)
        out.append(("wan", ref, [tiny_wan.dit_inputs(layout, seed=11)]))
    return out


def _qwen_case():
    return (
        "qwen-image",
        tiny_qwen_image.reference_dit(seed=5),
        [tiny_qwen_image.dit_inputs(seed=11)],
    )


def _qwen_zero_cond_case():
    """Qwen-Image-Edit-2511 (``zero_cond_t``): output 3 x 5, condition images 2 x 3 and 1 x 2;
    23 image tokens, so the output / condition boundary (token 15) falls inside a shard."""
    from diffusers import QwenImageTransformer2DModel

    ref = QwenImageTransformer2DModel(**tiny_qwen_image.TINY_DIT, zero_cond_t=True).eval()
    ref.load_state_dict(tiny_qwen_image.reference_dit(seed=5).state_dict())
    images = [(1, 3, 5), (1, 2, 3), (1, 1, 2)]
    return "qwen-image", ref, [tiny_qwen_image.dit_inputs(seed=11, images=images)]


def _cases():
    return [_zimage_case(), _flux_case(), *_wan_cases(), _qwen_case(), _qwen_zero_cond_case()]


def _model_out(model, inp):
    out = model(**inp)  # Z-Image: a list of differently sized items
    return torch.cat([o.flatten() for o in out]) if isinstance(out, list) else out


def _record_attention_tokens(seen: list):
    """Wrap every DiT module's ``attention`` to record ``(tokens in q, declared split)``."""
    import importlib

    from sglang.multimodal_gen.distributed.sequence import active_split

    # where each calls attention (Flux: the shared MM-DiT blocks)
    for name in (
        "models.dits.zimage_layers",
        "layers.mmdit",
        "models.dits.wan",
        "models.dits.qwen_image",
    ):
        mod = importlib.import_module(f"sglang.multimodal_gen.{name}")
        real = mod.attention

        def wrapper(q, k, v, *a, _real=real, **kw):
            split = active_split()
            if split is not None:  # None: Z-Image's caption refiner (replicated, per request)
                seen.append((q.shape[1], k.shape[1], split.sizes[split.rank], split.total))
            return _real(q, k, v, *a, **kw)

        mod.attention = wrapper


def _rank_fn(rank, runs):
    seen: list = []
    _record_attention_tokens(seen)
    results = []
    for family, config, state, inputs in runs:
        spec = get_family(family).denoiser()
        cfg = resolve_object(spec.config_class).from_dict(config)
        model = resolve_object(spec.model_class)(cfg, dtype=torch.float32)
        name_map = resolve_object(spec.name_map)
        load_tensors_into(model, (("<sd>", k, v) for k, v in state.items()), name_map)
        with torch.no_grad():
            results.append([_model_out(model, inp) for inp in inputs])
    return results, get_tp_world_size(), get_sp_world_size(), seen


@pytest.fixture(scope="module")
def runs_and_expected():
    runs, expected = [], []
    for family, ref, inputs in _cases():
        ours = denoiser_from_module(ref, get_family(family).denoiser(), tp_rank=0, tp_size=1)
        with torch.no_grad():
            expected.append([_model_out(ours, inp) for inp in inputs])
        state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        runs.append((family, dict(ref.config), state, inputs))
    return runs, expected


LAYOUTS = {
    "ulysses2": ParallelLayout(ulysses_degree=2),
    "ring2": ParallelLayout(ring_degree=2),
    "usp2x2": ParallelLayout(ulysses_degree=2, ring_degree=2),
    "tp2_ulysses2": ParallelLayout(tp_size=2, ulysses_degree=2),
    "ulysses3": ParallelLayout(ulysses_degree=3),  # 4 heads split 2 / 1 / 1 (uneven)
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sequence_parallel_equals_one_process(name, runs_and_expected):
    layout = LAYOUTS[name]
    runs, expected = runs_and_expected
    results = launch_processes(_rank_fn, layout.world_size, (runs,), layout=layout)
    for rank, (per_case, tp, sp, seen) in enumerate(results):
        assert (tp, sp) == (layout.tp_size, layout.sp_degree)
        # memory: every self-attention call on this rank got only its share of the sequence
        assert seen and all(q == k == mine < total for q, k, mine, total in seen), seen[:3]
        for (family, *_), outs, outs1 in zip(runs, per_case, expected):
            for out, out1 in zip(outs, outs1):
                assert out.shape == out1.shape
                err = rel_err(out, out1)
                print(f"{name} rank {rank} {family}: rel err {err:.3g}")
                assert err <= MAX_REL_ERR, f"{name} rank {rank} {family}: {err}"


def test_nearby_wrong_input_is_far(runs_and_expected):
    """The bar above is tight: a timestep moved by 1e-3 fails it in every family."""
    runs, expected = runs_and_expected
    for (family, config, state, inputs), outs1 in zip(runs, expected):
        inp = dict(inputs[0])
        key = "t" if family == "zimage" else "timestep"
        inp[key] = inp[key] + (1e-3 if family in ("zimage", "flux", "qwen-image") else 1.0)
        ref = _rank_fn(0, [(family, config, state, [inp])])[0][0][0]
        assert rel_err(ref, outs1[0]) > 10 * MAX_REL_ERR, family


# Z-Image with 6 heads (dim 96, head dim 16): heads per TP rank that the Ulysses degree does not
# divide are split unevenly over the Ulysses ranks (6 over 4: 2 / 2 / 1 / 1; 3 per TP rank over 2:
# 2 / 1), and the DiT still equals one process.
UNEVEN_HEADS = {
    "ulysses4": ParallelLayout(ulysses_degree=4),
    "tp2_ulysses2": ParallelLayout(tp_size=2, ulysses_degree=2),
}


@pytest.fixture(scope="module")
def zimage_six_heads():
    family, ref, inputs = _zimage_case(dim=96, n_heads=6, n_kv_heads=6)
    ours = denoiser_from_module(ref, get_family(family).denoiser(), tp_rank=0, tp_size=1)
    with torch.no_grad():
        expected = [_model_out(ours, inp) for inp in inputs]
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return [(family, dict(ref.config), state, inputs)], expected


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UNEVEN_HEADS))
def test_zimage_uneven_heads_equal_one_process(name, zimage_six_heads):
    layout = UNEVEN_HEADS[name]
    runs, expected = zimage_six_heads
    results = launch_processes(_rank_fn, layout.world_size, (runs,), layout=layout)
    for rank, ((outs,), tp, sp, seen) in enumerate(results):
        assert (tp, sp) == (layout.tp_size, layout.sp_degree)
        assert seen and all(q == k == mine < total for q, k, mine, total in seen), seen[:3]
        for out, out1 in zip(outs, expected):
            err = rel_err(out, out1)
            print(f"{name} rank {rank} zimage 6 heads: rel err {err:.3g}")
            assert err <= MAX_REL_ERR, f"{name} rank {rank}: {err}"
