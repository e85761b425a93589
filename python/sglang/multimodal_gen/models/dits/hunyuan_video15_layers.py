"""The conditioning embedders and blocks of the HunyuanVideo 1.5 DiT, on our parallel layers.

Follows diffusers 0.42.1 ``models/transformers/transformer_hunyuan_video15.py`` (module names are
diffusers', except the fused q/k/v projections, see ``hunyuan_video15_names.py``):

* :class:`HunyuanVideo15TimeEmbedding`: ``time_embed`` (sinusoid of 256 features, cos first, then a
  SiLU MLP; with ``use_meanflow`` a second one for ``timestep_r``, summed);
* :class:`HunyuanVideo15ByT5Projection`: ``context_embedder_2`` (LayerNorm, three linears, exact
  GELU between them) on the ByT5 glyph features;
* :class:`HunyuanVideo15ImageProjection`: ``image_embedder`` (LayerNorm, linear, GELU, linear,
  LayerNorm) on the SigLIP image features;

The token refiner (``context_embedder``) is 1.0's ``hunyuan_video_layers.HunyuanVideoTokenRefiner``
(diffusers' ``HunyuanVideo15TokenRefiner`` differs from 1.0's only in not forcing the first key
on: ``first_key_always=False``); the dual-stream blocks are the shared
``layers.mmdit.DualStreamBlock`` (see ``hunyuan_video15.py``).

Tensor parallelism: the embedders here (conditioning vectors, ByT5 / image projections) are
replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.hunyuan_video15 import HunyuanVideo15ArchConfig
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding, timestep_sinusoid
from sglang.multimodal_gen.layers.linear import ReplicatedLinear

__all__ = [
    "HunyuanVideo15ByT5Projection",
    "HunyuanVideo15ImageProjection",
    "HunyuanVideo15TimeEmbedding",
]


# ------------------------------------------------------------------------------ conditioning
class HunyuanVideo15TimeEmbedding(nn.Module):
    """``time_embed``: ``timestep_embedder(sinusoid(t))`` (+ ``timestep_embedder_r(sinusoid(r))``
    for MeanFlow models given ``timestep_r``); diffusers' ``HunyuanVideo15TimeEmbedding``.

    Shapes: ``t [B]`` (the scheduler's timestep, ``[0, 1000]``), ``r [B] | None`` -> ``[B, D]`` in
    ``dtype`` (the sinusoid is computed in fp32 and cast to ``dtype`` before the MLP).
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, **kw):
        super().__init__()
        f, d = cfg.T_FREQ_DIM, cfg.inner_dim
        self.freq_dim = f
        self.timestep_embedder = TimestepEmbedding(f, d, f"{prefix}.timestep_embedder", **kw)
        self.timestep_embedder_r = (
            TimestepEmbedding(f, d, f"{prefix}.timestep_embedder_r", **kw)
            if cfg.use_meanflow
            else None
        )

    def forward(self, t: torch.Tensor, dtype: torch.dtype, r: torch.Tensor | None = None):
        emb = self.timestep_embedder(timestep_sinusoid(t, self.freq_dim).to(dtype))
        if r is not None:
            if self.timestep_embedder_r is None:
                raise ValueError(
                    "timestep_r is given but this model has no MeanFlow embedder "
                    "(use_meanflow=False)"
                )
            emb = emb + self.timestep_embedder_r(timestep_sinusoid(r, self.freq_dim).to(dtype))
        return emb


class HunyuanVideo15ByT5Projection(nn.Module):
    """``context_embedder_2``: ``linear_3(gelu(linear_2(gelu(linear_1(LayerNorm(x))))))`` with an
    affine LayerNorm (eps 1e-5) and exact GELU (diffusers' ``HunyuanVideo15ByT5TextProjection``).

    Shapes: ``[B, L2, text_embed_2_dim]`` -> ``[B, L2, D]``.
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, **kw):
        super().__init__()
        i, h, d = cfg.text_embed_2_dim, cfg.BYT5_HIDDEN, cfg.inner_dim
        self.norm = nn.LayerNorm(i, dtype=kw.get("params_dtype"))
        self.linear_1 = ReplicatedLinear(i, h, prefix=f"{prefix}.linear_1", **kw)
        self.linear_2 = ReplicatedLinear(h, h, prefix=f"{prefix}.linear_2", **kw)
        self.linear_3 = ReplicatedLinear(h, d, prefix=f"{prefix}.linear_3", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.linear_1(self.norm(x))[0])
        h = F.gelu(self.linear_2(h)[0])
        return self.linear_3(h)[0]


class HunyuanVideo15ImageProjection(nn.Module):
    """``image_embedder``: ``norm_out(linear_2(gelu(linear_1(norm_in(x)))))``, affine LayerNorms
    (eps 1e-5), exact GELU (diffusers' ``HunyuanVideo15ImageProjection``).

    Shapes: ``[B, N_img, image_embed_dim]`` -> ``[B, N_img, D]``.
    """

    def __init__(self, cfg: HunyuanVideo15ArchConfig, prefix: str, **kw):
        super().__init__()
        i, d = cfg.image_embed_dim, cfg.inner_dim
        dtype = kw.get("params_dtype")
        self.norm_in = nn.LayerNorm(i, dtype=dtype)
        self.linear_1 = ReplicatedLinear(i, i, prefix=f"{prefix}.linear_1", **kw)
        self.linear_2 = ReplicatedLinear(i, d, prefix=f"{prefix}.linear_2", **kw)
        self.norm_out = nn.LayerNorm(d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.linear_1(self.norm_in(x))[0])
        return self.norm_out(self.linear_2(h)[0])
