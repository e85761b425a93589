"""Architecture config of the HunyuanVideo 1.5 video DiT (``HunyuanVideo15Transformer3DModel``).

Read from the ``transformer/config.json`` of a diffusers-format HunyuanVideo 1.5 directory. Field
names and defaults are those of diffusers' ``HunyuanVideo15Transformer3DModel.__init__``
(diffusers 0.42.1, ``models/transformers/transformer_hunyuan_video15.py``; Tencent Hunyuan,
"HunyuanVideo 1.5", 2025): the defaults are the released 8.3B shapes (16 heads of 128, 54
dual-stream blocks, 65 input channels = 32 noise latents + 32 condition latents + 1 mask, 32
output channels, Qwen2.5-VL text features of 3584, ByT5 glyph features of 1472, SigLIP image
features of 1152, RoPE axes (16, 56, 56) with theta 256). ``target_size`` and ``task_type`` are
read by the pipeline, not by the DiT (the same transformer code serves T2V and I2V checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sglang.multimodal_gen.configs.base import DiffusersConfig

__all__ = [
    "HUNYUAN_VIDEO15_TRANSFORMER_CLASS",
    "HunyuanVideo15ArchConfig",
    "hunyuan_video15_tp_divisors",
]

HUNYUAN_VIDEO15_TRANSFORMER_CLASS = "HunyuanVideo15Transformer3DModel"


@dataclass
class HunyuanVideo15ArchConfig(DiffusersConfig):
    """Shapes of one HunyuanVideo 1.5 transformer.

    Attributes mirror the diffusers config; ``out_channels`` ``None`` / ``0`` means
    ``in_channels`` (as the diffusers model resolves it). Derived: ``inner_dim = num_attention_heads
    * attention_head_dim`` (the width ``D``), ``mlp_hidden = int(D * mlp_ratio)`` (the dual-stream
    blocks' feed-forward width), ``refiner_mlp_hidden = int(D * 4.0)`` (the token refiner's; diffusers
    builds the refiner with its default ratio whatever ``mlp_ratio`` is), ``out_features =
    out_channels * patch_size_t * patch_size ** 2``.

    Raises:
        ValueError: ``qk_norm`` other than ``"rms_norm"`` (the only q/k norm implemented),
            ``rope_axes_dim`` not three even sizes summing to ``attention_head_dim``, a
            non-positive size, a negative layer count, or a ``task_type`` that is not a string
            (each message names the field).
    """

    DIFFUSERS_CLASS: ClassVar[str] = HUNYUAN_VIDEO15_TRANSFORMER_CLASS

    in_channels: int = 65
    out_channels: int | None = 32
    num_attention_heads: int = 16
    attention_head_dim: int = 128
    num_layers: int = 54
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 1
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    text_embed_dim: int = 3584
    text_embed_2_dim: int = 1472
    image_embed_dim: int = 1152
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)
    target_size: int = 640
    task_type: str = "i2v"
    use_meanflow: bool = False
    extra: dict = field(default_factory=dict)

    # constants of the architecture (hard-coded in the reference)
    NORM_EPS: ClassVar[float] = 1e-6  # adaLN, q/k RMSNorm, refiner LayerNorms
    T_FREQ_DIM: ClassVar[int] = 256  # sinusoidal timestep features
    BYT5_HIDDEN: ClassVar[int] = 2048  # ByT5 projection's hidden width
    REFINER_MLP_RATIO: ClassVar[float] = 4.0
    NUM_COND_TYPES: ClassVar[int] = 3  # 0: Qwen2.5-VL text, 1: ByT5 glyphs, 2: SigLIP image

    def __post_init__(self):
        if not self.out_channels:
            self.out_channels = self.in_channels
        if isinstance(self.rope_axes_dim, int) or len(self.rope_axes_dim) != 3:
            raise ValueError(
                f"HunyuanVideo 1.5 config: rope_axes_dim={self.rope_axes_dim!r} must be three "
                "ints (frames, rows, columns)"
            )
        self.rope_axes_dim = tuple(int(d) for d in self.rope_axes_dim)
        self.mlp_ratio = float(self.mlp_ratio)
        self.rope_theta = float(self.rope_theta)
        self.use_meanflow = bool(self.use_meanflow)
        if self.qk_norm != "rms_norm":
            raise ValueError(
                f"HunyuanVideo 1.5 config: qk_norm={self.qk_norm!r} is not supported; only "
                "'rms_norm' (per-head RMSNorm, the released models' norm) is implemented"
            )
        for name in (
            "in_channels",
            "out_channels",
            "num_attention_heads",
            "attention_head_dim",
            "patch_size",
            "patch_size_t",
            "text_embed_dim",
            "text_embed_2_dim",
            "image_embed_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(
                    f"HunyuanVideo 1.5 config: {name}={getattr(self, name)} must be positive"
                )
        for name in ("num_layers", "num_refiner_layers"):
            if int(getattr(self, name)) < 0:
                raise ValueError(
                    f"HunyuanVideo 1.5 config: {name}={getattr(self, name)} must be >= 0"
                )
        if self.mlp_ratio <= 0 or self.mlp_hidden <= 0:
            raise ValueError(f"HunyuanVideo 1.5 config: mlp_ratio={self.mlp_ratio} must be > 0")
        if any(d <= 0 or d % 2 for d in self.rope_axes_dim) or (
            sum(self.rope_axes_dim) != self.attention_head_dim
        ):
            raise ValueError(
                f"HunyuanVideo 1.5 config: rope_axes_dim={list(self.rope_axes_dim)} must be three "
                f"positive even sizes summing to attention_head_dim={self.attention_head_dim}"
            )
        if not isinstance(self.task_type, str):
            raise ValueError(
                f"HunyuanVideo 1.5 config: task_type={self.task_type!r} must be a string"
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
    def out_features(self) -> int:
        return self.out_channels * self.patch_size_t * self.patch_size**2


def hunyuan_video15_tp_divisors(cfg: HunyuanVideo15ArchConfig) -> dict[str, int]:
    """The numbers every TP size must divide: the attention heads (dual-stream blocks and token
    refiner split their heads over the ranks) and the feed-forward widths (column- then
    row-parallel)."""
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "mlp_hidden": cfg.mlp_hidden,
        "refiner_mlp_hidden": cfg.refiner_mlp_hidden,
    }
