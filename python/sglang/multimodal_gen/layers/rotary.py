"""Multi-axis rotary position embeddings (RoPE) on interleaved channel pairs.

Used by Z-Image: each token has an integer position per axis (caption index / frame, row, column);
axis ``i`` owns ``axes_dims[i]`` channels of every head (``sum(axes_dims) == head_dim``). Channels
``(2j, 2j+1)`` of an axis form one complex number rotated by ``pos * theta ** (-2j / d)``.

Numerics follow diffusers' ``RopeEmbedder`` + ``apply_rotary_emb`` in ``transformer_z_image.py``
(0.42): the inverse frequencies and angles are computed in float64 and rounded to fp32 angles;
the rotation runs in fp32 and the result is cast back to the input dtype. We keep ``cos``/``sin``
tables instead of complex tensors (same values; the complex product is written out).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class MultiAxisRope:
    """Precomputed cos/sin tables for each axis.

    Args:
        theta: RoPE base.
        axes_dims: channels per axis (each even); ``sum == head_dim``.
        axes_lens: table length per axis (positions must be ``< axes_lens[i]``).

    ``__call__(pos_ids [N, n_axes] int) -> (cos, sin)``, each ``[N, head_dim // 2]`` fp32.
    """

    def __init__(self, theta: float, axes_dims: Sequence[int], axes_lens: Sequence[int]):
        if len(axes_dims) != len(axes_lens):
            raise ValueError(
                f"axes_dims {list(axes_dims)} and axes_lens {list(axes_lens)} differ in length"
            )
        for d in axes_dims:
            if d % 2:
                raise ValueError(
                    f"every RoPE axis needs an even channel count, got {list(axes_dims)}"
                )
        self.theta = float(theta)
        self.axes_dims = tuple(int(d) for d in axes_dims)
        self.axes_lens = tuple(int(n) for n in axes_lens)
        self._tables: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _build(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tables = []
        for d, n in zip(self.axes_dims, self.axes_lens):
            inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            ang = torch.outer(torch.arange(n, dtype=torch.float64), inv).float()
            tables.append((torch.cos(ang), torch.sin(ang)))
        return tables

    def tables(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        device = torch.device(device)
        if device not in self._tables:
            cpu = self._tables.get(torch.device("cpu")) or self._build()
            self._tables[torch.device("cpu")] = cpu
            self._tables[device] = [(c.to(device), s.to(device)) for c, s in cpu]
        return self._tables[device]

    def __call__(self, pos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if pos_ids.ndim != 2 or pos_ids.shape[-1] != len(self.axes_dims):
            raise ValueError(
                f"pos_ids must be [N, {len(self.axes_dims)}], got {tuple(pos_ids.shape)}"
            )
        pos_ids = pos_ids.long()
        cos, sin = [], []
        for i, (c, s) in enumerate(self.tables(pos_ids.device)):
            cos.append(c[pos_ids[:, i]])
            sin.append(s[pos_ids[:, i]])
        return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x``.

    Args:
        x: ``[B, S, H, D]`` any float dtype (``D`` even).
        cos, sin: ``[B, S, D // 2]`` fp32 (broadcast over heads).

    Returns:
        ``[B, S, H, D]`` in ``x.dtype``: pair ``(a, b)`` becomes ``(a c - b s, a s + b c)``,
        computed in fp32.
    """
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c = cos.unsqueeze(2)
    s = sin.unsqueeze(2)
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return out.to(x.dtype)
