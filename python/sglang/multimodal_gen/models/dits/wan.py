"""The Wan2.1 / Wan2.2 video DiT on our tensor-parallel layers.

Same architecture and numerics as diffusers' ``WanTransformer3DModel`` (follows diffusers 0.42.1
``models/transformers/transformer_wan.py``; Wan-AI, "Wan: Open and Advanced Large-Scale Video
Generative Models", 2025), text-to-video only: a Conv3d patch embedding of the latent video, then
``num_layers`` blocks of

* self-attention over all video tokens with 3-axis RoPE (frames, rows, columns) and q/k RMSNorm
  over the whole ``inner_dim`` (all heads together),
* cross-attention to the projected text features (same q/k norm, no RoPE, no mask),
* a GELU(tanh) FFN,

modulated by the timestep embedding through a learned per-block ``scale_shift_table`` (adaLN
with shift/scale/gate for self-attention and FFN; the cross-attention is not modulated), then an
adaLN output norm, a linear head and unpatchify. Both Wan2.2 layouts use this class: the A14B
experts (Wan2.1 14B shapes) and TI2V-5B (``in_channels = out_channels = 48``, per-token
timesteps, see :meth:`WanTransformer.forward`).

Module names equal diffusers' (a diffusers state dict loads 1:1 through ``WAN_NAME_MAP`` in
``wan_names.py``) except two fused layers per block:

* ``blocks.N.attn1.to_qkv``: ``QKVParallelLinear`` from ``attn1.to_q/to_k/to_v`` (shard ids
  ``"q"``, ``"k"``, ``"v"``);
* ``blocks.N.attn2.to_kv``: ``MergedColumnParallelLinear`` ``[D, D]`` from ``attn2.to_k/to_v``
  (shard ids ``0``, ``1``); the cross-attention query ``attn2.to_q`` reads the video tokens, not
  the text, so it stays a separate ``ColumnParallelLinear``.

Tensor parallelism (``D = inner_dim``, ``n = tp_size``): attention heads are split over the ranks
(``attn1.to_qkv``, ``attn2.to_q``, ``attn2.to_kv`` column-parallel; ``attn1.to_out.0``,
``attn2.to_out.0`` row-parallel), FFN hidden units are split (``ffn.net.0.proj`` column,
``ffn.net.2`` row). The q/k RMSNorms normalise over all ``D`` channels, i.e. over heads that live
on other ranks: each rank sums the squares of its ``D / n`` channels in fp32, one all-reduce adds
the sums of q and k together (one collective per attention, not two), and each rank divides by
the full ``D`` (see :class:`RMSNormAcrossHeads`). Per block: two all-reduces of ``[B, S, 1]``
/ ``[B, L, 1]`` sums and three of ``[B, S, D]`` (the row-parallel outputs). The patch embedding,
condition embedder, ``scale_shift_table``s, norms and the head are replicated.

Dtypes: as diffusers' ``from_pretrained(torch_dtype=...)`` with ``_keep_in_fp32_modules``, the
timestep embedder (``condition_embedder.time_embedder``), every ``scale_shift_table`` and the
affine cross-attention norms (``blocks.N.norm2``) are kept in fp32 whatever ``dtype`` is; the
modulation arithmetic and the LayerNorms run in fp32, the rest in ``dtype``.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.multimodal_gen.configs.wan import WanArchConfig
from sglang.multimodal_gen.distributed import get_tp_world_size
from sglang.multimodal_gen.distributed.sequence import SeqSplit, sequence_split
from sglang.multimodal_gen.layers.attention import attention, sdpa_bshd
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage, ModulatedInput
from sglang.multimodal_gen.layers.feedforward import GeluTanhFeedForward
from sglang.multimodal_gen.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.norm import (
    FP32LayerNorm,
    LayerNormNoAffine,
    RMSNormAcrossHeads,
    modulate,
    rms_norm_qk,
)
from sglang.multimodal_gen.layers.rotary import apply_rope_real
from sglang.multimodal_gen.models.dits.common import tp_kwargs
from sglang.multimodal_gen.models.dits.wan_layers import WanConditionEmbedder, WanRotaryEmbed
from sglang.multimodal_gen.models.registry import get_family

__all__ = [
    "WanRotaryEmbed",
    "WanTransformer",
    "wan_from_diffusers_module",
]

#: TeaCache4Wan2.1's ``use_ret_steps`` rescaling of the projected timestep's change
#: (``np.poly1d`` order) and its "slow" ``rel_l1_thresh``, by DiT width (T2V 1.3B: 1536, T2V
#: 14B: 5120; Wan2.2 A14B shares the 14B width and takes its values, none being published).
WAN_TEACACHE = {
    1536: ((-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02), 0.05),
    5120: ((-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01), 0.10),
}


# ------------------------------------------------------------------------------- attention
class WanSelfAttention(nn.Module):
    """Self-attention with q/k RMSNorm across heads and RoPE (diffusers' ``attn1``:
    ``WanAttention`` + ``WanAttnProcessor``). Heads split over TP.

    Shapes: ``x [B, S, D]``, ``cos``/``sin`` ``[S, head_dim / 2]`` -> ``[B, S, D]``
    (all-reduced over TP).
    """

    def __init__(self, cfg: WanArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, hd, heads = cfg.inner_dim, cfg.attention_head_dim, cfg.num_attention_heads
        self.head_dim = hd
        self.to_qkv = QKVParallelLinear(
            d,
            hd,
            heads,
            heads,
            bias=True,
            **tp_kwargs(f"{prefix}.to_qkv", tp_rank, tp_size, dtype),
        )
        # local widths [D/n, D/n, D/n], fixed here so a LoRA wrapper replacing the layer is fine
        self.split_sizes = list(self.to_qkv.output_partition_sizes)
        self.norm_q = RMSNormAcrossHeads(d, cfg.eps, tp_rank, tp_size, f"{prefix}.norm_q", dtype)
        self.norm_k = RMSNormAcrossHeads(d, cfg.eps, tp_rank, tp_size, f"{prefix}.norm_k", dtype)
        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    d,
                    d,
                    bias=True,
                    input_is_parallel=True,
                    **tp_kwargs(f"{prefix}.to_out.0", tp_rank, tp_size, dtype),
                )
            ]
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.to_qkv(x)[0].split(self.split_sizes, dim=-1)
        q, k = rms_norm_qk(self.norm_q, q, self.norm_k, k)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        q = apply_rope_real(q, cos, sin)
        k = apply_rope_real(k, cos, sin)
        out = attention(q, k, v).type_as(q)
        return self.to_out[0](out)[0]


class WanCrossAttention(nn.Module):
    """Cross-attention of the video tokens to the text (diffusers' ``attn2``, text-to-video): q
    from ``x``, fused k|v from the text, q/k RMSNorm across heads, no RoPE, no mask. Heads split
    over TP.

    Shapes: ``x [B, S, D]``, ``ctx [B, L, D]`` -> ``[B, S, D]`` (all-reduced over TP).
    """

    def __init__(self, cfg: WanArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, hd = cfg.inner_dim, cfg.attention_head_dim
        self.head_dim = hd
        self.to_q = ColumnParallelLinear(
            d, d, bias=True, **tp_kwargs(f"{prefix}.to_q", tp_rank, tp_size, dtype)
        )
        self.to_kv = MergedColumnParallelLinear(
            d, [d, d], bias=True, **tp_kwargs(f"{prefix}.to_kv", tp_rank, tp_size, dtype)
        )
        self.kv_split_sizes = list(self.to_kv.output_partition_sizes)
        self.norm_q = RMSNormAcrossHeads(d, cfg.eps, tp_rank, tp_size, f"{prefix}.norm_q", dtype)
        self.norm_k = RMSNormAcrossHeads(d, cfg.eps, tp_rank, tp_size, f"{prefix}.norm_k", dtype)
        self.to_out = nn.ModuleList(
            [
                RowParallelLinear(
                    d,
                    d,
                    bias=True,
                    input_is_parallel=True,
                    **tp_kwargs(f"{prefix}.to_out.0", tp_rank, tp_size, dtype),
                )
            ]
        )

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        q = self.to_q(x)[0]
        k, v = self.to_kv(ctx)[0].split(self.kv_split_sizes, dim=-1)
        q, k = rms_norm_qk(self.norm_q, q, self.norm_k, k)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        out = sdpa_bshd(q, k, v).type_as(q)
        return self.to_out[0](out)[0]


# ------------------------------------------------------------------------------------ block
class WanBlock(nn.Module):
    """One Wan transformer block (diffusers' ``WanTransformerBlock``).

    With ``m = scale_shift_table + timestep_proj`` (fp32) split into ``shift_a, scale_a, gate_a,
    shift_f, scale_f, gate_f``::

        x = x + gate_a * attn1(LN(x) * (1 + scale_a) + shift_a)      # fp32 residual arithmetic
        x = x + attn2(norm2(x), text)                                 # norm2: affine LN or identity
        x = x + gate_f * ffn(LN(x) * (1 + scale_f) + shift_f)

    each modulated input and each residual sum rounded to ``x.dtype`` as the reference does.

    Shapes: ``x [B, S, D]``; ``ctx [B, L, D]``; ``timestep_proj [B, 6, D]`` (one timestep per
    item) or ``[B, S, 6, D]`` (per-token timesteps); ``cos``/``sin`` ``[S, head_dim / 2]`` ->
    ``[B, S, D]``.
    """

    def __init__(self, cfg: WanArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, eps = cfg.inner_dim, cfg.eps
        self.norm1 = LayerNormNoAffine(d, eps=eps)
        self.attn1 = WanSelfAttention(cfg, f"{prefix}.attn1", tp_rank, tp_size, dtype)
        self.attn2 = WanCrossAttention(cfg, f"{prefix}.attn2", tp_rank, tp_size, dtype)
        self.norm2 = FP32LayerNorm(d, eps) if cfg.cross_attn_norm else nn.Identity()
        self.ffn = GeluTanhFeedForward(
            cfg.inner_dim, cfg.ffn_dim, f"{prefix}.ffn", tp_rank, tp_size, dtype
        )
        self.norm3 = LayerNormNoAffine(d, eps=eps)
        # fp32 like diffusers' _keep_in_fp32_modules ("scale_shift_table"); filled by the loader
        self.scale_shift_table = nn.Parameter(
            torch.zeros(1, cfg.MODULATION_CHUNKS, d, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x, ctx, timestep_proj, cos, sin):
        if timestep_proj.ndim == 4:  # per-token timesteps: [B, S, 6, D] -> six [B, S, D]
            mods = (self.scale_shift_table.unsqueeze(0) + timestep_proj.float()).chunk(6, dim=2)
            mods = [m.squeeze(2) for m in mods]
        else:  # [B, 6, D] -> six [B, 1, D]
            mods = (self.scale_shift_table + timestep_proj.float()).chunk(6, dim=1)
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mods

        h = modulate(self.norm1(x.float()), shift_a, scale_a).type_as(x)
        x = (x.float() + self.attn1(h, cos, sin) * gate_a).type_as(x)

        h = self.norm2(x.float()).type_as(x)
        x = x + self.attn2(h, ctx)

        h = modulate(self.norm3(x.float()), shift_f, scale_f).type_as(x)
        return (x.float() + self.ffn(h).float() * gate_f).type_as(x)


# ---------------------------------------------------------------------------------- model
class WanTransformer(nn.Module):
    """Wan2.1 / Wan2.2 text-to-video DiT (``WanTransformer3DModel``), tensor-parallel.

    Args:
        cfg: architecture (``transformer/config.json``; Wan2.2 A14B: also ``transformer_2``).
        tp_rank, tp_size: explicit TP coordinates (default: the TP group's).
        dtype: parameter dtype (default: ``torch.get_default_dtype()``); the time embedder, the
            ``scale_shift_table``s and the cross-attention norms stay fp32 (see the module doc).
        device: where to allocate parameters.

    Raises:
        ValueError: the TP size does not divide a number of the family's ``tp_divisors``
            (``ModelFamily.check_tp_size``: the number, the TP size and the valid sizes named).

    Parameters are allocated uninitialised (norm weights start at 1, ``scale_shift_table``s at
    0); load them with ``models.loader.load_tensors_into(..., WAN_NAME_MAP)`` or
    :func:`wan_from_diffusers_module`.
    """

    def __init__(
        self,
        cfg: WanArchConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = get_tp_world_size() if tp_size is None else tp_size
        get_family("wan").check_tp_size(cfg, tp)  # the family's rule, as at load time
        self.cfg = cfg
        self.tp_size = tp
        dtype = dtype or torch.get_default_dtype()
        d = cfg.inner_dim
        with torch.device(device or "cpu"):
            self.rope = WanRotaryEmbed(
                cfg.attention_head_dim, cfg.rope_dims, cfg.rope_max_seq_len, cfg.ROPE_THETA
            )
            self.patch_embedding = nn.Conv3d(
                cfg.in_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size, dtype=dtype
            )
            self.condition_embedder = WanConditionEmbedder(
                cfg, "condition_embedder", tp_rank, tp_size, dtype
            )
            self.blocks = nn.ModuleList(
                WanBlock(cfg, f"blocks.{i}", tp_rank, tp_size, dtype) for i in range(cfg.num_layers)
            )
            self.norm_out = LayerNormNoAffine(d, eps=cfg.eps)
            self.proj_out = ReplicatedLinear(
                d,
                cfg.out_features,
                prefix="proj_out",
                tp_rank=tp_rank,
                tp_size=tp_size,
                params_dtype=dtype,
            )
            self.scale_shift_table = nn.Parameter(
                torch.zeros(1, 2, d, dtype=torch.float32), requires_grad=False
            )
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.weight.device

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
    ) -> torch.Tensor:
        """Predict the flow for a latent video (diffusers' signature and numerics, text only).

        Args:
            hidden_states: ``[B, in_channels, F, H, W]`` latents; ``F``, ``H``, ``W`` divisible
                by ``patch_size`` and at most ``rope_max_seq_len`` patches per axis. Cast to the
                model dtype.
            timestep: the scheduler's timestep (``[0, 1000]``, any float/int dtype), either
                ``[B]`` (or ``[1]``, or a 0-d scalar: one value broadcast to the batch) or, for
                Wan2.2 TI2V-5B (``expand_timesteps``), ``[B, S]`` with one timestep per patch token
                (``S = F/p_t * H/p_h * W/p_w`` in frame-row-column order; ``[1, S]`` broadcasts).
            encoder_hidden_states: ``[B, L, text_dim]`` UMT5 features (the Wan pipelines pad to
                ``L = 512`` with zeros and attend to every position). Cast to the model dtype.

        Returns:
            ``[B, out_channels, F, H, W]`` in the model dtype (a tensor, not a tuple).

        Raises:
            ValueError: wrong ranks or channel counts, a size not divisible by the patch, a grid
                beyond the RoPE tables, or a timestep whose shape fits neither form.
        """
        cfg = self.cfg
        if hidden_states.ndim != 5 or hidden_states.shape[1] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, {cfg.in_channels}, F, H, W], got "
                f"{list(hidden_states.shape)}"
            )
        b, _, f, h, w = hidden_states.shape
        p_t, p_h, p_w = cfg.patch_size
        if f % p_t or h % p_h or w % p_w:
            raise ValueError(
                f"latent size (F, H, W)=({f}, {h}, {w}) is not divisible by patch_size "
                f"{list(cfg.patch_size)}"
            )
        ppf, pph, ppw = f // p_t, h // p_h, w // p_w
        if max(ppf, pph, ppw) > cfg.rope_max_seq_len:
            raise ValueError(
                f"patch grid ({ppf}, {pph}, {ppw}) exceeds rope_max_seq_len={cfg.rope_max_seq_len}"
            )
        seq = ppf * pph * ppw
        if (
            encoder_hidden_states.ndim != 3
            or encoder_hidden_states.shape[0] != b
            or encoder_hidden_states.shape[2] != cfg.text_dim
        ):
            raise ValueError(
                f"encoder_hidden_states must be [{b}, L, {cfg.text_dim}], got "
                f"{list(encoder_hidden_states.shape)}"
            )
        if timestep.ndim == 0:
            timestep = timestep.reshape(1)
        per_token = timestep.ndim == 2
        if (
            timestep.ndim not in (1, 2)
            or timestep.shape[0] not in (1, b)
            or (per_token and timestep.shape[1] != seq)
        ):
            raise ValueError(
                f"timestep must be [{b}] or [{b}, {seq}] (one per patch token), got "
                f"{list(timestep.shape)}"
            )

        x = hidden_states.to(self.dtype)
        ctx = encoder_hidden_states.to(self.dtype)
        timestep = timestep.to(x.device)
        cos, sin = self.rope(ppf, pph, ppw, x.device)
        # one video at a time: oneDNN's Conv3d rounds an item differently at batch 1 than among
        # others, and a request's video must not change when it joins a batch
        x = torch.cat([self.patch_embedding(x[i : i + 1]) for i in range(x.shape[0])])
        x = x.flatten(2).transpose(1, 2).contiguous()  # [B, S, D]

        temb, tproj, ctx = self.condition_embedder(
            timestep.flatten(), ctx, seq if per_token else None
        )
        # [B, S, 6, D] per token, else [B, 6, D]
        tproj = tproj.unflatten(2 if per_token else 1, (6, -1))
        # sequence parallelism: each rank keeps its chunk of the video tokens (identity without
        # SP); the text keys of the cross-attention stay whole on every rank
        xs = SeqSplit.of(seq)
        x = xs.local(x)
        cos, sin = xs.local(cos, 0), xs.local(sin, 0)
        if per_token:
            tproj, temb = xs.local(tproj), xs.local(temb)

        with sequence_split(xs):
            (x,) = self.block_sequence(ctx, tproj, (cos, sin)).run((x,))

        if per_token:  # temb [B, S, D]
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:  # temb [B, D]
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = modulate(self.norm_out(x.float()), shift, scale).type_as(x)
        x = xs.gather(self.proj_out(x)[0])  # [B, S, p_t * p_h * p_w * C_out]

        x = x.reshape(b, ppf, pph, ppw, p_t, p_h, p_w, -1)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def block_sequence(self, ctx=None, tproj=None, rope=None) -> BlockSequence:
        """The blocks as one :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence`
        on the video stream ``[B, S, D]`` (the text tokens are not a stream: the blocks only read
        them). Row arguments: ``ctx [B, S_txt, D]`` (the embedded text),
        ``tproj [B, 6, D]`` or per token ``[B, S, 6, D]``. Shared: ``rope = (cos, sin)``.
        TeaCache's modulated input: the projected timestep ``tproj`` (TeaCache4Wan2.1's ``e0``,
        its ``use_ret_steps`` variant: 5 warm-up steps) with that variant's Wan2.1 T2V
        coefficients by width (1.3B: 1536, 14B and Wan2.2 A14B: 5120; identity for other widths)
        and its "slow" threshold (1.3B 0.05, 14B 0.10). Without arguments: the declaration alone
        (its block count), not runnable."""
        return BlockSequence(
            owner=self,
            stages=(
                BlockStage(
                    self.blocks,
                    lambda blk, s, a: (blk(s[0], a["ctx"], a["tproj"], rope[0], rope[1]),),
                ),
            ),
            row_args={"ctx": ctx, "tproj": tproj},
            modulated_input=ModulatedInput(
                lambda s, a: a["tproj"],
                *WAN_TEACACHE.get(self.cfg.inner_dim, ((1.0, 0.0), 0.15)),
                warmup=5,
                per_token=False,
            ),
        )


def wan_from_diffusers_module(
    reference: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> WanTransformer:
    """Our DiT with the weights of an in-memory diffusers ``WanTransformer3DModel`` (benchmarks
    and tests; the same name map and weight loaders as file loading, strict: every tensor of the
    reference is used and every parameter of ours is filled).

    ``dtype`` defaults to the dtype of the reference's first parameter (its patch embedding);
    the fp32-kept modules stay fp32 either way.
    """
    from sglang.multimodal_gen.models.loader import denoiser_from_module

    spec = get_family("wan").denoiser()
    return denoiser_from_module(reference, spec, dtype, device, tp_rank, tp_size)
