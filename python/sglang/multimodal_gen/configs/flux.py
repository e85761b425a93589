"""Architecture config of the Flux.1 DiT (``FluxTransformer2DModel`` in diffusers).

Read from the ``transformer/config.json`` of a diffusers-format model directory. Field names and
defaults are those of diffusers' ``FluxTransformer2DModel.__init__`` (diffusers 0.42.1,
``models/transformers/transformer_flux.py``); the defaults are the Flux.1 (12B) shapes.
FLUX.1-dev sets ``guidance_embeds=true`` (guidance-distilled), FLUX.1-schnell leaves it false.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sglang.multimodal_gen.configs.base import DiffusersConfig
from sglang.multimodal_gen.configs.sampling_params import SamplingParams, param

FLUX_TRANSFORMER_CLASS = "FluxTransformer2DModel"


@dataclass
class FluxArchConfig(DiffusersConfig):
    """Shapes of one Flux.1 transformer.

    Attributes mirror the diffusers config. ``out_channels=None`` means ``in_channels`` (resolved
    in ``__post_init__``, as the diffusers model does). Derived: ``inner_dim =
    num_attention_heads * attention_head_dim`` (the model width ``D``), ``mlp_hidden =
    int(inner_dim * 4.0)`` (the FFN / single-block MLP width), ``out_features = patch_size ** 2 *
    out_channels`` (the final projection's width).

    Raises:
        ValueError: ``sum(axes_dims_rope) != attention_head_dim``, an odd RoPE axis, or a
            non-positive size.
    """

    DIFFUSERS_CLASS: ClassVar[str] = FLUX_TRANSFORMER_CLASS

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    extra: dict = field(default_factory=dict)

    # constants of the architecture (hard-coded in the reference)
    ROPE_THETA = 10000.0
    MLP_RATIO = 4.0
    T_FREQ_DIM = 256  # sinusoidal features of the timestep / guidance embedders
    TIMESTEP_SCALE = 1000.0  # the model multiplies the pipeline's t (in [0, 1]) by this
    NORM_EPS = 1e-6  # LayerNorms, q/k RMSNorms

    def __post_init__(self):
        self.axes_dims_rope = tuple(int(d) for d in self.axes_dims_rope)
        if self.out_channels is None:
            self.out_channels = self.in_channels
        self.guidance_embeds = bool(self.guidance_embeds)
        for name in (
            "patch_size",
            "in_channels",
            "out_channels",
            "attention_head_dim",
            "num_attention_heads",
            "joint_attention_dim",
            "pooled_projection_dim",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Flux config: {name}={getattr(self, name)} must be positive")
        if self.num_layers < 0 or self.num_single_layers < 0:
            raise ValueError(
                f"Flux config: num_layers={self.num_layers} and num_single_layers="
                f"{self.num_single_layers} must be >= 0"
            )
        if any(d <= 0 or d % 2 for d in self.axes_dims_rope):
            raise ValueError(
                f"Flux config: every RoPE axis needs a positive even channel count, got "
                f"axes_dims_rope={list(self.axes_dims_rope)}"
            )
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"Flux config: sum(axes_dims_rope)={sum(self.axes_dims_rope)} "
                f"(axes_dims_rope={list(self.axes_dims_rope)}) must equal "
                f"attention_head_dim={self.attention_head_dim}"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        return int(self.inner_dim * self.MLP_RATIO)

    @property
    def out_features(self) -> int:
        return self.patch_size * self.patch_size * self.out_channels


@dataclass(frozen=True)
class FluxSamplingParams(SamplingParams):
    """Request fields of Flux.1 models: the common ones plus real classifier-free guidance
    (``FluxPipeline``'s ``true_cfg_scale``; Flux.1 [dev]'s ``guidance_scale`` is the embedded,
    distilled guidance)."""

    true_cfg_scale: float | None = param(
        "scale",
        "real classifier-free guidance weight, used with negative_prompt when > 1 (1: off)",
    )
