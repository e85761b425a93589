"""The unit the LoRA runtime hands to a LoRA layer: one (A, B) pair for one shard of one module."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN/Inf (non-float tensors: always).

    ``max |t|`` is NaN/Inf iff some element is: one reduction, about 10x faster than
    ``isfinite(t).all()`` on bf16 CPU tensors. The one finiteness check of the LoRA code.
    """
    return not (t.is_floating_point() and t.numel()) or bool(torch.isfinite(t.abs().amax()))


@dataclass
class LoRAWeights:
    """One LoRA pair in the layer's full (unsharded) logical layout.

    Attributes:
        lora_A: ``[r, in_features]``, the down projection (PEFT ``lora_A``, kohya ``lora_down``).
        lora_B: ``[out_features_of_shard, r]``, the up projection (PEFT ``lora_B``, kohya ``lora_up``).
            For a fused layer the rows are those of one shard (``q``, ``k``, ``v``, gate/up) when
            the weights are keyed by that shard id, else the whole fused output.
        scale: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA); the user's strength is NOT folded in.
        offset: optional ``[out_features_of_shard]`` constant added to the output, scaled like the
            delta (some LoRA files carry a bias term, e.g. ``lora_B.bias`` / ``diff_b``).

    The delta this pair adds to ``y = x W^T`` is ``strength * scale * ((x A^T) B^T + offset)``,
    i.e. ``W' = W + strength * scale * B A`` (Hu et al., 2021, "LoRA", eq. 3; peft's ``LoraLayer``).
    """

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scale: float = 1.0
    offset: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])

    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` in fp32, shape ``[out, in]`` (reference form, used by tests and merge)."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())
