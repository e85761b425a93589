"""Architecture config of the Qwen-Image DiT (``QwenImageTransformer2DModel`` in diffusers).

Read from the ``transformer/config.json`` of a diffusers-format model directory. Field names and
defaults are those of diffusers' ``QwenImageTransformer2DModel.__init__`` (diffusers 0.42.1,
``models/transformers/transformer_qwenimage.py``); the defaults are the Qwen-Image (20B) shapes:
60 double-stream blocks, 24 heads x 128 (``inner_dim`` 3072), Qwen2.5-VL text features of width
3584, packed 2x2 latents of 16 channels (``in_channels`` 64).

``zero_cond_t`` (Qwen-Image-Edit-2511) is implemented: the condition images' tokens are modulated
with the embedding of timestep 0 (see ``models/dits/qwen_image.py``). The variant switches of
Qwen-Image-Layered (``use_additional_t_cond``, ``use_layer3d_rope``) are read but not implemented:
a config that turns one on is rejected with a clear error. ``guidance_embeds`` is accepted (the
reference builds nothing for it and cannot run with a guidance tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sglang.multimodal_gen.configs.base import DiffusersConfig
from sglang.multimodal_gen.configs.sampling_params import SamplingParams, param

QWEN_IMAGE_TRANSFORMER_CLASS = "QwenImageTransformer2DModel"


@dataclass
class QwenImageArchConfig(DiffusersConfig):
    """Shapes of one Qwen-Image transformer.

    Attributes mirror the diffusers config. ``zero_cond_t``: the image stream's adaLN gives the
    output tokens the parameters of the timestep and the condition images' tokens those of
    timestep 0 (Qwen-Image-Edit-2511). ``out_channels=None`` means ``in_channels`` (as the
    diffusers model resolves it; note its default is 16, not ``None``). Derived: ``inner_dim =
    num_attention_heads * attention_head_dim`` (the model width ``D``), ``mlp_hidden = 4 *
    inner_dim`` (the GELU-tanh FFN width of ``img_mlp`` / ``txt_mlp``), ``out_features =
    patch_size ** 2 * out_channels`` (the final projection's width).

    Raises:
        ValueError: ``sum(axes_dims_rope) != attention_head_dim``, an odd RoPE axis, a
            non-positive size, or a Qwen-Image-Layered switch turned on.
    """

    DIFFUSERS_CLASS: ClassVar[str] = QWEN_IMAGE_TRANSFORMER_CLASS

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False
    extra: dict = field(default_factory=dict)

    # constants of the architecture (hard-coded in the reference)
    ROPE_THETA = 10000
    MLP_RATIO = 4
    T_FREQ_DIM = 256  # sinusoidal features of the timestep embedder
    TIMESTEP_SCALE = 1000.0  # the sinusoid multiplies the pipeline's t (in [0, 1]) by this
    NORM_EPS = 1e-6  # block LayerNorms, q/k RMSNorms, txt_norm, norm_out

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
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(
                    f"Qwen-Image config: {name}={getattr(self, name)} must be positive"
                )
        if self.num_layers < 0:
            raise ValueError(f"Qwen-Image config: num_layers={self.num_layers} must be >= 0")
        if len(self.axes_dims_rope) != 3 or any(d <= 0 or d % 2 for d in self.axes_dims_rope):
            raise ValueError(
                f"Qwen-Image config: axes_dims_rope needs three positive even channel counts "
                f"(frame, height, width), got {list(self.axes_dims_rope)}"
            )
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"Qwen-Image config: sum(axes_dims_rope)={sum(self.axes_dims_rope)} "
                f"(axes_dims_rope={list(self.axes_dims_rope)}) must equal "
                f"attention_head_dim={self.attention_head_dim}"
            )
        self.zero_cond_t = bool(self.zero_cond_t)
        for name in ("use_additional_t_cond", "use_layer3d_rope"):
            if getattr(self, name):
                raise ValueError(
                    f"Qwen-Image config: {name}=true (a Qwen-Image-Layered variant) "
                    f"is not supported by this implementation"
                )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden(self) -> int:
        return self.MLP_RATIO * self.inner_dim

    @property
    def out_features(self) -> int:
        return self.patch_size * self.patch_size * self.out_channels


@dataclass(frozen=True)
class QwenImageSamplingParams(SamplingParams):
    """Request fields of Qwen-Image models: the common ones plus real classifier-free guidance
    (``QwenImagePipeline``'s ``true_cfg_scale``, with the norm rescale)."""

    true_cfg_scale: float | None = param(
        "scale",
        "real classifier-free guidance weight, used with negative_prompt when > 1 (1: off)",
    )
