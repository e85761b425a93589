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
        offset: optional ``[out_features_of_shard]`` constant added to the output, i.e. a bias
            delta (``lora_B.bias`` of a peft LoRA with a bias, ``diff_b`` of ComfyUI-style files).
        offset_scale: what ``offset`` is multiplied by besides the strength; ``None``: ``scale``
            (peft scales ``lora_B``'s bias with the delta). A ``diff_b`` is added at the user's
            strength only (ComfyUI), so its ``offset_scale`` is 1.

    The delta this pair adds to ``y = x W^T`` is
    ``strength * (scale * (x A^T) B^T + offset_scale * offset)``, i.e.
    ``W' = W + strength * scale * B A`` (Hu et al., 2021, "LoRA", eq. 3; peft's ``LoraLayer``) and
    ``b' = b + strength * offset_scale * offset``. A pair with an offset may have rank 0
    (``A [0, in]``, ``B [out, 0]``): a bias delta alone.
    """

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scale: float = 1.0
    offset: torch.Tensor | None = None
    offset_scale: float | None = None

    @property
    def effective_offset_scale(self) -> float:
        """The multiplier of ``offset`` besides the strength (``offset_scale``, else ``scale``)."""
        return float(self.scale if self.offset_scale is None else self.offset_scale)

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])

    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` in fp32, shape ``[out, in]`` (reference form, used by tests and merge)."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())
