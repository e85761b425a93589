"""Kernel choices: ``--attention-backend`` and ``--enable-torch-compile`` change how, not what;
``--float32-matmul-precision medium`` changes the numbers a little.

Reference: the default engine (``auto`` SDPA kernel, eager). Measured (torch 2.13 CPU, fp32): the
math kernel and the compiled DiT blocks give the default image within one level on a few values
(>= 60 dB). Bar 45 dB; the nearby wrong case (another seed) is below 15 dB. With bfloat16 GEMM
inputs (``medium``, on a CPU with AMX/AVX512-BF16) the image measured 52 dB at TP 2
(bar 40 dB).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.layers.attention import set_attention_backend
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams
from sglang.multimodal_gen.runtime.runner import ModelRunner

REQ = dict(prompt="a lighthouse at dusk", negative_prompt="blurry", guidance_scale=3.0,
           height=32, width=48, num_inference_steps=2, seed=9)  # fmt: skip


def _image(runner, **kw):
    req = runner.spec.resolve(SamplingParams(**dict(REQ, **kw)))
    return np.asarray(runner.cmd_generate(req)[0])


@pytest.fixture
def reset_backend():
    yield
    set_attention_backend("auto")  # process-wide: leave it as the other tests expect


def test_backend_choices_checked_per_device(reset_backend):
    for name in ("efficient", "cudnn", "fast"):
        with pytest.raises(ValueError, match="--attention-backend"):
            set_attention_backend(name, "cpu")
    set_attention_backend("math", "cpu")


@pytest.fixture(scope="module")
def runner_and_ref(tiny_zimage_dir):
    runner = ModelRunner(tiny_zimage_dir)
    ref = _image(runner)
    assert psnr(_image(runner, seed=10), ref) < 15
    return runner, ref


def test_math_kernel_gives_the_default_image(runner_and_ref, reset_backend):
    runner, ref = runner_and_ref
    set_attention_backend("math", "cpu")
    assert psnr(_image(runner), ref) >= 45


@pytest.mark.slow
def test_compiled_blocks_give_the_default_image(tiny_zimage_dir, runner_and_ref):
    _, ref = runner_and_ref
    runner = ModelRunner(tiny_zimage_dir, enable_torch_compile=True)
    blocks = [m for m in runner.pipeline.transformer.modules() if type(m).__name__ == "ZImageBlock"]
    assert len(blocks) == 6 and all(b._compiled_call_impl is not None for b in blocks)
    assert psnr(_image(runner), ref) >= 45


@pytest.mark.slow
def test_float32_matmul_precision_is_set_in_every_engine_process(tiny_zimage_dir, runner_and_ref):
    _, ref = runner_and_ref
    with DiffusionEngine(
        tiny_zimage_dir, tp_size=2, device="cpu", float32_matmul_precision="medium"
    ) as engine:
        assert engine.model_info["float32_matmul_precision"] == "medium"  # rank 0's process
        assert torch.get_float32_matmul_precision() == "highest"  # TP 2: not this process
        got = np.asarray(engine.generate(**REQ)[0])
    assert psnr(got, ref) >= 40  # the same picture, to bf16 rounding (wrong seed: < 15 dB)


def test_float32_matmul_precision_values_checked(tiny_zimage_dir, monkeypatch):
    with pytest.raises(ValueError, match="--float32-matmul-precision"):
        ServerArgs(float32_matmul_precision="low")
    with pytest.raises(ValueError, match="float32_matmul_precision"):
        ModelRunner(tiny_zimage_dir, float32_matmul_precision="low")
    # a multi-process engine refuses bad kernel settings before it starts any worker
    import sglang.multimodal_gen.runtime.executors as executors_mod

    def no_spawn(*a, **k):
        raise AssertionError("workers were started for a refused setting")

    monkeypatch.setattr(executors_mod, "spawn_workers", no_spawn)  # the engine's executors
    with pytest.raises(ValueError, match="float32_matmul_precision"):
        DiffusionEngine(tiny_zimage_dir, tp_size=2, device="cpu", float32_matmul_precision="low")
    with pytest.raises(ValueError, match="--attention-backend"):
        DiffusionEngine(tiny_zimage_dir, tp_size=2, device="cpu", attention_backend="cudnn")
    assert torch.get_float32_matmul_precision() == "highest"  # a refused value changes nothing
