"""Our LTX-2.x DiT vs diffusers' ``LTX2VideoTransformer3DModel`` on the same weights (fp32, CPU):
loading through the loader from ``save_pretrained`` files, the LTX-2.3 switches (STG,
isolate_modalities, use_cross_timestep, per-token timesteps), original Lightricks names, TP 2,
Ulysses 2 and ring 2 (both streams sharded; real gloo processes) against one process.

Two tiny layouts (``fixtures/tiny_ltx2_dit.py``): ``ltx23`` (gated attention, cross-attention adaLN
and prompt modulation on both streams, perturbed attention, interleaved RoPE) and ``ltx20``
(caption projections, split RoPE in fp32, video and audio head counts different). Every parameter
of the reference is perturbed with seeded noise.

Measured on this machine (torch 2.13 CPU, fp32), max |ours - ref| / max |ref| per output (video,
audio): ltx23 3.2e-7 / 3.1e-7, ltx20 2.4e-7 / 1.4e-7; with STG (all items / item 0 only),
isolate_modalities, use_cross_timestep and per-token timesteps <= 3.1e-7 (not bitwise: our
self-attention q/k/v and the cross-attention k/v are one fused GEMM each); bf16 (weights and
latents on both sides) 0.0, bitwise. TP 2 vs TP 1 2.9e-7; video and audio sequence parallel vs
one process (both layouts): Ulysses 2 2.3e-7, ring 2 2.9e-7, Ulysses 2 x ring 2 2.5e-7. Thresholds: parity 2e-6, bf16 2**-8, parallel 5e-6. Nearby wrong cases, all far
outside: fps 25 instead of 24 in the video coordinates 0.34 / 0.18 (ltx23), 0.13 / 0.12 (ltx20);
each mode vs the plain forward > 1e-2 on both streams (e.g. STG at block 1 0.14,
isolate_modalities 0.6). Once on an H200 (torch 2.11, CUDA, TF32 off): fp32 <= 2.7e-7, bf16 0.0.

The gloo tests are ``slow`` (about 25 s each on a loaded 2-core machine: two spawned processes);
SP 4 (four processes) is in the extended tier.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.tiny_ltx2_dit import AUDIO_FRAMES, LAYOUTS, VIDEO, dit_inputs, reference_dit
from fixtures.tiny_models import rel_err
from sglang.multimodal_gen.configs.ltx2 import LTX2_TRANSFORMER_CLASS, LTX2ArchConfig
from sglang.multimodal_gen.distributed import (
    ParallelLayout,
    get_sp_world_size,
    get_tp_world_size,
    launch_processes,
)
from sglang.multimodal_gen.distributed.sequence import even_split
from sglang.multimodal_gen.models.dits.ltx2 import LTX2Transformer, ltx2_from_diffusers_module
from sglang.multimodal_gen.models.dits.ltx2_names import LTX2_NAME_MAP
from sglang.multimodal_gen.models.registry import DenoiserSpec

PARITY_REL_ERR = 2e-6  # measured <= 3.2e-7 (both layouts, every mode)
BF16_REL_ERR = 2**-8  # measured 0.0 (bitwise); one bf16 ulp of max |ref| as the margin
PARALLEL_REL_ERR = 5e-6  # measured 2.9e-7 (TP 2), <= 2.9e-7 (SP 2 and 4, both streams sharded)

_PKG = "sglang.multimodal_gen"
SPEC = DenoiserSpec(
    component="transformer",
    diffusers_classes=(LTX2_TRANSFORMER_CLASS,),
    config_class=f"{_PKG}.configs.ltx2:LTX2ArchConfig",
    model_class=f"{_PKG}.models.dits.ltx2:LTX2Transformer",
    name_map=f"{_PKG}.models.dits.ltx2_names:LTX2_NAME_MAP",
)


def _err(got, expected) -> tuple[float, float]:
    return rel_err(got[0], expected[0]), rel_err(got[1], expected[1])


@pytest.fixture(scope="module", params=list(LAYOUTS))
def models(request, tmp_path_factory):
    """(ours loaded by the loader from save_pretrained files, diffusers' reference, layout,
    the reference's output on the plain inputs)."""
    from sglang.multimodal_gen.models.loader import load_denoiser

    ref = reference_dit(request.param)
    path = tmp_path_factory.mktemp(request.param) / "transformer"
    ref.save_pretrained(path)
    ours = load_denoiser(str(path), SPEC, tp_rank=0, tp_size=1)
    with torch.no_grad():
        plain = ref(**dit_inputs(request.param), return_dict=False)
    return ours, ref, request.param, plain


def _variants(layout: str) -> dict[str, dict]:
    """The modes, two at a time where they are independent (each forward costs seconds on a
    loaded 2-core machine)."""
    g = torch.Generator().manual_seed(5)
    sv, sa = VIDEO[0] * VIDEO[1] * VIDEO[2], AUDIO_FRAMES
    cross = dict(use_cross_timestep=True, audio_sigma=torch.tensor([0.2, 0.9]))
    per_token = dict(
        timestep=torch.rand(2, sv, generator=g) * 1000,
        audio_timestep=torch.rand(2, sa, generator=g) * 1000,
    )
    if not LAYOUTS[layout].get("perturbed_attn"):
        return {
            "isolate_modalities": dict(isolate_modalities=True),
            "cross+per_token": {**cross, **per_token},
        }
    return {
        "isolate_modalities": dict(isolate_modalities=True),
        # STG on every item (attention skipped: values only) + the cross-modal timestep
        "stg_all+cross": dict(spatio_temporal_guidance_blocks=[1], **cross),
        # STG on item 0 only (lerp between values and attention) + per-token timesteps
        "stg_mask+per_token": dict(
            spatio_temporal_guidance_blocks=[0, 1],
            perturbation_mask=torch.tensor([0.0, 1.0]),
            **per_token,
        ),
    }


def test_matches_diffusers_in_every_mode(models):
    ours, ref, layout, plain = models
    base = dit_inputs(layout)
    assert min(plain[0].abs().max(), plain[1].abs().max()) > 0.5  # a real signal
    with torch.no_grad():
        got = ours(**base)
    err = _err(got, plain)
    print(f"ltx2 parity ({layout}, plain): rel err video {err[0]:.3g} audio {err[1]:.3g}")
    assert max(err) <= PARITY_REL_ERR
    for name, extra in _variants(layout).items():
        inp = dict(base, **extra)
        with torch.no_grad():
            expected = ref(**inp, return_dict=False)
            got = ours(**inp)
        assert got[0].shape == expected[0].shape and got[1].shape == expected[1].shape
        err = _err(got, expected)
        print(f"ltx2 parity ({layout}, {name}): rel err video {err[0]:.3g} audio {err[1]:.3g}")
        assert max(err) <= PARITY_REL_ERR, (name, err)
        assert min(_err(expected, plain)) > 1e-2, name  # the mode changes both streams


def test_nearby_wrong_case_and_coords_and_dtype(models):
    """fps 25 instead of 24 (the time axis of the video RoPE) is far outside the threshold; the
    coordinates we expose equal diffusers'; bf16 / fp16 inputs give outputs in their dtype."""
    ours, ref, layout, plain = models
    inp = dit_inputs(layout)
    vc = ours.prepare_video_coords(2, *VIDEO, fps=24.0)
    ac = ours.prepare_audio_coords(2, AUDIO_FRAMES)
    assert torch.equal(vc, ref.rope.prepare_video_coords(2, *VIDEO, "cpu", fps=24.0))
    assert torch.equal(ac, ref.audio_rope.prepare_audio_coords(2, AUDIO_FRAMES, "cpu"))
    vc25 = ours.prepare_video_coords(2, *VIDEO, fps=25.0)
    half = dict(
        hidden_states=inp["hidden_states"].bfloat16(),
        audio_hidden_states=inp["audio_hidden_states"].half(),
    )
    with torch.no_grad():
        fps25 = ours(**dict(inp, video_coords=vc25, audio_coords=ac))
        v, a = ours(**dict(inp, **half, video_coords=vc, audio_coords=ac))
    print(f"ltx2 ({layout}): fps 25 vs 24 rel err {_err(fps25, plain)}")  # 1.2e-2 .. 4e-2
    assert max(_err(fps25, plain)) > 2e3 * PARITY_REL_ERR
    assert v.dtype == torch.bfloat16 and a.dtype == torch.float16
    assert max(_err((v, a), plain)) < 2e-2


def test_bf16_matches_diffusers(models):
    """bf16 weights and latents on both sides (diffusers keeps no LTX-2 module in fp32): the
    modulation arithmetic, norms and RoPE round where the reference rounds (measured 0.0 on this
    machine and on an H200 for both layouts)."""
    import copy

    ours, ref, layout, _ = models
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    ours16 = ltx2_from_diffusers_module(ref16, tp_rank=0, tp_size=1)
    assert ours16.dtype == torch.bfloat16
    inp = dit_inputs(layout)
    for k in ("hidden_states", "audio_hidden_states", "encoder_hidden_states"):
        inp[k] = inp[k].bfloat16()
    inp["audio_encoder_hidden_states"] = inp["audio_encoder_hidden_states"].bfloat16()
    with torch.no_grad():
        expected = ref16(**inp, return_dict=False)
        got = ours16(**inp)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    err = _err(got, expected)
    print(f"ltx2 bf16 parity ({layout}): {err}")
    assert max(err) <= BF16_REL_ERR


def test_bad_inputs_are_clear_errors(models):
    ours, _, layout, _ = models
    inp = dit_inputs(layout)
    with pytest.raises(ValueError, match="audio_hidden_states must be"):
        ours(**dict(inp, audio_hidden_states=inp["audio_hidden_states"][..., :-1]))
    with pytest.raises(ValueError, match="timestep must be"):
        ours(**dict(inp, timestep=torch.ones(2, 5)))
    with pytest.raises(ValueError, match="audio_timestep is required"):
        ours(**dict(inp, timestep=torch.ones(2, 18)))
    with pytest.raises(ValueError, match="video coordinates"):
        ours(**dict(inp, num_frames=4))
    with pytest.raises(ValueError, match="out of range"):
        ours(**dict(inp, spatio_temporal_guidance_blocks=[2]))
    if ours.cfg.prompt_modulation:
        with pytest.raises(ValueError, match="sigma is required"):
            ours(**dict(inp, sigma=None))


def test_config_errors_name_the_field():
    base = LAYOUTS["ltx23"]
    for bad, field in (
        (dict(rope_type="complex"), "rope_type"),
        (dict(audio_cross_attention_dim=24), "audio_cross_attention_dim"),
        (dict(use_keyframes_abs_pos_embedding=True), "use_keyframes_abs_pos_embedding"),
        (dict(ff_bias=False), "ff_bias"),
        (dict(use_prompt_adaln_single=False), "use_prompt_adaln_single"),
        (dict(qk_norm="rms_norm"), "qk_norm"),
        (dict(num_attention_heads=0), "num_attention_heads"),
    ):
        with pytest.raises(ValueError, match=field):
            LTX2ArchConfig(**dict(base, **bad))
    cfg = LTX2ArchConfig(**base)
    with pytest.raises(
        ValueError, match=r"audio_num_attention_heads=2 is not divisible by tp_size=4"
    ):
        LTX2Transformer(cfg, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by tp_size=3"):
        LTX2Transformer(cfg, tp_rank=0, tp_size=3)


# ------------------------------------------------------------------------------ original names
_TOP = [  # diffusers -> Lightricks top-level modules (written out by hand)
    ("proj_in.", "patchify_proj."),
    ("audio_proj_in.", "audio_patchify_proj."),
    ("time_embed.", "adaln_single."),
    ("audio_time_embed.", "audio_adaln_single."),
    ("av_cross_attn_video_scale_shift.", "av_ca_video_scale_shift_adaln_single."),
    ("av_cross_attn_video_a2v_gate.", "av_ca_a2v_gate_adaln_single."),
    ("av_cross_attn_audio_scale_shift.", "av_ca_audio_scale_shift_adaln_single."),
    ("av_cross_attn_audio_v2a_gate.", "av_ca_v2a_gate_adaln_single."),
    ("prompt_adaln.", "prompt_adaln_single."),
    ("audio_prompt_adaln.", "audio_prompt_adaln_single."),
]


def _original_name(name: str) -> str:
    for a, b in _TOP:
        if name.startswith(a):
            return b + name[len(a) :]
    return (
        name.replace(".norm_q.", ".q_norm.")
        .replace(".norm_k.", ".k_norm.")
        .replace("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video")
        .replace("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio")
    )


def test_original_lightricks_names_load_and_match():
    """The state dict in the Lightricks layout (``model.diffusion_model.`` wrapped) loads through
    LTX2_NAME_MAP and gives the reference's output. The original names are checked against
    diffusers' own converter (the LoRA one, which also knows LTX-2.3's ``prompt_adaln_single``),
    which must map them back exactly."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_ltx2_lora_to_diffusers as to_diffusers,
    )
    from sglang.multimodal_gen.models.loader import load_tensors_into

    ref = reference_dit("ltx23", seed=6)
    sd = ref.state_dict()
    original = {"model.diffusion_model." + _original_name(k): v for k, v in sd.items()}
    assert "model.diffusion_model.adaln_single.linear.weight" in original
    assert "model.diffusion_model.transformer_blocks.1.attn1.q_norm.weight" in original
    assert "model.diffusion_model.transformer_blocks.0.scale_shift_table_a2v_ca_audio" in original
    back = to_diffusers({k[len("model.") :]: v for k, v in original.items()})
    assert {k[len("transformer.") :] for k in back} == set(sd)

    ours = LTX2Transformer(LTX2ArchConfig.from_dict(dict(ref.config)), tp_rank=0, tp_size=1)
    n = load_tensors_into(ours, (("<orig>", k, v) for k, v in original.items()), LTX2_NAME_MAP)
    assert n == len(sd)
    inp = dit_inputs("ltx23", seed=7)
    with torch.no_grad():
        assert max(_err(ours(**inp), ref(**inp, return_dict=False))) <= PARITY_REL_ERR


# ------------------------------------------------------------------------------ TP and SP
@pytest.fixture(scope="module")
def parallel_runs():
    """Both layouts' configs, state dicts and inputs (ltx23: STG on item 0 + cross timestep +
    per-token timesteps; ltx20: the plain inputs) and the one-process outputs, shared by the
    TP and SP tests."""
    runs, expected = [], []
    for i, name in enumerate(LAYOUTS):
        ref = reference_dit(name, seed=10 + i)
        inp = dit_inputs(name, seed=11 + i)
        if LAYOUTS[name].get("perturbed_attn"):
            g = torch.Generator().manual_seed(1)
            inp.update(
                spatio_temporal_guidance_blocks=[1],
                perturbation_mask=torch.tensor([0.0, 1.0]),
                use_cross_timestep=True,
                audio_sigma=torch.tensor([0.2, 0.9]),
                timestep=torch.rand(2, 18, generator=g) * 1000,
                audio_timestep=torch.rand(2, AUDIO_FRAMES, generator=g) * 1000,
            )
        tp1 = ltx2_from_diffusers_module(ref, tp_rank=0, tp_size=1)
        cases = [inp]
        if not LAYOUTS[name].get("perturbed_attn"):  # one audio token: fewer than SP ranks
            g = torch.Generator().manual_seed(2)
            audio = torch.randn(2, 1, LAYOUTS[name]["audio_in_channels"], generator=g)
            cases.append(dict(inp, audio_hidden_states=audio, audio_num_frames=1))
        for case in cases:
            with torch.no_grad():
                out = tp1(**case)
            rows = tp1.transformer_blocks[0].audio_attn1.to_qkv.weight.shape[0]
            expected.append((out, rows))
            state = {k: v.clone() for k, v in ref.state_dict().items()}
            runs.append((dict(ref.config), state, case))
    return runs, expected


def _rank_fn(rank, runs):
    """Each layout's model on this rank: ``([(output, local audio qkv rows, tokens), ...], tp,
    sp)``; ``tokens``: the (video, audio) token counts the first block's self-attentions got on
    this rank (the rank's shard of each stream under SP)."""
    from sglang.multimodal_gen.models.loader import load_tensors_into

    results = []
    for config, state_dict, inp in runs:
        model = LTX2Transformer(LTX2ArchConfig.from_dict(config), dtype=torch.float32)
        load_tensors_into(model, (("<sd>", k, v) for k, v in state_dict.items()), LTX2_NAME_MAP)
        block, tokens = model.transformer_blocks[0], {}

        def count(module, args, seen=tokens):
            seen.setdefault(module, args[0].shape[1])

        for attn in (block.attn1, block.audio_attn1):
            attn.register_forward_pre_hook(count)
        with torch.no_grad():
            out = model(**inp)
        rows = block.audio_attn1.to_qkv.weight.shape[0]
        results.append((out, rows, (tokens[block.attn1], tokens[block.audio_attn1])))
    return results, get_tp_world_size(), get_sp_world_size()


def _parallel_case(parallel_runs, layout: ParallelLayout | None, label: str):
    runs, expected = parallel_runs
    n = 2 if layout is None else layout.world_size
    results = launch_processes(_rank_fn, n, args=(runs,), backend="gloo", layout=layout)
    worst = 0.0
    for i, (out1, _) in enumerate(expected):
        tokens = [per_layout[i][2] for per_layout, _, _ in results]
        sp = results[0][2]
        for full, got in zip((out1[0].shape[1], out1[1].shape[1]), zip(*tokens)):
            # each rank holds its shard of each stream (uneven: the first n % sp one more);
            # a replicated stream would give every rank the whole sequence. An audio stream
            # shorter than the SP group stays whole on every rank.
            shards = even_split(full, sp) if full >= sp else (full,) * sp
            assert sorted(got) == sorted(shards * (n // sp)), (label, got, full)
    for per_layout, tp, sp in results:
        assert tp * sp == n
        for (out, rows, _), (out1, rows1) in zip(per_layout, expected):
            assert rows * tp == rows1  # heads really are split under TP
            worst = max(worst, *_err(out, out1))
    print(f"ltx2 {label}: max rel err vs one process {worst:.3g}")
    assert worst <= PARALLEL_REL_ERR


@pytest.mark.slow
def test_tp2_equals_tp1(parallel_runs):
    """Heads of all six attentions, the gate logits, the FFNs and the q/k norms' sums of squares
    split / reduced over 2 ranks; both layouts (split RoPE with video heads != audio heads in
    ltx20; STG, cross timestep and per-token timesteps in ltx23)."""
    _parallel_case(parallel_runs, None, "TP 2")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(ulysses_degree=2),
        ParallelLayout(ring_degree=2),
        ParallelLayout(ulysses_degree=2, ring_degree=2),
        ParallelLayout(ulysses_degree=4),  # 2 audio heads over 4 ranks: two attend none
    ],
    ids=["ulysses2", "ring2", "ulysses2_ring2", "ulysses4"],
)
def test_sequence_parallel_equals_one_process(parallel_runs, layout):
    """Both streams split over the SP ranks: 18 video tokens (9 / 9) and 7 audio tokens (4 / 3:
    a length that does not divide the SP size); one audio token (fewer than the ranks) stays
    whole on every rank. Each stream's self-attention runs Ulysses or
    ring, the other stream's keys/values are gathered for the audio-to-video and video-to-audio
    attentions, RoPE tables and per-token modulation are sharded with the tokens (ltx23: per-token
    timesteps on both streams, STG on item 0). Each rank's token counts are checked, so a
    replicated stream fails."""
    label = f"Ulysses {layout.ulysses_degree} x ring {layout.ring_degree}"
    _parallel_case(parallel_runs, layout, label)
