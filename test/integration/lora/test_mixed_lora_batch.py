"""Requests with different LoRA compositions in ONE batch: each image equals the request alone.

Two random adapters (peft-style keys on every linear layer of the diffusers transformer, embedders
and final layers included, non-zero ``lora_A``/``lora_B``) are loaded; a batch mixes rows with the
global composition, no LoRA, ``a`` alone, ``b`` alone and ``a + b`` at other strengths. Reference:
the same runner generating each request alone (``cmd_generate``: the request's adapters selected
for its rows, nothing applied to the layers). Measured (fp32, torch 2.13 CPU): every row >= 83 dB
against its single run (most bit-equal), for all four families, unmerged and merged; bar 45 dB. The same
request under two compositions is 12.5-28 dB apart, so a row that saw another row's adapters
fails.
"""

from __future__ import annotations

import pytest
from fixtures.tiny_models import count_dit_calls, output_pixels, psnr, random_peft_lora
from sglang.multimodal_gen.errors import NotFoundError
from sglang.multimodal_gen.layers.lora.composition import lora_context_of
from sglang.multimodal_gen.lora.requests import normalize_set_lora
from sglang.multimodal_gen.runtime import SamplingParams
from sglang.multimodal_gen.runtime.runner import ModelRunner

MIN_PSNR = 45.0
COMPOSITIONS = [None, [], [("a", 0.8)], [("b", 1.2)], [("a", -0.6), ("b", 0.9)]]


def _runner(model_dir, tmp_path, merged: bool) -> ModelRunner:
    runner = ModelRunner(model_dir)
    a = random_peft_lora(model_dir, str(tmp_path / "a"), seed=1)
    b = random_peft_lora(model_dir, str(tmp_path / "b"), seed=2)
    runner.cmd_set_lora(
        normalize_set_lora(["a", "b"], [a, b], "all", [0.5, 0.7], "merge" if merged else None)
    )
    return runner


def _check(runner: ModelRunner, base: dict, prompts=("a red fox", "a lighthouse at dusk")):
    reqs = [
        runner.spec.params(prompt=prompts[i % len(prompts)], seed=10 + i, lora=comp, **base)
        for i, comp in enumerate(COMPOSITIONS)
    ]
    reqs = [runner.spec.resolve(r) for r in reqs]
    single = [output_pixels(runner.cmd_generate(r)) for r in reqs]
    calls = count_dit_calls(runner)
    out = runner.cmd_generate_batch(reqs)
    # every row shares one DiT call per step, whatever its composition
    assert calls[0] == base["num_inference_steps"], calls[0]
    for i, (a, (ok, b)) in enumerate(zip(single, out)):
        assert ok, b
        b = output_pixels(b)
        assert psnr(a, b) >= MIN_PSNR, f"row {i} ({COMPOSITIONS[i]}): {psnr(a, b):.1f} dB"
    # the compositions matter: the same request under two compositions is far apart
    other = output_pixels(runner.cmd_generate(reqs[2].replace(lora=COMPOSITIONS[3])))
    assert psnr(other, single[2]) < 30
    return runner


@pytest.mark.parametrize("merged", [False, True])
def test_zimage_mixed_compositions(tiny_zimage_dir, tmp_path, merged):
    runner = _runner(tiny_zimage_dir, tmp_path, merged)
    _check(runner, dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0,
                        negative_prompt="blurry"))  # fmt: skip
    # an unknown adapter fails its own request only; the others run
    reqs = [
        SamplingParams(prompt="a boat", seed=1, height=32, width=32, num_inference_steps=2,
                       lora=comp)
        for comp in ([("a", 1.0)], [("missing", 1.0)], None)
    ]  # fmt: skip
    reqs = [runner.spec.resolve(r) for r in reqs]
    out = runner.cmd_generate_batch(reqs)
    assert out[0][0] and out[2][0]
    assert not out[1][0] and out[1][1]["type"] == NotFoundError.__name__, out[1][1]
    assert psnr(output_pixels(out[0][1]), output_pixels(runner.cmd_generate(reqs[0]))) >= MIN_PSNR
    # the row mappings are per batch: none is left on the layers afterwards, and a request of
    # the global composition is served as before the batch
    layers = [m for m in runner.pipeline.transformer.modules() if lora_context_of(m) is not None]
    assert layers and all(lora_context_of(m).mapping is None for m in layers)
    global_row = output_pixels(runner.cmd_generate(reqs[2]))
    assert psnr(output_pixels(out[2][1]), global_row) >= MIN_PSNR
    if merged:
        return
    # with per-expert offload an unknown adapter still fails its own request only (the expert
    # switch is a no-op on this one-expert CPU model)
    runner.per_expert_offload = True
    runner._activate_expert = lambda module: None
    out = runner.cmd_generate_batch(reqs)
    assert out[0][0] and out[2][0]
    assert not out[1][0] and out[1][1]["type"] == NotFoundError.__name__, out[1][1]


def test_flux_mixed_compositions(tiny_flux_dev_dir, tmp_path):
    _check(_runner(tiny_flux_dev_dir, tmp_path, merged=False),
           dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=2.0,
                negative_prompt="blurry"))  # fmt: skip


def test_qwen_image_and_wan_mixed_compositions(tiny_qwen_image_dir, tiny_wan_ti2v_dir, tmp_path):
    _check(_runner(tiny_qwen_image_dir, tmp_path / "q", merged=True),
           dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=2.0,
                negative_prompt="blurry"), prompts=("a red fox", "a red cat"))  # fmt: skip
    _check(_runner(tiny_wan_ti2v_dir, tmp_path / "w", merged=False),
           dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=3.0,
                negative_prompt="blurry"))  # fmt: skip


PARALLEL_BASE = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0,
                     negative_prompt="blurry")  # fmt: skip
PARALLEL_REQS = [
    SamplingParams(prompt=["a red fox", "a boat"][i % 2], seed=i, lora=comp, **PARALLEL_BASE)
    for i, comp in enumerate(COMPOSITIONS)
]


def _load(engine, loras):
    engine.set_lora(["a", "b"], list(loras), strength=[0.5, 0.7])


@pytest.fixture(scope="module")
def parallel_single(tiny_zimage_dir, tiny_zimage_loras):
    """Each request of ``PARALLEL_REQS`` alone on one process (both layouts compare with it)."""
    import numpy as np
    from sglang.multimodal_gen.runtime import DiffusionEngine

    with DiffusionEngine(tiny_zimage_dir, device="cpu") as e1:
        _load(e1, tiny_zimage_loras)
        single = [np.asarray(e1.generate(r)[0]) for r in PARALLEL_REQS]
    assert psnr(single[2], single[3]) < 30
    return single


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "cfg2"])
def test_parallel_mixed_batch_equals_one_process(
    request, tiny_zimage_dir, tiny_zimage_loras, parallel_single, layout
):
    """At TP 2 every rank runs the same rows with its weight shards; with CFG parallelism each
    rank runs one branch, i.e. its half of the batch's rows and their compositions. (TP 2: the
    session's shared engine.)"""
    import numpy as np
    from sglang.multimodal_gen.runtime import DiffusionEngine

    if layout == "tp2":
        e2 = request.getfixturevalue("zimage_tp2_engine")
        _load(e2, tiny_zimage_loras)
        out = e2.generate_batch(PARALLEL_REQS)
    else:
        with DiffusionEngine(tiny_zimage_dir, device="cpu", cfg_degree=2) as e2:
            _load(e2, tiny_zimage_loras)
            out = e2.generate_batch(PARALLEL_REQS)
    for i, (a, b) in enumerate(zip(parallel_single, out)):
        assert psnr(a, np.asarray(b[0])) >= MIN_PSNR, f"row {i}: {psnr(a, np.asarray(b[0])):.1f}"
