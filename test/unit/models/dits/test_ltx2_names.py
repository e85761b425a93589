"""LTX2_NAME_MAP against a hand-written table: diffusers and original (Lightricks) module names ->
(our module, shard id). The expected targets are written out here, not derived from the rules."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.configs.ltx2 import LTX2ArchConfig
from sglang.multimodal_gen.models.dits.ltx2 import LTX2Transformer
from sglang.multimodal_gen.models.dits.ltx2_names import LTX2_NAME_MAP

B = "transformer_blocks"

DIFFUSERS = [
    # self-attentions: split q/k/v -> fused QKV
    (f"{B}.0.attn1.to_q", (f"{B}.0.attn1.to_qkv", "q")),
    (f"{B}.7.attn1.to_k", (f"{B}.7.attn1.to_qkv", "k")),
    (f"{B}.47.audio_attn1.to_v", (f"{B}.47.audio_attn1.to_qkv", "v")),
    (f"{B}.0.attn1.to_out.0", (f"{B}.0.attn1.to_out.0", None)),
    (f"{B}.0.attn1.norm_q", (f"{B}.0.attn1.norm_q", None)),
    (f"{B}.0.audio_attn1.to_gate_logits", (f"{B}.0.audio_attn1.to_gate_logits", None)),
    # cross-attentions: q alone, k/v -> merged k|v
    (f"{B}.2.attn2.to_q", (f"{B}.2.attn2.to_q", None)),
    (f"{B}.2.attn2.to_k", (f"{B}.2.attn2.to_kv", 0)),
    (f"{B}.2.audio_attn2.to_v", (f"{B}.2.audio_attn2.to_kv", 1)),
    (f"{B}.3.audio_to_video_attn.to_k", (f"{B}.3.audio_to_video_attn.to_kv", 0)),
    (f"{B}.3.video_to_audio_attn.to_v", (f"{B}.3.video_to_audio_attn.to_kv", 1)),
    (f"{B}.3.video_to_audio_attn.to_q", (f"{B}.3.video_to_audio_attn.to_q", None)),
    (f"{B}.3.audio_to_video_attn.norm_k", (f"{B}.3.audio_to_video_attn.norm_k", None)),
    # FFNs
    (f"{B}.5.ff.net.0.proj", (f"{B}.5.ff.net.0.proj", None)),
    (f"{B}.5.audio_ff.net.2", (f"{B}.5.audio_ff.net.2", None)),
    # top level
    ("proj_in", ("proj_in", None)),
    ("audio_proj_out", ("audio_proj_out", None)),
    ("time_embed.linear", ("time_embed.linear", None)),
    (
        "time_embed.emb.timestep_embedder.linear_1",
        ("time_embed.emb.timestep_embedder.linear_1", None),
    ),
    ("prompt_adaln.linear", ("prompt_adaln.linear", None)),
    ("caption_projection.linear_2", ("caption_projection.linear_2", None)),
    # our fused names resolve to themselves
    (f"{B}.0.attn1.to_qkv", (f"{B}.0.attn1.to_qkv", None)),
    (f"{B}.0.attn2.to_kv", (f"{B}.0.attn2.to_kv", None)),
]

ORIGINAL = [
    ("patchify_proj", ("proj_in", None)),
    ("audio_patchify_proj", ("audio_proj_in", None)),
    ("adaln_single.linear", ("time_embed.linear", None)),
    (
        "adaln_single.emb.timestep_embedder.linear_2",
        ("time_embed.emb.timestep_embedder.linear_2", None),
    ),
    ("audio_adaln_single.linear", ("audio_time_embed.linear", None)),
    (
        "av_ca_video_scale_shift_adaln_single.linear",
        ("av_cross_attn_video_scale_shift.linear", None),
    ),
    ("av_ca_a2v_gate_adaln_single.linear", ("av_cross_attn_video_a2v_gate.linear", None)),
    (
        "av_ca_audio_scale_shift_adaln_single.linear",
        ("av_cross_attn_audio_scale_shift.linear", None),
    ),
    ("av_ca_v2a_gate_adaln_single.linear", ("av_cross_attn_audio_v2a_gate.linear", None)),
    ("prompt_adaln_single.linear", ("prompt_adaln.linear", None)),
    ("audio_prompt_adaln_single.linear", ("audio_prompt_adaln.linear", None)),
    (f"{B}.4.attn1.q_norm", (f"{B}.4.attn1.norm_q", None)),
    (f"{B}.4.video_to_audio_attn.k_norm", (f"{B}.4.video_to_audio_attn.norm_k", None)),
    # wrapper prefixes (the single file; LoRA files)
    (f"model.diffusion_model.{B}.1.attn1.to_k", (f"{B}.1.attn1.to_qkv", "k")),
    (f"diffusion_model.{B}.1.audio_attn2.to_v", (f"{B}.1.audio_attn2.to_kv", 1)),
    ("diffusion_model.patchify_proj", ("proj_in", None)),
]

PARAMS = [
    (
        f"{B}.0.scale_shift_table_a2v_ca_video",
        (f"{B}.0.video_a2v_cross_attn_scale_shift_table", None),
    ),
    (
        f"model.diffusion_model.{B}.1.scale_shift_table_a2v_ca_audio",
        (f"{B}.1.audio_a2v_cross_attn_scale_shift_table", None),
    ),
    ("model.diffusion_model.scale_shift_table", ("scale_shift_table", None)),
    ("diffusion_model.audio_scale_shift_table", ("audio_scale_shift_table", None)),
    (f"{B}.1.prompt_scale_shift_table", (f"{B}.1.prompt_scale_shift_table", None)),
    (f"{B}.1.attn1.to_v.bias", (f"{B}.1.attn1.to_qkv.bias", "v")),
    (f"{B}.1.attn2.q_norm.weight", (f"{B}.1.attn2.norm_q.weight", None)),
    ("model.diffusion_model.patchify_proj.bias", ("proj_in.bias", None)),
]

LTX23 = dict(
    gated_attn=True,
    audio_gated_attn=True,
    cross_attn_mod=True,
    audio_cross_attn_mod=True,
    perturbed_attn=True,
    use_prompt_embeddings=False,
)


def _tiny(num_layers: int = 48, **kw) -> LTX2Transformer:
    cfg = LTX2ArchConfig(
        **dict(LTX23, **kw),
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=4,
        cross_attention_dim=8,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        caption_channels=8,
        num_layers=num_layers,
    )
    return LTX2Transformer(cfg, tp_rank=0, tp_size=1)


@pytest.mark.parametrize(
    "name,expected", DIFFUSERS + ORIGINAL, ids=[n for n, _ in DIFFUSERS + ORIGINAL]
)
def test_resolve(name, expected):
    assert LTX2_NAME_MAP.resolve(name) == expected


@pytest.mark.parametrize("name,expected", PARAMS, ids=[n for n, _ in PARAMS])
def test_resolve_param(name, expected):
    assert LTX2_NAME_MAP.resolve_param(name) == expected


def test_every_target_is_a_module_or_parameter_of_ours_with_that_shard():
    """At the real depth (48 blocks, tiny width) every resolved module exists and its shard id is
    one of that layer's shards; every renamed parameter exists (caption projections: LTX-2.0)."""
    model = _tiny()
    modules = dict(model.named_modules())
    modules.update(_tiny(num_layers=1, use_prompt_embeddings=True).named_modules())
    params = dict(model.named_parameters())
    for name, (ours, shard) in DIFFUSERS + ORIGINAL:
        assert ours in modules, name
        if shard is not None:
            assert shard in modules[ours].output_shard_ids, name
    for name, (ours, _) in PARAMS:
        assert ours in params, name


def test_lora_vocabulary_reaches_original_names():
    """The LoRA adapter's vocabulary (built by inverting the rules) contains the Lightricks
    spellings with the right targets, and every projection is a LoRA target."""
    from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec

    spec = LoRAModelSpec.from_module(_tiny(num_layers=2), LTX2_NAME_MAP)
    assert spec.shards(f"{B}.1.attn1.to_qkv") == ["q", "k", "v"]
    assert spec.shards(f"{B}.1.audio_to_video_attn.to_kv") == [0, 1]
    vocab = spec.vocabulary
    assert vocab[f"{B}.1.attn1.to_q"] == (f"{B}.1.attn1.to_qkv", "q")
    assert vocab[f"{B}.0.video_to_audio_attn.to_k"] == (f"{B}.0.video_to_audio_attn.to_kv", 0)
    assert vocab["patchify_proj"] == ("proj_in", None)
    assert vocab["adaln_single.linear"] == ("time_embed.linear", None)
    assert vocab["prompt_adaln_single.linear"] == ("prompt_adaln.linear", None)
    for target in (
        f"{B}.0.attn1.to_gate_logits",
        f"{B}.0.audio_ff.net.0.proj",
        "av_cross_attn_audio_v2a_gate.linear",
        "audio_prompt_adaln.emb.timestep_embedder.linear_1",
        "audio_proj_out",
    ):
        assert vocab[target] == (target, None), target


def test_real_config_builds_with_the_reference_parameter_count():
    """The full-size model with LTX-2.3's switches at the default shapes builds (on the meta
    device) with the reference's parameter count (diffusers' LTX2VideoTransformer3DModel with the
    same config, counted once on the meta device: 18,988,838,144; LTX-2.0's defaults give
    18,876,174,592 on both sides); at TP 8 a rank holds 1/8 of every head-split layer, including
    gates and q/k norm weights."""
    cfg = LTX2ArchConfig(**LTX23)
    full = LTX2Transformer(cfg, tp_rank=0, tp_size=1, device="meta")
    assert sum(p.numel() for p in full.parameters()) == 18_988_838_144
    tp8 = LTX2Transformer(cfg, tp_rank=7, tp_size=8, device="meta")
    d, da = cfg.inner_dim, cfg.audio_inner_dim
    blk = tp8.transformer_blocks[0]
    assert blk.attn1.to_qkv.weight.shape == (3 * d // 8, d)
    assert blk.audio_to_video_attn.to_q.weight.shape == (da // 8, d)
    assert blk.video_to_audio_attn.to_kv.weight.shape == (2 * da // 8, d)
    assert blk.video_to_audio_attn.to_out[0].weight.shape == (da, da // 8)
    assert blk.attn2.norm_q.weight.shape == (d // 8,)
    assert blk.ff.net[2].weight.shape == (d, 4 * d // 8)
    assert blk.attn1.to_gate_logits.weight.shape == (cfg.num_attention_heads // 8, d)
