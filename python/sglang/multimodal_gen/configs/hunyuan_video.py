"""Architecture config of the HunyuanVideo 1.0 DiT (``HunyuanVideoTransformer3DModel`` in
diffusers).

Read from the ``transformer/config.json`` of a diffusers-format model directory. Field names and
defaults are those of diffusers' ``HunyuanVideoTransformer3DModel.__init__`` (diffusers 0.42.1,
``models/transformers/transformer_hunyuan_video.py``); the defaults are the 13B text-to-video
model's shapes (24 heads x 128 = 3072 wide, 20 dual-stream and 40 single-stream blocks, 2 token
refiner blocks, LLaVA-Llama-3 text features of 4096 and pooled CLIP-L features of 768).

Text-to-video and image conditioning by channel concatenation (``image_condition_type=
"latent_concat"``, which only changes ``in_channels``) are implemented; the ``"token_replace"``
image-to-video variant (its own first-frame modulation) is refused with a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sglang.multimodal_gen.configs.base import DiffusersConfig

__all__ = [
    "HUNYUAN_VIDEO_TRANSFORMER_CLASS",
    "HunyuanVideoArchConfig",
    "hunyuan_video_tp_divisors",
]

HUNYUAN_VIDEO_TRANSFORMER_CLASS = "HunyuanVideoTransformer3DModel"
_IMAGE_CONDITION_TYPES = (None, "latent_concat")


@dataclass
class HunyuanVideoArchConfig(DiffusersConfig):
    """Shapes of one HunyuanVideo 1.0 transformer.

    Attributes mirror the diffusers config. ``out_channels`` ``None`` / ``0`` means
    ``in_channels`` (resolved in ``__post_init__``, as the diffusers model does). Derived:
    ``inner_dim = num_attention_heads * attention_head_dim`` (the model width ``D``),
    ``mlp_hidden = int(inner_dim * mlp_ratio)`` (dual-block FFN and single-block MLP width),
    ``refiner_mlp_hidden = int(inner_dim * 4.0)`` (the token refiner's FFN: diffusers builds it
    with its default ratio, not ``mlp_ratio``), ``patch_volume = patch_size_t * patch_size ** 2``
    and ``out_features = patch_volume * out_channels`` (the final projection's width).

    Raises:
        ValueError: naming the field: ``qk_norm`` other than ``"rms_norm"``,
            ``image_condition_type="token_replace"`` (not implemented) or unknown,
            ``sum(rope_axes_dim) != attention_head_dim``, an odd or non-positive RoPE axis, a
            non-positive size or ``rope_theta``, negative block counts.
    """

    DIFFUSERS_CLASS: ClassVar[str] = HUNYUAN_VIDEO_TRANSFORMER_CLASS

    in_channels: int = 16
    out_channels: int | None = 16
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 20
    num_single_layers: int = 40
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 2
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    guidance_embeds: bool = True
    text_embed_dim: int = 4096
    pooled_projection_dim: int = 768
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)
    image_condition_type: str | None = None
    extra: dict = field(default_factory=dict)

    # constants of the architecture (hard-coded in the reference)
    NORM_EPS = 1e-6  # every LayerNorm and the q/k RMSNorms
    T_FREQ_DIM = 256  # sinusoidal features of the timestep / guidance embedders
    REFINER_MLP_RATIO = 4.0

    def __post_init__(self):
        if isinstance(self.rope_axes_dim, int):
            raise ValueError(
                f"HunyuanVideo config: rope_axes_dim={self.rope_axes_dim!r} must be three ints"
            )
        self.rope_axes_dim = tuple(int(d) for d in self.rope_axes_dim)
        if not self.out_channels:
            self.out_channels = self.in_channels
        self.guidance_embeds = bool(self.guidance_embeds)
        self.mlp_ratio = float(self.mlp_ratio)
        self.rope_theta = float(self.rope_theta)
        if self.qk_norm != "rms_norm":
            raise ValueError(
                f"HunyuanVideo config: qk_norm={self.qk_norm!r} is not supported; only "
                "'rms_norm' (the released models' value) is implemented"
            )
        if self.image_condition_type not in _IMAGE_CONDITION_TYPES:
            raise ValueError(
                f"HunyuanVideo config: image_condition_type={self.image_condition_type!r} is not "
                "supported; implemented: null (text to video) and 'latent_concat' (the "
                "'token_replace' image-to-video variant is not)"
            )
        for name in (
            "in_channels",
            "out_channels",
            "num_attention_heads",
            "attention_head_dim",
            "patch_size",
            "patch_size_t",
            "text_embed_dim",
            "pooled_projection_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(
                    f"HunyuanVideo config: {name}={getattr(self, name)} must be positive"
                )
        for name in ("num_layers", "num_single_layers", "num_refiner_layers"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"HunyuanVideo config: {name}={getattr(self, name)} must be >= 0")
        if self.mlp_ratio <= 0 or self.mlp_hidden <= 0:
            raise ValueError(f"HunyuanVideo config: mlp_ratio={self.mlp_ratio} must be positive")
        if self.rope_theta <= 0:
            raise ValueError(f"HunyuanVideo config: rope_theta={self.rope_theta} must be positive")
        if len(self.rope_axes_dim) != 3 or any(d <= 0 or d % 2 for d in self.rope_axes_dim):
            raise ValueError(
                f"HunyuanVideo config: rope_axes_dim={list(self.rope_axes_dim)} must be three "
                "positive even channel counts (frames, rows, columns)"
            )
        if sum(self.rope_axes_dim) != self.attention_head_dim:
            raise ValueError(
                f"HunyuanVideo config: sum(rope_axes_dim)={sum(self.rope_axes_dim)} "
                f"(rope_axes_dim={list(self.rope_axes_dim)}) must equal "
                f"attention_head_dim={self.attention_head_dim}"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)

    @property
    def refiner_mlp_hidden(self) -> int:
        return int(self.inner_dim * self.REFINER_MLP_RATIO)

    @property
    def patch_volume(self) -> int:
        return self.patch_size_t * self.patch_size * self.patch_size

    @property
    def out_features(self) -> int:
        return self.patch_volume * self.out_channels


def hunyuan_video_tp_divisors(cfg: HunyuanVideoArchConfig) -> dict[str, int]:
    """The numbers every TP size must divide (``ModelFamily.tp_divisors``): the attention heads
    (split over the ranks in every block and in the token refiner), the dual/single-block MLP
    width and the token refiner's FFN width."""
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "mlp_hidden": cfg.mlp_hidden,
        "refiner_mlp_hidden": cfg.refiner_mlp_hidden,
    }
