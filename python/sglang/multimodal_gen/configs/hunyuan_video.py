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
    "HunyuanVideoDims",
    "hunyuan_video_tp_divisors",
]

HUNYUAN_VIDEO_TRANSFORMER_CLASS = "HunyuanVideoTransformer3DModel"
_IMAGE_CONDITION_TYPES = (None, "latent_concat")


class HunyuanVideoDims:
    """What the HunyuanVideo 1.0 and 1.5 configs share (a base of both dataclasses): the
    reference's hard-coded constants, the derived widths and the checks of the shared fields.

    The subclass has the fields ``num_attention_heads``, ``attention_head_dim``, ``mlp_ratio``,
    ``patch_size``, ``patch_size_t``, ``out_channels``, ``qk_norm``, ``rope_theta`` and
    ``rope_axes_dim`` and names its model in ``MODEL`` (the errors' prefix).

    Derived: ``inner_dim = num_attention_heads * attention_head_dim`` (the width ``D``),
    ``mlp_hidden = int(D * mlp_ratio)`` (the blocks' feed-forward width), ``refiner_mlp_hidden =
    int(D * 4.0)`` (the token refiner's: diffusers builds it with its default ratio whatever
    ``mlp_ratio`` is), ``patch_volume = patch_size_t * patch_size ** 2``, ``out_features =
    patch_volume * out_channels`` (the final projection's width).
    """

    MODEL: ClassVar[str] = "HunyuanVideo"
    NORM_EPS: ClassVar[float] = 1e-6  # every LayerNorm and the q/k RMSNorms
    T_FREQ_DIM: ClassVar[int] = 256  # sinusoidal features of the timestep / guidance embedders
    REFINER_MLP_RATIO: ClassVar[float] = 4.0

    def _check_shared(self, positive: tuple[str, ...], counts: tuple[str, ...]) -> None:
        """Normalises ``rope_axes_dim`` / ``mlp_ratio`` / ``rope_theta`` / ``out_channels`` and
        checks them, ``qk_norm``, the ``positive`` sizes and the non-negative block ``counts``.

        Raises:
            ValueError: naming the field (prefixed ``"<MODEL> config:"``).
        """
        what = f"{self.MODEL} config"
        if isinstance(self.rope_axes_dim, int):
            raise ValueError(f"{what}: rope_axes_dim={self.rope_axes_dim!r} must be three ints")
        self.rope_axes_dim = tuple(int(d) for d in self.rope_axes_dim)
        if not self.out_channels:
            self.out_channels = self.in_channels
        self.mlp_ratio = float(self.mlp_ratio)
        self.rope_theta = float(self.rope_theta)
        if self.qk_norm != "rms_norm":
            raise ValueError(
                f"{what}: qk_norm={self.qk_norm!r} is not supported; only 'rms_norm' (per-head "
                "RMSNorm, the released models' norm) is implemented"
            )
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{what}: {name}={getattr(self, name)} must be positive")
        for name in counts:
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{what}: {name}={getattr(self, name)} must be >= 0")
        if self.mlp_ratio <= 0 or self.mlp_hidden <= 0:
            raise ValueError(f"{what}: mlp_ratio={self.mlp_ratio} must be positive")
        if self.rope_theta <= 0:
            raise ValueError(f"{what}: rope_theta={self.rope_theta} must be positive")
        if len(self.rope_axes_dim) != 3 or any(d <= 0 or d % 2 for d in self.rope_axes_dim):
            raise ValueError(
                f"{what}: rope_axes_dim={list(self.rope_axes_dim)} must be three positive even "
                "channel counts (frames, rows, columns)"
            )
        if sum(self.rope_axes_dim) != self.attention_head_dim:
            raise ValueError(
                f"{what}: sum(rope_axes_dim)={sum(self.rope_axes_dim)} "
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


@dataclass
class HunyuanVideoArchConfig(HunyuanVideoDims, DiffusersConfig):
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

    def __post_init__(self):
        self.guidance_embeds = bool(self.guidance_embeds)
        if self.image_condition_type not in _IMAGE_CONDITION_TYPES:
            raise ValueError(
                f"HunyuanVideo config: image_condition_type={self.image_condition_type!r} is not "
                "supported; implemented: null (text to video) and 'latent_concat' (the "
                "'token_replace' image-to-video variant is not)"
            )
        self._check_shared(
            positive=(
                "in_channels",
                "out_channels",
                "num_attention_heads",
                "attention_head_dim",
                "patch_size",
                "patch_size_t",
                "text_embed_dim",
                "pooled_projection_dim",
            ),
            counts=("num_layers", "num_single_layers", "num_refiner_layers"),
        )


def hunyuan_video_tp_divisors(cfg: HunyuanVideoDims) -> dict[str, int]:
    """The numbers every TP size must divide (``ModelFamily.tp_divisors``) in HunyuanVideo 1.0
    and 1.5: the attention heads (split over the ranks in every block and in the token refiner),
    the blocks' MLP width and the token refiner's FFN width."""
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "mlp_hidden": cfg.mlp_hidden,
        "refiner_mlp_hidden": cfg.refiner_mlp_hidden,
    }
