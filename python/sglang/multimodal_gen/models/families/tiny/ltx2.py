"""A small, seeded, random-weight LTX-2.3 directory in diffusers format (tests, demos).

LTX-2.3 layout (``LTX2Pipeline``): a DiT with gated attention, the sigma-dependent cross-attention
modulation (``cross_attn_mod`` / ``audio_cross_attn_mod``), perturbable self-attention for STG
(``perturbed_attn``) and the caption projections in the connectors (``use_prompt_embeddings``
off, ``per_modality_projections`` on); a Gemma 3 text encoder (transformers'
``Gemma3ForConditionalGeneration``, tiny text and vision towers) with an offline character-level
``GemmaTokenizer``; ``LTX2TextConnectors``; the video VAE ``AutoencoderKLLTX2Video`` (spatial
and temporal factor 4; timestep conditioning optional); the audio VAE ``AutoencoderKLLTX2Audio``
(16 kHz, hop 160, 8 mel bins); ``LTX2Vocoder`` upsampling each mel frame to its 160 samples (so
the waveform lasts as long as the video); ``FlowMatchEulerDiscreteScheduler``. Saved with
``LTX2Pipeline.save_pretrained``. Random weights: frames and sound are noise by construction.

Sizes (TP 1, 2, 4): video 4 heads x 8, audio 4 heads x 4, 2 blocks. A 32 x 32, 5-frame request
is 2 x 8 x 8 video tokens and 5 audio tokens.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from sglang.multimodal_gen.models.families.tiny.common import redraw_constant_params

TINY_VERSION = "1"
DEFAULT_SEED = 1234

TINY_TRANSFORMER: dict[str, Any] = dict(
    in_channels=4,
    out_channels=4,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=4,
    attention_head_dim=8,
    cross_attention_dim=32,
    vae_scale_factors=(2, 2, 2),
    audio_in_channels=4,
    audio_out_channels=4,
    audio_num_attention_heads=4,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=16,
    num_layers=2,
    caption_channels=32,
    gated_attn=True,
    cross_attn_mod=True,
    audio_gated_attn=True,
    audio_cross_attn_mod=True,
    perturbed_attn=True,
    use_prompt_embeddings=False,
    rope_type="split",
)
# Gemma 3 text tower: width 32, 2 layers (the connectors read all 3 hidden states)
TINY_GEMMA_TEXT: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=2048,
    sliding_window=16,
)
TINY_SIGLIP: dict[str, Any] = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


# The vocoder's default init shrinks the signal through its stages: its waveform would hardly
# depend on the mel spectrogram (measured: two random latents 64 dB apart). At this gain two
# random latents are 25 dB apart and a 1% change of the spectrogram 60 dB, without clipping.
VOCODER_GAIN = 1.5


def _amplify(module: torch.nn.Module, gain: float) -> None:
    """Scale every weight of ``module``'s (transposed) convolutions to ``gain / sqrt(fan_in)``
    standard deviation."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
                w = m.weight
                fan_in = w.shape[0] if isinstance(m, torch.nn.ConvTranspose1d) else w.shape[1]
                fan_in *= w.shape[2]
                w.mul_(gain / (w.std() * fan_in**0.5))


def build_gemma_tokenizer():
    """A character-level ``GemmaTokenizer`` built offline: ``<pad>`` (0), ``<eos>`` (1), ``<bos>``
    (2), ``<unk>`` (3), ``<mask>`` (4), the word marker ``\\u2581`` (5) and printable ASCII (BPE
    without merges: one token per character)."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "\u2581": 5}
    for c in range(33, 127):
        vocab[chr(c)] = len(vocab)
    return GemmaTokenizer(vocab=vocab, merges=[])


def _text_encoder(vocab_size: int):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(
        text_config=dict(TINY_GEMMA_TEXT, vocab_size=vocab_size),
        vision_config=TINY_SIGLIP,
        mm_tokens_per_image=4,
    )
    return Gemma3ForConditionalGeneration(cfg).eval()


def build_ltx2_components(
    seed: int = DEFAULT_SEED, vae_timestep_conditioning: bool = False
) -> dict[str, Any]:
    """The components of an ``LTX2Pipeline`` (fp32, CPU, eval mode), seeded, with every
    constant-initialised parameter re-drawn (so each one influences the output).

    Args:
        vae_timestep_conditioning: a video VAE that decodes at a noise level
            (``decode_timestep`` / ``decode_noise_scale``). Off by default: diffusers'
            ``LTX2Pipeline`` cannot decode several videos per prompt with it (its decode
            timestep has one entry per prompt), which the conformance suite asks.
    """
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    gen = torch.Generator().manual_seed(seed)
    tok = build_gemma_tokenizer()
    torch.manual_seed(seed)
    te = _text_encoder(len(tok))
    layers = TINY_GEMMA_TEXT["num_hidden_layers"] + 1
    torch.manual_seed(seed + 1)
    connectors = LTX2TextConnectors(
        caption_channels=TINY_GEMMA_TEXT["hidden_size"], text_proj_in_factor=layers,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        video_gated_attn=True, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, audio_gated_attn=True,
        connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split",
        per_modality_projections=True, video_hidden_dim=32, audio_hidden_dim=16,
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 2)
    transformer = LTX2VideoTransformer3DModel(**TINY_TRANSFORMER).eval()
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8), layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"), upsample_residual=(False, False),
        upsample_factor=(1, 1), timestep_conditioning=vae_timestep_conditioning,
        patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 4)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1,
        attn_resolutions=None, in_channels=2, resolution=32, latent_channels=2,
        norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True,
        mel_bins=8,
    ).eval()  # fmt: skip
    torch.manual_seed(seed + 5)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=16, out_channels=2, upsample_kernel_sizes=[8, 8, 20],
        upsample_factors=[4, 4, 10], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    ).eval()  # fmt: skip
    for m in (te, connectors, transformer, vae, audio_vae, vocoder):
        redraw_constant_params(m, gen, 0.1)
    _amplify(vocoder, VOCODER_GAIN)
    # the VAEs' latent statistics are buffers: non-trivial values so the (de)normalisation counts
    with torch.no_grad():
        for m in (vae, audio_vae):
            for name in ("latents_mean", "latents_std"):
                buf = getattr(m, name)
                val = torch.rand(buf.shape, generator=gen) * 0.5
                buf.copy_(val + (0.75 if name == "latents_std" else -0.25))
    sched = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1,
    )  # fmt: skip
    return dict(
        scheduler=sched, vae=vae, audio_vae=audio_vae, text_encoder=te, tokenizer=tok,
        connectors=connectors, transformer=transformer, vocoder=vocoder,
    )  # fmt: skip


def build_ltx2_dir(
    path: str | os.PathLike, *, seed: int = DEFAULT_SEED, vae_timestep_conditioning: bool = False
) -> str:
    """Write a diffusers-format tiny LTX-2.3 directory at ``path`` (see
    :func:`build_ltx2_components`); returns ``str(path)``."""
    from diffusers import LTX2Pipeline

    path = os.fspath(path)
    comps = build_ltx2_components(seed, vae_timestep_conditioning)
    LTX2Pipeline(**comps).save_pretrained(path, safe_serialization=True)
    return path


build_ltx2_dir.version = TINY_VERSION  # cache key of an embedded default model
