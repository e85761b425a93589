"""Architecture config of the Wan2.1 / Wan2.2 video DiT (``WanTransformer3DModel`` in diffusers).

Read from the ``transformer/config.json`` (and, for the two-expert Wan2.2 A14B models, the
``transformer_2/config.json``) of a diffusers-format model directory. Field names and defaults
are those of diffusers' ``WanTransformer3DModel.__init__`` (diffusers 0.42.1,
``models/transformers/transformer_wan.py``); the defaults are the Wan2.1 14B shapes, which the two
Wan2.2 A14B experts share. Wan2.2 TI2V-5B sets ``num_attention_heads=24`` (``inner_dim`` 3072),
``ffn_dim=14336``, ``num_layers=30``, ``in_channels=out_channels=48``.

Only text-to-video conditioning is implemented: the image-embedding branch of the Wan2.1 I2V /
FLF2V models (``image_dim``, ``added_kv_proj_dim``) is refused with a ``ValueError``. Image
conditioning by channel concatenation (Wan2.2 I2V-A14B, ``in_channels=36``) needs no extra module
and is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from sglang.multimodal_gen.configs.base import DiffusersConfig
from sglang.multimodal_gen.configs.sampling_params import VideoSamplingParams, param

WAN_TRANSFORMER_CLASS = "WanTransformer3DModel"

# the only q/k norm diffusers 0.42.1 builds (it ignores the field and always uses this one)
WAN_QK_NORM = "rms_norm_across_heads"


@dataclass
class WanArchConfig(DiffusersConfig):
    """Shapes of one Wan transformer.

    Attributes mirror the diffusers config. ``out_channels`` ``None`` / ``0`` means
    ``in_channels`` (resolved in ``__post_init__``, as the diffusers model does); ``patch_size``
    is ``(p_t, p_h, p_w)``. Derived: ``inner_dim = num_attention_heads * attention_head_dim`` (the
    model width ``D``), ``out_features = out_channels * p_t * p_h * p_w`` (the final projection's
    width), ``rope_dims = (t_dim, h_dim, w_dim)`` (RoPE channels of each head per axis:
    ``h_dim = w_dim = 2 * (attention_head_dim // 6)``, ``t_dim`` the rest).

    ``pos_embed_seq_len`` is only used by the image embedder, so it is accepted and ignored when
    ``image_dim`` is ``None`` (as in diffusers).

    Raises:
        ValueError: ``image_dim`` or ``added_kv_proj_dim`` set (image-embedding I2V is not
            implemented), ``qk_norm`` other than ``"rms_norm_across_heads"``, an odd
            ``attention_head_dim``, a ``patch_size`` that is not three positive ints, or a
            non-positive size.
    """

    DIFFUSERS_CLASS: ClassVar[str] = WAN_TRANSFORMER_CLASS

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = WAN_QK_NORM
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None
    extra: dict = field(default_factory=dict)

    # constants of the architecture (hard-coded in the reference)
    ROPE_THETA = 10000.0
    MODULATION_CHUNKS = 6  # shift/scale/gate for self-attention and for the FFN, per block

    def __post_init__(self):
        if isinstance(self.patch_size, int) or len(self.patch_size) != 3:
            raise ValueError(
                f"Wan config: patch_size={self.patch_size!r} must be three ints (p_t, p_h, p_w)"
            )
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if not self.out_channels:
            self.out_channels = self.in_channels
        self.cross_attn_norm = bool(self.cross_attn_norm)
        self.eps = float(self.eps)
        if self.image_dim is not None or self.added_kv_proj_dim is not None:
            raise ValueError(
                f"Wan config: image_dim={self.image_dim}, added_kv_proj_dim="
                f"{self.added_kv_proj_dim}: the image-embedding (CLIP) branch of Wan2.1 I2V/FLF2V "
                "is not implemented; only text-to-video transformers (image_dim=null, "
                "added_kv_proj_dim=null) are supported"
            )
        if self.qk_norm != WAN_QK_NORM:
            raise ValueError(
                f"Wan config: qk_norm={self.qk_norm!r} is not supported; diffusers 0.42.1 always "
                f"builds {WAN_QK_NORM!r} (RMSNorm over all heads), which is the only one we "
                "implement"
            )
        for name in (
            "num_attention_heads",
            "attention_head_dim",
            "in_channels",
            "out_channels",
            "text_dim",
            "freq_dim",
            "ffn_dim",
            "rope_max_seq_len",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Wan config: {name}={getattr(self, name)} must be positive")
        if any(p <= 0 for p in self.patch_size):
            raise ValueError(f"Wan config: patch_size={list(self.patch_size)} must be positive")
        if self.num_layers < 0:
            raise ValueError(f"Wan config: num_layers={self.num_layers} must be >= 0")
        if self.attention_head_dim % 2:
            raise ValueError(
                f"Wan config: attention_head_dim={self.attention_head_dim} must be even (RoPE "
                "rotates channel pairs)"
            )
        if self.freq_dim % 2:
            raise ValueError(f"Wan config: freq_dim={self.freq_dim} must be even")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_features(self) -> int:
        return self.out_channels * math.prod(self.patch_size)

    @property
    def rope_dims(self) -> tuple[int, int, int]:
        """``(t_dim, h_dim, w_dim)``: RoPE channels of a head for frames, rows, columns."""
        hw = 2 * (self.attention_head_dim // 6)
        return (self.attention_head_dim - 2 * hw, hw, hw)


@dataclass(frozen=True)
class WanSamplingParams(VideoSamplingParams):
    """Request fields of Wan2.x models: those of every video model plus the second expert's
    guidance of two-expert models (``WanPipeline``'s ``guidance_scale_2``)."""

    guidance_scale_2: float | None = param(
        "scale",
        "guidance weight of the second (low-noise) expert of two-expert models (default: the "
        "model's)",
    )
