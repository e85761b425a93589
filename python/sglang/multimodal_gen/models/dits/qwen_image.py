"""The Qwen-Image DiT on our tensor-parallel layers.

Same architecture and numerics as diffusers' ``QwenImageTransformer2DModel`` (follows diffusers
0.42.1 ``models/transformers/transformer_qwenimage.py``; Qwen team, Qwen-Image, 2025): an MMDiT
of ``num_layers`` double-stream blocks only (separate weights for text and image tokens, one
joint attention over ``[text, image]``), adaLN modulated by the timestep embedding alone (no
pooled text vector), text features RMS-normalised (``txt_norm``) before ``txt_in``, and a 3-axis
complex RoPE (frame, height, width) in which the image grid is centred on 0 and text tokens sit
on the diagonal *after* the largest image half-extent.

Module names equal diffusers' (a diffusers state dict loads 1:1 through ``QWEN_IMAGE_NAME_MAP``
in ``qwen_image_names.py``) except two fused layers per block:

* ``transformer_blocks.N.attn.to_qkv``: ``QKVParallelLinear`` from ``attn.to_q/to_k/to_v``
  (shard ids ``"q"``, ``"k"``, ``"v"``);
* ``transformer_blocks.N.attn.to_added_qkv``: ``QKVParallelLinear`` from
  ``attn.add_q_proj/add_k_proj/add_v_proj`` (shard ids ``"q"``, ``"k"``, ``"v"``).

Tensor parallelism (``n = tp_size``): attention heads are split over the ranks (each rank attends
with its ``heads / n`` heads over the whole joint sequence; no communication inside attention),
``attn.to_out.0`` and ``attn.to_add_out`` are row-parallel, and ``img_mlp`` / ``txt_mlp`` are
GELU-tanh FFNs (diffusers' ``FeedForward(activation_fn="gelu-approximate")``) split column ->
row. Four all-reduces per block. The embedders, ``txt_norm``, the adaLN modulations
(``img_mod.1`` / ``txt_mod.1``), ``norm_out`` and ``proj_out`` are replicated.

``zero_cond_t`` (Qwen-Image-Edit-2511; diffusers' ``zero_cond_t=True``): the timestep embedding is
computed for ``[t, 0]`` (``[2B, D]``); the image stream's ``img_mod`` gives each image token the
parameters of ``t`` when it is an output token (the first ``(F, H, W)`` entry of its item's
``img_shapes``) and those of ``0`` when it belongs to a condition image; the text stream's
``txt_mod`` and the final ``norm_out`` use ``t`` only. The per-token choice is a ``[B, S_img]``
bool index built before the sequence is sharded and sharded with the image tokens, so it works
under TP (the modulations are replicated) and sequence parallelism alike.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.qwen_image import QwenImageArchConfig
from sglang.multimodal_gen.distributed import get_tp_world_size
from sglang.multimodal_gen.distributed.sequence import SeqSplit, sequence_split
from sglang.multimodal_gen.layers.attention import attention
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage, ModulatedInput
from sglang.multimodal_gen.layers.feedforward import GeluTanhFeedForward
from sglang.multimodal_gen.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from sglang.multimodal_gen.layers.norm import (
    AdaLayerNormContinuous,
    LayerNormNoAffine,
    RMSNorm,
    modulate,
)
from sglang.multimodal_gen.layers.rotary import apply_rope_complex
from sglang.multimodal_gen.models.dits.common import tp_kwargs
from sglang.multimodal_gen.models.dits.qwen_image_layers import QwenImageRope, QwenTimeTextEmbed
from sglang.multimodal_gen.models.registry import get_family

__all__ = ["QwenImageRope", "QwenImageTransformer", "qwen_image_from_diffusers_module"]

FP16_MAX = 65504.0


# ------------------------------------------------------------------------------- the block
class QwenJointAttention(nn.Module):
    """Joint attention of a block: image and text tokens have their own fused QKV projections,
    per-head RMSNorms (diffusers' ``RMSNorm``, eps 1e-6) and output projections, get the complex
    RoPE and attend together over ``[text, image]`` with padded text keys masked out (diffusers'
    ``Attention(added_kv_proj_dim=D, qk_norm="rms_norm")`` + ``QwenDoubleStreamAttnProcessor2_0``).
    Heads are split over TP.

    Shapes: ``x [B, S_img, D]``, ``ctx [B, S_txt, D]``, ``img_freqs [S_img, hd / 2]``,
    ``txt_freqs [S_txt, hd / 2]`` complex64, ``key_mask [B, S_txt + S_img]`` bool or ``None``
    -> ``(x_out [B, S_img, D], ctx_out [B, S_txt, D])`` (all-reduced over TP).
    """

    def __init__(self, cfg: QwenImageArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, hd, heads = cfg.inner_dim, cfg.attention_head_dim, cfg.num_attention_heads
        self.head_dim = hd
        eps = cfg.NORM_EPS
        self.to_qkv = QKVParallelLinear(
            d,
            hd,
            heads,
            heads,
            bias=True,
            **tp_kwargs(f"{prefix}.to_qkv", tp_rank, tp_size, dtype),
        )
        self.to_added_qkv = QKVParallelLinear(
            d,
            hd,
            heads,
            heads,
            bias=True,
            **tp_kwargs(f"{prefix}.to_added_qkv", tp_rank, tp_size, dtype),
        )
        self.num_heads = self.to_qkv.num_heads
        self.norm_q = RMSNorm(hd, eps=eps)
        self.norm_k = RMSNorm(hd, eps=eps)
        self.norm_added_q = RMSNorm(hd, eps=eps)
        self.norm_added_k = RMSNorm(hd, eps=eps)
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
        self.to_add_out = RowParallelLinear(
            d,
            d,
            bias=True,
            input_is_parallel=True,
            **tp_kwargs(f"{prefix}.to_add_out", tp_rank, tp_size, dtype),
        )

    def _heads(self, layer: nn.Module, x: torch.Tensor):
        """Fused projection -> ``q, k, v`` each ``[B, S, heads_local, hd]``."""
        qkv = layer(x)[0].unflatten(-1, (3, self.num_heads, self.head_dim))
        return qkv.unbind(-3)

    def forward(self, x, ctx, img_freqs, txt_freqs, key_mask):
        q, k, v = self._heads(self.to_qkv, x)
        cq, ck, cv = self._heads(self.to_added_qkv, ctx)
        q = apply_rope_complex(self.norm_q(q), img_freqs)
        k = apply_rope_complex(self.norm_k(k), img_freqs)
        cq = apply_rope_complex(self.norm_added_q(cq), txt_freqs)
        ck = apply_rope_complex(self.norm_added_k(ck), txt_freqs)
        jq = torch.cat([cq, q], dim=1)
        jk = torch.cat([ck, k], dim=1)
        jv = torch.cat([cv, v], dim=1)
        out = attention(jq, jk, jv, key_mask).to(jq.dtype)
        n_txt = ctx.shape[1]
        ctx_out, x_out = out[:, :n_txt], out[:, n_txt:]
        return self.to_out[0](x_out.contiguous())[0], self.to_add_out(ctx_out.contiguous())[0]


def _modulate(x: torch.Tensor, params: torch.Tensor, cond_index: torch.Tensor | None = None):
    """``shift, scale, gate = params.chunk(3)``; returns ``(x * (1 + scale) + shift, gate)`` with
    ``x [B, S, D]``, ``params [B, 3D]``, ``gate [B, 1, D]``.

    With ``cond_index`` (``[B, S, 1]`` bool, ``zero_cond_t``) ``params`` is ``[2B, 3D]`` (the
    parameters of ``t``, then of timestep 0) and each token takes the second half's where its
    index is True (diffusers' ``QwenImageTransformerBlock._modulate`` with ``index``); ``gate`` is
    then ``[B, S, D]``."""
    if cond_index is not None:
        b = params.shape[0] // 2
        params = torch.where(cond_index, params[b:].unsqueeze(1), params[:b].unsqueeze(1))
        shift, scale, gate = params.chunk(3, dim=-1)
        return modulate(x, shift, scale), gate
    shift, scale, gate = params.chunk(3, dim=-1)
    return modulate(x, shift.unsqueeze(1), scale.unsqueeze(1)), gate.unsqueeze(1)


class QwenImageBlock(nn.Module):
    """Double-stream block; diffusers' ``QwenImageTransformerBlock``.

    For each stream ``s`` in (image ``x``, text ``ctx``), with ``s_mod.1(silu(temb))`` split into
    ``shift_a, scale_a, gate_a, shift_f, scale_f, gate_f``::

        attn_x, attn_ctx = joint_attention(LN(x) * (1 + scale_a) + shift_a, same for ctx)
        s = s + gate_a * attn_s
        s = s + gate_f * s_mlp(LN(s) * (1 + scale_f) + shift_f)

    (``LN``: LayerNorm without affine, eps 1e-6; fp16 results are clipped to +-65504.)

    Shapes: ``x [B, S_img, D]``, ``ctx [B, S_txt, D]``, ``temb [B, D]``, RoPE tables and key
    mask as :class:`QwenJointAttention` -> ``(ctx, x)`` (the reference's order).

    ``zero_cond_t``: ``cond_index [B, S_img, 1]`` bool (True: a condition image's token) and
    ``temb [2B, D]`` (the embeddings of ``t``, then of 0); ``img_mod`` runs on both halves and
    each image token takes its half (:func:`_modulate`), ``txt_mod`` on the first half only.
    """

    def __init__(self, cfg: QwenImageArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, eps, h = cfg.inner_dim, cfg.NORM_EPS, cfg.mlp_hidden
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        self.img_mod = nn.ModuleList(
            [nn.SiLU(), ReplicatedLinear(d, 6 * d, prefix=f"{prefix}.img_mod.1", **kw)]
        )
        self.img_norm1 = LayerNormNoAffine(d, eps=eps)
        self.attn = QwenJointAttention(cfg, f"{prefix}.attn", tp_rank, tp_size, dtype)
        self.img_norm2 = LayerNormNoAffine(d, eps=eps)
        self.img_mlp = GeluTanhFeedForward(d, h, f"{prefix}.img_mlp", tp_rank, tp_size, dtype)
        self.txt_mod = nn.ModuleList(
            [nn.SiLU(), ReplicatedLinear(d, 6 * d, prefix=f"{prefix}.txt_mod.1", **kw)]
        )
        self.txt_norm1 = LayerNormNoAffine(d, eps=eps)
        self.txt_norm2 = LayerNormNoAffine(d, eps=eps)
        self.txt_mlp = GeluTanhFeedForward(d, h, f"{prefix}.txt_mlp", tp_rank, tp_size, dtype)

    def forward(self, x, ctx, temb, img_freqs, txt_freqs, key_mask, cond_index=None):
        img_mod1, img_mod2 = self.img_mod[1](F.silu(temb))[0].chunk(2, dim=-1)
        if cond_index is not None:
            temb = temb[: temb.shape[0] // 2]
        txt_mod1, txt_mod2 = self.txt_mod[1](F.silu(temb))[0].chunk(2, dim=-1)

        nx, img_gate1 = _modulate(self.img_norm1(x), img_mod1, cond_index)
        nc, txt_gate1 = _modulate(self.txt_norm1(ctx), txt_mod1)
        attn_x, attn_c = self.attn(nx, nc, img_freqs, txt_freqs, key_mask)
        x = x + img_gate1 * attn_x
        ctx = ctx + txt_gate1 * attn_c

        hx, img_gate2 = _modulate(self.img_norm2(x), img_mod2, cond_index)
        x = x + img_gate2 * self.img_mlp(hx)
        hc, txt_gate2 = _modulate(self.txt_norm2(ctx), txt_mod2)
        ctx = ctx + txt_gate2 * self.txt_mlp(hc)

        if ctx.dtype == torch.float16:
            ctx = ctx.clip(-FP16_MAX, FP16_MAX)
        if x.dtype == torch.float16:
            x = x.clip(-FP16_MAX, FP16_MAX)
        return ctx, x


# ---------------------------------------------------------------------------------- the model
def _first_item_shapes(img_shapes) -> list[tuple[int, int, int]]:
    """The ``(F, H, W)`` list RoPE uses, as the reference reads ``img_shapes``: a list per batch
    item (only the first is used) of ``(F, H, W)`` tuples, or a bare ``(F, H, W)`` per item."""
    if img_shapes is None:
        raise ValueError("Qwen-Image: img_shapes is required, e.g. [[(1, H/16, W/16)]] * batch")
    first = img_shapes[0] if isinstance(img_shapes, list) else img_shapes
    items = first if isinstance(first, list) else [first]
    out = []
    for fhw in items:
        if len(fhw) != 3:
            raise ValueError(f"Qwen-Image: img_shapes entries are (frames, h, w), got {fhw!r}")
        out.append(tuple(int(v) for v in fhw))
    return out


def _condition_token_index(img_shapes, b: int, s_img: int, device) -> torch.Tensor:
    """``zero_cond_t``'s per-token index: ``[b, s_img]`` bool, False for an item's output tokens
    (the first ``(F, H, W)`` entry of its ``img_shapes`` list), True for the condition images'
    tokens after them (diffusers' ``modulate_index``, 0 and 1).

    Raises:
        ValueError: ``img_shapes`` does not hold one entry per batch item.
    """
    per_item = img_shapes if isinstance(img_shapes, list) else [img_shapes]
    if len(per_item) != b:
        raise ValueError(
            f"Qwen-Image (zero_cond_t): img_shapes needs one entry per batch item "
            f"({b}), got {len(per_item)}"
        )
    n_out = []
    for entry in per_item:
        f, h, w = entry[0] if isinstance(entry, list) else entry
        n_out.append(int(f) * int(h) * int(w))
    first = torch.tensor(n_out, device=device).unsqueeze(1)
    return torch.arange(s_img, device=device).unsqueeze(0) >= first


class QwenImageTransformer(nn.Module):
    """Qwen-Image DiT (``QwenImageTransformer2DModel``), tensor-parallel.

    Args:
        cfg: architecture (``transformer/config.json``).
        tp_rank, tp_size: explicit TP coordinates (default: the TP group's).
        dtype: parameter dtype (default: ``torch.get_default_dtype()``).
        device: where to allocate parameters.

    Raises:
        ValueError: the TP size does not divide a number of the family's ``tp_divisors``
            (``ModelFamily.check_tp_size``: the number, the TP size and the valid sizes named).

    The linear layers' parameters are allocated uninitialised (the RMSNorm weights start at 1);
    load them with ``models.loader.load_tensors_into(..., QWEN_IMAGE_NAME_MAP)`` or
    :func:`qwen_image_from_diffusers_module`.
    """

    def __init__(
        self,
        cfg: QwenImageArchConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = get_tp_world_size() if tp_size is None else tp_size
        get_family("qwen-image").check_tp_size(cfg, tp)  # the family's rule, as at load time
        self.cfg = cfg
        self.tp_size = tp
        dtype = dtype or torch.get_default_dtype()
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        d = cfg.inner_dim
        with torch.device(device or "cpu"):
            self.pos_embed = QwenImageRope(cfg.ROPE_THETA, cfg.axes_dims_rope)
            self.time_text_embed = QwenTimeTextEmbed(cfg, "time_text_embed", **kw)
            self.txt_norm = RMSNorm(cfg.joint_attention_dim, eps=cfg.NORM_EPS)
            self.img_in = ReplicatedLinear(cfg.in_channels, d, prefix="img_in", **kw)
            self.txt_in = ReplicatedLinear(cfg.joint_attention_dim, d, prefix="txt_in", **kw)
            self.transformer_blocks = nn.ModuleList(
                QwenImageBlock(cfg, f"transformer_blocks.{i}", tp_rank, tp_size, dtype)
                for i in range(cfg.num_layers)
            )
            self.norm_out = AdaLayerNormContinuous(d, cfg.NORM_EPS, "norm_out", **kw)
            self.proj_out = ReplicatedLinear(d, cfg.out_features, prefix="proj_out", **kw)
        self.to(dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        timestep: torch.Tensor = None,
        img_shapes: list | None = None,
        guidance: torch.Tensor | None = None,
        attention_kwargs: dict | None = None,
        controlnet_block_samples: list[torch.Tensor] | None = None,
        additional_t_cond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict the flow for packed latents (diffusers 0.42.1's signature and numerics, minus
        ``return_dict``: the output tensor is returned).

        Args:
            hidden_states: ``[B, S_img, in_channels]`` packed latent tokens (2x2 patches of the
                16-channel VAE latent: ``in_channels = 64``), in the model dtype. With several
                images (edit models) their tokens are concatenated in ``img_shapes`` order.
            encoder_hidden_states: ``[B, S_txt, joint_attention_dim]`` Qwen2.5-VL features,
                right-padded to the longest prompt of the batch.
            encoder_hidden_states_mask: ``[B, S_txt]`` (bool, or 1/0 of any dtype; True/1 =
                real token) or ``None`` (every text token is real). Masked text tokens are
                dropped as attention *keys* (they still produce outputs, which are discarded).
                RoPE always uses the padded length ``S_txt``.
            timestep: ``[B]`` in ``[0, 1]`` (the pipeline passes ``t / 1000``); cast to the model
                dtype and multiplied by 1000 inside the sinusoid, as the reference. With
                ``zero_cond_t`` the condition images' tokens are modulated with timestep 0.
            img_shapes: ``[[(F, H, W), ...], ...]`` per batch item, ``H``/``W`` in packed tokens
                (latent size / 2); as in diffusers only the first item's list is used for RoPE,
                so all items must share it. ``sum(F * H * W)`` must equal ``S_img``. With
                ``zero_cond_t`` the first entry of each item's list is its output, the rest its
                condition images (one list per batch item is then required).
            guidance: must be ``None`` (Qwen-Image has no guidance embedder; the reference
                cannot run with one either).
            attention_kwargs: ``None`` or a dict with at most ``"scale"`` (diffusers' LoRA
                scale; LoRA scaling is done by our LoRA layers, so it is ignored here).
            controlnet_block_samples: optional residuals ``[B, S_img, D]``; block ``i`` adds
                sample ``i // ceil(num_layers / len(samples))`` to the image stream, as the
                reference.
            additional_t_cond: must be ``None`` (``use_additional_t_cond`` models are rejected
                by the config).

        Returns:
            ``[B, S_img, patch_size**2 * out_channels]`` in the model dtype.

        Raises:
            ValueError: a mask whose shape is not ``[B, S_txt]``, missing or inconsistent
                ``img_shapes`` (``zero_cond_t``: not one entry per item), or an unsupported
                argument.
        """
        if guidance is not None:
            raise ValueError("Qwen-Image has no guidance embedder: pass guidance=None")
        if additional_t_cond is not None:
            raise ValueError("this Qwen-Image model has no additional_t_cond embedding")
        if attention_kwargs and set(attention_kwargs) - {"scale"}:
            raise ValueError(f"Qwen-Image: unsupported attention_kwargs {sorted(attention_kwargs)}")
        shapes = _first_item_shapes(img_shapes)
        s_img = hidden_states.shape[1]
        if sum(f * h * w for f, h, w in shapes) != s_img:
            raise ValueError(
                f"Qwen-Image: img_shapes {shapes} give {sum(f * h * w for f, h, w in shapes)} "
                f"image tokens, hidden_states has {s_img}"
            )

        x = self.img_in(hidden_states)[0]
        t = timestep.to(x.dtype)
        ctx = self.txt_in(self.txt_norm(encoder_hidden_states))[0]
        b, s_txt = ctx.shape[:2]
        key_mask = None
        if encoder_hidden_states_mask is not None:
            if tuple(encoder_hidden_states_mask.shape[:2]) != (b, s_txt):
                raise ValueError(
                    f"Qwen-Image: encoder_hidden_states_mask shape "
                    f"{list(encoder_hidden_states_mask.shape)} must be [{b}, {s_txt}] "
                    f"(batch, text tokens)"
                )
            txt_mask = encoder_hidden_states_mask.to(torch.bool)
            img_mask = torch.ones((b, s_img), dtype=torch.bool, device=x.device)
            key_mask = torch.cat([txt_mask, img_mask], dim=1)

        cond_index = None
        if self.cfg.zero_cond_t:
            # embeddings of [t, 0]: the blocks' img_mod picks one per token; the rest uses t
            block_temb = self.time_text_embed(torch.cat([t, t * 0], dim=0), x.dtype)
            temb = block_temb.chunk(2, dim=0)[0]
            cond_index = _condition_token_index(img_shapes, b, s_img, x.device)
        else:
            temb = block_temb = self.time_text_embed(t, x.dtype)
        img_freqs, txt_freqs = self.pos_embed(shapes, s_txt, x.device)
        # sequence parallelism: each rank keeps its chunk of both streams (identity without SP)
        xs, ts = SeqSplit.of(s_img), SeqSplit.of(s_txt)
        x, ctx = xs.local(x), ts.local(ctx)
        img_freqs, txt_freqs = xs.local(img_freqs, 0), ts.local(txt_freqs, 0)
        if key_mask is not None:
            key_mask = torch.cat([ts.local(key_mask[:, :s_txt]), xs.local(key_mask[:, s_txt:])], 1)
        if cond_index is not None:  # follows the image tokens it describes
            cond_index = xs.local(cond_index).unsqueeze(-1)

        control = None
        if controlnet_block_samples is not None:  # [B, n, S_img local, D]
            control = torch.stack([xs.local(c) for c in controlnet_block_samples], dim=1)
        temb_zero = None
        if cond_index is not None:  # the rows of [t, 0]'s embedding, each batch-major
            block_temb, temb_zero = block_temb.chunk(2, dim=0)
        seq = self.block_sequence(
            block_temb, temb_zero, (img_freqs, txt_freqs), key_mask, cond_index, control
        )
        with sequence_split(ts + xs):
            x, ctx = seq.run((x, ctx))
        return xs.gather(self.proj_out(self.norm_out(x, temb))[0])

    def block_sequence(
        self, temb=None, temb_zero=None, rope=None, key_mask=None, cond_index=None, control=None
    ) -> BlockSequence:
        """The blocks as one :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence`
        on the canonical streams ``(image [B, S_img, D], text [B, S_txt, D])``.

        Row arguments: ``temb [B, D]``; ``temb_zero [B, D]`` (``zero_cond_t``: the embedding of
        timestep 0, which the blocks take as the second half of ``cat([temb, temb_zero])``, else
        ``None``); ``key_mask [B, S_txt + S_img]`` bool or ``None``; ``cond_index [B, S_img, 1]``
        bool or ``None``; ``control [B, n, S_img, D]`` or ``None``: ControlNet residuals, block
        ``i`` adds ``control[:, i // ceil(L / n)]`` to the image stream (diffusers' interval
        rule). Shared: ``rope = (img_freqs, txt_freqs)``. TeaCache's modulated input: block 0's
        modulated image norm ``img_norm1(x) * (1 + scale) + shift`` (no published Qwen-Image
        rescaling: identity, threshold 0.15). Without arguments: the declaration alone (its block
        count), not runnable."""
        blocks = self.transformer_blocks
        index = {id(b): i for i, b in enumerate(blocks)}

        def modulated(s, a):
            first = blocks[0]
            t = a["temb"] if a["temb_zero"] is None else torch.cat([a["temb"], a["temb_zero"]])
            params = first.img_mod[1](F.silu(t))[0].chunk(2, dim=-1)[0]
            return _modulate(first.img_norm1(s[0]), params, a["cond_index"])[0]

        def call(blk, s, a):
            t = a["temb"] if a["temb_zero"] is None else torch.cat([a["temb"], a["temb_zero"]])
            ctx, x = blk(s[0], s[1], t, rope[0], rope[1], a["key_mask"], a["cond_index"])
            c = a["control"]
            if c is not None:
                x = x + c[:, index[id(blk)] // int(math.ceil(len(blocks) / c.shape[1]))]
            return x, ctx

        return BlockSequence(
            owner=self,
            stages=(BlockStage(blocks, call),),
            row_args={
                "temb": temb,
                "temb_zero": temb_zero,
                "key_mask": key_mask,
                "cond_index": cond_index,
                "control": control,
            },  # fmt: skip
            modulated_input=ModulatedInput(modulated),
        )


def qwen_image_from_diffusers_module(
    reference: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> QwenImageTransformer:
    """Our DiT with the weights of an in-memory diffusers ``QwenImageTransformer2DModel``
    (benchmarks and tests; the same name map and weight loaders as file loading, strict: every
    tensor of the reference is used and every parameter of ours is filled)."""
    from sglang.multimodal_gen.models.loader import denoiser_from_module

    spec = get_family("qwen-image").denoiser()
    return denoiser_from_module(reference, spec, dtype, device, tp_rank, tp_size)
