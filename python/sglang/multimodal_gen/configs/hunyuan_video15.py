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
from sglang.multimodal_gen.configs.hunyuan_video import HunyuanVideoDims

__all__ = [
    "HUNYUAN_VIDEO15_TRANSFORMER_CLASS",
    "HunyuanVideo15ArchConfig",
]

HUNYUAN_VIDEO15_TRANSFORMER_CLASS = "HunyuanVideo15Transformer3DModel"


@dataclass
class HunyuanVideo15ArchConfig(HunyuanVideoDims, DiffusersConfig):
    """Shapes of one HunyuanVideo 1.5 transformer.

    Attributes mirror the diffusers config; ``out_channels`` ``None`` / ``0`` means
    ``in_channels`` (as the diffusers model resolves it). The constants (``NORM_EPS``,
    ``T_FREQ_DIM``, ``REFINER_MLP_RATIO``), the derived widths (``inner_dim``, ``mlp_hidden``,
    ``refiner_mlp_hidden``, ``out_features``) and the shared checks are 1.0's
    (``configs.hunyuan_video.HunyuanVideoDims``).

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

    MODEL: ClassVar[str] = "HunyuanVideo 1.5"
    BYT5_HIDDEN: ClassVar[int] = 2048  # ByT5 projection's hidden width
    NUM_COND_TYPES: ClassVar[int] = 3  # 0: Qwen2.5-VL text, 1: ByT5 glyphs, 2: SigLIP image

    def __post_init__(self):
        self.use_meanflow = bool(self.use_meanflow)
        self._check_shared(
            positive=(
                "in_channels",
                "out_channels",
                "num_attention_heads",
                "attention_head_dim",
                "patch_size",
                "patch_size_t",
                "text_embed_dim",
                "text_embed_2_dim",
                "image_embed_dim",
            ),
            counts=("num_layers", "num_refiner_layers"),
        )
        if not isinstance(self.task_type, str):
            raise ValueError(
                f"HunyuanVideo 1.5 config: task_type={self.task_type!r} must be a string"
            )
