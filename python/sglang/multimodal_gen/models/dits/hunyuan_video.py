"""The HunyuanVideo 1.0 DiT on our tensor-parallel layers.

Same architecture and numerics as diffusers' ``HunyuanVideoTransformer3DModel`` (follows diffusers
0.42.1 ``models/transformers/transformer_hunyuan_video.py``; Tencent, "HunyuanVideo: A Systematic
Framework For Large Video Generative Models", 2024), text-to-video (and ``latent_concat`` image
conditioning, which is only more input channels):

* ``x_embedder``: ``(p_t, p, p)`` patches of the latent video -> ``D`` (a linear on flattened
  patches, equal to the reference's Conv3d);
* ``time_text_embed``: ``temb = MLP(sinusoid(t)) + MLP(sinusoid(guidance)) + MLP(pooled CLIP)``;
* ``context_embedder``: the token refiner (its own timestep + masked-mean-pooled text embedding,
  ``proj_in`` and ``num_refiner_layers`` self-attention blocks over the text tokens);
* ``num_layers`` dual-stream and ``num_single_layers`` single-stream blocks: the shared
  ``layers.mmdit`` blocks with HunyuanVideo's choices (joint order ``[video, text]``, RoPE on
  the video tokens only, diffusers' RMSNorm for q/k, the text padding as a key mask, no fp16
  clipping);
* ``norm_out`` (adaLN continuous) + ``proj_out``, unpatchified to ``[B, C, F, H, W]``.

RoPE: 3-D positions ``(frame, row, column)`` of the patch grid, ``rope_axes_dim`` channels each,
base ``rope_theta``, fp32 tables (``hunyuan_video_layers.hunyuan_video_rope``).

Text padding: the reference lets every token attend to the video tokens and to the first
``sum(encoder_attention_mask)`` text tokens (padding is assumed at the end); the refiner uses the
mask itself (see ``hunyuan_video_layers``). Text positions after the last real token of every
item are dropped first (they are never keys, and their own outputs are not read): a batch whose
items have the same prompt length then runs without an attention mask.

Tensor parallelism (``n = tp_size``): heads split over the ranks in every block and in the token
refiner (``num_attention_heads`` must be divisible by ``n``), FFN / MLP widths split likewise
(``mlp_hidden``, ``refiner_mlp_hidden``); embedders, adaLN linears, ``norm_out`` and ``proj_out``
are replicated. Sequence parallelism (Ulysses, ring): each SP rank holds a chunk of the video
tokens and a chunk of the text tokens (``[video chunk, text chunk]``, the split of the joint
sequence being the sum of the two) and its chunk of the key mask; the output is gathered once.

Module names are diffusers' except the fused projections (``hunyuan_video_names.py``):
``transformer_blocks.N.attn.to_qkv`` / ``to_added_qkv``, ``single_transformer_blocks.N.
to_qkv_mlp`` and ``context_embedder.token_refiner.refiner_blocks.N.attn.to_qkv``.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.multimodal_gen.configs.hunyuan_video import (
    HunyuanVideoArchConfig,
    HunyuanVideoDims,
    hunyuan_video_tp_divisors,
)
from sglang.multimodal_gen.distributed import get_tp_world_size
from sglang.multimodal_gen.distributed.sequence import SeqSplit, sequence_split
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage, ModulatedInput
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.layers.mmdit import SingleStreamBlock
from sglang.multimodal_gen.layers.norm import AdaLayerNormContinuous
from sglang.multimodal_gen.models.dits.hunyuan_video_layers import (
    HunyuanVideoConditionEmbed,
    HunyuanVideoPatchEmbed,
    HunyuanVideoTokenRefiner,
    hunyuan_video_dual_blocks,
    hunyuan_video_rope,
    trim_padding,
)

__all__ = ["HunyuanVideoTransformer", "check_hunyuan_video_tp_size"]


def check_hunyuan_video_tp_size(cfg: HunyuanVideoDims, tp_size: int) -> None:
    """Raises ``ValueError`` naming the field a TP size fails to divide (the numbers of
    ``configs.hunyuan_video.hunyuan_video_tp_divisors``, the family's ``tp_divisors``), with the
    TP sizes that would; for the 1.0 and the 1.5 DiT (``cfg.MODEL`` names the model)."""
    divisors = hunyuan_video_tp_divisors(cfg)
    for what, n in divisors.items():
        if n % tp_size:
            valid = [
                t
                for t in range(1, max(divisors.values()) + 1)
                if all(m % t == 0 for m in divisors.values())
            ]
            raise ValueError(
                f"{cfg.MODEL}: {what}={n} is not divisible by tp_size={tp_size}; valid TP "
                f"sizes: {valid}"
            )


class HunyuanVideoTransformer(nn.Module):
    """HunyuanVideo 1.0 DiT (``HunyuanVideoTransformer3DModel``), tensor- and sequence-parallel.

    Args:
        cfg: architecture (``transformer/config.json``).
        tp_rank, tp_size: explicit TP coordinates (default: the TP group's).
        dtype: parameter dtype (default: ``torch.get_default_dtype()``).
        device: where to allocate parameters.

    Raises:
        ValueError: the TP size does not divide ``num_attention_heads``, ``mlp_hidden`` or
            ``refiner_mlp_hidden`` (named with the valid sizes).

    Parameters are allocated uninitialised (norm weights at 1); load them with
    ``models.loader.load_denoiser`` / ``load_tensors_into(..., HUNYUAN_VIDEO_NAME_MAP)``.
    """

    def __init__(
        self,
        cfg: HunyuanVideoArchConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = get_tp_world_size() if tp_size is None else tp_size
        check_hunyuan_video_tp_size(cfg, tp)
        self.cfg = cfg
        self.tp_size = tp
        dtype = dtype or torch.get_default_dtype()
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        d, hd, eps = cfg.inner_dim, cfg.attention_head_dim, cfg.NORM_EPS
        with torch.device(device or "cpu"):
            self.x_embedder = HunyuanVideoPatchEmbed(cfg, "x_embedder", tp_rank, tp_size, dtype)
            self.context_embedder = HunyuanVideoTokenRefiner(
                cfg, "context_embedder", tp_rank, tp_size, dtype
            )
            self.time_text_embed = HunyuanVideoConditionEmbed(
                d, cfg.pooled_projection_dim, cfg.guidance_embeds, "time_text_embed", **kw
            )
            self.transformer_blocks = hunyuan_video_dual_blocks(cfg, tp_rank, tp_size, dtype)
            self.single_transformer_blocks = nn.ModuleList(
                SingleStreamBlock(
                    d,
                    hd,
                    cfg.mlp_hidden,
                    eps,
                    qk_norm="diffusers",
                    clip_fp16=False,
                    prefix=f"single_transformer_blocks.{i}",
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    dtype=dtype,
                )
                for i in range(cfg.num_single_layers)
            )
            self.norm_out = AdaLayerNormContinuous(d, eps, "norm_out", **kw)
            self.proj_out = ReplicatedLinear(d, cfg.out_features, prefix="proj_out", **kw)
        self.to(dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None,
        pooled_projections: torch.Tensor,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow for a latent video (diffusers' keyword names and numerics).

        Args:
            hidden_states: ``[B, C, F, H, W]`` latents (``in_channels`` channels; ``F`` divisible
                by ``patch_size_t``, ``H``/``W`` by ``patch_size``); cast to the model dtype.
            timestep: ``[B]`` the scheduler's timestep (0..1000, as diffusers' pipeline passes).
            encoder_hidden_states: ``[B, L, text_embed_dim]`` text-encoder features.
            encoder_attention_mask: ``[B, L]`` nonzero for the real text tokens (padding at the
                end), or ``None`` (all real).
            pooled_projections: ``[B, pooled_projection_dim]`` pooled CLIP features.
            guidance: ``[B]`` embedded guidance already multiplied by 1000 (as diffusers'
                pipeline passes it); required when ``guidance_embeds``, ignored otherwise (as the
                reference ignores it).

        Returns:
            ``[B, out_channels, F, H, W]`` in ``hidden_states.dtype`` (a tensor, not a tuple).

        Raises:
            ValueError: wrong ranks, channel counts, batch sizes or mask shape, a latent size not
                divisible by the patch, or guidance missing for a guidance-distilled model.
        """
        cfg = self.cfg
        if hidden_states.ndim != 5 or hidden_states.shape[1] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, {cfg.in_channels}, F, H, W], got "
                f"{list(hidden_states.shape)}"
            )
        b, _, f, h, w = hidden_states.shape
        pt, p = cfg.patch_size_t, cfg.patch_size
        if f % pt or h % p or w % p:
            raise ValueError(
                f"latent size (F, H, W)=({f}, {h}, {w}) is not divisible by the patch "
                f"(patch_size_t={pt}, patch_size={p})"
            )
        if encoder_hidden_states.ndim != 3 or encoder_hidden_states.shape[0] != b:
            raise ValueError(
                f"encoder_hidden_states must be [{b}, L, {cfg.text_embed_dim}], got "
                f"{list(encoder_hidden_states.shape)}"
            )
        n_txt = encoder_hidden_states.shape[1]
        if encoder_attention_mask is not None and tuple(encoder_attention_mask.shape) != (b, n_txt):
            raise ValueError(
                f"encoder_attention_mask must be [{b}, {n_txt}], got "
                f"{list(encoder_attention_mask.shape)}"
            )
        if self.time_text_embed.guidance_embedder is not None and guidance is None:
            raise ValueError(
                "this HunyuanVideo model is guidance-distilled (guidance_embeds=True): pass "
                "guidance [B] (the guidance scale times 1000)"
            )
        out_dtype = hidden_states.dtype
        dt = self.dtype
        grid = (f // pt, h // p, w // p)

        if encoder_attention_mask is not None:
            # text tokens after the last real token of every item are padding everywhere: masked
            # as keys in the refiner and in the blocks, their own outputs never read
            encoder_hidden_states, encoder_attention_mask = trim_padding(
                encoder_hidden_states, encoder_attention_mask
            )
            n_txt = encoder_hidden_states.shape[1]

        x = self.x_embedder(hidden_states.to(dt))
        pooled = pooled_projections.to(dt)
        temb = self.time_text_embed(
            timestep,
            pooled,
            guidance if self.time_text_embed.guidance_embedder is not None else None,
        )
        ctx = self.context_embedder(encoder_hidden_states.to(dt), timestep, encoder_attention_mask)
        cos, sin = hunyuan_video_rope(grid, cfg.rope_axes_dim, cfg.rope_theta, x.device)

        # text keys: the first sum(mask) tokens of each item (the reference's rule)
        txt_keys = None
        if encoder_attention_mask is not None:
            n_valid = encoder_attention_mask.sum(dim=1, dtype=torch.int).to(x.device)
            txt_keys = torch.arange(n_txt, device=x.device)[None] < n_valid[:, None]
            if bool(txt_keys.all()):
                txt_keys = None

        # sequence parallelism: each rank keeps its chunk of both streams (identity without SP)
        xs, ts = SeqSplit.of(x.shape[1]), SeqSplit.of(n_txt)
        x, ctx = xs.local(x), ts.local(ctx)
        rope = (xs.local(cos, 0), xs.local(sin, 0))
        key_mask = None
        if txt_keys is not None:
            vid_keys = torch.ones(b, x.shape[1], dtype=torch.bool, device=x.device)
            key_mask = torch.cat([vid_keys, ts.local(txt_keys)], dim=1)

        with sequence_split(xs + ts):
            x, ctx = self.block_sequence(temb, rope, key_mask, x.shape[1]).run((x, ctx))
        out = xs.gather(self.proj_out(self.norm_out(x, temb))[0])
        out = out.reshape(b, *grid, cfg.out_channels, pt, p, p)
        out = out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, cfg.out_channels, f, h, w)
        return out.to(out_dtype)

    def block_sequence(self, temb=None, rope=None, key_mask=None, n_vid: int = 0) -> BlockSequence:
        """The blocks as one :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence`
        on the canonical streams ``(video [B, S_vid, D], text [B, S_txt, D])``: the dual-stream
        blocks, then the single-stream blocks on ``cat([video, text])`` (the reference
        concatenates and splits in every single block; doing it once around all of them is the
        same arithmetic). Row arguments: ``temb [B, D]``, ``key_mask [B, S_vid + S_txt]`` bool
        or ``None``. Shared: ``rope`` (``(cos, sin)``) and ``n_vid`` (local video tokens).
        TeaCache's modulated input: dual-stream block 0's ``norm1(video, temb)[0]`` with
        TeaCache4HunyuanVideo's coefficients and ``rel_l1_thresh`` (0.15: ~2.1x; 0.1: ~1.6x).
        Without arguments: the declaration alone (its block count), not runnable."""
        first = self.transformer_blocks[0]
        return BlockSequence(
            owner=self,
            stages=(
                BlockStage(
                    self.transformer_blocks,
                    lambda blk, s, a: blk(s[0], s[1], a["temb"], rope, a["key_mask"]),
                ),
                BlockStage(
                    self.single_transformer_blocks,
                    lambda blk, s, a: (blk(s[0], a["temb"], rope, a["key_mask"]),),
                    enter=lambda s: (torch.cat([s[0], s[1]], dim=1),),
                    leave=lambda s: (s[0][:, :n_vid], s[0][:, n_vid:]),
                ),
            ),
            row_args={"temb": temb, "key_mask": key_mask},
            modulated_input=ModulatedInput(
                lambda s, a: first.norm1(s[0], a["temb"])[0],
                (7.33226126e02, -4.01131952e02, 6.75869174e01, -3.14987800e00, 9.61237896e-02),
                threshold=0.15,
            ),
        )
