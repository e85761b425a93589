"""The Flux.1 DiT on our tensor-parallel layers.

Same architecture and numerics as diffusers' ``FluxTransformer2DModel`` (follows diffusers 0.42.1
``models/transformers/transformer_flux.py``; Black Forest Labs, Flux.1, 2024): an MMDiT with
``num_layers`` double-stream blocks (separate weights for text and image tokens, one joint
attention over ``[text, image]``) followed by ``num_single_layers`` single-stream blocks (one
weight set, attention and MLP in parallel from one fused input projection), adaLN-Zero modulated
by ``temb = timestep (+ guidance) embedding + pooled text embedding``, and 3-axis RoPE.

Module names equal diffusers' (so a diffusers state dict loads 1:1 through ``FLUX_NAME_MAP`` in
``flux_names.py``) except three fused layers:

* ``transformer_blocks.N.attn.to_qkv``: ``QKVParallelLinear`` from ``attn.to_q/to_k/to_v``
  (shard ids ``"q"``, ``"k"``, ``"v"``);
* ``transformer_blocks.N.attn.to_added_qkv``: ``QKVParallelLinear`` from
  ``attn.add_q_proj/add_k_proj/add_v_proj`` (shard ids ``"q"``, ``"k"``, ``"v"``);
* ``single_transformer_blocks.N.to_qkv_mlp``: ``MergedColumnParallelLinear`` with output sections
  ``[D, D, D, mlp_hidden]`` from ``attn.to_q``, ``attn.to_k``, ``attn.to_v``, ``proj_mlp`` (shard
  ids ``0``, ``1``, ``2``, ``3``); the BFL checkpoint's ``linear1`` is exactly this fused weight.

Tensor parallelism (``D = inner_dim``, ``n = tp_size``): attention heads are split over the ranks
(each rank attends with its ``heads / n`` heads over the whole joint sequence, no communication
inside attention), FFN hidden units are split (column-parallel in, row-parallel out), and in a
single block rank ``r`` holds ``[q_r | k_r | v_r | mlp_r]`` of the fused projection and feeds its
local ``[attn_r | gelu(mlp_r)]`` to ``proj_out``, a ``RowParallelLinear`` with
``input_sizes=[D, mlp_hidden]`` (two input sections each split over the ranks). One all-reduce per
row-parallel layer: four per double block, one per single block. The embedders, adaLN
modulations, ``norm_out`` and the final ``proj_out`` are replicated.

The two block kinds are the shared ``layers.mmdit`` blocks (also HunyuanVideo's) with Flux's
choices: joint order ``[text, image]``, RoPE on every token, ``torch.nn.RMSNorm`` q/k norms, fp16
clipping, no attention mask (:func:`flux_double_block`, :func:`flux_single_block`).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.multimodal_gen.configs.flux import FluxArchConfig
from sglang.multimodal_gen.distributed import get_tp_world_size
from sglang.multimodal_gen.distributed.sequence import SeqSplit, sequence_split
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage, ModulatedInput
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding, timestep_sinusoid
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.layers.mmdit import DualStreamBlock, SingleStreamBlock
from sglang.multimodal_gen.layers.norm import AdaLayerNormContinuous
from sglang.multimodal_gen.layers.rotary import MultiAxisRopeReal
from sglang.multimodal_gen.models.registry import get_family

__all__ = [
    "FluxTimeTextEmbed",
    "FluxTransformer",
    "flux_double_block",
    "flux_from_diffusers_module",
    "flux_single_block",
]


#: TeaCache's rescaling of Flux.1's modulated-input change (``np.poly1d`` order) and its
#: ``rel_l1_thresh`` default (ali-vilab/TeaCache, TeaCache4FLUX: 0.25 ~1.5x, 0.4 ~1.8x, 0.6 ~2.0x,
#: 0.8 ~2.25x on FLUX.1-dev, 28 steps).
FLUX_TEACACHE_COEFFICIENTS = (
    4.98651651e02,
    -2.83781631e02,
    5.58554382e01,
    -3.82021401e00,
    2.64230861e-01,
)
FLUX_TEACACHE_THRESHOLD = 0.6


# ------------------------------------------------------------------------------ conditioning
class FluxTimeTextEmbed(nn.Module):
    """``temb = MLP(sinusoid(t)) [+ MLP(sinusoid(guidance))] + MLP(pooled)``.

    Diffusers' ``CombinedTimestepTextProjEmbeddings`` (no guidance) and
    ``CombinedTimestepGuidanceTextProjEmbeddings`` (with ``guidance_embedder``) of
    ``embeddings.py``; the sum is taken in the same order (``(t + g) + pooled``). The MLPs are
    :class:`~sglang.multimodal_gen.layers.embeddings.TimestepEmbedding` (SiLU).

    Shapes: ``t [B]``, ``guidance [B] | None`` (both already multiplied by 1000),
    ``pooled [B, pooled_projection_dim]`` -> ``[B, D]`` in the weight dtype.
    """

    def __init__(self, cfg: FluxArchConfig, prefix: str, **kw):
        super().__init__()
        d, f = cfg.inner_dim, cfg.T_FREQ_DIM
        self.freq_dim = f
        self.timestep_embedder = TimestepEmbedding(f, d, f"{prefix}.timestep_embedder", **kw)
        if cfg.guidance_embeds:
            self.guidance_embedder = TimestepEmbedding(f, d, f"{prefix}.guidance_embedder", **kw)
        else:
            self.guidance_embedder = None
        self.text_embedder = TimestepEmbedding(  # diffusers' PixArtAlphaTextProjection
            cfg.pooled_projection_dim, d, f"{prefix}.text_embedder", **kw
        )

    def forward(self, t, pooled, guidance=None) -> torch.Tensor:
        emb = self.timestep_embedder(timestep_sinusoid(t, self.freq_dim).to(pooled.dtype))
        if self.guidance_embedder is not None:
            g = self.guidance_embedder(timestep_sinusoid(guidance, self.freq_dim).to(pooled.dtype))
            emb = emb + g
        return emb + self.text_embedder(pooled)


# ------------------------------------------------------------------------------- the blocks
def flux_double_block(cfg: FluxArchConfig, prefix: str, tp_rank, tp_size, dtype) -> DualStreamBlock:
    """Diffusers' ``FluxTransformerBlock``: the shared dual-stream block with Flux's choices
    (joint order ``[text, image]``, RoPE on every token, ``torch.nn.RMSNorm`` q/k norms, the text
    stream clipped to the fp16 range)."""
    return DualStreamBlock(
        cfg.inner_dim,
        cfg.attention_head_dim,
        cfg.num_attention_heads,
        cfg.mlp_hidden,
        cfg.NORM_EPS,
        qk_norm="torch",
        text_first=True,
        clip_fp16=True,
        prefix=prefix,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=dtype,
    )


def flux_single_block(
    cfg: FluxArchConfig, prefix: str, tp_rank, tp_size, dtype
) -> SingleStreamBlock:
    """Diffusers' ``FluxSingleTransformerBlock``: the shared single-stream block over ``[text,
    image]`` with RoPE on every token, ``torch.nn.RMSNorm`` q/k norms and fp16 clipping."""
    return SingleStreamBlock(
        cfg.inner_dim,
        cfg.attention_head_dim,
        cfg.mlp_hidden,
        cfg.NORM_EPS,
        qk_norm="torch",
        clip_fp16=True,
        prefix=prefix,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=dtype,
    )


# ---------------------------------------------------------------------------------- the model
class FluxTransformer(nn.Module):
    """Flux.1 DiT (``FluxTransformer2DModel``), tensor-parallel.

    Args:
        cfg: architecture (``transformer/config.json``).
        tp_rank, tp_size: explicit TP coordinates (default: the TP group's).
        dtype: parameter dtype (default: ``torch.get_default_dtype()``).
        device: where to allocate parameters.

    Raises:
        ValueError: the TP size does not divide a number of the family's ``tp_divisors``
            (``ModelFamily.check_tp_size``: the number, the TP size and the valid sizes named).

    The linear layers' parameters are allocated uninitialised (the q/k RMSNorm weights start at
    1); load them with ``models.loader.load_tensors_into(..., FLUX_NAME_MAP)`` or
    :func:`flux_from_diffusers_module`.
    """

    def __init__(
        self,
        cfg: FluxArchConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = get_tp_world_size() if tp_size is None else tp_size
        get_family("flux").check_tp_size(cfg, tp)  # the family's rule, as at load time
        self.cfg = cfg
        self.tp_size = tp
        dtype = dtype or torch.get_default_dtype()
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        d = cfg.inner_dim
        with torch.device(device or "cpu"):
            self.pos_embed = MultiAxisRopeReal(cfg.ROPE_THETA, cfg.axes_dims_rope)
            self.time_text_embed = FluxTimeTextEmbed(cfg, "time_text_embed", **kw)
            self.context_embedder = ReplicatedLinear(
                cfg.joint_attention_dim, d, prefix="context_embedder", **kw
            )
            self.x_embedder = ReplicatedLinear(cfg.in_channels, d, prefix="x_embedder", **kw)
            self.transformer_blocks = nn.ModuleList(
                flux_double_block(cfg, f"transformer_blocks.{i}", tp_rank, tp_size, dtype)
                for i in range(cfg.num_layers)
            )
            self.single_transformer_blocks = nn.ModuleList(
                flux_single_block(cfg, f"single_transformer_blocks.{i}", tp_rank, tp_size, dtype)
                for i in range(cfg.num_single_layers)
            )
            self.norm_out = AdaLayerNormContinuous(d, cfg.NORM_EPS, "norm_out", **kw)
            self.proj_out = ReplicatedLinear(d, cfg.out_features, prefix="proj_out", **kw)
        self.to(dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.x_embedder.dtype

    @property
    def device(self) -> torch.device:
        return self.x_embedder.weight.device

    def rotary_tables(
        self, img_ids: torch.Tensor, txt_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[S_txt + S_img, head_dim / 2]`` fp32 for the joint sequence (text
        first), one value per channel pair."""
        return self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        timestep: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow for packed latents (diffusers' signature and numerics).

        Args:
            hidden_states: ``[B, S_img, in_channels]`` packed latent tokens (Flux packs 2x2 VAE
                patches: ``in_channels = 4 * latent_channels``), in the model dtype.
            encoder_hidden_states: ``[B, S_txt, joint_attention_dim]`` T5 features.
            pooled_projections: ``[B, pooled_projection_dim]`` pooled CLIP features.
            timestep: ``[B]`` in ``[0, 1]`` (the pipeline passes ``t / 1000``); multiplied by 1000
                here in the model dtype, as the reference.
            img_ids: ``[S_img, 3]`` RoPE positions of the image tokens (a ``[B, S_img, 3]`` tensor
                is accepted and its first item used, as diffusers does with a warning).
            txt_ids: ``[S_txt, 3]`` RoPE positions of the text tokens (usually zeros); same
                ``[B, ...]`` rule.
            guidance: ``[B]`` guidance scale for guidance-distilled models (FLUX.1-dev; multiplied
                by 1000 here), ``None`` otherwise.

        Returns:
            ``[B, S_img, patch_size**2 * out_channels]`` in the model dtype (a tensor, not a tuple).

        Raises:
            ValueError: guidance missing for a guidance-distilled model or given to one without a
                guidance embedder, or ids that do not match the sequence lengths.
        """
        if self.time_text_embed.guidance_embedder is not None and guidance is None:
            raise ValueError(
                "this Flux model is guidance-distilled (guidance_embeds=True): pass guidance [B]"
            )
        if self.time_text_embed.guidance_embedder is None and guidance is not None:
            raise ValueError(
                "this Flux model has no guidance embedder (guidance_embeds=False): pass "
                "guidance=None"
            )
        if txt_ids.ndim == 3:
            txt_ids = txt_ids[0]
        if img_ids.ndim == 3:
            img_ids = img_ids[0]
        s_img, s_txt = hidden_states.shape[1], encoder_hidden_states.shape[1]
        if img_ids.shape[0] != s_img or txt_ids.shape[0] != s_txt:
            raise ValueError(
                f"img_ids {list(img_ids.shape)} / txt_ids {list(txt_ids.shape)} do not match "
                f"{s_img} image and {s_txt} text tokens"
            )

        x = self.x_embedder(hidden_states)[0]
        t = timestep.to(x.dtype) * 1000
        g = None if guidance is None else guidance.to(x.dtype) * 1000
        temb = self.time_text_embed(t, pooled_projections, g)
        ctx = self.context_embedder(encoder_hidden_states)[0]
        cos, sin = self.rotary_tables(img_ids, txt_ids)
        # sequence parallelism: each rank keeps its chunk of both streams (identity without SP)
        xs, ts = SeqSplit.of(s_img), SeqSplit.of(s_txt)
        x, ctx = xs.local(x), ts.local(ctx)
        cos, sin = (torch.cat([ts.local(t[:s_txt], 0), xs.local(t[s_txt:], 0)]) for t in (cos, sin))

        with sequence_split(ts + xs):
            x, ctx = self.block_sequence(temb, (cos, sin), ctx.shape[1]).run((x, ctx))
        return xs.gather(self.proj_out(self.norm_out(x, temb))[0])

    def block_sequence(self, temb=None, rope=None, n_txt: int = 0) -> BlockSequence:
        """The blocks as one :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence`
        on the canonical streams ``(image [B, S_img, D], text [B, S_txt, D])``: the dual-stream
        blocks, then the single-stream blocks on ``cat([text, image])`` (the reference
        concatenates and splits in every single block; doing it once around all of them is the
        same arithmetic). ``temb [B, D]`` is a row argument; ``rope`` (``(cos, sin)``) and
        ``n_txt`` (local text tokens) are shared. TeaCache's modulated input is dual-stream block
        0's ``norm1(image, temb)[0]`` (TeaCache4FLUX). Without arguments: the declaration alone
        (its block count), not runnable."""
        first = self.transformer_blocks[0] if len(self.transformer_blocks) else None
        return BlockSequence(
            owner=self,
            stages=(
                BlockStage(
                    self.transformer_blocks,
                    lambda blk, s, a: blk(s[0], s[1], a["temb"], rope),
                ),
                BlockStage(
                    self.single_transformer_blocks,
                    lambda blk, s, a: (blk(s[0], a["temb"], rope),),
                    enter=lambda s: (torch.cat([s[1], s[0]], dim=1),),
                    leave=lambda s: (s[0][:, n_txt:], s[0][:, :n_txt]),
                ),
            ),
            row_args={"temb": temb},
            modulated_input=None
            if first is None
            else ModulatedInput(
                lambda s, a: first.norm1(s[0], a["temb"])[0],
                FLUX_TEACACHE_COEFFICIENTS,
                FLUX_TEACACHE_THRESHOLD,
            ),
        )


def flux_from_diffusers_module(
    reference: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> FluxTransformer:
    """Our DiT with the weights of an in-memory diffusers ``FluxTransformer2DModel`` (benchmarks
    and tests; the same name map and weight loaders as file loading, strict: every tensor of the
    reference is used and every parameter of ours is filled)."""
    from sglang.multimodal_gen.models.loader import denoiser_from_module

    spec = get_family("flux").denoiser()
    return denoiser_from_module(reference, spec, dtype, device, tp_rank, tp_size)
