"""The Z-Image DiT on our tensor-parallel layers.

Same architecture and numerics as diffusers' ``ZImageTransformer2DModel`` (diffusers 0.42.1,
``models/transformers/transformer_z_image.py``; Z-Image paper, Alibaba Tongyi-MAI 2025), text-to-
image mode only (no Omni/SigLIP inputs). Module names equal diffusers' except two fused layers:
``attention.to_qkv`` (``to_q``/``to_k``/``to_v``, shard ids ``"q"/"k"/"v"``) and
``feed_forward.w13`` (``w1``/``w3``, shard ids ``0``/``1``); see ``zimage_names.py``.

Data flow for one batch item (``p`` = patch size, ``pf`` = frame patch size):

* caption ``[L, cap_dim]`` -> RMSNorm + Linear -> ``[L, dim]``, padded to a multiple of 32 with the
  learned ``cap_pad_token`` (``C`` tokens), RoPE positions ``(1 + j, 0, 0)`` for ``j < C`` ->
  ``context_refiner`` blocks (no modulation). Independent of the image and of the timestep, so the
  pipeline computes it once per request (:meth:`ZImageTransformer.encode_captions`).
* latent ``[C_in, F, H, W]`` -> patches ``[N, pf*p*p*C_in]`` (patch channel order ``pf, p, p, C``)
  -> Linear -> padded to a multiple of 32 with ``x_pad_token`` (``X`` tokens); positions
  ``(C + 1 + f, h, w)`` for real patches and ``(0, 0, 0)`` for pad tokens -> ``noise_refiner``
  blocks (adaLN-modulated by the timestep embedding).
* unified sequence ``[x tokens (X), caption tokens (C)]`` -> ``layers`` -> final layer
  (LayerNorm, scale-only adaLN, Linear) -> first ``N`` tokens -> unpatchified
  ``[C_in, F, H, W]``.

Items of a batch with different lengths are right-padded and masked as keys (the mask is only
built when lengths differ, as in the reference). Tensor parallelism: attention heads and FFN
hidden units are split over the TP ranks (``QKVParallelLinear`` / ``MergedColumnParallelLinear``
then ``RowParallelLinear`` with one all-reduce each); everything else is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sglang.multimodal_gen.configs.zimage import ZImageArchConfig
from sglang.multimodal_gen.distributed import get_sp_world_size, get_tp_world_size
from sglang.multimodal_gen.distributed.sequence import SeqSplit, sequence_split
from sglang.multimodal_gen.layers.block_sequence import BlockSequence, BlockStage, ModulatedInput
from sglang.multimodal_gen.layers.linear import ReplicatedLinear
from sglang.multimodal_gen.layers.norm import RMSNorm
from sglang.multimodal_gen.layers.rotary import MultiAxisRope
from sglang.multimodal_gen.models.dits.zimage_layers import (
    ZImageBlock,
    ZImageFinalLayer,
    ZImageTimestepEmbedder,
)
from sglang.multimodal_gen.models.registry import get_family


@dataclass
class CaptionContext:
    """Refined caption tokens of a batch (computed once per request, reused every step).

    Attributes:
        tokens: ``[B, Cmax, dim]`` refined caption tokens (item ``i`` valid up to ``lens[i]``).
        lens: padded (multiple of 32) caption length per item.
        cis: ``[B, Cmax, head_dim / 2]`` complex64 RoPE rotations of the caption positions.
    """

    tokens: torch.Tensor
    lens: list[int]
    cis: torch.Tensor

    def __len__(self) -> int:
        return len(self.lens)

    @classmethod
    def concat(cls, parts: list[CaptionContext]) -> CaptionContext:
        """The contexts of several batches as one (shorter ones padded; lengths kept)."""
        m = max(p.tokens.shape[1] for p in parts)

        def pad(t):
            return F.pad(t, (0, 0, 0, m - t.shape[1])) if t.shape[1] < m else t

        return CaptionContext(
            torch.cat([pad(p.tokens) for p in parts]),
            [n for p in parts for n in p.lens],
            torch.cat([pad(p.cis) for p in parts]),
        )

    def select(self, index: list[int]) -> CaptionContext:
        """The context of the items ``index`` (e.g. to repeat or reorder a batch)."""
        idx = torch.tensor(index, device=self.tokens.device)
        lens = [self.lens[i] for i in index]
        m = max(lens)
        return CaptionContext(
            self.tokens.index_select(0, idx)[:, :m],
            lens,
            self.cis.index_select(0, idx)[:, :m],
        )


def _pad_batch(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Right-pad ``[L_i, ...]`` tensors with zeros to ``[B, Lmax, ...]``; the ``[B, Lmax]`` bool
    key mask is ``None`` when every length is equal."""
    lens = [s.shape[0] for s in seqs]
    m = max(lens)
    if all(n == m for n in lens):
        return torch.stack(seqs, 0), None
    out = seqs[0].new_zeros((len(seqs), m, *seqs[0].shape[1:]))
    mask = torch.zeros(len(seqs), m, dtype=torch.bool, device=seqs[0].device)
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
        mask[i, : s.shape[0]] = True
    return out, mask


def _per_item(layer: nn.Module, items: list[torch.Tensor]) -> list[torch.Tensor]:
    """``layer`` (a linear layer) on each item's ``[L_i, in]`` tokens, run as ONE ``[B, Lmax, in]``
    input (the items stacked, zero-padded to the longest, the padding cut off again), so the
    input's leading dimension is the item: a per-row LoRA composition of the batch applies to
    each item's own tokens. Each output row is the row computed on its own (row-invariant GEMMs),
    so the numbers equal those of the items concatenated."""
    stacked, _ = _pad_batch(items)
    out = layer(stacked)[0]
    return [out[i, : t.shape[0]] for i, t in enumerate(items)]


def _round_up(n: int, m: int) -> int:
    return n + (-n) % m


class ZImageTransformer(nn.Module):
    """Z-Image DiT (text-to-image), tensor-parallel.

    Args:
        cfg: architecture (``transformer/config.json``).
        tp_rank, tp_size: explicit TP coordinates (default: the TP group's).
        dtype: parameter dtype (default: ``torch.get_default_dtype()``).
        device: where to allocate parameters.

    Raises:
        ValueError: the TP size does not divide a number of the family's ``tp_divisors``
            (``ModelFamily.check_tp_size``: the number, the TP size and the valid sizes named).

    Parameters are allocated uninitialised; load them with ``models.loader``.
    """

    def __init__(
        self,
        cfg: ZImageArchConfig,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = get_tp_world_size() if tp_size is None else tp_size
        get_family("zimage").check_tp_size(cfg, tp)  # the family's rule, as at load time
        self.cfg = cfg
        self.tp_size = tp
        dtype = dtype or torch.get_default_dtype()
        kw = dict(tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype)
        with torch.device(device or "cpu"):
            x_emb, final = {}, {}
            for p, pf in zip(cfg.all_patch_size, cfg.all_f_patch_size):
                key = f"{p}-{pf}"
                patch_dim = pf * p * p * cfg.in_channels
                x_emb[key] = ReplicatedLinear(
                    patch_dim, cfg.dim, prefix=f"all_x_embedder.{key}", **kw
                )
                final[key] = ZImageFinalLayer(
                    cfg, p * p * pf * cfg.out_channels, f"all_final_layer.{key}", **kw
                )
            self.all_x_embedder = nn.ModuleDict(x_emb)
            self.all_final_layer = nn.ModuleDict(final)
            self.noise_refiner = nn.ModuleList(
                ZImageBlock(cfg, True, f"noise_refiner.{i}", tp_rank, tp_size, dtype)
                for i in range(cfg.n_refiner_layers)
            )
            self.context_refiner = nn.ModuleList(
                ZImageBlock(cfg, False, f"context_refiner.{i}", tp_rank, tp_size, dtype)
                for i in range(cfg.n_refiner_layers)
            )
            self.t_embedder = ZImageTimestepEmbedder(cfg, "t_embedder", tp_rank, tp_size, dtype)
            self.cap_embedder = nn.ModuleList(
                [
                    RMSNorm(cfg.cap_feat_dim, eps=cfg.norm_eps),
                    ReplicatedLinear(cfg.cap_feat_dim, cfg.dim, prefix="cap_embedder.1", **kw),
                ]
            )
            self.x_pad_token = nn.Parameter(torch.empty(1, cfg.dim), requires_grad=False)
            self.cap_pad_token = nn.Parameter(torch.empty(1, cfg.dim), requires_grad=False)
            self.layers = nn.ModuleList(
                ZImageBlock(cfg, True, f"layers.{i}", tp_rank, tp_size, dtype)
                for i in range(cfg.n_layers)
            )
        self.to(dtype)
        for p in self.parameters():
            p.requires_grad_(False)
        self.rope = MultiAxisRope(cfg.rope_theta, cfg.axes_dims, cfg.axes_lens)

    @property
    def dtype(self) -> torch.dtype:
        return self.x_pad_token.dtype

    @property
    def device(self) -> torch.device:
        return self.x_pad_token.device

    # ------------------------------------------------------------------ caption side
    def encode_captions(self, cap_feats: list[torch.Tensor]) -> CaptionContext:
        """Embed, pad and refine the captions of a batch.

        Args:
            cap_feats: per item ``[L_i, cap_feat_dim]`` text-encoder features (any float dtype).

        Returns:
            :class:`CaptionContext` with ``B = len(cap_feats)``.
        """
        if not cap_feats:
            raise ValueError("encode_captions needs at least one caption")
        lens = [int(c.shape[0]) for c in cap_feats]
        if min(lens) == 0:
            raise ValueError("a caption has zero tokens")
        norm, lin = self.cap_embedder
        emb = _per_item(lin, list(norm(torch.cat(cap_feats, 0)).split(lens, 0)))
        seqs, cis_l, plens = [], [], []
        for e, n in zip(emb, lens):
            c = _round_up(n, self.cfg.SEQ_MULTI_OF)
            if c > n:
                e = torch.cat([e, self.cap_pad_token.expand(c - n, -1)], 0)
            pos = torch.zeros(c, 3, dtype=torch.long, device=e.device)
            pos[:, 0] = torch.arange(1, c + 1, device=e.device)
            seqs.append(e)
            cis_l.append(self.rope(pos))
            plens.append(c)
        x, mask = _pad_batch(seqs)
        cis, _ = _pad_batch(cis_l)
        for block in self.context_refiner:
            x = block(x, cis, mask)
        return CaptionContext(x, plens, cis)

    # ------------------------------------------------------------------ image side
    def _patchify(self, img: torch.Tensor, p: int, pf: int):
        c, f, h, w = img.shape
        if f % pf or h % p or w % p:
            raise ValueError(
                f"latent of shape {list(img.shape)} is not divisible by the patch size "
                f"(frames by {pf}, height/width by {p})"
            )
        ft, ht, wt = f // pf, h // p, w // p
        tok = img.reshape(c, ft, pf, ht, p, wt, p).permute(1, 3, 5, 2, 4, 6, 0)
        return tok.reshape(ft * ht * wt, pf * p * p * c), (ft, ht, wt)

    def _unpatchify(self, tok: torch.Tensor, grid, p: int, pf: int) -> torch.Tensor:
        ft, ht, wt = grid
        c = self.cfg.out_channels
        x = tok[: ft * ht * wt].reshape(ft, ht, wt, pf, p, p, c)
        return x.permute(6, 0, 3, 1, 4, 2, 5).reshape(c, ft * pf, ht * p, wt * p)

    def forward(
        self,
        x: list[torch.Tensor] | torch.Tensor,
        t: torch.Tensor,
        cap: list[torch.Tensor] | CaptionContext,
        patch_size: int = 2,
        f_patch_size: int = 1,
    ) -> list[torch.Tensor]:
        """Predict the flow for a batch of latents.

        Args:
            x: per item ``[C_in, F, H, W]`` latents (a list, or a ``[B, C_in, F, H, W]`` tensor),
                in the model dtype. ``F`` divisible by ``f_patch_size``, ``H``/``W`` by
                ``patch_size``.
            t: ``[B]`` timesteps in ``[0, 1]`` (the pipeline passes ``1 - sigma``); multiplied by
                ``t_scale`` here.
            cap: per item ``[L_i, cap_feat_dim]`` caption features, or a precomputed
                :class:`CaptionContext` of the same batch size.
            patch_size, f_patch_size: one of the configured patch pairs.

        Returns:
            Per item ``[C_in, F, H, W]`` model output (the reference's sign: the pipeline negates
            it to get the flow-matching velocity), in the model dtype.

        Raises:
            ValueError: unknown patch pair, batch-size mismatch, or a latent whose size does not
                divide by the patch size.
        """
        key = f"{patch_size}-{f_patch_size}"
        if key not in self.all_x_embedder:
            raise ValueError(
                f"patch pair {key!r} not in the model's {sorted(self.all_x_embedder.keys())}"
            )
        xs = list(x.unbind(0)) if isinstance(x, torch.Tensor) else list(x)
        ctx = cap if isinstance(cap, CaptionContext) else self.encode_captions(list(cap))
        bsz = len(xs)
        if len(ctx.lens) != bsz or t.shape[0] != bsz:
            raise ValueError(
                f"batch mismatch: {bsz} latents, {len(ctx.lens)} captions, {t.shape[0]} timesteps"
            )
        dtype = xs[0].dtype
        adaln = self.t_embedder(t * self.cfg.t_scale).to(dtype)

        patches, grids, nlens = [], [], []
        for img in xs:
            tok, grid = self._patchify(img, patch_size, f_patch_size)
            patches.append(tok)
            grids.append(grid)
            nlens.append(tok.shape[0])
        emb = _per_item(self.all_x_embedder[key], patches)
        seqs, cis_l, xlens = [], [], []
        for i, (e, n, grid) in enumerate(zip(emb, nlens, grids)):
            xl = _round_up(n, self.cfg.SEQ_MULTI_OF)
            if xl > n:
                e = torch.cat([e, self.x_pad_token.expand(xl - n, -1)], 0)
            pos = torch.zeros(xl, 3, dtype=torch.long, device=e.device)
            axes = [
                torch.arange(g, device=e.device) + off
                for g, off in zip(grid, (ctx.lens[i] + 1, 0, 0))
            ]
            pos[:n] = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(n, 3)
            seqs.append(e)
            cis_l.append(self.rope(pos))
            xlens.append(xl)
        h, mask = _pad_batch(seqs)
        cis, _ = _pad_batch(cis_l)
        if get_sp_world_size() > 1:
            out = self._layers_sequence_parallel(h, cis, mask, ctx, adaln, key)
            return [
                self._unpatchify(out[i], grids[i], patch_size, f_patch_size) for i in range(bsz)
            ]
        for block in self.noise_refiner:
            h = block(h, cis, mask, adaln)

        # unified [image tokens, caption tokens] per item
        if mask is None and all(c == ctx.lens[0] for c in ctx.lens):
            u = torch.cat([h, ctx.tokens], 1)
            ucis = torch.cat([cis, ctx.cis], 1)
            umask = None
        else:
            u, umask = _pad_batch(
                [torch.cat([h[i, : xlens[i]], ctx.tokens[i, : ctx.lens[i]]]) for i in range(bsz)]
            )
            ucis, _ = _pad_batch(
                [torch.cat([cis[i, : xlens[i]], ctx.cis[i, : ctx.lens[i]]]) for i in range(bsz)]
            )
        lengths = [xlens[i] + ctx.lens[i] for i in range(bsz)]
        (u,) = self.block_sequence(adaln, ucis, umask, lengths).run((u,))
        out = self.all_final_layer[key](u, adaln)
        return [self._unpatchify(out[i], grids[i], patch_size, f_patch_size) for i in range(bsz)]

    def block_sequence(self, adaln=None, ucis=None, umask=None, lengths=None) -> BlockSequence:
        """The main ``layers`` as one
        :class:`~sglang.multimodal_gen.layers.block_sequence.BlockSequence` on the unified stream
        ``[B, S, dim]`` (the refiners stay outside, as diffusers' caches leave them). Row
        arguments: ``adaln [B, dim]``, RoPE ``ucis [B, S, head_dim / 2]`` complex64, key mask
        ``umask [B, S]`` bool or ``None``; ``lengths``: each row's unified tokens (``None`` under
        sequence parallelism, where a rank holds chunks of both token kinds). TeaCache's modulated
        input: layer 0's ``attention_norm1(x) * (1 + scale_msa)`` (no published Z-Image rescaling:
        identity, threshold 0.15). Without arguments: the declaration alone (its block count), not
        runnable."""
        first = self.layers[0]

        def modulated(s, a):
            scale = first.adaLN_modulation[0](a["adaln"])[0].unsqueeze(1).chunk(4, dim=2)[0]
            return first.attention_norm1(s[0]) * (1.0 + scale)

        return BlockSequence(
            owner=self,
            stages=(
                BlockStage(
                    self.layers,
                    lambda blk, s, a: (blk(s[0], a["cis"], a["mask"], a["adaln"]),),
                ),
            ),
            row_args={"adaln": adaln, "cis": ucis, "mask": umask},
            lengths=lengths,
            modulated_input=ModulatedInput(modulated),
        )

    def _layers_sequence_parallel(self, h, cis, mask, ctx: CaptionContext, adaln, key):
        """Noise refiner, main layers and final layer with the tokens sharded over the SP group.

        Each rank keeps its chunk of the image tokens and of the (already refined, replicated)
        caption tokens; its unified sequence is ``[image chunk, caption chunk]``, which attention
        treats as the same key set as the reference's per-item ``[image, caption]`` packing
        (padding of either stream is masked). Returns the gathered ``[B, X, out]`` image tokens.
        """
        xs = SeqSplit.of(h.shape[1])
        cs = SeqSplit.of(ctx.tokens.shape[1])
        h, cis = xs.local(h), xs.local(cis)
        mask = None if mask is None else xs.local(mask)
        with sequence_split(xs):
            for block in self.noise_refiner:
                h = block(h, cis, mask, adaln)
        cmask = None
        if any(n != ctx.tokens.shape[1] for n in ctx.lens):
            pos = torch.arange(ctx.tokens.shape[1], device=h.device)
            cmask = cs.local(pos[None] < torch.tensor(ctx.lens, device=h.device)[:, None])
        u = torch.cat([h, cs.local(ctx.tokens)], 1)
        ucis = torch.cat([cis, cs.local(ctx.cis)], 1)
        umask = None
        if mask is not None or cmask is not None:
            ones = torch.ones(h.shape[0], 1, dtype=torch.bool, device=h.device)
            umask = torch.cat(
                [
                    ones.expand(-1, h.shape[1]) if mask is None else mask,
                    ones.expand(-1, u.shape[1] - h.shape[1]) if cmask is None else cmask,
                ],
                1,
            )
        with sequence_split(xs + cs):
            (u,) = self.block_sequence(adaln, ucis, umask, None).run((u,))
        out = self.all_final_layer[key](u[:, : h.shape[1]], adaln)
        return xs.gather(out)
