"""``--dit-cpu-offload`` with LoRA: pre-merge snapshots and cached merges live in host memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams
from sglang.multimodal_gen.runtime.runner import build_lora_manager


@pytest.mark.parametrize("offload", [False, True])
def test_build_lora_manager_devices(tiny_zimage_dir, offload):
    pipe = ZImagePipeline.from_pretrained(tiny_zimage_dir)
    dits = pipe.denoisers
    manager = build_lora_manager(dits, pipe.family, None, cpu_offload=offload)
    layers = manager.layers("transformer").values()
    want = torch.device("cpu") if offload else None
    assert all(layer.snapshot_device == want for layer in layers)
    assert manager.cache.device == want
    assert manager.allowed_roots is None
    assert build_lora_manager(dits, pipe.family, ()).allowed_roots == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="DiT CPU offload needs a GPU")
def test_offloaded_dit_merges_with_host_snapshots(tiny_zimage_dir, tiny_zimage_loras):
    req = SamplingParams(prompt="a fox", height=32, width=32, num_inference_steps=2, seed=3)
    with DiffusionEngine(tiny_zimage_dir, device="cuda", dit_cpu_offload=True) as engine:
        base = np.asarray(engine.generate(req)[0])
        engine.set_lora("a", tiny_zimage_loras[0], strength=0.8, merge_mode="merge")
        manager = engine._executor.runner.lora_manager
        merged = [layer for layer in manager.layers("transformer").values() if layer.merged]
        assert merged and all(layer._snapshot.device.type == "cpu" for layer in merged)
        assert manager.cache.device == torch.device("cpu")
        assert not np.array_equal(np.asarray(engine.generate(req)[0]), base)
        engine.unset_lora()
        assert np.array_equal(np.asarray(engine.generate(req)[0]), base)
