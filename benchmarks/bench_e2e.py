"""End-to-end benchmark per family: our pipeline vs diffusers' (``ZImagePipeline`` /
``FluxPipeline`` / ``WanPipeline`` / ``QwenImagePipeline`` / ``LTX2Pipeline`` /
``HunyuanVideoPipeline``), same weights.

Both pipelines share the text encoders, tokenizers, VAE and scheduler config; our DiT is loaded from
the diffusers DiT's state dict through the same name map and weight loaders as file loading. Runs
are interleaved (ours, diffusers, diffusers, ours, ...) after one warm-up each; we report the
median over ``--repeats`` runs of the end-to-end time (prompt encoding + denoising + VAE decode)
and of the DiT time per step (all DiT forwards of a run, timed with forward hooks and
CUDA-synchronized on GPU, divided by the step count: a batched CFG call and two separate ones
compare fairly), plus
the PSNR between the two images as a sanity check.

Configs (``--family zimage``, the default):
    cpu: DiT dim 768, 8 layers, 12 heads, 256x256, 8 steps, fp32; a small Qwen3 text
        encoder and a reduced Flux-style VAE (random weights).
    --gpu: the real Z-Image-Turbo shapes: DiT dim 3840, 30 layers, 30 heads; Qwen3-4B-shaped text
        encoder; Flux VAE; 1024x1024, 8 steps, bf16, random weights (built on the GPU).
Configs (``--family flux``, FLUX.1-dev layout with guidance embedding and dynamic shift):
    cpu: DiT 4 double + 8 single blocks, 8 heads x 64, 256x256, 8 steps, guidance 3.5, fp32.
    --gpu: the real FLUX.1-dev shapes: 19 double + 38 single blocks, 24 heads x 128, 1024x1024,
        28 steps, bf16, random weights; one-layer CLIP/T5 of the real widths (text encoding is
        a small part of the time) and the real Flux VAE.

Configs (``--family wan``, Wan2.2 T2V-A14B layout: two experts, ``boundary_ratio`` 0.875):
    cpu: DiT dim 256 x 4 layers per expert, 128x128, 9 frames, 8 steps, CFG 4.0 / 3.0, fp32.
    --gpu: the real A14B expert shapes (dim 5120, 40 layers, 40 heads, both experts), 480x832,
        17 frames, 4 steps, bf16, random weights; a one-layer UMT5 of the real width and the real
        Wan2.1 VAE.

Configs (``--family qwen-image``, true CFG 4.0 with a negative prompt):
    cpu: DiT 4 layers, 8 heads x 32, 256x256, 8 steps, fp32.
    --gpu: the real Qwen-Image DiT shapes (60 layers, 24 heads x 128, text width 3584),
        1024x1024, 8 steps, bf16, random weights; a one-layer Qwen2.5-VL of the real width and the
        real Qwen-Image VAE.

Configs (``--family ltx2``, LTX-2.3 layout: gated attention, cross-attention and prompt
modulation on both streams, perturbable self-attention, caption projections in the connectors;
the family's default guidance: CFG 3 / audio 7, STG 1 on one block, modality isolation 3,
rescale 0.7, so a step is a batched cond/uncond call plus an STG and an isolated pass; ours
decodes the sound track too, as diffusers does):
    cpu: DiT 4 layers, video 8 heads x 32, audio 4 heads x 32, 128x128, 9 frames, 4 steps, STG
        on the last block, fp32; a 2-layer Gemma 3 (width 128), reduced video VAE (spatial 16,
        temporal 4), audio VAE and vocoder (random weights).
    --gpu: the real LTX-2.3 DiT shapes (diffusers' defaults: 48 layers, video 32 heads x 128,
        audio 32 heads x 64, plus the 2.3 switches), 512x768, 25 frames, 4 steps, STG on block
        28, bf16, random weights built on the GPU; a one-layer Gemma 3 of the real width (3840),
        diffusers' default connectors (2 layers, 128 registers) with LTX-2.3's per-modality
        projections, the default (LTX-2) video VAE and audio VAE, LTX-2.3's vocoder with
        bandwidth extension (``LTX2VocoderWithBWE`` defaults).

Configs (``--family hunyuan-video``, HunyuanVideo 1.0 layout: guidance embedding, embedded guidance
6.0, one DiT forward per step):
    cpu: DiT 2 double + 4 single blocks, 8 heads x 32, 128x128, 9 frames, 8 steps, fp32; a
        3-layer Llama (width 256), a 1-layer CLIP (width 64), a reduced HunyuanVideo VAE.
    --gpu: the real HunyuanVideo DiT shapes (20 double + 40 single blocks, 24 heads x 128, text
        4096, pooled 768), 544x960, 33 frames, 4 steps, bf16, random weights built on the GPU; a
        3-layer Llama and a 1-layer CLIP-L of the real widths and the real VAE.

Usage:
    python benchmarks/bench_e2e.py [--family zimage|flux|wan|qwen-image|ltx2|hunyuan-video] [--gpu] [--repeats 5] [--steps N]
        [--size PX] [--compile] [--matmul-precision highest|high|medium]
        [--attention-backend auto|flash|efficient|cudnn|math]
        [--cpu-gemm-backend auto|onednn|onednn-packed|blas]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

CPU_CFG = dict(
    transformer=dict(
        all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=768, n_layers=8,
        n_refiner_layers=2, n_heads=12, n_kv_heads=12, norm_eps=1e-5, qk_norm=True,
        rope_theta=256.0, t_scale=1000.0, axes_dims=[16, 24, 24], axes_lens=[1024, 512, 512],
    ),
    text_encoder=dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    ),
    vae=dict(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[32, 64, 64, 64],
        layers_per_block=1, latent_channels=16, norm_num_groups=32, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    ),
    size=256, steps=8, dtype=torch.float32, device="cpu",
)  # fmt: skip

GPU_CFG = dict(
    transformer=dict(
        all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=30,
        n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
        rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
    ),
    text_encoder=dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
    ),
    vae=dict(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
        layers_per_block=2, latent_channels=16, norm_num_groups=32, scaling_factor=0.3611,
        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    ),
    size=1024, steps=8, dtype=torch.bfloat16, device="cuda",
)  # fmt: skip


FLUX_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2, latent_channels=16,
    norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
    use_post_quant_conv=False,
)  # fmt: skip
FLUX_SCHED = dict(
    num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
)  # fmt: skip
FLUX_CPU_CFG = dict(
    transformer=dict(
        patch_size=1, in_channels=64, num_layers=4, num_single_layers=8, attention_head_dim=64,
        num_attention_heads=8, joint_attention_dim=256, pooled_projection_dim=128,
        guidance_embeds=True, axes_dims_rope=[16, 24, 24],
    ),
    clip=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=77, projection_dim=128),
    t5=dict(d_model=256, d_kv=32, d_ff=512, num_layers=2, num_heads=8,
            feed_forward_proj="gated-gelu"),
    vae=dict(FLUX_VAE, block_out_channels=[32, 64, 64, 64], layers_per_block=1),
    size=256, steps=8, guidance=3.5, max_sequence_length=128, dtype=torch.float32, device="cpu",
)  # fmt: skip
FLUX_GPU_CFG = dict(
    transformer=dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56],
    ),
    clip=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=1,
              num_attention_heads=12, max_position_embeddings=77, projection_dim=768),
    t5=dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64,
            feed_forward_proj="gated-gelu"),
    vae=dict(FLUX_VAE, block_out_channels=[128, 256, 512, 512]),
    size=1024, steps=28, guidance=3.5, max_sequence_length=512, dtype=torch.bfloat16,
    device="cuda",
)  # fmt: skip


def build_flux(cfg):
    """(ours, reference) Flux pipelines sharing everything but the DiT implementation."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from sglang.multimodal_gen.models.families.tiny.common import build_clip_t5_tokenizers
    from sglang.multimodal_gen.models.loader import denoiser_from_module
    from sglang.multimodal_gen.models.registry import get_family
    from sglang.multimodal_gen.pipelines.flux import FluxPipeline as OurPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    dev, dtype = torch.device(cfg["device"]), cfg["dtype"]
    clip_tok, t5_tok = build_clip_t5_tokenizers()
    torch.manual_seed(0)
    with torch.device(dev):
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), **cfg["clip"]))
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), **cfg["t5"]))
        dit = FluxTransformer2DModel(**cfg["transformer"])
        vae = AutoencoderKL(**cfg["vae"])
    clip, t5, dit, vae = (m.to(dtype).eval() for m in (clip, t5, dit, vae))
    sched = FlowMatchEulerDiscreteScheduler(**FLUX_SCHED)
    comps = dict(
        text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok,
        vae=vae, scheduler=sched,
    )  # fmt: skip
    ref = FluxPipeline(transformer=dit, **comps)
    ref.set_progress_bar_config(disable=True)
    family = get_family("flux")
    ours_dit = denoiser_from_module(dit, family.denoiser(), dtype=dtype, device=dev)
    configs = dict(vae=dict(vae.config), scheduler=dict(sched.config))
    ours = OurPipeline(family, dict(comps, transformer=ours_dit), configs, device=dev)
    return ours, ref


WAN_CPU_CFG = dict(
    transformer=dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=16,
        out_channels=16, text_dim=256, freq_dim=256, ffn_dim=1024, num_layers=4,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    ),
    t5=dict(d_model=256, d_kv=32, d_ff=512, num_layers=2, num_heads=8,
            feed_forward_proj="gated-gelu"),
    vae=dict(base_dim=32, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    height=128, width=128, frames=9, steps=8, guidance=4.0, guidance_2=3.0,
    max_sequence_length=128, dtype=torch.float32, device="cpu",
)  # fmt: skip
WAN_GPU_CFG = dict(
    transformer=dict(
        patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    ),
    t5=dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=1, num_heads=64,
            feed_forward_proj="gated-gelu"),
    vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2),
    height=480, width=832, frames=17, steps=4, guidance=4.0, guidance_2=3.0,
    max_sequence_length=512, dtype=torch.bfloat16, device="cuda",
)  # fmt: skip


def build_wan(cfg):
    """(ours, reference) two-expert Wan pipelines sharing everything but the DiTs."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from sglang.multimodal_gen.models.families.tiny.common import build_clip_t5_tokenizers
    from sglang.multimodal_gen.models.loader import denoiser_from_module
    from sglang.multimodal_gen.models.registry import get_family
    from sglang.multimodal_gen.pipelines.wan import WanPipeline as OurPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    dev, dtype = torch.device(cfg["device"]), cfg["dtype"]
    _, tok = build_clip_t5_tokenizers()
    torch.manual_seed(0)
    with torch.device(dev):
        te = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), **cfg["t5"])).to(dtype).eval()
        vae = AutoencoderKLWan(**cfg["vae"]).eval()  # fp32, as diffusers' Wan examples keep it
        experts = {n: WanTransformer3DModel(**cfg["transformer"]).to(dtype).eval()
                   for n in ("transformer", "transformer_2")}  # fmt: skip
    sched = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    comps = dict(text_encoder=te, tokenizer=tok, vae=vae, scheduler=sched)
    ref = WanPipeline(**comps, **experts, boundary_ratio=0.875)
    ref.set_progress_bar_config(disable=True)
    family = get_family("wan")
    ours_experts = {
        n: denoiser_from_module(m, family.denoiser(n), dtype=dtype, device=dev)
        for n, m in experts.items()
    }
    configs = dict(vae=dict(vae.config), scheduler=dict(sched.config))
    ours = OurPipeline(
        family, dict(comps, **ours_experts), configs, device=dev,
        pipeline_config=dict(boundary_ratio=0.875),
    )  # fmt: skip
    return ours, ref


QWEN_CPU_CFG = dict(
    transformer=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=4,
                     attention_head_dim=32, num_attention_heads=8, joint_attention_dim=256,
                     axes_dims_rope=(8, 12, 12)),
    text=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2),
    vae=dict(base_dim=32, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    size=256, steps=8, true_cfg=4.0, dtype=torch.float32, device="cpu",
)  # fmt: skip
QWEN_GPU_CFG = dict(
    transformer=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                     attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                     axes_dims_rope=(16, 56, 56)),
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=1,
              num_attention_heads=28, num_key_value_heads=4),
    vae=dict(base_dim=96, z_dim=16),
    size=1024, steps=8, true_cfg=4.0, dtype=torch.bfloat16, device="cuda",
)  # fmt: skip


def build_qwen(cfg):
    """(ours, reference) Qwen-Image pipelines sharing everything but the DiT."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from sglang.multimodal_gen.models.families.tiny.common import build_byte_level_chat_tokenizer
    from sglang.multimodal_gen.models.families.tiny.qwen_image import QWEN_SCHEDULER
    from sglang.multimodal_gen.models.loader import denoiser_from_module
    from sglang.multimodal_gen.models.registry import get_family
    from sglang.multimodal_gen.pipelines.qwen_image import QwenImagePipeline as OurPipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    dev, dtype = torch.device(cfg["device"]), cfg["dtype"]
    tok = build_byte_level_chat_tokenizer()
    text = dict(cfg["text"], vocab_size=len(tok), max_position_embeddings=4096,
                rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}
                if cfg["text"]["hidden_size"] > 256 else {"type": "mrope",
                "mrope_section": [8, 12, 12]})  # fmt: skip
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=cfg["text"]["hidden_size"])  # fmt: skip
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # a 20B DiT built in fp32 first would need 80 GB on its own
    try:
        with torch.device(dev):
            config = Qwen2_5_VLConfig(text_config=text, vision_config=vision)
            te = Qwen2_5_VLForConditionalGeneration(config).eval()
            dit = QwenImageTransformer2DModel(**cfg["transformer"]).eval()
            vae = AutoencoderKLQwenImage(**cfg["vae"]).eval()
    finally:
        torch.set_default_dtype(default)
    sched = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    comps = dict(text_encoder=te, tokenizer=tok, vae=vae, scheduler=sched)
    ref = QwenImagePipeline(transformer=dit, **comps)
    ref.set_progress_bar_config(disable=True)
    family = get_family("qwen-image")
    ours_dit = denoiser_from_module(dit, family.denoiser(), dtype=dtype, device=dev)
    configs = dict(vae=dict(vae.config), scheduler=dict(sched.config))
    ours = OurPipeline(family, dict(comps, transformer=ours_dit), configs, device=dev)
    return ours, ref


# LTX-2.3 DiT switches (as models/families/tiny/ltx2.py builds them): gated attention, the
# sigma-dependent cross-attention / prompt modulation on both streams, perturbable self-attention
# (STG), caption projections in the connectors (use_prompt_embeddings off), split RoPE
LTX23_FLAGS = dict(
    gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
    perturbed_attn=True, use_prompt_embeddings=False, rope_type="split",
)  # fmt: skip
LTX2_CPU_CFG = dict(
    transformer=dict(
        LTX23_FLAGS, in_channels=32, out_channels=32, num_attention_heads=8,
        attention_head_dim=32, cross_attention_dim=256, vae_scale_factors=(4, 16, 16),
        audio_in_channels=16, audio_out_channels=16, audio_num_attention_heads=4,
        audio_attention_head_dim=32, audio_cross_attention_dim=128, num_layers=4,
        caption_channels=128,
    ),
    gemma=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=64,
               max_position_embeddings=2048, sliding_window=64),
    connectors=dict(
        video_connector_num_attention_heads=8, video_connector_attention_head_dim=32,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=32,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=128,
    ),
    # spatial factor 16 (patch 4, two spatio-temporal stages), temporal 4
    vae=dict(
        in_channels=3, out_channels=3, latent_channels=32, block_out_channels=(32, 64),
        decoder_block_out_channels=(32, 64), layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True), decoder_inject_noise=(False, False, False),
        down_block_types=("LTX2VideoDownBlock3D",) * 2,
        downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal"), upsample_residual=(False, False),
        upsample_factor=(1, 1), patch_size=4, patch_size_t=1, decoder_causal=False,
    ),
    audio_vae=dict(
        base_channels=16, output_channels=2, ch_mult=(1, 2), num_res_blocks=1,
        attn_resolutions=None, in_channels=2, resolution=64, latent_channels=4,
        mel_bins=16,
    ),
    vocoder=dict(in_channels=2 * 16, hidden_channels=64, out_channels=2,
                 upsample_kernel_sizes=[8, 8, 20], upsample_factors=[4, 4, 10],
                 resnet_kernel_sizes=[3], resnet_dilations=[[1, 3]],
                 output_sampling_rate=16000),
    height=128, width=128, frames=9, steps=4, max_sequence_length=128,
    dtype=torch.float32, device="cpu",
)  # fmt: skip
LTX2_GPU_CFG = dict(
    # diffusers' LTX2VideoTransformer3DModel defaults are LTX-2's 19B shapes (48 layers, video
    # 32 heads x 128, audio 32 heads x 64, caption width 3840) plus the LTX-2.3 switches
    transformer=dict(LTX23_FLAGS, num_layers=48),
    # Gemma 3 12B's text tower, one layer
    gemma=dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=1,
               num_attention_heads=16, num_key_value_heads=8, head_dim=256,
               max_position_embeddings=131072, sliding_window=1024),
    # the connectors' defaults (2 layers, 128 registers) with LTX-2.3's per-modality projections
    # and gates, their widths matching the DiT's (video 32 x 128, audio 32 x 64)
    connectors=dict(
        video_connector_num_attention_heads=32, video_connector_attention_head_dim=128,
        audio_connector_num_attention_heads=32, audio_connector_attention_head_dim=64,
    ),
    vae=dict(decoder_causal=False, spatial_compression_ratio=32, temporal_compression_ratio=8),
    audio_vae=dict(),  # diffusers' defaults (LTX-2's audio VAE: 16 kHz, 64 mel bins, 8 latents)
    vocoder=None,  # LTX2VocoderWithBWE's defaults (LTX-2.3: 48 kHz output)
    height=512, width=768, frames=25, steps=4, max_sequence_length=1024,
    dtype=torch.bfloat16, device="cuda",
)  # fmt: skip


def build_ltx2(cfg):
    """(ours, reference) LTX-2.3 pipelines sharing everything but the DiT (text encoder,
    tokenizer, connectors, both VAEs, vocoder and scheduler are the same objects)."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
    from sglang.multimodal_gen.models.families.tiny.common import redraw_constant_params
    from sglang.multimodal_gen.models.families.tiny.ltx2 import TINY_SIGLIP, build_gemma_tokenizer
    from sglang.multimodal_gen.models.loader import denoiser_from_module
    from sglang.multimodal_gen.models.registry import get_family
    from sglang.multimodal_gen.pipelines.ltx2 import LTX2Pipeline as OurPipeline
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    dev, dtype = torch.device(cfg["device"]), cfg["dtype"]
    tok = build_gemma_tokenizer()
    gemma = cfg["gemma"]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # two 19B DiTs built in fp32 first would not fit
    try:
        with torch.device(dev):
            te = Gemma3ForConditionalGeneration(Gemma3Config(
                text_config=dict(gemma, vocab_size=len(tok)), vision_config=TINY_SIGLIP,
                mm_tokens_per_image=4,
            )).eval()  # fmt: skip
            t = cfg["transformer"]
            connectors = LTX2TextConnectors(**dict(
                dict(caption_channels=gemma["hidden_size"],
                     text_proj_in_factor=gemma["num_hidden_layers"] + 1, video_gated_attn=True,
                     audio_gated_attn=True, rope_type="split", per_modality_projections=True),
                video_hidden_dim=t.get("cross_attention_dim", 4096),
                audio_hidden_dim=t.get("audio_cross_attention_dim", 2048), **cfg["connectors"],
            )).eval()  # fmt: skip
            dit = LTX2VideoTransformer3DModel(**t).eval()
            vae = AutoencoderKLLTX2Video(**cfg["vae"]).eval()
            audio_vae = AutoencoderKLLTX2Audio(**cfg["audio_vae"]).eval()
            vocoder = (LTX2VocoderWithBWE() if cfg["vocoder"] is None
                       else LTX2Vocoder(**cfg["vocoder"])).eval()  # fmt: skip
    finally:
        torch.set_default_dtype(default)
    if dev.type == "cpu":  # zero/one-initialised parameters (gates, norms) made to count
        gen = torch.Generator().manual_seed(1)
        for m in (te, connectors, dit, vae, audio_vae, vocoder):
            redraw_constant_params(m, gen, 0.1)
    sched = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1,
    )  # fmt: skip
    comps = dict(text_encoder=te, tokenizer=tok, connectors=connectors, vae=vae,
                 audio_vae=audio_vae, vocoder=vocoder, scheduler=sched)  # fmt: skip
    ref = LTX2Pipeline(transformer=dit, **comps)
    ref.set_progress_bar_config(disable=True)
    family = get_family("ltx2")
    ours_dit = denoiser_from_module(dit, family.denoiser(), dtype=dtype, device=dev)
    configs = dict(vae=dict(vae.config), audio_vae=dict(audio_vae.config),
                   vocoder=dict(vocoder.config), scheduler=dict(sched.config))  # fmt: skip
    ours = OurPipeline(family, dict(comps, transformer=ours_dit), configs, device=dev)
    return ours, ref


def build(cfg):
    """(ours, reference) pipelines sharing everything but the DiT implementation."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from sglang.multimodal_gen.models.families.tiny.common import build_byte_level_chat_tokenizer
    from sglang.multimodal_gen.models.families.tiny.zimage import DEFAULT_SCHEDULER
    from sglang.multimodal_gen.models.families.zimage import zimage_from_diffusers_module
    from sglang.multimodal_gen.models.registry import get_family
    from sglang.multimodal_gen.pipelines.zimage import ZImagePipeline as OurPipeline
    from transformers import Qwen3Config, Qwen3Model

    dev, dtype = torch.device(cfg["device"]), cfg["dtype"]
    tok = build_byte_level_chat_tokenizer()
    torch.manual_seed(0)
    with torch.device(dev):
        te_cfg = dict(cfg["text_encoder"], vocab_size=len(tok), tie_word_embeddings=False)
        te = Qwen3Model(Qwen3Config(**te_cfg)).to(dtype).eval()
        t_cfg = dict(cfg["transformer"], cap_feat_dim=te_cfg["hidden_size"])
        dit = ZImageTransformer2DModel(**t_cfg).to(dtype).eval()
        with torch.no_grad():
            dit.x_pad_token.normal_()
            dit.cap_pad_token.normal_()
        vae = AutoencoderKL(**cfg["vae"]).to(dtype).eval()
    sched = FlowMatchEulerDiscreteScheduler(**DEFAULT_SCHEDULER)
    ref = ZImagePipeline(scheduler=sched, vae=vae, text_encoder=te, tokenizer=tok, transformer=dit)
    ref.set_progress_bar_config(disable=True)
    ours_dit = zimage_from_diffusers_module(dit, dtype=dtype, device=dev)
    comps = dict(transformer=ours_dit, text_encoder=te, tokenizer=tok, vae=vae, scheduler=sched)
    configs = dict(vae=dict(vae.config), scheduler=dict(sched.config))
    ours = OurPipeline(get_family("zimage"), comps, configs, device=dev)
    return ours, ref


class StepTimer:
    """Times every forward of a module (synchronizing CUDA around it)."""

    def __init__(self, modules, cuda: bool):
        self.times: list[float] = []
        self.cuda = cuda
        for module in modules if isinstance(modules, list) else [modules]:
            module.register_forward_pre_hook(self._pre)
            module.register_forward_hook(self._post)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _pre(self, *_):
        self._sync()
        self._t0 = time.perf_counter()

    def _post(self, *_):
        self._sync()
        self.times.append(time.perf_counter() - self._t0)


HV_CPU_CFG = dict(
    transformer=dict(in_channels=16, out_channels=16, num_attention_heads=8, attention_head_dim=32,
                     num_layers=2, num_single_layers=4, num_refiner_layers=1,
                     rope_axes_dim=(8, 12, 12)),
    llama=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2),
    clip=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
              projection_dim=64),
    vae=dict(latent_channels=16, block_out_channels=(32, 32, 64, 64), layers_per_block=1,
             norm_num_groups=8),
    height=128, width=128, frames=9, steps=8, guidance=6.0, max_sequence_length=256,
    dtype=torch.float32, device="cpu",
)  # fmt: skip
HV_GPU_CFG = dict(
    transformer=dict(in_channels=16, out_channels=16, num_attention_heads=24,
                     attention_head_dim=128, num_layers=20, num_single_layers=40,
                     num_refiner_layers=2, rope_axes_dim=(16, 56, 56)),
    llama=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=3,
               num_attention_heads=32, num_key_value_heads=8),
    clip=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=1,
              num_attention_heads=12, projection_dim=768),
    vae=dict(latent_channels=16),
    height=544, width=960, frames=33, steps=4, guidance=6.0, max_sequence_length=256,
    dtype=torch.bfloat16, device="cuda",
)  # fmt: skip


def build_hunyuan_video(cfg):
    """(ours, reference) HunyuanVideo 1.0 pipelines sharing everything but the DiT."""
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from sglang.multimodal_gen.models.families.tiny.common import build_clip_t5_tokenizers
    from sglang.multimodal_gen.models.families.tiny.hunyuan_video import build_llama_tokenizer
    from sglang.multimodal_gen.models.loader import denoiser_from_module
    from sglang.multimodal_gen.models.registry import get_family
    from sglang.multimodal_gen.pipelines.hunyuan_video import HunyuanVideoPipeline as OurPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    dev, dtype = torch.device(cfg["device"]), cfg["dtype"]
    tok = build_llama_tokenizer()
    clip_tok, _ = build_clip_t5_tokenizers()
    torch.manual_seed(0)
    with torch.device(dev):
        te = LlamaModel(LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                    **cfg["llama"])).to(dtype).eval()  # fmt: skip
        te_2 = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(clip_tok), bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id, **cfg["clip"],
        )).to(dtype).eval()  # fmt: skip
        vae = AutoencoderKLHunyuanVideo(**cfg["vae"]).to(dtype).eval()
        dit = HunyuanVideoTransformer3DModel(
            text_embed_dim=cfg["llama"]["hidden_size"], pooled_projection_dim=cfg["clip"][
                "hidden_size"], **cfg["transformer"],
        ).to(dtype).eval()  # fmt: skip
    sched = FlowMatchEulerDiscreteScheduler(shift=7.0)
    comps = dict(text_encoder=te, tokenizer=tok, text_encoder_2=te_2, tokenizer_2=clip_tok,
                 vae=vae, scheduler=sched)  # fmt: skip
    ref = HunyuanVideoPipeline(transformer=dit, **comps)
    ref.set_progress_bar_config(disable=True)
    family = get_family("hunyuan-video")
    ours_dit = denoiser_from_module(dit, family.denoiser(), dtype=dtype, device=dev)
    configs = dict(vae=dict(vae.config), scheduler=dict(sched.config), transformer=dict(dit.config))
    ours = OurPipeline(family, dict(comps, transformer=ours_dit), configs, device=dev)
    return ours, ref


VIDEO_FAMILIES = ("wan", "ltx2", "hunyuan-video")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--family",
        choices=("zimage", "flux", "wan", "qwen-image", "ltx2", "hunyuan-video"),
        default="zimage",
    )
    ap.add_argument("--gpu", action="store_true", help="the real model shapes on CUDA, bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--size", type=int, default=None, help="image height = width")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile our DiT blocks (the warm-up compiles)"
    )
    ap.add_argument(
        "--matmul-precision",
        choices=("highest", "high", "medium"),
        default="highest",
        help="torch.set_float32_matmul_precision during our runs only (diffusers: highest)",
    )
    ap.add_argument(
        "--attention-backend",
        choices=("auto", "flash", "efficient", "cudnn", "math"),
        default="auto",
        help="the SDPA kernel of our attention (--attention-backend of serve); diffusers: auto",
    )
    ap.add_argument(
        "--cpu-gemm-backend",
        choices=("auto", "onednn", "onednn-packed", "blas"),
        default="auto",
        help="the CPU kernel of our linear layers (--cpu-gemm-backend of serve); diffusers: "
        "F.linear (the BLAS for fp32)",
    )
    args = ap.parse_args(argv)
    if args.family == "flux":
        cfg = dict(FLUX_GPU_CFG if args.gpu else FLUX_CPU_CFG)
    elif args.family == "wan":
        cfg = dict(WAN_GPU_CFG if args.gpu else WAN_CPU_CFG)
    elif args.family == "qwen-image":
        cfg = dict(QWEN_GPU_CFG if args.gpu else QWEN_CPU_CFG)
    elif args.family == "ltx2":
        cfg = dict(LTX2_GPU_CFG if args.gpu else LTX2_CPU_CFG)
    elif args.family == "hunyuan-video":
        cfg = dict(HV_GPU_CFG if args.gpu else HV_CPU_CFG)
    else:
        cfg = dict(GPU_CFG if args.gpu else CPU_CFG)
    if args.gpu and not torch.cuda.is_available():
        print("--gpu needs CUDA", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or cfg["steps"]
    size = args.size or cfg.get("size") or cfg["height"]
    cuda = cfg["device"] == "cuda"

    t0 = time.perf_counter()
    builders = {
        "zimage": build,
        "flux": build_flux,
        "wan": build_wan,
        "qwen-image": build_qwen,
        "ltx2": build_ltx2,
        "hunyuan-video": build_hunyuan_video,
    }
    ours, ref = builders[args.family](cfg)
    print(f"built in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    from sglang.multimodal_gen.layers.attention import set_attention_backend

    set_attention_backend(args.attention_backend, cfg["device"])  # our attention() only
    from sglang.multimodal_gen.layers.cpu_gemm import set_cpu_gemm_backend

    print(f"cpu gemm backend: {set_cpu_gemm_backend(args.cpu_gemm_backend)}", file=sys.stderr)
    if args.compile:
        from sglang.multimodal_gen.runtime.placement import compile_blocks

        for denoiser in ours.denoisers.values():
            compile_blocks(denoiser)
    timers = {
        "ours": StepTimer(list(ours.denoisers.values()), cuda),
        "diffusers": StepTimer(
            [m for m in (ref.transformer, getattr(ref, "transformer_2", None)) if m is not None],
            cuda,
        ),
    }
    gen_dev = cfg["device"]
    kw = dict(height=size, width=size, num_inference_steps=steps, guidance_scale=0.0)
    if args.family == "flux":
        kw.update(guidance_scale=cfg["guidance"], max_sequence_length=cfg["max_sequence_length"])
    if args.family == "qwen-image":
        kw.update(true_cfg_scale=cfg["true_cfg"], negative_prompt="blurry, low quality")
        del kw["guidance_scale"]
    if args.family == "wan":
        kw.update(
            height=args.size or cfg["height"], width=args.size or cfg["width"],
            num_frames=cfg["frames"], guidance_scale=cfg["guidance"],
            guidance_scale_2=cfg["guidance_2"], max_sequence_length=cfg["max_sequence_length"],
        )  # fmt: skip
    if args.family == "hunyuan-video":  # embedded guidance, one DiT forward per step
        kw.update(
            height=args.size or cfg["height"], width=args.size or cfg["width"],
            num_frames=cfg["frames"], guidance_scale=cfg["guidance"],
            max_sequence_length=cfg["max_sequence_length"],
        )  # fmt: skip
    ref_kw = kw
    if args.family == "ltx2":
        # the family's default guidance (CFG 3 / audio 7, STG 1, modality isolation 3, rescale
        # 0.7), with the STG block inside the DiT (block 28, or the last one of a smaller DiT:
        # diffusers runs the STG pass even when its blocks are missing, we skip it)
        num_layers = ours.transformer.cfg.num_layers
        d = ours.spec.defaults
        kw = dict(
            height=args.size or cfg["height"], width=args.size or cfg["width"],
            num_frames=cfg["frames"], fps=d.fps, num_inference_steps=steps,
            max_sequence_length=cfg["max_sequence_length"], negative_prompt="blurry, low quality",
            spatio_temporal_guidance_blocks=[min(28, num_layers - 1)],
            **{k: getattr(d, k) for k in (
                "guidance_scale", "audio_guidance_scale", "stg_scale", "audio_stg_scale",
                "modality_scale", "audio_modality_scale", "guidance_rescale",
                "audio_guidance_rescale")},
        )  # fmt: skip
        ref_kw = {("frame_rate" if k == "fps" else k): v for k, v in kw.items()}

    dit_per_step: dict[str, list[float]] = {"ours": [], "diffusers": []}

    def run(name):
        timers[name].times.clear()
        g = torch.Generator(gen_dev).manual_seed(0)
        if cuda:
            torch.cuda.synchronize()
        torch.set_float32_matmul_precision(args.matmul_precision if name == "ours" else "highest")
        start = time.perf_counter()
        if name == "ours" and args.family == "ltx2":  # frames and the sound track
            img = ours("a benchmark prompt", generator=g, output_type="media", progress=False,
                       **kw)[0].frames  # fmt: skip
        elif name == "ours":
            img = ours("a benchmark prompt", generator=g, output_type="np", progress=False, **kw)[0]
        else:
            out = ref("a benchmark prompt", generator=g, output_type="np", **ref_kw)
            img = np.asarray(out.frames if args.family in VIDEO_FAMILIES else out.images)[0]
            img = (img * 255).round().astype("uint8")
        if cuda:
            torch.cuda.synchronize()
        # all DiT calls of the run (CFG may be one batched call or two) over the step count
        dit_per_step[name].append(sum(timers[name].times) / steps)
        return time.perf_counter() - start, img

    with torch.inference_mode():
        run("ours")
        run("diffusers")
        for v in dit_per_step.values():
            v.clear()
        e2e = {"ours": [], "diffusers": []}
        images = {}
        for i in range(args.repeats):
            order = ("ours", "diffusers") if i % 2 == 0 else ("diffusers", "ours")
            for name in order:
                dt, images[name] = run(name)
                e2e[name].append(dt)
                print(f"  run {i} {name}: {dt:.3f}s", file=sys.stderr)

    a, b = images["ours"].astype(np.float64), images["diffusers"].astype(np.float64)
    mse = float(np.mean((a - b) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)
    step = {k: statistics.median(v) for k, v in dit_per_step.items()}
    step_min = {k: min(v) for k, v in dit_per_step.items()}
    total = {k: statistics.median(v) for k, v in e2e.items()}
    total_min = {k: min(v) for k, v in e2e.items()}
    t = cfg["transformer"]
    if args.family == "flux":
        shape = (
            f"{t['num_layers']}+{t['num_single_layers']} blocks, "
            f"{t['num_attention_heads']} heads x {t['attention_head_dim']}"
        )
    elif args.family == "qwen-image":
        shape = (
            f"{t['num_layers']} layers, {t['num_attention_heads']} heads x "
            f"{t['attention_head_dim']}, true CFG {cfg['true_cfg']}"
        )
    elif args.family == "wan":
        shape = (
            f"2 experts x {t['num_layers']} layers, {t['num_attention_heads']} heads x "
            f"{t['attention_head_dim']}, {kw['height']}x{kw['width']}x{kw['num_frames']} frames"
        )
    elif args.family == "ltx2":
        v = (t.get("num_attention_heads", 32), t.get("attention_head_dim", 128))
        a = (t.get("audio_num_attention_heads", 32), t.get("audio_attention_head_dim", 64))
        shape = (
            f"LTX-2.3 {t['num_layers']} layers, video {v[0]} heads x {v[1]}, audio {a[0]} heads x "
            f"{a[1]}, {kw['height']}x{kw['width']}x{kw['num_frames']} frames, CFG+STG+modality"
        )
    elif args.family == "hunyuan-video":
        shape = (
            f"{t['num_layers']}+{t['num_single_layers']} blocks, {t['num_attention_heads']} heads "
            f"x {t['attention_head_dim']}, {kw['height']}x{kw['width']}x{kw['num_frames']} frames"
        )
    else:
        shape = f"dim {t['dim']}, {t['n_layers']} layers"
    label = (
        f"{args.family} {'GPU' if cuda else 'CPU'} {shape}, "
        f"{'' if args.family in VIDEO_FAMILIES else f'{size}x{size}, '}"
        f"{steps} steps, {str(cfg['dtype']).replace('torch.', '')}"
    )
    if args.compile or args.matmul_precision != "highest" or args.attention_backend != "auto":
        label += (
            f"; ours with compile={args.compile}, fp32 matmul {args.matmul_precision}, "
            f"attention {args.attention_backend}"
        )
    what = "frames" if args.family in VIDEO_FAMILIES else "image"
    print(f"\nconfig: {label}; {args.repeats} interleaved runs; {what} PSNR {psnr:.1f} dB")
    print("| metric | ours | diffusers | ours/diffusers |")
    print("|---|---|---|---|")
    rows = [
        ("DiT time per step, median (ms)", step, 1e3, ".1f"),
        ("DiT time per step, min (ms)", step_min, 1e3, ".1f"),
        ("end to end, median (s)", total, 1, ".3f"),
        ("end to end, min (s)", total_min, 1, ".3f"),
    ]
    for name, d, k, fmt in rows:
        print(
            f"| {name} | {d['ours'] * k:{fmt}} | {d['diffusers'] * k:{fmt}} "
            f"| {d['ours'] / d['diffusers']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
