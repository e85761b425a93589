"""Architecture config of the LTX-2 / LTX-2.3 audio-video DiT (``LTX2VideoTransformer3DModel``).

Read from ``transformer/config.json`` of a diffusers-format LTX-2 directory. Field names and
defaults are those of diffusers' ``LTX2VideoTransformer3DModel.__init__`` (diffusers 0.42.1,
``models/transformers/transformer_ltx2.py``). One model holds two token streams, video (width
``inner_dim = num_attention_heads * attention_head_dim``) and audio (width ``audio_inner_dim =
audio_num_attention_heads * audio_attention_head_dim``), joined by audio-to-video and
video-to-audio cross-attention in every block.

Versions: LTX-2.0 projects the caption features inside the DiT (``use_prompt_embeddings``);
LTX-2.3 sets ``gated_attn`` / ``audio_gated_attn`` (a per-head gate on every attention output),
``cross_attn_mod`` / ``audio_cross_attn_mod`` (9 instead of 6 modulation vectors per block and a
sigma-dependent modulation of the prompt) and ``perturbed_attn`` (STG). The LTX-2.5-only options
``use_keyframes_abs_pos_embedding``, ``use_prompt_adaln_single=False`` and bias-free feed-forwards
(``ff_bias`` / ``audio_ff_bias`` ``False``) are refused with a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sglang.multimodal_gen.configs.base import DiffusersConfig

__all__ = [
    "LTX2ArchConfig",
    "LTX2_TRANSFORMER_CLASS",
    "check_ltx2_tp_size",
    "ltx2_tp_divisors",
]

LTX2_TRANSFORMER_CLASS = "LTX2VideoTransformer3DModel"
LTX2_QK_NORM = "rms_norm_across_heads"  # the only q/k norm diffusers 0.42.1 builds
LTX2_ACTIVATION = "gelu-approximate"
LTX2_ROPE_TYPES = ("interleaved", "split")


@dataclass
class LTX2ArchConfig(DiffusersConfig):
    """Shapes and switches of one LTX-2.x transformer (every field of diffusers' ``__init__``,
    same default).

    ``out_channels`` / ``audio_out_channels`` ``None`` (or 0) mean the matching input width, as
    in diffusers. Derived: :attr:`inner_dim`, :attr:`audio_inner_dim`, :attr:`prompt_modulation`.

    Raises:
        ValueError: a non-positive size; an unknown ``rope_type``; ``qk_norm`` other than
            ``"rms_norm_across_heads"``; ``activation_fn`` other than ``"gelu-approximate"``;
            ``audio_cross_attention_dim != audio_inner_dim`` (the audio-video cross-attention
            RoPE is built that wide); with ``use_prompt_embeddings``, ``cross_attention_dim !=
            inner_dim``; an odd head dim; a ``split`` RoPE whose half width does not divide by
            its head count; the refused LTX-2.5 options (see the module docstring). Each message
            names the field.
    """

    DIFFUSERS_CLASS: ClassVar[str] = LTX2_TRANSFORMER_CLASS

    # video
    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    # audio
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    # shared
    num_layers: int = 48
    activation_fn: str = LTX2_ACTIVATION
    qk_norm: str = LTX2_QK_NORM
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "interleaved"
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.out_channels:
            self.out_channels = self.in_channels
        if not self.audio_out_channels:
            self.audio_out_channels = self.audio_in_channels
        vsf = self.vae_scale_factors
        if isinstance(vsf, int) or len(vsf) != 3:
            raise ValueError(
                f"LTX-2 config: vae_scale_factors={vsf!r} must be three ints (time, height, width)"
            )
        self.vae_scale_factors = tuple(int(v) for v in vsf)
        self.norm_eps = float(self.norm_eps)
        self.rope_theta = float(self.rope_theta)
        for name in (
            "in_channels", "out_channels", "patch_size", "patch_size_t", "num_attention_heads",
            "attention_head_dim", "cross_attention_dim", "pos_embed_max_pos", "base_height",
            "base_width", "audio_in_channels", "audio_out_channels", "audio_patch_size",
            "audio_patch_size_t", "audio_num_attention_heads", "audio_attention_head_dim",
            "audio_cross_attention_dim", "audio_scale_factor", "audio_pos_embed_max_pos",
            "audio_sampling_rate", "audio_hop_length", "caption_channels",
            "timestep_scale_multiplier",
        ):  # fmt: skip
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"LTX-2 config: {name}={getattr(self, name)} must be positive")
        if any(v <= 0 for v in self.vae_scale_factors):
            raise ValueError(
                f"LTX-2 config: vae_scale_factors={list(self.vae_scale_factors)} must be positive"
            )
        if self.num_layers < 0:
            raise ValueError(f"LTX-2 config: num_layers={self.num_layers} must be >= 0")
        if self.qk_norm != LTX2_QK_NORM:
            raise ValueError(
                f"LTX-2 config: qk_norm={self.qk_norm!r} is not supported; diffusers builds only "
                f"{LTX2_QK_NORM!r}"
            )
        if self.activation_fn != LTX2_ACTIVATION:
            raise ValueError(
                f"LTX-2 config: activation_fn={self.activation_fn!r} is not supported; only "
                f"{LTX2_ACTIVATION!r} (tanh-approximate GELU) is implemented"
            )
        if self.rope_type not in LTX2_ROPE_TYPES:
            raise ValueError(
                f"LTX-2 config: rope_type={self.rope_type!r} must be one of {list(LTX2_ROPE_TYPES)}"
            )
        for name in ("attention_head_dim", "audio_attention_head_dim"):
            if getattr(self, name) % 2:
                raise ValueError(
                    f"LTX-2 config: {name}={getattr(self, name)} must be even (RoPE rotates "
                    "channel pairs)"
                )
        if self.audio_cross_attention_dim != self.audio_inner_dim:
            raise ValueError(
                f"LTX-2 config: audio_cross_attention_dim={self.audio_cross_attention_dim} must "
                f"equal audio_num_attention_heads * audio_attention_head_dim = "
                f"{self.audio_inner_dim} (the audio-video cross-attention RoPE has that width)"
            )
        if self.use_prompt_embeddings and self.cross_attention_dim != self.inner_dim:
            raise ValueError(
                f"LTX-2 config: cross_attention_dim={self.cross_attention_dim} must equal "
                f"num_attention_heads * attention_head_dim = {self.inner_dim} when "
                "use_prompt_embeddings projects the captions to the video width"
            )
        if self.rope_type == "split":
            for name, width, heads in (
                ("num_attention_heads", self.inner_dim, self.num_attention_heads),
                ("audio_num_attention_heads", self.audio_inner_dim, self.audio_num_attention_heads),
                ("num_attention_heads", self.audio_inner_dim, self.num_attention_heads),
            ):
                if (width // 2) % heads:
                    raise ValueError(
                        f"LTX-2 config: split RoPE of width {width} cannot be divided over "
                        f"{name}={heads} heads"
                    )
        refused = {
            "use_keyframes_abs_pos_embedding": self.use_keyframes_abs_pos_embedding,
            "use_prompt_adaln_single": not self.use_prompt_adaln_single,
            "ff_bias": not self.ff_bias,
            "audio_ff_bias": not self.audio_ff_bias,
        }
        for name, bad in refused.items():
            if bad:
                raise ValueError(
                    f"LTX-2 config: {name}={getattr(self, name)} is an LTX-2.5 option that is not "
                    "implemented"
                )

    @property
    def inner_dim(self) -> int:
        """Video stream width ``num_attention_heads * attention_head_dim``."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_inner_dim(self) -> int:
        """Audio stream width ``audio_num_attention_heads * audio_attention_head_dim``."""
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @property
    def prompt_modulation(self) -> bool:
        """LTX-2.3's sigma-dependent modulation of the prompt features (``prompt_adaln``)."""
        return bool(self.cross_attn_mod or self.audio_cross_attn_mod)


def ltx2_tp_divisors(cfg: LTX2ArchConfig) -> dict[str, int]:
    """The numbers every TP size must divide (for the family's ``tp_divisors``): the video heads
    (self-attention, text cross-attention, FFN) and the audio heads (audio attentions and both
    audio-video cross-attentions). The video heads come first (the automatic Ulysses degree
    prefers one that divides them); both streams' self-attentions run Ulysses, with any degree
    (heads it does not divide are split unevenly over its ranks)."""
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "audio_num_attention_heads": cfg.audio_num_attention_heads,
    }


def check_ltx2_tp_size(cfg: LTX2ArchConfig, tp_size: int) -> None:
    """Raises ``ValueError`` naming the head count ``tp_size`` does not divide."""
    for what, n in ltx2_tp_divisors(cfg).items():
        if n % tp_size:
            raise ValueError(f"LTX-2: {what}={n} is not divisible by tp_size={tp_size}")
