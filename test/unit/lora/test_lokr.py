"""LoKr (LyCORIS) factors -> an exact low-rank LoRA pair (``lora/lokr.py``), and its refusals."""

from __future__ import annotations

import pytest
import torch
from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.lokr import lokr_to_lora


@pytest.mark.parametrize(
    "parts,expected_rank",
    [
        ({"w1": (4, 4), "w2_a": (16, 2), "w2_b": (2, 16)}, 8),  # (I, W1) x (w2_a, w2_b)
        ({"w1_a": (4, 1), "w1_b": (1, 4), "w2": (16, 16)}, 16),  # (w1_a, w1_b) x (I or W2)
        ({"w1_a": (8, 2), "w1_b": (2, 2), "w2_a": (8, 3), "w2_b": (3, 32)}, 6),
        ({"w1": (2, 8), "w2_a": (32, 4), "w2_b": (4, 8)}, 8),
    ],
)
def test_lokr_exact_low_rank(parts, expected_rank):
    """B @ A of the converted pair equals kron(W1, W2) * scale exactly (LyCORIS semantics)."""
    g = torch.Generator().manual_seed(15)
    t = {
        k: torch.randn(*shape, generator=g, dtype=torch.float64).float()
        for k, shape in parts.items()
    }
    w1 = t["w1"] if "w1" in t else t["w1_a"] @ t["w1_b"]
    w2 = t["w2"] if "w2" in t else t["w2_a"] @ t["w2_b"]
    rank = t["w2_b"].shape[0] if "w2_b" in t else t["w1_b"].shape[0]
    a, b, scale = lokr_to_lora(t, torch.tensor(3.0), "m")
    assert a.shape[0] == expected_rank and b.shape[1] == expected_rank
    assert scale == pytest.approx(3.0 / rank)
    torch.testing.assert_close(b @ a, torch.kron(w1, w2), atol=1e-5, rtol=1e-5)
    # no alpha: scale 1
    assert lokr_to_lora(t, None, "m")[2] == 1.0


def test_lokr_refusals():
    g = torch.Generator().manual_seed(16)
    full = {"w1": torch.randn(4, 4, generator=g), "w2": torch.randn(16, 16, generator=g)}
    with pytest.raises(LoRAFormatError, match="no low-rank form"):
        lokr_to_lora(full, torch.tensor(1.0), "m")
    with pytest.raises(LoRAFormatError, match="missing"):
        lokr_to_lora({"w1": full["w1"]}, None, "m")
    with pytest.raises(LoRAFormatError, match="do not chain"):
        lokr_to_lora(
            {"w1": full["w1"], "w2_a": torch.ones(16, 2), "w2_b": torch.ones(3, 16)}, None, "m"
        )
    with pytest.raises(LoRAFormatError, match="only linear"):
        lokr_to_lora({"w1": full["w1"], "w2": torch.ones(16, 16, 1, 1)}, None, "m")
