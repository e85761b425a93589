"""The Qwen-Image DiT's RoPE tables (complex, with the reference's positive/negative position
tables) and its timestep embedding.

Same numerics as diffusers 0.42.1 ``models/transformers/transformer_qwenimage.py``; the blocks
and the model are in :mod:`sglang.multimodal_gen.models.dits.qwen_image`. The shared pieces
(the complex rotation, the sinusoid and MLP of the timestep embedding, the continuous adaLN
output norm) are in ``layers/``.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.multimodal_gen.configs.qwen_image import QwenImageArchConfig
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding, timestep_sinusoid

__all__ = ["QwenImageRope", "QwenTimeTextEmbed"]

ROPE_TABLE_LEN = 4096  # positions per direction the reference tabulates


# --------------------------------------------------------------------------------------- RoPE
def _rope_table(index: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
    """``exp(i * p * theta ** (-2j / dim))`` for positions ``index [N]`` (int64) and pairs
    ``j < dim / 2``: ``[N, dim / 2]`` complex64, computed in fp32 as the reference's
    ``QwenEmbedRope.rope_params``."""
    inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))
    angles = torch.outer(index, inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


class QwenImageRope(nn.Module):
    """Qwen-Image's 3-axis complex rotary tables (diffusers' ``QwenEmbedRope(scale_rope=True)``).

    Head channel pairs are split ``axes_dims / 2`` between the frame, height and width axes. For
    image ``idx`` of shape ``(F, H, W)`` (several images are concatenated, e.g. the edit
    model's conditioning images), token ``(f, h, w)`` gets frame position ``idx + f``, height
    position ``h - (H - H // 2)`` and width position ``w - (W - W // 2)`` (the grid is centred:
    ``-(H - H//2) .. H//2 - 1``). Text token ``s`` gets position ``m + s`` on all three axes with
    ``m = max(H // 2, W // 2)`` over the images. The tables are those of the reference bit for
    bit: the same fp32 formula evaluated over ``[0, 4096)`` and ``[-4096, -1]`` and then indexed.

    Shapes: :meth:`forward` returns ``(img [S_img, hd / 2], txt [S_txt, hd / 2])`` complex64.
    No parameters (the tables are plain attributes, cached per device).
    """

    def __init__(self, theta: float, axes_dims):
        super().__init__()
        self.theta = theta
        self.axes_dims = tuple(int(d) for d in axes_dims)
        pos = torch.arange(ROPE_TABLE_LEN)
        neg = torch.arange(ROPE_TABLE_LEN).flip(0) * -1 - 1
        # not buffers: .to(dtype) must never touch complex tables
        self._pos = torch.cat([_rope_table(pos, d, theta) for d in self.axes_dims], dim=1)
        self._neg = torch.cat([_rope_table(neg, d, theta) for d in self.axes_dims], dim=1)
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._cache:
            self._cache[device] = (self._pos.to(device), self._neg.to(device))
        return self._cache[device]

    def _image(self, f: int, h: int, w: int, idx: int, pos, neg) -> torch.Tensor:
        sizes = [d // 2 for d in self.axes_dims]
        pf, ph, pw = pos.split(sizes, dim=1)
        _, nh, nw = neg.split(sizes, dim=1)
        frame = pf[idx : idx + f].view(f, 1, 1, -1).expand(f, h, w, -1)
        height = torch.cat([nh[-(h - h // 2) :], ph[: h // 2]], dim=0)
        height = height.view(1, h, 1, -1).expand(f, h, w, -1)
        width = torch.cat([nw[-(w - w // 2) :], pw[: w // 2]], dim=0)
        width = width.view(1, 1, w, -1).expand(f, h, w, -1)
        return torch.cat([frame, height, width], dim=-1).reshape(f * h * w, -1)

    def forward(
        self, shapes: list[tuple[int, int, int]], txt_len: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for the images ``shapes`` (``[(F, H, W), ...]`` of one batch item, in token
        order) and ``txt_len`` text tokens.

        Raises:
            ValueError: a position beyond the reference's 4096-entry tables.
        """
        pos, neg = self._tables(torch.device(device))
        parts, m = [], 0
        for idx, (f, h, w) in enumerate(shapes):
            if idx + f > ROPE_TABLE_LEN or max(h, w) > 2 * ROPE_TABLE_LEN:
                raise ValueError(f"Qwen-Image RoPE: image shape {(f, h, w)} exceeds the tables")
            parts.append(self._image(int(f), int(h), int(w), idx, pos, neg))
            m = max(h // 2, w // 2, m)
        if m + txt_len > ROPE_TABLE_LEN:
            raise ValueError(
                f"Qwen-Image RoPE: {txt_len} text tokens after image offset {m} exceed the "
                f"{ROPE_TABLE_LEN} positions of the reference's tables"
            )
        return torch.cat(parts, dim=0), pos[m : m + txt_len]

    def extra_repr(self) -> str:
        return f"theta={self.theta}, axes_dims={list(self.axes_dims)}"


# --------------------------------------------------------------------------------- embeddings
class QwenTimeTextEmbed(nn.Module):
    """``temb = timestep_embedder(sinusoid(1000 t))`` (diffusers' ``QwenTimestepProjEmbeddings``
    without the additional-t embedding).

    Shapes: ``t [B]`` (already in the model dtype) -> ``[B, D]`` in ``dtype``.
    """

    def __init__(self, cfg: QwenImageArchConfig, prefix: str, **kw):
        super().__init__()
        self.freq_dim = cfg.T_FREQ_DIM
        self.scale = cfg.TIMESTEP_SCALE
        self.timestep_embedder = TimestepEmbedding(
            cfg.T_FREQ_DIM, cfg.inner_dim, f"{prefix}.timestep_embedder", **kw
        )

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        features = timestep_sinusoid(t, self.freq_dim, scale=self.scale)
        return self.timestep_embedder(features.to(dtype))
