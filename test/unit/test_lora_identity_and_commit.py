"""Adapter identity (merge cache, reuse) follows the content, and commit_as_base is atomic.

Regressions from review: the identity used to be ``path:size:mtime``, so a file rewritten with
the same size and mtime hit a stale cached merge, and a PEFT folder whose ``adapter_config.json``
changed (alpha) kept the old adapter; ``commit_as_base`` used to commit some layers before
failing on a layer without a bias for an adapter's output offset.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from fixtures.lora_model import (
    assert_params_equal,
    build_model,
    make_manager,
    model_input,
    params,
    reference_output,
    run_model,
    write_lora,
)
from safetensors.torch import save_file
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.models.dits.zimage_names import ZIMAGE_NAME_MAP
from torch import nn


def _same_stat_rewrite(path, seed):
    """Rewrite ``path`` with other tensors of the same shapes, keeping size and mtime."""
    st = os.stat(path)
    deltas = write_lora(path, seed)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    return deltas


@pytest.mark.parametrize("mode", ["merge", "dynamic"])
def test_rewritten_file_with_same_size_and_mtime_is_a_new_adapter(tmp_path, mode):
    path = tmp_path / "x.safetensors"
    write_lora(path, 11)
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    x = model_input(1)
    mgr.set_lora("x", str(path), merge_mode=mode)
    mgr.unset_lora()
    new = _same_stat_rewrite(path, 12)
    # a new nickname on the rewritten file must not reuse the old file's cached merge
    mgr.set_lora("y", str(path), merge_mode=mode)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(new, 1.0)]), atol=1e-3, rtol=1e-3
    )
    # and re-setting the old nickname on the same path reloads it
    mgr.set_lora("x", str(path), merge_mode=mode)
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(new, 1.0)]), atol=1e-3, rtol=1e-3
    )


def test_changed_adapter_config_is_reloaded(tmp_path):
    folder = tmp_path / "peft"
    folder.mkdir()
    deltas = write_lora(folder / "adapter_model.safetensors", 21, rank=4)
    cfg = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"],
    }
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    model = build_model()
    mgr = make_manager(model, {"root": str(tmp_path)})
    x = model_input(2)
    mgr.set_lora("p", str(folder), merge_mode="merge")
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(deltas, 1.0)]), atol=1e-3, rtol=1e-3
    )
    cfg["lora_alpha"] = 16  # scale alpha / r: 1 -> 4
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    mgr.set_lora("p", str(folder), merge_mode="merge")
    torch.testing.assert_close(
        run_model(model, x), reference_output(x, [(deltas, 4.0)]), atol=1e-3, rtol=1e-3
    )


class _FeedForward(nn.Module):
    """A biased merged-column layer, then a row-parallel layer WITHOUT a bias."""

    def __init__(self):
        super().__init__()
        p = "layers.0.feed_forward"
        self.w13 = MergedColumnParallelLinear(8, [12, 12], prefix=f"{p}.w13")
        self.w2 = RowParallelLinear(12, 8, bias=False, prefix=f"{p}.w2")
        g = torch.Generator().manual_seed(3)
        for layer in (self.w13, self.w2):
            layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
            if layer.bias is not None:
                layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=g))

    def forward(self, x):
        gate, up = self.w13(x)[0].chunk(2, dim=-1)
        return self.w2(gate * up)[0]


class _NoBiasModel(nn.Module):
    """``layers.0.feed_forward.{w13, w2}`` with Z-Image names."""

    def __init__(self):
        super().__init__()
        block = nn.Module()
        block.feed_forward = _FeedForward()
        self.layers = nn.ModuleList([block])

    def forward(self, x):
        return self.layers[0].feed_forward(x)


def test_commit_as_base_refuses_offsets_without_bias_and_changes_nothing(tmp_path):
    g = torch.Generator().manual_seed(5)
    sd = {}
    for name, (o, i) in {"w1": (12, 8), "w3": (12, 8), "w2": (8, 12)}.items():
        key = f"transformer.layers.0.feed_forward.{name}"
        sd[f"{key}.lora_A.weight"] = torch.randn(2, i, generator=g)
        sd[f"{key}.lora_B.weight"] = torch.randn(o, 2, generator=g)
        sd[f"{key}.lora_B.bias"] = torch.randn(o, generator=g)  # peft lora_bias=True
    path = tmp_path / "biased.safetensors"
    save_file(sd, str(path))
    model = _NoBiasModel()
    start = params(model)
    mgr = LoRAManager({"transformer": model}, ZIMAGE_NAME_MAP, allowed_roots=[str(tmp_path)])
    mgr.set_lora("b", str(path), merge_mode="merge")
    x = torch.randn(3, 8)
    with_lora = run_model(model, x)
    merged = params(model)
    listed = mgr.list_loras()
    with pytest.raises(InvalidRequestError, match="no bias to fold it into"):
        mgr.commit_as_base()
    assert_params_equal(model, merged)
    assert mgr.list_loras() == listed
    torch.testing.assert_close(run_model(model, x), with_lora, atol=0, rtol=0)
    mgr.unset_lora()
    assert_params_equal(model, start)
