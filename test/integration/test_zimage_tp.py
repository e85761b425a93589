"""Tensor parallelism: TP 2 (two gloo processes) equals TP 1 for the DiT output and the image."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.distributed import get_tp_world_size, launch_processes
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline
from sglang.multimodal_gen.runtime import DiffusionEngine, GenerationRequest

GEN_KW = dict(height=32, width=48, num_inference_steps=2, guidance_scale=2.5, output_type="np")


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


def test_tp2_transformer_and_image_equal_tp1(tiny_zimage_dir, tp1):
    out1, image1, rows1, world1 = tp1
    results = launch_processes(_rank_fn, 2, args=(tiny_zimage_dir,), backend="gloo")
    assert world1 == 1
    for rank, (out2, image2, rows2, world2) in enumerate(results):
        assert world2 == 2
        assert rows2 * 2 == rows1  # heads really are split
        for a, b in zip(out2, out1):
            err = float((a - b).abs().max() / b.abs().max())
            assert err <= 1e-5, f"rank {rank}: rel err {err}"
        assert psnr(image2[0], image1[0]) >= 45


def test_engine_tp2_equals_tp1(tiny_zimage_dir):
    req = GenerationRequest(
        prompt="a lighthouse at dusk", height=32, width=32, num_inference_steps=2, seed=9
    )
    e1 = DiffusionEngine(tiny_zimage_dir, tp_size=1, device="cpu")
    img1 = np.asarray(e1.generate(req)[0])
    e1.shutdown()
    with DiffusionEngine(tiny_zimage_dir, tp_size=2, device="cpu") as e2:
        assert e2.is_alive() and e2.spatial_factor == 16
        img2 = np.asarray(e2.generate(req)[0])
        # a second, different request through the broadcast path
        req_b = GenerationRequest(
            prompt="x", height=16, width=32, num_inference_steps=1, guidance_scale=1.0, seed=1
        )
        assert np.asarray(e2.generate(req_b)[0]).shape == (16, 32, 3)
    assert not e2.is_alive()
    assert psnr(img2, img1) >= 45


def test_tp_size_not_dividing_heads_is_a_clear_error(tiny_zimage_dir):
    from sglang.multimodal_gen.models.loader import load_zimage_transformer

    with pytest.raises(ValueError, match=r"n_heads=2 is not divisible by tp_size=4"):
        load_zimage_transformer(f"{tiny_zimage_dir}/transformer", tp_rank=0, tp_size=4)
