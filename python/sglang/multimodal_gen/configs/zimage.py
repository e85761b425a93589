"""Architecture config of the Z-Image DiT (``ZImageTransformer2DModel`` in diffusers).

Read from the ``transformer/config.json`` of a diffusers-format model directory. Field names and
defaults are those of diffusers' ``ZImageTransformer2DModel.__init__`` (0.42.1); the defaults are
the Z-Image-Turbo (6B) shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sglang.multimodal_gen.configs.base import DiffusersConfig
from sglang.multimodal_gen.configs.sampling_params import SamplingParams, param

ZIMAGE_TRANSFORMER_CLASS = "ZImageTransformer2DModel"


@dataclass
class ZImageArchConfig(DiffusersConfig):
    """Shapes and constants of one Z-Image transformer.

    Attributes mirror the diffusers config. Derived: ``head_dim = dim // n_heads`` (must equal
    ``sum(axes_dims)``), ``ffn_hidden = int(dim / 3 * 8)``, ``adaln_dim = min(dim, 256)``.
    ``n_kv_heads`` is accepted but, as in diffusers, the attention uses ``n_heads`` for K and V.
    """

    DIFFUSERS_CLASS: ClassVar[str] = ZIMAGE_TRANSFORMER_CLASS

    all_patch_size: tuple[int, ...] = (2,)
    all_f_patch_size: tuple[int, ...] = (1,)
    in_channels: int = 16
    dim: int = 3840
    n_layers: int = 30
    n_refiner_layers: int = 2
    n_heads: int = 30
    n_kv_heads: int = 30
    norm_eps: float = 1e-5
    qk_norm: bool = True
    cap_feat_dim: int = 2560
    siglip_feat_dim: int | None = None
    rope_theta: float = 256.0
    t_scale: float = 1000.0
    axes_dims: tuple[int, ...] = (32, 48, 48)
    axes_lens: tuple[int, ...] = (1024, 512, 512)
    extra: dict = field(default_factory=dict)

    # constants of the architecture (diffusers' module-level constants)
    ADALN_EMBED_DIM = 256
    SEQ_MULTI_OF = 32
    T_FREQ_DIM = 256
    T_MID_DIM = 1024

    def __post_init__(self):
        self.all_patch_size = tuple(int(p) for p in self.all_patch_size)
        self.all_f_patch_size = tuple(int(p) for p in self.all_f_patch_size)
        self.axes_dims = tuple(int(d) for d in self.axes_dims)
        self.axes_lens = tuple(int(n) for n in self.axes_lens)
        if len(self.all_patch_size) != len(self.all_f_patch_size):
            raise ValueError(
                f"all_patch_size {self.all_patch_size} and all_f_patch_size "
                f"{self.all_f_patch_size} must have the same length"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.head_dim != sum(self.axes_dims):
            raise ValueError(
                f"head_dim={self.head_dim} (dim / n_heads) must equal sum(axes_dims)="
                f"{sum(self.axes_dims)} (axes_dims={list(self.axes_dims)})"
            )
        if self.siglip_feat_dim is not None:
            raise ValueError(
                "siglip_feat_dim is set: the Z-Image Omni variant is not supported (text-to-image only)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return int(self.dim / 3 * 8)

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, self.ADALN_EMBED_DIM)

    @property
    def out_channels(self) -> int:
        return self.in_channels


@dataclass(frozen=True)
class ZImageSamplingParams(SamplingParams):
    """Request fields of Z-Image models: the common ones plus ``ZImagePipeline``'s two CFG knobs
    (diffusers 0.42.1, ``pipelines/z_image/pipeline_z_image.py``)."""

    cfg_normalization: float | None = param(
        "scale",
        "caps the guided prediction's norm at this multiple of the conditional one (0: off)",
    )
    cfg_truncation: float | None = param(
        "scale",
        "classifier-free guidance stops once (1000 - t) / 1000 exceeds this value (1: never)",
    )
