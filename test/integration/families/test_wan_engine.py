"""Wan2.2 through the engine and the CLI: LoRA on both experts, TP 2 = TP 1, video files.

References: diffusers' ``WanPipeline`` with ``load_lora_weights`` (the high-noise file into
``transformer``, the low-noise file into ``transformer_2`` with ``load_into_transformer_2``) for
TP 1, and the TP 1 engine for TP 2 (the upstream project lost consistency exactly there: Wan2.2
A14B with a LoRA on two GPUs). LoRA files are diffusers/PEFT-format with random non-zero weights
and alpha != r.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from fixtures.tiny_models import psnr
from fixtures.tiny_wan import reference_frames, reference_wan
from PIL import Image
from sglang.cli.main import main as sglang_main
from sglang.multimodal_gen.configs.wan import WanSamplingParams
from sglang.multimodal_gen.outputs import Video
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

REQ = dict(prompt="a paper boat", height=32, width=32, num_frames=5, num_inference_steps=4,
           guidance_scale=3.0, guidance_scale_2=2.0, negative_prompt="blurry", seed=3)  # fmt: skip
KW = {k: v for k, v in REQ.items() if k not in ("prompt", "seed")}
# TP 2 changes only the summation order of the row-parallel GEMMs and of the across-heads q/k
# RMSNorm: measured >= 80 dB here.
TP_MIN_PSNR = 60.0


def _lora_file(path, seed, r=4, alpha=2.0, d=32, ffn=64):
    """A diffusers-format Wan LoRA on self/cross attention and the FFN of both blocks."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for b in range(2):
        for name, (out_f, in_f) in {
            "attn1.to_q": (d, d), "attn1.to_v": (d, d), "attn1.to_out.0": (d, d),
            "attn2.to_k": (d, d), "ffn.net.0.proj": (ffn, d), "ffn.net.2": (d, ffn),
        }.items():  # fmt: skip
            key = f"transformer.blocks.{b}.{name}"
            sd[f"{key}.lora_A.weight"] = torch.randn(r, in_f, generator=g) * 0.3
            sd[f"{key}.lora_B.weight"] = torch.randn(out_f, r, generator=g) * 0.3
    from diffusers import WanPipeline
    from peft import LoraConfig

    targets = ["to_q", "to_v", "to_out.0", "to_k", "proj", "net.2"]
    meta = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets).to_dict()
    WanPipeline.save_lora_weights(
        str(path.parent), weight_name=path.name,
        transformer_lora_layers={k.removeprefix("transformer."): v for k, v in sd.items()},
        transformer_lora_adapter_metadata=meta,
    )  # fmt: skip
    return str(path)


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_loras")
    return _lora_file(root / "high.safetensors", 1), _lora_file(root / "low.safetensors", 2)


@pytest.fixture(scope="module")
def tp1(tiny_wan_a14b_dir, loras):
    with DiffusionEngine(tiny_wan_a14b_dir, device="cpu") as engine:
        base = engine.generate(**REQ)[0].frames
        engine.set_lora(["high", "low"], list(loras), target=["transformer", "transformer_2"],
                        strength=[0.8, 1.2], merge_mode="merge")  # fmt: skip
        with_lora = engine.generate(**REQ)[0].frames
        yield engine, base, with_lora


def test_engine_equals_diffusers_with_lora_on_both_experts(tiny_wan_a14b_dir, loras, tp1):
    engine, base, with_lora = tp1
    assert engine.modality == "video" and engine.lora_targets[1:] == (
        "transformer",
        "transformer_2",
    )
    ref = reference_wan(tiny_wan_a14b_dir)
    assert psnr(base, reference_frames(ref, REQ["prompt"], 3, **KW)[0]) >= 70.0  # measured inf
    ref.load_lora_weights(loras[0], adapter_name="high")
    ref.load_lora_weights(loras[1], adapter_name="low", load_into_transformer_2=True)
    ref.set_adapters(["high", "low"], [0.8, 1.2])
    expected = reference_frames(ref, REQ["prompt"], 3, **KW)[0]
    assert psnr(with_lora, expected) >= 70.0
    assert psnr(with_lora, base) < 45.0  # the adapters change the video


def test_generate_on_a_video_model_returns_videos(tp1):
    """``generate`` makes what the model makes: ``Video`` objects (uint8 frames at the request's
    frame rate, the model's by default) for a video model; a base ``SamplingParams`` (the common
    fields) is converted to the model's class."""
    engine, _, with_lora = tp1  # the fixture's global adapters are active
    assert engine.spec.outputs == "video" and engine.spec.params_class is WanSamplingParams
    (video,) = engine.generate(**REQ)
    assert isinstance(video, Video) and video.audio is None
    assert video.frames.dtype == np.uint8 and video.frames.shape == (5, 32, 32, 3)
    assert video.fps == engine.spec.defaults.fps == 16
    assert np.array_equal(video.frames, with_lora)
    assert engine.generate(**REQ, fps=8)[0].fps == 8
    common = SamplingParams(
        prompt="x", height=32, width=32, num_inference_steps=1, num_outputs_per_prompt=2
    )
    two = engine.generate(common)
    assert len(two) == 2 and all(isinstance(v, Video) for v in two)
    assert two[0].frames.shape == (engine.spec.defaults.num_frames, 32, 32, 3)


@pytest.mark.slow
def test_tp2_equals_tp1_with_lora_on_both_experts(tiny_wan_a14b_dir, loras, tp1):
    _, base, with_lora = tp1
    with DiffusionEngine(tiny_wan_a14b_dir, tp_size=2, device="cpu") as engine:
        assert psnr(engine.generate(**REQ)[0].frames, base) >= TP_MIN_PSNR
        for mode in ("merge", "dynamic"):
            engine.set_lora(["high", "low"], list(loras), target=["transformer", "transformer_2"],
                            strength=[0.8, 1.2], merge_mode=mode)  # fmt: skip
            got = engine.generate(**REQ)[0].frames
            assert psnr(got, with_lora) >= TP_MIN_PSNR, mode
            assert psnr(got, base) < TP_MIN_PSNR


def test_cli_writes_mp4_and_frames(tiny_wan_a14b_dir, tp1, tmp_path):
    import av

    _, base, _ = tp1
    common = ["generate", "--model-path", tiny_wan_a14b_dir, "--prompt", REQ["prompt"],
              "--seed", "3", "--height", "32", "--width", "32", "--num-frames", "5",
              "--num-inference-steps", "4", "--guidance-scale", "3", "--guidance-scale-2", "2",
              "--negative-prompt", "blurry", "--fps", "8", "--no-progress"]  # fmt: skip
    frames_dir = tmp_path / "frames"
    assert sglang_main(common + ["--output-path", f"{frames_dir}/"]) == 0
    names = sorted(os.listdir(frames_dir / "video_000"))
    assert len(names) == 5
    got = np.stack([np.asarray(Image.open(frames_dir / "video_000" / n)) for n in names])
    assert np.array_equal(got, base)  # lossless frames equal the engine's
    mp4 = tmp_path / "clip.mp4"
    assert sglang_main(common + ["--output-path", str(mp4)]) == 0
    with av.open(str(mp4)) as c:
        stream = c.streams.video[0]
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
        assert stream.average_rate == 8 and stream.codec_context.name == "h264"
    assert len(decoded) == 5 and decoded[0].shape == (32, 32, 3)
    assert sglang_main(common + ["--output-path", str(tmp_path / "x.png")]) == 2  # wrong modality


def test_serve_startup_loras_per_expert(tiny_wan_a14b_dir, loras, tp1):
    """``sglang serve --lora-path H L --lora-target transformer transformer_2`` applies each file
    to its expert, as the Python call in ``tp1`` did."""
    import argparse

    from sglang.multimodal_gen.configs.server_args import ServerArgs
    from sglang.multimodal_gen.entrypoints.http_server import load_startup_loras

    engine, _, with_lora = tp1
    parser = ServerArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["--model-path", tiny_wan_a14b_dir, "--lora-path", *loras, "--lora-nickname", "high",
            "low", "--lora-scale", "0.8", "1.2", "--lora-target", "transformer",
            "transformer_2"]  # fmt: skip
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    assert args.startup_lora_targets == ["transformer", "transformer_2"]
    engine.unset_lora()
    load_startup_loras(engine, args)
    assert np.array_equal(engine.generate(**REQ)[0].frames, with_lora)
    with pytest.raises(ValueError, match="--lora-target given 3 values for 2"):
        ServerArgs.from_cli_args(parser.parse_args(argv + ["all"])).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DiT CPU offload needs a GPU")
def test_offload_keeps_only_the_active_expert_on_the_gpu(tiny_wan_a14b_dir, loras):
    """``--dit-cpu-offload`` on a two-expert model: during a generation exactly one expert is on
    the accelerator; frames equal the non-offloaded engine's, also with a global merged LoRA and
    a per-request composition (merged into, and restored on, the host copies)."""
    req = WanSamplingParams(**REQ)
    comp = dict(REQ, lora=[("high", 0.5), ("low", 1.5)])
    results = {}
    for offload in (False, True):
        with DiffusionEngine(tiny_wan_a14b_dir, device="cuda", dtype="float32",
                             dit_cpu_offload=offload) as engine:  # fmt: skip
            runner = engine._executor.runner
            seen = []
            if offload:
                activate = runner._activate_expert

                def spy(module, activate=activate, runner=runner, seen=seen):
                    activate(module)
                    seen.append(sorted(
                        n for n, m in runner.pipeline.denoisers.items()
                        if next(m.parameters()).device.type == "cuda"
                    ))  # fmt: skip

                runner._activate_expert = spy
                runner.pipeline.on_denoiser_change = spy
            out = [engine.generate(req)[0].frames]
            engine.set_lora(["high", "low"], list(loras), target=["transformer", "transformer_2"],
                            strength=[0.8, 1.2], merge_mode="merge")  # fmt: skip
            out.append(engine.generate(req)[0].frames)
            out.append(engine.generate(**comp)[0].frames)
            engine.unset_lora()
            out.append(engine.generate(req)[0].frames)  # the composition left nothing behind
            results[offload] = out
            if offload:
                assert ["transformer"] in seen and ["transformer_2"] in seen
                assert all(len(s) <= 1 for s in seen)  # never both experts on the GPU
    for a, b in zip(results[False], results[True]):
        assert np.array_equal(a, b)
    assert np.array_equal(results[True][0], results[True][3])


@pytest.mark.slow
def test_cfg_and_ring_parallel_equal_one_process(tiny_wan_a14b_dir, loras, tp1):
    """CFG 2 x ring 2 (4 processes) on both experts, with their LoRAs merged and dynamic."""
    _, base, with_lora = tp1
    with DiffusionEngine(tiny_wan_a14b_dir, cfg_degree=2, ring_degree=2, device="cpu") as engine:
        assert psnr(engine.generate(**REQ)[0].frames, base) >= TP_MIN_PSNR
        for mode in ("merge", "dynamic"):
            engine.set_lora(["high", "low"], list(loras), target=["transformer", "transformer_2"],
                            strength=[0.8, 1.2], merge_mode=mode)  # fmt: skip
            got = engine.generate(**REQ)[0].frames
            assert psnr(got, with_lora) >= TP_MIN_PSNR, mode
