"""``configs.launch_plan.fingerprint``: the transformer weight options enter by content, so two
nodes holding the same checkpoint at other paths agree and other checkpoints are refused."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file
from sglang.multimodal_gen.configs.launch_plan import fingerprint, plan_launch
from sglang.multimodal_gen.models.loader import WeightOptions


def _checkpoint(folder, rows: int = 4) -> str:
    os.makedirs(folder)
    save_file({"a.weight": torch.zeros(rows, 2)}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"quantization_config": {"quant_algo": "FP8"}}, f)
    return str(folder)


def test_weights_enter_the_fingerprint_by_content(tmp_path):
    plan = plan_launch(2, 2, 0, "127.0.0.1:1", env={})

    def fp(weights):
        return fingerprint(plan, dict(model_path=None, device="cpu", weights=weights), "gloo")

    a = _checkpoint(tmp_path / "a")
    b = shutil.copytree(a, tmp_path / "elsewhere" / "a")
    other = _checkpoint(tmp_path / "other", rows=5)
    assert fp(WeightOptions(transformer_path=a)) == fp(WeightOptions(transformer_path=str(b)))
    assert fp(WeightOptions(transformer_path=a)) != fp(WeightOptions(transformer_path=other))
    file_a = os.path.join(a, "model.safetensors")
    file_o = os.path.join(other, "model.safetensors")
    assert fp(WeightOptions(transformer_weights_path=file_a)) != fp(
        WeightOptions(transformer_weights_path=file_o)
    )
    assert fp(None) != fp(WeightOptions(quantization="fp8"))
    assert fp(None)["weights"] is None
