"""The LTX-2 / LTX-2.3 audio-video DiT on our tensor-parallel layers.

Same architecture and numerics as diffusers' ``LTX2VideoTransformer3DModel`` (follows diffusers
0.42.1 ``models/transformers/transformer_ltx2.py``; Lightricks, "LTX-2: Efficient Joint
Audio-Visual Foundation Model", 2026). Two token streams run side by side: packed video latents
``[B, Sv, in_channels]`` (width ``D = inner_dim``) and audio latents ``[B, Sa,
audio_in_channels]`` (width ``Da = audio_inner_dim``). Each of the ``num_layers`` blocks does,
for both streams, with adaLN modulation from the timestep (``scale_shift_table`` + per-block
tables):

1. self-attention with RoPE over the stream's positions (video: time in seconds, rows, columns;
   audio: time in seconds);
2. cross-attention to the stream's prompt features (LTX-2.3 ``cross_attn_mod``: the query is
   modulated and gated too, and the prompt itself is modulated by ``sigma``);
3. audio-to-video (q video, k/v audio) and video-to-audio (q audio, k/v video) cross-attention,
   ``Da`` wide with ``audio_num_attention_heads`` heads, RoPE on the time axis only, modulated by
   the global ``av_cross_attn_*`` embedders plus per-block tables;
4. a GELU(tanh) feed-forward (4x).

LTX-2.3 ``gated_attn`` multiplies every attention's per-head output by ``2 * sigmoid(
to_gate_logits(x))``; ``perturbed_attn`` enables STG (value pass-through of both self-attentions
at chosen blocks). Every projection is a ``ParallelLinear`` (LoRA-wrappable): self-attention
``to_qkv`` fused (``QKVParallelLinear``, shard ids ``"q" | "k" | "v"`` from diffusers'
``to_q|to_k|to_v``), cross-attention ``to_q`` + fused ``to_kv`` (``MergedColumnParallelLinear``,
shard ids ``0 | 1``); all other module names equal diffusers' (see ``ltx2_names.py``).

Tensor parallelism: the heads of all six attentions are split over the TP ranks (q/k/v and the
gate logits column-parallel, ``to_out.0`` row-parallel), the FFN hidden units too; the q/k RMSNorm
over all heads adds the ranks' sums of squares (:class:`~sglang.multimodal_gen.models.dits.
layers.norm.RMSNormAcrossHeads`, one all-reduce per attention for q and k together). RoPE tables
are sliced to the rank's channels. Embedders, adaLN linears, caption projections, ``proj_in`` /
``proj_out`` and the modulation tables are replicated. ``num_attention_heads`` and
``audio_num_attention_heads`` must divide by the TP size.

Sequence parallelism: the tokens of both streams are split over the SP group (``SeqSplit``:
uneven contiguous chunks, the first ``n % sp`` ranks one token more, no padding and no padding
mask), together with their RoPE tables (sliced from the whole sequence's, so every shard keeps
its unsharded positions) and per-token modulation; an audio stream of fewer tokens than SP ranks
stays whole on every rank (no gathers for it then). Each stream's self-attention runs Ulysses /
ring through :func:`~sglang.multimodal_gen.layers.attention.attention` under its own split; the
prompt cross-attentions are local (whole prompt, local queries); audio-to-video attention
all-gathers the audio keys/values (after norm and RoPE) over the SP group for the rank's video
queries, video-to-audio attention the video keys/values for the rank's audio queries (one
all-gather of ``[k | v]`` each). Both outputs are gathered after ``proj_out`` /
``audio_proj_out``.

Dtypes: diffusers keeps no module of this model in fp32; every parameter is ``dtype`` and the
modulation arithmetic runs in ``dtype`` as in the reference; the RoPE tables are fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang.multimodal_gen.configs.ltx2 import LTX2ArchConfig, check_ltx2_tp_size
from sglang.multimodal_gen.distributed import get_tp_rank, get_tp_world_size
from sglang.multimodal_gen.distributed.sequence import SeqSplit, sequence_split
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage, ModulatedInput
from sglang.multimodal_gen.layers.embeddings import TimestepEmbedding
from sglang.multimodal_gen.layers.feedforward import GeluTanhFeedForward
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.layers.norm import LayerNormNoAffine, RMSNorm
from sglang.multimodal_gen.models.dits.common import tp_kwargs
from sglang.multimodal_gen.models.dits.ltx2_layers import (
    LTX2AdaLayerNormSingle,
    LTX2Attention,
    LTX2Rope,
    Perturbation,
    ltx2_audio_coords,
    ltx2_video_coords,
)

__all__ = ["LTX2Transformer", "ltx2_from_diffusers_module"]

_MASK_BIAS = -10000.0  # diffusers' additive bias of a masked text key


def _mods(table: torch.Tensor, temb: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    """``table [n, D] + temb [B, T, n * D]`` -> ``n`` tensors ``[B, T, D]`` (diffusers'
    ``get_mod_params``)."""
    n = table.shape[0]
    return (table[None, None] + temb.reshape(batch, temb.shape[1], n, -1)).unbind(dim=2)


def _param(*shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


class LTX2Block(nn.Module):
    """One block (diffusers' ``LTX2VideoTransformerBlock``), both streams; see the module doc.

    Shapes: ``x [B, Sv_local, D]``, ``ax [B, Sa_local, Da]`` (this SP rank's tokens of each
    stream; ``splits`` the two ``SeqSplit``), ``ctx [B, L, D]``, ``actx [B, La, Da]``,
    modulation inputs ``[B, T, n * D]`` (``T`` 1 or the rank's tokens) -> ``(x, ax)`` same
    shapes.
    """

    def __init__(self, cfg: LTX2ArchConfig, prefix: str, tp_rank, tp_size, dtype):
        super().__init__()
        d, da = cfg.inner_dim, cfg.audio_inner_dim
        h, hd = cfg.num_attention_heads, cfg.attention_head_dim
        ah, ahd = cfg.audio_num_attention_heads, cfg.audio_attention_head_dim
        eps, affine = cfg.norm_eps, cfg.norm_elementwise_affine
        bias, obias = cfg.attention_bias, cfg.attention_out_bias
        vg, ag = cfg.gated_attn, cfg.audio_gated_attn
        args = (tp_rank, tp_size, dtype)

        def norm(width):
            return RMSNorm(width, eps=eps, elementwise_affine=affine).to(dtype)

        def attn(name, qd, kd, heads, head_dim, gated):
            return LTX2Attention(
                qd, kd, heads, head_dim, bias, obias, gated, f"{prefix}.{name}", *args
            )

        self.perturbed_attn = cfg.perturbed_attn
        self.norm1, self.attn1 = norm(d), attn("attn1", d, None, h, hd, vg)
        self.audio_norm1, self.audio_attn1 = norm(da), attn("audio_attn1", da, None, ah, ahd, ag)
        self.norm2, self.attn2 = norm(d), attn("attn2", d, cfg.cross_attention_dim, h, hd, vg)
        self.audio_norm2 = norm(da)
        self.audio_attn2 = attn("audio_attn2", da, cfg.audio_cross_attention_dim, ah, ahd, ag)
        self.audio_to_video_norm = norm(d)
        self.audio_to_video_attn = attn("audio_to_video_attn", d, da, ah, ahd, vg)
        self.video_to_audio_norm = norm(da)
        self.video_to_audio_attn = attn("video_to_audio_attn", da, d, ah, ahd, ag)
        self.norm3 = norm(d)
        self.ff = GeluTanhFeedForward(d, 4 * d, f"{prefix}.ff", *args)
        self.audio_norm3 = norm(da)
        self.audio_ff = GeluTanhFeedForward(da, 4 * da, f"{prefix}.audio_ff", *args)

        self.video_cross_attn_adaln = cfg.cross_attn_mod
        self.audio_cross_attn_adaln = cfg.audio_cross_attn_mod
        self.cross_attn_adaln = cfg.prompt_modulation
        self.scale_shift_table = _param(9 if cfg.cross_attn_mod else 6, d, dtype=dtype)
        self.audio_scale_shift_table = _param(9 if cfg.audio_cross_attn_mod else 6, da, dtype=dtype)
        if self.cross_attn_adaln:
            self.prompt_scale_shift_table = _param(2, d, dtype=dtype)
            self.audio_prompt_scale_shift_table = _param(2, da, dtype=dtype)
        self.video_a2v_cross_attn_scale_shift_table = _param(5, d, dtype=dtype)
        self.audio_a2v_cross_attn_scale_shift_table = _param(5, da, dtype=dtype)

    def forward(self, x, ax, ctx, actx, m: dict, ropes: dict, masks, use_av: bool, splits, stg):
        b = x.shape[0]
        xs, axs = splits  # the video and audio sequence splits (SP)
        rt = ropes["type"]
        perturb = stg if self.perturbed_attn else None

        # 1. self-attention, both streams
        vp = _mods(self.scale_shift_table, m["temb"], b)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = vp[:6]
        h = self.norm1(x) * (1 + scale_msa) + shift_msa
        a = self.attn1(
            h, q_rope=ropes["video"], rope_type=rt, rope_groups=ropes["video_groups"],
            sequence_parallel=True, perturbation=perturb,
        )  # fmt: skip
        x = x + a * gate_msa

        ap = _mods(self.audio_scale_shift_table, m["temb_audio"], b)
        a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = ap[:6]
        h = self.audio_norm1(ax) * (1 + a_scale_msa) + a_shift_msa
        with sequence_split(axs):
            a = self.audio_attn1(
                h, q_rope=ropes["audio"], rope_type=rt, rope_groups=ropes["audio_groups"],
                sequence_parallel=True, perturbation=perturb,
            )  # fmt: skip
        ax = ax + a * a_gate_msa

        # 2. prompt cross-attention, both streams
        if self.cross_attn_adaln:
            shift_kv, scale_kv = _mods(self.prompt_scale_shift_table, m["temb_prompt"], b)
            a_shift_kv, a_scale_kv = _mods(
                self.audio_prompt_scale_shift_table, m["temb_prompt_audio"], b
            )
            ctx = ctx * (1 + scale_kv) + shift_kv
            actx = actx * (1 + a_scale_kv) + a_shift_kv
        h = self.norm2(x)
        if self.video_cross_attn_adaln:
            h = h * (1 + vp[7]) + vp[6]
        a = self.attn2(h, ctx, key_mask=masks[0])
        if self.video_cross_attn_adaln:
            a = a * vp[8]
        x = x + a

        h = self.audio_norm2(ax)
        if self.audio_cross_attn_adaln:
            h = h * (1 + ap[7]) + ap[6]
        a = self.audio_attn2(h, actx, key_mask=masks[1])
        if self.audio_cross_attn_adaln:
            a = a * ap[8]
        ax = ax + a

        # 3. audio-to-video and video-to-audio attention
        if use_av:
            nx = self.audio_to_video_norm(x)
            nax = self.video_to_audio_norm(ax)
            vt = self.video_a2v_cross_attn_scale_shift_table
            at = self.audio_a2v_cross_attn_scale_shift_table
            v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = _mods(vt[:4], m["ca_video"], b)
            (a2v_gate,) = _mods(vt[4:], m["ca_video_gate"], b)
            a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = _mods(at[:4], m["ca_audio"], b)
            (v2a_gate,) = _mods(at[4:], m["ca_audio_gate"], b)
            ca_groups_v, ca_groups_a = ropes["ca_video_groups"], ropes["ca_audio_groups"]

            q_in = nx * (1 + v_a2v_scale) + v_a2v_shift
            kv_in = nax * (1 + a_a2v_scale) + a_a2v_shift
            a = self.audio_to_video_attn(
                q_in, kv_in, q_rope=ropes["ca_video"], k_rope=ropes["ca_audio"], rope_type=rt,
                rope_groups=(ca_groups_v, ca_groups_a), kv_split=axs,
            )  # fmt: skip
            x = x + a2v_gate * a

            kv_in = nx * (1 + v_v2a_scale) + v_v2a_shift
            q_in = nax * (1 + a_v2a_scale) + a_v2a_shift
            a = self.video_to_audio_attn(
                q_in, kv_in, q_rope=ropes["ca_audio"], k_rope=ropes["ca_video"], rope_type=rt,
                rope_groups=(ca_groups_a, ca_groups_v), kv_split=xs,
            )  # fmt: skip
            ax = ax + v2a_gate * a

        # 4. feed-forward
        h = self.norm3(x) * (1 + scale_mlp) + shift_mlp
        x = x + self.ff(h) * gate_mlp
        h = self.audio_norm3(ax) * (1 + a_scale_mlp) + a_shift_mlp
        ax = ax + self.audio_ff(h) * a_gate_mlp
        return x, ax


class LTX2Transformer(nn.Module):
    """LTX-2.x audio-video DiT (``LTX2VideoTransformer3DModel``), tensor- and sequence-parallel.

    Args:
        cfg: architecture (``transformer/config.json``).
        tp_rank, tp_size: explicit TP coordinates (default: the TP group's).
        dtype: parameter dtype (default: ``torch.get_default_dtype()``).
        device: where to allocate parameters.

    Raises:
        ValueError: ``num_attention_heads`` or ``audio_num_attention_heads`` not divisible by the
            TP size (the message names the field). Any Ulysses degree is served: heads per TP
            rank that it does not divide are split unevenly (``layers.attention``).

    Parameters are allocated uninitialised (zeros; norm weights 1); load them with
    ``models.loader.load_tensors_into(..., LTX2_NAME_MAP)`` or :func:`ltx2_from_diffusers_module`.
    """

    def __init__(
        self,
        cfg: LTX2ArchConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = get_tp_world_size() if tp_size is None else tp_size
        check_ltx2_tp_size(cfg, tp)
        self.cfg = cfg
        self.tp_size = tp
        self.tp_rank = (get_tp_rank() if tp > 1 else 0) if tp_rank is None else tp_rank
        dtype = dtype or torch.get_default_dtype()
        d, da = cfg.inner_dim, cfg.audio_inner_dim
        args = (tp_rank, tp_size, dtype)
        with torch.device(device or "cpu"):
            self.proj_in = ReplicatedLinear(cfg.in_channels, d, **tp_kwargs("proj_in", *args))
            self.audio_proj_in = ReplicatedLinear(
                cfg.audio_in_channels, da, **tp_kwargs("audio_proj_in", *args)
            )
            if cfg.use_prompt_embeddings:
                kw = dict(act="gelu_tanh", tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
                self.caption_projection = TimestepEmbedding(
                    cfg.caption_channels, d, "caption_projection", **kw
                )
                self.audio_caption_projection = TimestepEmbedding(
                    cfg.caption_channels, da, "audio_caption_projection", **kw
                )
            vmods = 9 if cfg.cross_attn_mod else 6
            amods = 9 if cfg.audio_cross_attn_mod else 6
            self.time_embed = LTX2AdaLayerNormSingle(d, vmods, "time_embed", *args)
            self.audio_time_embed = LTX2AdaLayerNormSingle(da, amods, "audio_time_embed", *args)
            self.av_cross_attn_video_scale_shift = LTX2AdaLayerNormSingle(
                d, 4, "av_cross_attn_video_scale_shift", *args
            )
            self.av_cross_attn_audio_scale_shift = LTX2AdaLayerNormSingle(
                da, 4, "av_cross_attn_audio_scale_shift", *args
            )
            self.av_cross_attn_video_a2v_gate = LTX2AdaLayerNormSingle(
                d, 1, "av_cross_attn_video_a2v_gate", *args
            )
            self.av_cross_attn_audio_v2a_gate = LTX2AdaLayerNormSingle(
                da, 1, "av_cross_attn_audio_v2a_gate", *args
            )
            self.scale_shift_table = _param(2, d, dtype=dtype)
            self.audio_scale_shift_table = _param(2, da, dtype=dtype)
            if cfg.prompt_modulation:
                self.prompt_adaln = LTX2AdaLayerNormSingle(d, 2, "prompt_adaln", *args)
                self.audio_prompt_adaln = LTX2AdaLayerNormSingle(da, 2, "audio_prompt_adaln", *args)
            self.transformer_blocks = nn.ModuleList(
                LTX2Block(cfg, f"transformer_blocks.{i}", *args) for i in range(cfg.num_layers)
            )
            self.norm_out = LayerNormNoAffine(d, eps=1e-6)
            self.proj_out = ReplicatedLinear(d, cfg.out_channels, **tp_kwargs("proj_out", *args))
            self.audio_norm_out = LayerNormNoAffine(da, eps=1e-6)
            self.audio_proj_out = ReplicatedLinear(
                da, cfg.audio_out_channels, **tp_kwargs("audio_proj_out", *args)
            )
        self._rope_cache: dict[tuple, dict] = {}  # see _rope_tables
        for p in self.parameters():
            p.requires_grad_(False)

        common = dict(theta=cfg.rope_theta, double_precision=cfg.rope_double_precision)
        common["rope_type"] = cfg.rope_type
        ca_max = max(cfg.pos_embed_max_pos, cfg.audio_pos_embed_max_pos)
        self.rope = LTX2Rope(
            d, cfg.num_attention_heads,
            (cfg.pos_embed_max_pos, cfg.base_height, cfg.base_width), **common,
        )  # fmt: skip
        self.audio_rope = LTX2Rope(
            da, cfg.audio_num_attention_heads, (cfg.audio_pos_embed_max_pos,), **common
        )
        self.cross_attn_rope = LTX2Rope(
            cfg.audio_cross_attention_dim, cfg.num_attention_heads, (ca_max,), **common
        )
        self.cross_attn_audio_rope = LTX2Rope(
            cfg.audio_cross_attention_dim, cfg.audio_num_attention_heads, (ca_max,), **common
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_in.weight.device

    # ------------------------------------------------------------------ coordinates
    def prepare_video_coords(self, batch_size, num_frames, height, width, device=None, fps=24.0):
        """See :func:`~sglang.multimodal_gen.models.dits.ltx2_layers.ltx2_video_coords`
        (diffusers' ``transformer.rope.prepare_video_coords``): ``[B, 3, N, 2]`` fp32."""
        return ltx2_video_coords(self.cfg, batch_size, num_frames, height, width, device, fps)

    def prepare_audio_coords(self, batch_size, num_frames, device=None, shift=0):
        """See :func:`~sglang.multimodal_gen.models.dits.ltx2_layers.ltx2_audio_coords`
        (diffusers' ``transformer.audio_rope.prepare_audio_coords``): ``[B, 1, N, 2]`` fp32."""
        return ltx2_audio_coords(self.cfg, batch_size, num_frames, device, shift)

    # ------------------------------------------------------------------ helpers
    def _rope_local(self, rope: LTX2Rope, coords: torch.Tensor):
        return rope.local(rope(coords), self.tp_rank, self.tp_size)

    _ROPE_CACHE_SIZE = 8  # latent geometries kept (a request's calls and steps share one)

    def _rope_tables(self, b, sv, sa, video_coords, audio_coords, sizes) -> dict:
        """The four RoPE tables of the whole sequences, sliced to this TP rank's channels.

        Args:
            b, sv, sa: batch, video and audio token counts of the inputs.
            video_coords, audio_coords: ``[B, 3, Sv, 2]`` / ``[B, 1, Sa, 2]`` given by the caller,
                or ``None`` (built from ``sizes``).
            sizes: ``(num_frames, height, width, fps, audio_num_frames)``.

        Returns:
            ``{"video", "audio", "ca_video", "ca_audio"}``: ``(cos, sin)`` fp32 ``[B or 1, S, C]``
            (see :class:`LTX2Rope`). Tables built from the sizes alone have batch 1 (every item
            has the same positions) and are kept per geometry: the calls of a request (its
            guidance passes and steps) compute them once. They are read only, never written.

        Raises:
            ValueError: missing sizes, or coordinates that do not fit the token counts.
        """
        cfg, dev = self.cfg, self.device
        num_frames, height, width, fps, audio_num_frames = sizes
        key = None
        if video_coords is None and audio_coords is None:
            key = (num_frames, height, width, float(fps), audio_num_frames, str(dev))
            tables = self._rope_cache.get(key)
            if tables is not None:
                self._check_coords(tables["video"][0], tables["audio"][0], b, sv, sa)
                return tables
        if video_coords is None:
            if None in (num_frames, height, width):
                raise ValueError("num_frames, height and width are required without video_coords")
            n = 1 if key else b
            video_coords = ltx2_video_coords(cfg, n, num_frames, height, width, dev, fps)
        if audio_coords is None:
            if audio_num_frames is None:
                raise ValueError("audio_num_frames is required without audio_coords")
            audio_coords = ltx2_audio_coords(cfg, 1 if key else b, audio_num_frames, dev)
        video_coords, audio_coords = video_coords.to(dev), audio_coords.to(dev)
        self._check_coords(video_coords, audio_coords, b, sv, sa, coords=True)
        tables = {
            "video": self._rope_local(self.rope, video_coords),
            "audio": self._rope_local(self.audio_rope, audio_coords),
            "ca_video": self._rope_local(self.cross_attn_rope, video_coords[:, 0:1]),
            "ca_audio": self._rope_local(self.cross_attn_audio_rope, audio_coords[:, 0:1]),
        }
        if key is not None:
            if len(self._rope_cache) >= self._ROPE_CACHE_SIZE:
                self._rope_cache.pop(next(iter(self._rope_cache)))
            self._rope_cache[key] = tables
        return tables

    @staticmethod
    def _check_coords(video, audio, b, sv, sa, coords: bool = False) -> None:
        """``video`` / ``audio`` (coordinates ``[B or 1, axes, S, 2]`` when ``coords``, else
        tables ``[B or 1, S, C]``) must have one entry per token."""
        seq = 2 if coords else 1
        for name, t, axes, n in (("video", video, 3, sv), ("audio", audio, 1, sa)):
            ok = t.shape[0] in (1, b) and t.shape[seq] == n
            if coords:
                ok = ok and t.shape[1] == axes
            if not ok:
                what = f"[{b}, {axes}, {n}, 2]" if coords else f"{n} per item"
                raise ValueError(
                    f"{name} coordinates must be {what} (one per {name} token), got {list(t.shape)}"
                )

    @staticmethod
    def _key_mask(mask: torch.Tensor | None, b: int, length: int, name: str):
        """2-D 1/0 mask -> bool key mask (diffusers adds ``(1 - mask) * -10000``; an item whose
        keys are all masked then attends to all of them evenly, which is what no mask does)."""
        if mask is None:
            return None
        if mask.ndim != 2 or tuple(mask.shape) != (b, length):
            raise ValueError(
                f"{name} must be [{b}, {length}] (1 keep / 0 drop), got {list(mask.shape)}"
            )
        keep = mask > 0.5
        return keep | ~keep.any(dim=1, keepdim=True)

    @staticmethod
    def _timestep(t: torch.Tensor | None, b: int, seq: int, name: str) -> torch.Tensor:
        if t is None:
            raise ValueError(f"{name} is required")
        t = torch.as_tensor(t)
        if t.ndim == 0 or t.numel() == 1:
            t = t.reshape(1).expand(b)
        if t.numel() not in (b, b * seq):
            raise ValueError(
                f"{name} must be [{b}] or [{b}, {seq}] (one per token), got {list(t.shape)}"
            )
        return t.reshape(b, -1)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        audio_hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        audio_encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        audio_timestep: torch.Tensor | None = None,
        sigma: torch.Tensor | None = None,
        audio_sigma: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        audio_encoder_attention_mask: torch.Tensor | None = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        fps: float = 24.0,
        audio_num_frames: int | None = None,
        video_coords: torch.Tensor | None = None,
        audio_coords: torch.Tensor | None = None,
        isolate_modalities: bool = False,
        spatio_temporal_guidance_blocks: list[int] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        use_cross_timestep: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predict video and audio velocities (diffusers' keyword names and meaning).

        Args:
            hidden_states: ``[B, Sv, in_channels]`` packed video latents.
            audio_hidden_states: ``[B, Sa, audio_in_channels]`` packed audio latents.
            encoder_hidden_states: ``[B, L, caption_channels]`` (LTX-2.0,
                ``use_prompt_embeddings``) or ``[B, L, cross_attention_dim]`` prompt features.
            audio_encoder_hidden_states: the audio stream's, ``caption_channels`` or
                ``audio_cross_attention_dim`` wide.
            timestep: ``[B]`` or ``[B, Sv]`` (per token), already times
                ``timestep_scale_multiplier``.
            audio_timestep: ``[B]`` or ``[B, Sa]``; default ``timestep``.
            sigma, audio_sigma: ``[B]`` (``audio_sigma`` default ``sigma``): the prompt
                modulation's input (LTX-2.3, required then) and the cross-modal timestep of
                ``use_cross_timestep``.
            encoder_attention_mask, audio_encoder_attention_mask: ``[B, L]`` 1 keep / 0 drop.
            num_frames, height, width: latent video sizes (coordinates when ``video_coords`` is
                not given); fps: frames per second in the time coordinate.
            audio_num_frames: latent audio frames (coordinates when ``audio_coords`` is not
                given).
            video_coords: ``[B, 3, Sv, 2]`` (see :meth:`prepare_video_coords`).
            audio_coords: ``[B, 1, Sa, 2]`` (see :meth:`prepare_audio_coords`).
            isolate_modalities: skip the audio-to-video and video-to-audio attention.
            spatio_temporal_guidance_blocks: block indices where STG replaces both
                self-attentions' output by their values (only with ``perturbed_attn``, as
                diffusers: other models ignore it).
            perturbation_mask: ``[B]`` or ``[B, 1, 1]``, 0 perturb / 1 keep (default: all 0 when
                STG blocks are given).
            use_cross_timestep: the audio-video modulation of each stream uses the other
                stream's sigma (LTX-2.3) instead of its own timestep.

        Returns:
            ``(video [B, Sv, out_channels], audio [B, Sa, audio_out_channels])`` in the dtypes of
            ``hidden_states`` / ``audio_hidden_states``.

        Raises:
            ValueError: a shape that does not fit the config or the other inputs, a missing
                ``sigma`` / sizes / coordinates, a block index out of range.
        """
        cfg = self.cfg
        if hidden_states.ndim != 3 or hidden_states.shape[2] != cfg.in_channels:
            raise ValueError(
                f"hidden_states must be [B, Sv, {cfg.in_channels}], got {list(hidden_states.shape)}"
            )
        b, sv = hidden_states.shape[:2]
        if (
            audio_hidden_states.ndim != 3
            or audio_hidden_states.shape[0] != b
            or audio_hidden_states.shape[2] != cfg.audio_in_channels
        ):
            raise ValueError(
                f"audio_hidden_states must be [{b}, Sa, {cfg.audio_in_channels}], got "
                f"{list(audio_hidden_states.shape)}"
            )
        sa = audio_hidden_states.shape[1]
        ctx_w = cfg.caption_channels if cfg.use_prompt_embeddings else cfg.cross_attention_dim
        actx_w = (
            cfg.caption_channels if cfg.use_prompt_embeddings else cfg.audio_cross_attention_dim
        )
        for name, t, w in (
            ("encoder_hidden_states", encoder_hidden_states, ctx_w),
            ("audio_encoder_hidden_states", audio_encoder_hidden_states, actx_w),
        ):
            if t.ndim != 3 or t.shape[0] != b or t.shape[2] != w:
                raise ValueError(f"{name} must be [{b}, L, {w}], got {list(t.shape)}")
        out_dtype, audio_out_dtype = hidden_states.dtype, audio_hidden_states.dtype
        dev, dt = self.device, self.dtype

        # ---- timesteps
        timestep = self._timestep(timestep, b, sv, "timestep").to(dev)
        if audio_timestep is None:
            if timestep.shape[1] not in (1, sa):
                raise ValueError(
                    f"audio_timestep is required when timestep is per video token ({sv} per "
                    f"item; the audio has {sa} tokens)"
                )
            audio_timestep = timestep
        else:
            audio_timestep = self._timestep(audio_timestep, b, sa, "audio_timestep").to(dev)
        if sigma is not None:
            sigma = self._timestep(sigma, b, 1, "sigma").to(dev)
        audio_sigma = (
            sigma
            if audio_sigma is None
            else self._timestep(audio_sigma, b, 1, "audio_sigma").to(dev)
        )
        if (cfg.prompt_modulation or use_cross_timestep) and sigma is None:
            raise ValueError(
                "sigma is required by this model (LTX-2.3 prompt modulation) and by "
                "use_cross_timestep"
            )

        # ---- RoPE tables of the whole sequences (this TP rank's channels)
        sizes = (num_frames, height, width, fps, audio_num_frames)
        tables = self._rope_tables(b, sv, sa, video_coords, audio_coords, sizes)
        # sequence parallelism: both streams' tokens split over the SP group (an audio stream
        # shorter than the group stays whole on every rank: ring attention needs tokens on
        # every rank)
        xs = SeqSplit.of(sv)
        axs = SeqSplit.of(sa) if sa >= xs.world else SeqSplit((sa,))
        tp = self.tp_size

        def local_seq(table, split):
            return tuple(split.local(t, 1) for t in table)

        ropes = {
            "type": cfg.rope_type,
            "video": local_seq(tables["video"], xs),
            "audio": local_seq(tables["audio"], axs),
            "ca_video": local_seq(tables["ca_video"], xs),
            "ca_audio": local_seq(tables["ca_audio"], axs),
            # the split layout's channel groups on this rank (each RoPE's own head count)
            "video_groups": (self.rope.heads // tp,) * 2,
            "audio_groups": (self.audio_rope.heads // tp,) * 2,
            "ca_video_groups": self.cross_attn_rope.heads // tp,
            "ca_audio_groups": self.cross_attn_audio_rope.heads // tp,
        }

        # ---- inputs
        x = self.proj_in(hidden_states.to(dt))[0]
        ax = self.audio_proj_in(audio_hidden_states.to(dt))[0]

        def embed(layer, t):  # [B, T] -> ([B, T, n * D], [B, T, D])
            mods, emb = layer(t.flatten())
            return mods.view(b, -1, mods.shape[-1]), emb.view(b, -1, emb.shape[-1])

        temb, emb_t = embed(self.time_embed, timestep)
        temb_audio, audio_emb_t = embed(self.audio_time_embed, audio_timestep)
        m = {"temb": temb, "temb_audio": temb_audio}
        if cfg.prompt_modulation:
            m["temb_prompt"] = embed(self.prompt_adaln, sigma)[0]
            m["temb_prompt_audio"] = embed(self.audio_prompt_adaln, audio_sigma)[0]
        gate_factor = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
        video_ca_t = audio_sigma if use_cross_timestep else timestep
        audio_ca_t = sigma if use_cross_timestep else audio_timestep
        if not isolate_modalities:  # the audio-video attentions' modulation (unused otherwise)
            vg, ag = video_ca_t * gate_factor, audio_ca_t * gate_factor
            m["ca_video"] = embed(self.av_cross_attn_video_scale_shift, video_ca_t)[0]
            m["ca_video_gate"] = embed(self.av_cross_attn_video_a2v_gate, vg)[0]
            m["ca_audio"] = embed(self.av_cross_attn_audio_scale_shift, audio_ca_t)[0]
            m["ca_audio_gate"] = embed(self.av_cross_attn_audio_v2a_gate, ag)[0]

        ctx = encoder_hidden_states.to(dt)
        actx = audio_encoder_hidden_states.to(dt)
        if cfg.use_prompt_embeddings:
            ctx = self.caption_projection(ctx)
            actx = self.audio_caption_projection(actx)
        masks = (
            self._key_mask(encoder_attention_mask, b, ctx.shape[1], "encoder_attention_mask"),
            self._key_mask(
                audio_encoder_attention_mask, b, actx.shape[1], "audio_encoder_attention_mask"
            ),
        )

        # ---- STG
        stg_blocks = set(spatio_temporal_guidance_blocks or [])
        bad = [i for i in stg_blocks if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(
                f"spatio_temporal_guidance_blocks {sorted(bad)} out of range [0, {cfg.num_layers})"
            )
        explicit_mask = perturbation_mask is not None
        if stg_blocks and perturbation_mask is None:
            perturbation_mask = torch.zeros((b,), device=dev)
        if perturbation_mask is not None:
            perturbation_mask = perturbation_mask.to(dev)
            if perturbation_mask.ndim == 1:
                perturbation_mask = perturbation_mask[:, None, None]
        stg = None
        if perturbation_mask is not None:
            stg = Perturbation(perturbation_mask, bool(torch.all(perturbation_mask == 0)))

        # ---- sequence parallelism: this rank's tokens of each stream and their per-token
        # modulation
        x, ax = xs.local(x), axs.local(ax)
        for split, keys in (
            (xs, ("temb", "ca_video", "ca_video_gate")),
            (axs, ("temb_audio", "ca_audio", "ca_audio_gate")),
        ):
            for key in keys:
                if key in m and m[key].shape[1] != 1:
                    m[key] = split.local(m[key])
        if emb_t.shape[1] != 1:
            emb_t = xs.local(emb_t)
        if audio_emb_t.shape[1] != 1:
            audio_emb_t = axs.local(audio_emb_t)

        seq = self.block_sequence(
            ctx, actx, m, ropes, masks, isolate_modalities, (xs, axs), stg, tuple(stg_blocks), b
        )
        # caller-given per-row STG weights are not part of a cache key: such calls run plainly
        seq.cacheable = not (stg_blocks and explicit_mask)
        with sequence_split(xs):
            x, ax = seq.run((x, ax))

        # ---- output heads
        shift, scale = (self.scale_shift_table[None, None] + emb_t[:, :, None]).unbind(2)
        x = self.norm_out(x) * (1 + scale) + shift
        x = xs.gather(self.proj_out(x)[0])
        a_shift, a_scale = (
            self.audio_scale_shift_table[None, None] + audio_emb_t[:, :, None]
        ).unbind(2)
        ax = self.audio_norm_out(ax) * (1 + a_scale) + a_shift
        ax = axs.gather(self.audio_proj_out(ax)[0])
        return x.to(out_dtype), ax.to(audio_out_dtype)

    def block_sequence(
        self,
        ctx=None,
        actx=None,
        m: dict | None = None,
        ropes: dict | None = None,
        masks=(None, None),
        isolate_modalities: bool = False,
        splits=None,
        stg: Perturbation | None = None,
        stg_blocks: tuple[int, ...] = (),
        batch: int = 0,
    ) -> BlockSequence:
        """The blocks as one :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence`
        on the canonical streams ``(video [B, Sv, D], audio [B, Sa, Da])`` (the video stream is
        the main one: a cache measures its change there).

        Row arguments: the prompt contexts ``ctx [B, L, D]`` / ``actx [B, L, Da]``, their key
        masks ``[B, L]`` bool or ``None``, every modulation of ``m`` (``[B, 1 or S, n * D]``,
        as ``m.<name>``), the RoPE tables built per item (``[B, S, C]``, as
        ``rope.<name>.<0|1>``; tables of batch 1 are shared) and the STG mask ``[B, 1, 1]``.
        Shared: the rest of ``ropes``, the sequence ``splits`` and ``stg.all_perturbed``.

        The flags that change what the blocks compute, ``isolate_modalities`` (no audio-video
        attention) and the STG blocks, name the sequence (:meth:`BlockSequence.variant`): a cache
        keeps their residuals apart from the plain pass's. Without arguments: the declaration
        alone (its block count), not runnable."""
        m, ropes = m or {}, ropes or {}
        stg_ids = {id(self.transformer_blocks[i]) for i in stg_blocks}
        tables = {
            (k, j): t
            for k, v in ropes.items()
            if isinstance(v, tuple) and all(isinstance(t, torch.Tensor) for t in v)
            for j, t in enumerate(v)
        }
        per_row = {f"rope.{k}.{j}": t for (k, j), t in tables.items() if t.shape[0] == batch > 1}
        row_args = {"ctx": ctx, "actx": actx, "mask": masks[0], "audio_mask": masks[1]}
        row_args |= {f"m.{k}": v for k, v in m.items()}
        row_args |= per_row
        row_args["stg_mask"] = None if stg is None else stg.mask

        def call(blk, s, a):
            mods = {k[2:]: v for k, v in a.items() if k.startswith("m.")}
            r = ropes
            if per_row:  # this call's rows of the per-item tables
                r = dict(ropes)
                for k in {k for k, _ in tables}:
                    r[k] = tuple(a.get(f"rope.{k}.{i}", u) for i, u in enumerate(ropes[k]))
            p = None
            if stg is not None and id(blk) in stg_ids:
                p = Perturbation(a["stg_mask"], stg.all_perturbed)
            return blk(
                s[0], s[1], a["ctx"], a["actx"], mods, r, (a["mask"], a["audio_mask"]),
                not isolate_modalities, splits, p,
            )  # fmt: skip

        def modulated(s, a):  # TeaCache: block 0's norm1(video) * (1 + scale_msa) + shift_msa
            first = self.transformer_blocks[0]
            shift, scale = _mods(first.scale_shift_table, a["m.temb"], s[0].shape[0])[:2]
            return first.norm1(s[0]) * (1 + scale) + shift

        name = BlockSequence.variant(
            "blocks", isolate_modalities=isolate_modalities, stg=tuple(sorted(stg_blocks))
        )
        return BlockSequence(
            owner=self,
            stages=(BlockStage(self.transformer_blocks, call),),
            row_args=row_args,
            name=name,
            modulated_input=ModulatedInput(modulated),  # no published LTX-2 rescaling: identity
        )


def ltx2_from_diffusers_module(
    reference: nn.Module,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> LTX2Transformer:
    """Our DiT with the weights of an in-memory diffusers ``LTX2VideoTransformer3DModel`` (tests
    and benchmarks): the same name map and weight loaders as file loading, strict (every tensor of
    the reference used, every parameter of ours filled)."""
    from sglang.multimodal_gen.configs.ltx2 import LTX2ArchConfig as _Cfg
    from sglang.multimodal_gen.models.dits.ltx2_names import LTX2_NAME_MAP
    from sglang.multimodal_gen.models.loader import load_tensors_into

    cfg = _Cfg.from_dict(dict(reference.config))
    dtype = dtype or next(reference.parameters()).dtype
    device = device or next(reference.parameters()).device
    model = LTX2Transformer(cfg, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, device=device)
    items = (("<module>", k, v.detach()) for k, v in reference.state_dict().items())
    load_tensors_into(model, items, LTX2_NAME_MAP, where="<module>")
    return model.eval()
