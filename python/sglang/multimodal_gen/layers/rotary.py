"""Multi-axis rotary position embeddings (RoPE) on interleaved channel pairs.

Each token has a position per axis (caption index / frame, row, column); axis ``i`` owns
``axes_dims[i]`` channels of every head (``sum(axes_dims) == head_dim``). Channels ``(2j, 2j+1)``
of an axis form one pair rotated by ``pos * theta ** (-2j / d)``. Two table forms, each with
the rotation that consumes it:

* complex64 ``exp(i * angle)`` tables (:class:`MultiAxisRope`, integer positions looked up in
  precomputed tables) and :func:`apply_rope_complex`, one complex64 product per pair: diffusers
  0.42.1's ``RopeEmbedder`` + ``apply_rotary_emb`` in ``transformer_z_image.py``, and
  ``apply_rotary_emb_qwen(use_real=False)`` in ``transformer_qwenimage.py``;
* real ``(cos, sin)`` tables with one value per pair (:class:`MultiAxisRopeReal`, from arbitrary
  position ids) and :func:`apply_rope_real`: diffusers' ``get_1d_rotary_pos_embed(use_real=True)``
  + ``apply_rotary_emb(use_real=True)`` (``embeddings.py``; the reference repeats every value for
  both channels of its pair, we keep one).

The inverse frequencies and angles are computed in float64 and rounded to fp32; the rotation runs
in fp32 and the result is cast back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MultiAxisRope", "MultiAxisRopeReal", "apply_rope_complex", "apply_rope_real"]


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


def apply_rope_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs ``(a, b)`` of ``x`` as the complex number ``a + ib`` times
    its rotation.

    Args:
        x: ``[B, S, H, D]`` any float dtype (``D`` even).
        freqs: complex64 rotations broadcast over the heads, ``[S, D // 2]`` (one table for the
            batch) or ``[B, S, D // 2]`` (per item), e.g. from :class:`MultiAxisRope`.

    Returns:
        ``[B, S, H, D]`` in ``x.dtype``, computed in complex64 (fp32) arithmetic: diffusers'
        ``apply_rotary_emb(use_real=False)`` of ``transformer_z_image.py`` and
        ``apply_rotary_emb_qwen(use_real=False)`` of ``transformer_qwenimage.py``, same operations.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs.unsqueeze(-2)).flatten(3).to(x.dtype)


class MultiAxisRopeReal(nn.Module):
    """Multi-axis rotary tables as real ``(cos, sin)``, one value per channel pair, from arbitrary
    position ids (diffusers' ``FluxPosEmbed`` in ``transformer_flux.py``, built on
    ``get_1d_rotary_pos_embed(use_real=True, repeat_interleave_real=True)`` of ``embeddings.py``).

    For position ``p`` on axis ``i`` and pair ``j < axes_dims[i] / 2`` the angle is
    ``p * theta ** (-2j / axes_dims[i])``. As the reference: positions are cast to fp32, inverse
    frequencies, angles, ``cos`` and ``sin`` are computed in float64 and the tables rounded to fp32
    (float64 on devices that have it; MPS computes on the CPU and copies). The reference repeats
    each value for both channels of its pair; :func:`apply_rope_real` reads one per pair.

    Shapes: ``ids [S, n_axes]`` (any numeric dtype) -> ``(cos, sin)``, each ``[S, head_dim // 2]``
    fp32 on ``ids.device``. No parameters.

    Raises:
        ValueError: ``ids`` is not ``[S, len(axes_dims)]``.
    """

    def __init__(self, theta: float, axes_dims: Sequence[int]):
        super().__init__()
        self.theta = float(theta)
        self.axes_dims = tuple(int(d) for d in axes_dims)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if ids.ndim != 2 or ids.shape[-1] != len(self.axes_dims):
            raise ValueError(
                f"position ids must be [S, {len(self.axes_dims)}], got {list(ids.shape)}"
            )
        out_device = ids.device
        work = ids if ids.device.type in ("cpu", "cuda") else ids.cpu()
        pos = work.float().to(torch.float64)  # the reference's fp32 positions, widened exactly
        cos_parts, sin_parts = [], []
        for axis, dim in enumerate(self.axes_dims):
            exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=work.device) / dim
            inv_freq = 1.0 / (self.theta**exponents)  # [dim / 2]
            angles = torch.outer(pos[:, axis], inv_freq)  # [S, dim / 2] float64
            cos_parts.append(angles.cos().float())
            sin_parts.append(angles.sin().float())
        cos = torch.cat(cos_parts, dim=-1).to(out_device)
        sin = torch.cat(sin_parts, dim=-1).to(out_device)
        return cos, sin

    def extra_repr(self) -> str:
        return f"theta={self.theta}, axes_dims={list(self.axes_dims)}"


def apply_rope_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs ``(a, b) -> (a cos - b sin, a sin + b cos)``.

    Args:
        x: ``[B, S, H, D]`` any float dtype.
        cos, sin: ``[S, D / 2]`` fp32, one value per pair (from :class:`MultiAxisRopeReal`, or a
            family's own tables), broadcast over batch and heads; moved to ``x.device``.

    Returns:
        ``[B, S, H, D]`` in ``x.dtype``; the products and sums in fp32 (the tables' dtype), one
        rounding at the end. The same values as diffusers' ``apply_rotary_emb(use_real=True,
        use_real_unbind_dim=-1)`` (``embeddings.py``; ``x * cos + rot(x) * sin`` with the
        repeated tables: each output is the same two fp32 products and one fp32 sum) and as the
        rotation in ``WanAttnProcessor`` (``transformer_wan.py``), same operations.
    """
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    c = cos[None, :, None, :].to(x.device)
    s = sin[None, :, None, :].to(x.device)
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)
