"""LyCORIS LoKr as an exact low-rank (A, B) pair, when one exists.

A LoKr module stores two Kronecker factors, each either full or as a product of two matrices:
``W1 = lokr_w1`` or ``lokr_w1_a @ lokr_w1_b`` (``[a, b]``), ``W2 = lokr_w2`` or
``lokr_w2_a @ lokr_w2_b`` (``[c, d]``), and its delta is ``scale * kron(W1, W2)``
(``[a*c, b*d]`` = ``[out, in]``). Following LyCORIS (``lycoris/modules/lokr.py``) and diffusers'
``_bake_lokr_alpha_``, ``scale = alpha / rank`` when a factor is decomposed (``rank`` =
``lokr_w2_b.shape[0]``, else ``lokr_w1_b.shape[0]``) and ``1`` when both factors are full or
there is no ``alpha``.

No full ``[out, in]`` matrix is formed. With ``W1 = L1 @ R1`` and ``W2 = L2 @ R2`` (each factor
written as ``(W, I)``, ``(I, W)`` or its stored ``(x_a, x_b)``), the mixed-product property gives
``kron(W1, W2) = kron(L1, L2) @ kron(R1, R2)``, i.e. ``B = kron(L1, L2)``, ``A = kron(R1, R2)`` of
rank ``inner1 * inner2``. The split with the smallest rank is used; if even that is not below
``min(out, in)`` the module is refused (a full-rank LoKr has no low-rank form, and the LoRA layers
only apply (A, B) pairs).
"""

from __future__ import annotations

import torch

from sglang.multimodal_gen.errors import LoRAFormatError

__all__ = ["LOKR_PARTS", "lokr_to_lora"]

LOKR_PARTS = ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")


def _factor(parts: dict[str, torch.Tensor], n: str, module: str):
    """``(W, splits)``: the factor and its candidate ``(L, R)`` splits (fp32)."""
    full = parts.get(f"w{n}")
    fa, fb = parts.get(f"w{n}_a"), parts.get(f"w{n}_b")
    if full is not None and (fa is not None or fb is not None):
        raise LoRAFormatError(f"LoKr module {module!r}: both lokr_w{n} and lokr_w{n}_a/_b given")
    if full is None and (fa is None or fb is None):
        raise LoRAFormatError(f"LoKr module {module!r}: lokr_w{n} (or lokr_w{n}_a and _b) missing")
    for t in (full, fa, fb):
        if t is not None and t.dim() != 2:
            raise LoRAFormatError(
                f"LoKr module {module!r}: only linear LoKr is supported, got a factor of shape "
                f"{tuple(t.shape)}"
            )
    if full is None:
        if fa.shape[1] != fb.shape[0]:
            raise LoRAFormatError(
                f"LoKr module {module!r}: lokr_w{n}_a {tuple(fa.shape)} and lokr_w{n}_b "
                f"{tuple(fb.shape)} do not chain"
            )
        fa, fb = fa.float(), fb.float()
        w = fa @ fb
        splits = [(fa, fb)]
    else:
        w = full.float()
        splits = []
    rows, cols = w.shape
    splits += [(w, torch.eye(cols)), (torch.eye(rows), w)]
    return w, splits


def lokr_to_lora(
    parts: dict[str, torch.Tensor], alpha: torch.Tensor | None, module: str
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Convert one LoKr module to ``(A [k, in], B [out, k], scale)`` in float32.

    Args:
        parts: ``{"w1"|"w1_a"|"w1_b"|"w2"|"w2_a"|"w2_b": tensor}`` as found in the file.
        alpha: the module's ``.alpha`` tensor or ``None``.
        module: the module name, for error messages.

    Raises:
        LoRAFormatError: missing/inconsistent factors, non-2-D factors, or no split of rank below
            ``min(out, in)`` (full-rank LoKr).
    """
    w1, s1 = _factor(parts, "1", module)
    w2, s2 = _factor(parts, "2", module)
    out, inn = w1.shape[0] * w2.shape[0], w1.shape[1] * w2.shape[1]
    best = min(
        ((l1, r1, l2, r2) for l1, r1 in s1 for l2, r2 in s2),
        key=lambda f: f[0].shape[1] * f[2].shape[1],
    )
    l1, r1, l2, r2 = best
    rank = l1.shape[1] * l2.shape[1]
    if rank >= min(out, inn):
        raise LoRAFormatError(
            f"LoKr module {module!r}: kron(w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}) has no "
            f"low-rank form (smallest exact rank {rank} for a [{out}, {inn}] weight); full-rank "
            "LoKr is not supported"
        )
    b = torch.kron(l1, l2)
    a = torch.kron(r1, r2)
    scale = 1.0
    dec_rank = None
    if parts.get("w2_b") is not None:
        dec_rank = parts["w2_b"].shape[0]
    elif parts.get("w1_b") is not None:
        dec_rank = parts["w1_b"].shape[0]
    if dec_rank is not None and alpha is not None:
        if alpha.numel() != 1:
            raise LoRAFormatError(f"LoKr module {module!r}: alpha must be a scalar")
        scale = float(alpha.float().item()) / dec_rank
    return a.contiguous(), b.contiguous(), scale
