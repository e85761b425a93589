"""The HunyuanVideo 1.5 video DiT on our tensor- and sequence-parallel layers.

Same architecture and numerics as diffusers' ``HunyuanVideo15Transformer3DModel`` (follows
diffusers 0.42.1 ``models/transformers/transformer_hunyuan_video15.py``; Tencent Hunyuan,
"HunyuanVideo 1.5", 2025): a Conv3d patch embedding of the latent video (``in_channels`` 65 = noise
latents, condition latents and a mask), three conditioning token streams, and ``num_layers``
dual-stream (MM-DiT) blocks with joint attention over ``[video, text]``:

* the Qwen2.5-VL text features, refined by the token refiner (``context_embedder``);
* the ByT5 glyph features, projected by ``context_embedder_2``;
* the SigLIP image features (image-to-video), projected by ``image_embedder``;

each plus its learned cond-type embedding (``cond_type_embed`` rows 0, 1, 2). Per item the valid
tokens of the three streams come first (image, ByT5, text), then the padding (masked as keys;
the reference zeroes the ByT5/text padding). A text-to-video item's image tokens (its
``image_embeds`` all zero) are padding. ``temb`` is the timestep embedding only (no guidance or
pooled-text embedding at model level); RoPE over (frame, row, column) rotates the video tokens
(1.0's ``hunyuan_video_layers.hunyuan_video_rope``: fp32 tables, bitwise diffusers'
``HunyuanVideo15RotaryPosEmbed``).
The output is ``norm_out`` (adaLN-continuous), ``proj_out`` and unpatchify.

The dual-stream blocks are the shared ``layers.mmdit.DualStreamBlock`` (``[video, text]`` order,
diffusers' RMSNorm on q/k, RoPE on the video prefix, a key mask, no fp16 clipping). Module names
equal diffusers' except the fused projections (``attn.to_qkv``, ``attn.to_added_qkv``, the
refiner's ``attn.to_qkv``), see ``hunyuan_video15_names.py``.

Padding is trimmed: the token positions that are padding for every item of the batch (after the
valid-first ordering, the tail) are dropped before the blocks (the text and ByT5 padding
already before the token refiner and the ByT5 projection), so a text-to-video batch attends to
no image tokens and one request sees no padding keys at all. Masked keys have softmax weight 0,
so this changes only the order of floating-point additions (measured in the parity test).

Tensor parallelism: heads and feed-forward widths of the blocks and the token refiner split over
the ranks (see ``hunyuan_video_layers.py``); the embedders are replicated. Sequence parallelism
(Ulysses / ring / USP): each SP rank keeps a chunk of the video tokens and a chunk of the
conditioning tokens (``SeqSplit``), the key mask travels with its keys, and the output is
gathered once before unpatchifying.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.multimodal_gen.configs.hunyuan_video15 import HunyuanVideo15ArchConfig
from sglang.multimodal_gen.distributed import get_tp_world_size
from sglang.multimodal_gen.distributed.sequence import SeqSplit, sequence_split
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage, ModulatedInput
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.layers.norm import AdaLayerNormContinuous
from sglang.multimodal_gen.models.dits.hunyuan_video import check_hunyuan_video_tp_size
from sglang.multimodal_gen.models.dits.hunyuan_video15_layers import (
    HunyuanVideo15ByT5Projection,
    HunyuanVideo15ImageProjection,
    HunyuanVideo15TimeEmbedding,
)
from sglang.multimodal_gen.models.dits.hunyuan_video_layers import (
    HunyuanVideoTokenRefiner,
    hunyuan_video_dual_blocks,
    hunyuan_video_rope,
    trim_padding,
)

__all__ = ["HunyuanVideo15Transformer"]


class HunyuanVideo15Transformer(nn.Module):
    """HunyuanVideo 1.5 DiT (``HunyuanVideo15Transformer3DModel``), tensor- and sequence-parallel.

    Args:
        cfg: architecture (``transformer/config.json``).
        tp_rank, tp_size: explicit TP coordinates (default: the TP group's).
        dtype: parameter dtype (default: ``torch.get_default_dtype()``); diffusers keeps no module
            of this model in fp32, neither do we.
        device: where to allocate parameters.

    Raises:
        ValueError: the TP size does not divide ``num_attention_heads`` or a feed-forward width
            (``hunyuan_video.check_hunyuan_video_tp_size``).

    Parameters are allocated uninitialised (norm weights at 1); load them with
    ``models.loader.load_tensors_into(..., HUNYUAN_VIDEO15_NAME_MAP)``.
    """

    def __init__(
        self,
        cfg: HunyuanVideo15ArchConfig,
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
        d = cfg.inner_dim
        patch = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
        with torch.device(device or "cpu"):
            self.x_embedder = nn.Module()
            self.x_embedder.proj = nn.Conv3d(
                cfg.in_channels, d, kernel_size=patch, stride=patch, dtype=dtype
            )
            self.image_embedder = HunyuanVideo15ImageProjection(cfg, "image_embedder", **kw)
            # diffusers' HunyuanVideo15TokenRefiner: 1.0's refiner without the forced first key
            self.context_embedder = HunyuanVideoTokenRefiner(
                cfg, "context_embedder", tp_rank, tp_size, dtype, first_key_always=False
            )
            self.context_embedder_2 = HunyuanVideo15ByT5Projection(cfg, "context_embedder_2", **kw)
            self.time_embed = HunyuanVideo15TimeEmbedding(cfg, "time_embed", **kw)
            self.cond_type_embed = nn.Embedding(cfg.NUM_COND_TYPES, d, dtype=dtype)
            # diffusers' HunyuanVideo15TransformerBlock: 1.0's dual-stream blocks
            self.transformer_blocks = hunyuan_video_dual_blocks(cfg, tp_rank, tp_size, dtype)
            self.norm_out = AdaLayerNormContinuous(d, cfg.NORM_EPS, "norm_out", **kw)
            self.proj_out = ReplicatedLinear(d, cfg.out_features, prefix="proj_out", **kw)
        self.to(dtype)  # the blocks' q/k norms are created in the default dtype
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.x_embedder.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.x_embedder.proj.weight.device

    # ------------------------------------------------------------------------------ inputs
    def _check_inputs(self, x, timestep, ctx, mask, ctx2, mask2, image_embeds):
        cfg = self.cfg
        if x.ndim != 5 or x.shape[1] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, {cfg.in_channels}, F, H, W], got {list(x.shape)}"
            )
        b, _, f, h, w = x.shape
        if f % cfg.patch_size_t or h % cfg.patch_size or w % cfg.patch_size:
            raise ValueError(
                f"hidden_states: latent size (F, H, W)=({f}, {h}, {w}) is not divisible by "
                f"(patch_size_t, patch_size, patch_size)=({cfg.patch_size_t}, {cfg.patch_size}, "
                f"{cfg.patch_size})"
            )
        if timestep.ndim > 1 or timestep.numel() not in (1, b):
            raise ValueError(f"timestep must be [{b}] (or one value), got {list(timestep.shape)}")

        def seq(name, t, dim):
            if t is not None and (t.ndim != 3 or t.shape[0] != b or t.shape[2] != dim):
                raise ValueError(f"{name} must be [{b}, L, {dim}], got {list(t.shape)}")

        def seq_mask(name, m, t, tname):
            if m is None:
                return
            if t is None:
                raise ValueError(f"{name} is given without {tname}")
            if m.shape != t.shape[:2]:
                raise ValueError(
                    f"{name} must be [{b}, {t.shape[1]}] like {tname}, got {list(m.shape)}"
                )

        seq("encoder_hidden_states", ctx, cfg.text_embed_dim)
        seq("encoder_hidden_states_2", ctx2, cfg.text_embed_2_dim)
        seq("image_embeds", image_embeds, cfg.image_embed_dim)
        seq_mask("encoder_attention_mask", mask, ctx, "encoder_hidden_states")
        seq_mask("encoder_attention_mask_2", mask2, ctx2, "encoder_hidden_states_2")

    def _conditioning_tokens(self, ctx, mask, ctx2, mask2, image_embeds, timestep):
        """The joint conditioning sequence: ``(tokens [B, L, D], valid [B, L] bool)``, each item's
        valid tokens first in the order image, ByT5, text, then its padding; positions that are
        padding in every item are dropped (already before the refiner and the ByT5 projection,
        and the image tokens of a batch with no image)."""
        b = ctx.shape[0]
        w = self.cond_type_embed.weight
        streams, masks = [], []
        # an item whose image features are all zero is text-to-video: its image tokens are
        # padding (the reference decides this once per batch; per item is the same for a
        # uniform batch and keeps an item's result independent of its batch)
        i2v = None if image_embeds is None else (image_embeds != 0).flatten(1).any(dim=1)
        if i2v is not None and bool(i2v.any()):  # all t2v: only padding, left out
            img = self.image_embedder(image_embeds.to(self.dtype))
            img = torch.where(i2v[:, None, None], img, img * 0.0)
            streams.append(img + w[2])
            masks.append(i2v[:, None].expand(b, img.shape[1]))
        if ctx2 is not None:
            ctx2, m2 = trim_padding(ctx2, mask2)
            streams.append((self.context_embedder_2(ctx2.to(self.dtype)) + w[1]) * m2[..., None])
            masks.append(m2)
        ctx, m1 = trim_padding(ctx, mask)
        text = self.context_embedder(ctx.to(self.dtype), timestep, None if mask is None else m1)
        streams.append((text + w[0]) * m1[..., None])
        masks.append(m1)
        tokens, valid = torch.cat(streams, dim=1), torch.cat(masks, dim=1)
        # valid first (stable: the streams' order and each stream's order are kept)
        order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
        tokens = tokens.gather(1, order[..., None].expand_as(tokens))
        valid = valid.gather(1, order)
        keep = max(int(valid.sum(dim=1).max()), 1)
        return tokens[:, :keep], valid[:, :keep]

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        timestep_r: torch.Tensor | None = None,
        encoder_hidden_states_2: torch.Tensor | None = None,
        encoder_attention_mask_2: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow for a latent video (diffusers' keyword names and numerics).

        Args:
            hidden_states: ``[B, in_channels, F, H, W]`` (noise latents, condition latents, mask
                channel(s) concatenated by the pipeline), cast to the model dtype.
            timestep: ``[B]`` (or one value) scheduler timestep in ``[0, 1000]``; the sinusoid is
                computed in fp32 from its value (pass it in the model dtype, as the pipeline
                does, to round it as the reference does).
            encoder_hidden_states: ``[B, L1, text_embed_dim]`` Qwen2.5-VL features.
            encoder_attention_mask: ``[B, L1]`` (bool or 0/1), True for real tokens; ``None``:
                all real.
            timestep_r: ``[B]`` the MeanFlow reference timestep (``use_meanflow`` models only).
            encoder_hidden_states_2: ``[B, L2, text_embed_2_dim]`` ByT5 glyph features, or
                ``None`` (no glyph tokens).
            encoder_attention_mask_2: ``[B, L2]``, True for real ByT5 tokens; ``None``: all real.
            image_embeds: ``[B, N_img, image_embed_dim]`` SigLIP features (image-to-video); an
                item with all-zero features is text-to-video (the pipelines pass zeros); ``None``:
                no image tokens.

        Returns:
            ``[B, out_channels, F, H, W]`` in the model dtype (a tensor, not a tuple).

        Raises:
            ValueError: a wrong rank, batch or channel count (naming the argument), a latent
                size not divisible by the patch, a mask without its features, ``timestep_r`` for
                a model without a MeanFlow embedder.
        """
        cfg = self.cfg
        self._check_inputs(
            hidden_states,
            timestep,
            encoder_hidden_states,
            encoder_attention_mask,
            encoder_hidden_states_2,
            encoder_attention_mask_2,
            image_embeds,
        )
        b, _, f, h, w = hidden_states.shape
        p_t, p = cfg.patch_size_t, cfg.patch_size
        ppf, pph, ppw = f // p_t, h // p, w // p
        dev = self.device
        timestep = timestep.to(dev).reshape(-1).expand(b)
        if timestep_r is not None:
            timestep_r = timestep_r.to(dev).reshape(-1).expand(b)

        cos, sin = hunyuan_video_rope((ppf, pph, ppw), cfg.rope_axes_dim, cfg.rope_theta, dev)

        temb = self.time_embed(timestep, self.dtype, timestep_r)
        x = hidden_states.to(device=dev, dtype=self.dtype)
        # one video at a time: a convolution may round an item differently in a batch
        x = torch.cat([self.x_embedder.proj(x[i : i + 1]) for i in range(b)])
        x = x.flatten(2).transpose(1, 2).contiguous()  # [B, S, D]

        ctx, valid = self._conditioning_tokens(
            encoder_hidden_states.to(dev),
            encoder_attention_mask,
            None if encoder_hidden_states_2 is None else encoder_hidden_states_2.to(dev),
            encoder_attention_mask_2,
            None if image_embeds is None else image_embeds.to(dev),
            timestep,
        )

        # sequence parallelism: each rank keeps its chunk of both streams (identity without SP)
        xs, ts = SeqSplit.of(x.shape[1]), SeqSplit.of(ctx.shape[1])
        x, ctx, valid = xs.local(x), ts.local(ctx), ts.local(valid)
        cos, sin = xs.local(cos, 0), xs.local(sin, 0)
        key_mask = None  # under SP every rank passes one: the ranks exchange masks together
        if xs.world > 1 or not bool(valid.all()):
            ones = torch.ones(b, x.shape[1], dtype=torch.bool, device=dev)
            key_mask = torch.cat([ones, valid], dim=1)

        with sequence_split(xs + ts):
            x, ctx = self.block_sequence(temb, (cos, sin), key_mask).run((x, ctx))

        x = xs.gather(self.proj_out(self.norm_out(x, temb))[0])  # [B, S, C_out * p_t * p * p]
        x = x.reshape(b, ppf, pph, ppw, -1, p_t, p, p)
        x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def block_sequence(self, temb=None, rope=None, key_mask=None) -> BlockSequence:
        """The blocks as one :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence`
        on the canonical streams ``(video [B, S_vid, D], conditioning [B, S_ctx, D])``. Row
        arguments: ``temb [B, D]``, ``key_mask [B, S_vid + S_ctx]`` bool or ``None``. Shared:
        ``rope`` (``(cos, sin)``). TeaCache's modulated input: block 0's ``norm1(video, temb)[0]``
        (as HunyuanVideo 1.0's; the TeaCache repository publishes no HunyuanVideo 1.5 rescaling:
        identity, threshold 0.15). Without arguments: the declaration alone (its block count), not
        runnable."""
        first = self.transformer_blocks[0]
        return BlockSequence(
            owner=self,
            stages=(
                BlockStage(
                    self.transformer_blocks,
                    lambda blk, s, a: blk(s[0], s[1], a["temb"], rope, a["key_mask"]),
                ),
            ),
            row_args={"temb": temb, "key_mask": key_mask},
            modulated_input=ModulatedInput(lambda s, a: first.norm1(s[0], a["temb"])[0]),
        )
