"""Multi-axis rotary position embeddings (RoPE) on interleaved channel pairs.

Used by Z-Image: each token has an integer position per axis (caption index / frame, row, column);
axis ``i`` owns ``axes_dims[i]`` channels of every head (``sum(axes_dims) == head_dim``). Channels
``(2j, 2j+1)`` of an axis form one complex number rotated by ``pos * theta ** (-2j / d)``.

Numerics follow diffusers' ``RopeEmbedder`` + ``apply_rotary_emb`` in ``transformer_z_image.py``
(0.42): the inverse frequencies and angles are computed in float64 and rounded to fp32 angles;
the rotation is one complex64 product per channel pair (``exp(i * angle)`` tables) and the result
is cast back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class MultiAxisRope:
    """Precomputed rotation tables (complex64 ``exp(i * angle)``) for each axis.

    Args:
        theta: RoPE base.
        axes_dims: channels per axis (each even); ``sum == head_dim``.
        axes_lens: table length per axis (positions must be ``< axes_lens[i]``).

    ``__call__(pos_ids [N, n_axes] int) -> [N, head_dim // 2]`` complex64.
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
        self._tables: dict[torch.device, list[torch.Tensor]] = {}

    def _build(self) -> list[torch.Tensor]:
        tables = []
        for d, n in zip(self.axes_dims, self.axes_lens):
            inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
            ang = torch.outer(torch.arange(n, dtype=torch.float64), inv).float()
            tables.append(torch.polar(torch.ones_like(ang), ang))
        return tables

    def tables(self, device: torch.device) -> list[torch.Tensor]:
        device = torch.device(device)
        if device not in self._tables:
            cpu = self._tables.get(torch.device("cpu")) or self._build()
            self._tables[torch.device("cpu")] = cpu
            self._tables[device] = [t.to(device) for t in cpu]
        return self._tables[device]

    def __call__(self, pos_ids: torch.Tensor) -> torch.Tensor:
        if pos_ids.ndim != 2 or pos_ids.shape[-1] != len(self.axes_dims):
            raise ValueError(
                f"pos_ids must be [N, {len(self.axes_dims)}], got {tuple(pos_ids.shape)}"
            )
        pos_ids = pos_ids.long()
        parts = [t[pos_ids[:, i]] for i, t in enumerate(self.tables(pos_ids.device))]
        return torch.cat(parts, dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x``.

    Args:
        x: ``[B, S, H, D]`` any float dtype (``D`` even).
        cis: ``[B, S, D // 2]`` complex64 rotations (broadcast over heads).

    Returns:
        ``[B, S, H, D]`` in ``x.dtype``: pair ``(a, b)`` is multiplied, as ``a + ib``, by its
        rotation in complex64 (fp32) arithmetic.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * cis.unsqueeze(2)).flatten(3).to(x.dtype)
