"""Tensor parallelism: TP 2 (two gloo processes) equals TP 1 for the DiT output and the image.

Each comparison also shows that a nearby wrong case (timestep + 1e-3, guidance x1.1, a LoRA
strength 1.4 instead of 1.3) lands outside the threshold, so the threshold discriminates.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from fixtures.tiny_models import PARITY_MIN_PSNR, assert_same_image, psnr, rel_err
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.errors import NotFoundError
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

GEN_KW = dict(height=32, width=48, num_inference_steps=2, guidance_scale=2.5, output_type="np")

# Measured (fp32, CPU, gloo): DiT relative error TP 2 vs TP 1 3.2e-7 and 2.7e-7 (the two items),
# on both ranks; every image identical (inf dB), with and without LoRA, merged or not. Allowed:
# DiT relative error <= 1e-5; images >= 70 dB with no value off by more than one level and at
# most 0.1 % off by one. Nearby wrong cases: timestep + 1e-3 moves the DiT output by >= 7e-2
# (relative), guidance x1.1 and a LoRA strength 1.4 instead of 1.3 move the image below 70 dB.
MAX_REL_ERR = 1e-5


def _inputs():
    g = torch.Generator().manual_seed(123)
    x = [torch.randn(16, 1, h, w, generator=g) for h, w in ((6, 10), (4, 4))]
    caps = [torch.randn(n, 32, generator=g) for n in (9, 40)]
    return x, torch.tensor([0.25, 0.8]), caps


def _run(model_dir):
    pipe = ZImagePipeline.from_pretrained(model_dir)
    x, t, caps = _inputs()
    with torch.no_grad():
        out = [o.clone() for o in pipe.transformer(x, t, caps)]
    image = pipe("a lighthouse at dusk", generator=torch.Generator().manual_seed(5), **GEN_KW)
    qkv_rows = pipe.transformer.layers[0].attention.to_qkv.weight.shape[0]
    return out, image, qkv_rows, get_tp_world_size()


def _rank_fn(rank, model_dir):
    return _run(model_dir)


@pytest.fixture(scope="module")
def tp1(tiny_zimage_dir):
    return _run(tiny_zimage_dir)


@pytest.fixture(scope="module")
def tp1_near(tiny_zimage_dir):
    """TP 1 on nearby wrong inputs: the DiT at timesteps + 1e-3, the image at guidance x1.1."""
    pipe = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    x, t, caps = _inputs()
    with torch.no_grad():
        out = [o.clone() for o in pipe.transformer(x, t + 1e-3, caps)]
    kw = dict(GEN_KW, guidance_scale=GEN_KW["guidance_scale"] * 1.1)
    image = pipe("a lighthouse at dusk", generator=torch.Generator().manual_seed(5), **kw)
    return out, image


def test_tp2_transformer_and_image_equal_tp1(tiny_zimage_dir, tp1, tp1_near):
    out1, image1, rows1, world1 = tp1
    near_out, near_image = tp1_near
    results = launch_processes(_rank_fn, 2, args=(tiny_zimage_dir,), backend="gloo")
    assert world1 == 1
    for rank, (out2, image2, rows2, world2) in enumerate(results):
        assert world2 == 2
        assert rows2 * 2 == rows1  # heads really are split
        for a, b, near in zip(out2, out1, near_out):
            err = rel_err(a, b)
            assert err <= MAX_REL_ERR, f"rank {rank}: rel err {err}"
            assert rel_err(a, near) > MAX_REL_ERR  # a nearby timestep fails the same bar
        assert_same_image(image2[0], image1[0], f"rank {rank}")
        assert psnr(image2[0], near_image[0]) < PARITY_MIN_PSNR


def _engine_images(engine, loras):
    """Base, two LoRAs dynamic, the same merged, a per-request composition, back to base."""
    req = SamplingParams(
        prompt="a lighthouse at dusk", height=32, width=32, num_inference_steps=2, seed=9
    )
    out = [np.asarray(engine.generate(req)[0])]
    engine.set_lora(["a", "b"], list(loras), strength=[0.7, 1.3], merge_mode="dynamic")
    out.append(np.asarray(engine.generate(req)[0]))
    engine.set_lora(["a", "b"], [None, None], strength=[0.7, 1.3], merge_mode="merge")
    out.append(np.asarray(engine.generate(req)[0]))
    out.append(np.asarray(engine.generate(replace(req, lora=[("b", 1.3)]))[0]))
    engine.unset_lora()
    out.append(np.asarray(engine.generate(req)[0]))
    return out


def test_engine_tp2_equals_tp1_with_and_without_lora(
    tiny_zimage_dir, tiny_zimage_loras, zimage_tp2_engine
):
    with DiffusionEngine(tiny_zimage_dir, tp_size=1, device="cpu") as e1:
        ref = _engine_images(e1, tiny_zimage_loras)
        assert e1.steps_done() == 5 * 2  # five generations of two steps (the stall detector)
        near = SamplingParams(
            prompt="a lighthouse at dusk", height=32, width=32, num_inference_steps=2, seed=9,
            lora=[("a", 0.7), ("b", 1.4)],
        )  # fmt: skip
        near_lora = np.asarray(e1.generate(near)[0])
    e2 = zimage_tp2_engine  # the session's shared TP 2 engine
    assert e2.is_alive() and e2.spatial_factor == 16
    steps_before = e2.steps_done()
    got = _engine_images(e2, tiny_zimage_loras)
    assert e2.steps_done() - steps_before == 5 * 2  # counted by rank 0, read across processes
    # errors raised on the ranks come back as the same error types
    with pytest.raises(NotFoundError):
        e2.generate(SamplingParams(prompt="x", height=16, width=16, lora=[("zz", 1.0)]))
    assert e2.list_loras()["active"]["transformer"]["adapters"] == []
    assert psnr(ref[1], ref[0]) < 35  # LoRA really changes the image
    assert np.array_equal(ref[4], ref[0])
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_same_image(a, b, f"image {i}")
    assert psnr(got[1], near_lora) < PARITY_MIN_PSNR  # b at 1.4 instead of 1.3 fails the same bar


def test_tp_size_not_dividing_heads_is_a_clear_error(tiny_zimage_dir):
    from sglang.multimodal_gen.models.families.zimage import load_zimage_transformer

    with pytest.raises(ValueError, match=r"n_heads=2 is not divisible by tp_size=4"):
        load_zimage_transformer(f"{tiny_zimage_dir}/transformer", tp_rank=0, tp_size=4)
