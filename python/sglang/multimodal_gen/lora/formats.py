"""LoRA key formats -> one canonical form in our model's module names.

Accepted spellings of one LoRA pair on module ``<m>`` (``<m>`` a diffusers name such as
``layers.0.attention.to_q``, an original-checkpoint name such as ``layers.0.attention.qkv``, or our
fused name ``layers.0.attention.to_qkv``):

==========================  ======================================================================
diffusers / PEFT            ``transformer.<m>.lora_A.weight``, ``.lora_B.weight`` (+ ``.lora_B.bias``)
peft ``get_peft_model``     ``base_model.model.<m>.lora_A.weight`` (any wrapper prefix combination)
adapter-name infix          ``<m>.lora_A.<adapter>.weight`` (e.g. ``.default.``), one adapter per file
kohya / musubi              ``lora_unet_<m with . -> _>.lora_down.weight``, ``.lora_up.weight``,
                            ``.alpha`` (also ``lora_transformer_``, and VideoX-Fun's
                            ``lora_unet__``); names are un-flattened by looking the flattened name
                            up in the model's own flattened vocabulary
ComfyUI                     ``diffusion_model.<m>...`` with either weight naming
dotted kohya                ``<m>.lora.down.weight`` / ``<m>.lora.up.weight``
LoRA processors (XLabs)     ``<m>.down.weight`` / ``<m>.up.weight`` where the module's last name
                            ends in ``_lora`` or ``_lora<digits>`` (``processor.qkv_lora1``); the
                            model's name map says what such a module is; no alpha (scale 1)
alpha spellings             ``<m>.alpha``, also ``<m>.lora_A.weight.alpha`` / ``.lora_down...``
bias delta                  ``<m>.diff_b`` ``[out]``: added to the bias at the user's strength
                            (no alpha, as ComfyUI applies it); alone or with a LoRA pair
LyCORIS LoKr                ``<m>.lokr_w1`` (or ``_w1_a``/``_w1_b``), ``.lokr_w2`` (or
                            ``_w2_a``/``_w2_b``), ``.alpha``: converted to an exact low-rank
                            (A, B) of ``kron(W1, W2)`` when one exists (see ``lora/lokr.py``);
                            flattened names may carry ``lycoris_`` instead of ``lora_unet_``
==========================  ======================================================================

Files may mix these per module (each module keeps its own alpha). Text-encoder keys (``lora_te*``,
``text_encoder*.``, OneTrainer's ``bundle_emb.``, ...) and keys of another pipeline component
(``transformer_2.`` while converting ``transformer``) are skipped and reported in ``ignored_keys``.

Every alpha must satisfy ``0 < alpha <= 1024 r`` (``lora.limits.check_alpha``); a pair whose rank
exceeds ``min(in, out)`` of its target shard is stored exactly at that rank (``_at_most_full_rank``).

Where the model's name map says a file name stores its output rows in another order
(``NameRule.row_order``, e.g. BFL's ``final_layer.adaLN_modulation.1``), ``B``, ``lora_B.bias``
and ``diff_b`` are reordered (never ``A``); a name whose shard is a tuple (XLabs' single-block
``qkv_lora``) fills those shards of the fused layer.

Refused with :class:`~sglang.multimodal_gen.errors.LoRAFormatError` naming the feature and the
offending keys: DoRA (``dora_scale``, ``lora_magnitude_vector``), LoKr with a Tucker core
(``lokr_t1/t2``) or with full-rank factors, LoHa (``hada_*``), embedding LoRA
(``lora_embedding_*``), ``modules_to_save`` copies, full weight diffs (``.diff``), LoCon mid
weights, OFT/BOFT/IA3, conv (4-D) LoRA, unknown keys. Also refused: keys that match none of the
model's modules (with a guess of the architecture they target), modules of the file missing from
the model (with the guess too: a related architecture's file shares some module names), duplicate
or overlapping pairs, rank/shape mismatches and non-finite values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.layers.lora.weights import LoRAWeights, all_finite
from sglang.multimodal_gen.lora.key_grammar import KeyPair, guess_architecture, parse_keys
from sglang.multimodal_gen.lora.limits import MAX_ALPHA_PER_RANK, check_alpha
from sglang.multimodal_gen.lora.lokr import lokr_to_lora
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec
from sglang.multimodal_gen.lora.peft_config import (
    AdapterConfig,
    PatternBudget,
    config_from_sources,
    lora_scale,
)
from sglang.multimodal_gen.models.name_map import NameMap, ShardId

__all__ = ["CanonicalLoRA", "convert_to_canonical", "guess_architecture"]

logger = logging.getLogger(__name__)


@dataclass
class CanonicalLoRA:
    """A LoRA file converted to our module names, ready for ``BaseLayerWithLoRA.add_adapter``.

    Attributes:
        modules: ``{our_module_name: {shard_id: LoRAWeights}}``; every tensor is full (unsharded),
            ``lora_A [r, in]``, ``lora_B [out_of_shard, r]``, in the file's dtype; ``scale`` is
            ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), strength not included.
        matched_modules: number of LoRA pairs in the file that were matched (a fused ``qkv`` pair
            counts once even though it fills three shards).
        ignored_keys: keys deliberately skipped (text-encoder keys, keys of another pipeline
            component, orphan ``.alpha`` entries).
        source_format: the naming styles found, ``"+"``-joined (``"diffusers"``, ``"peft"``,
            ``"kohya"``, ``"comfyui"``, ...).
        target_guess: the model the keys appear to target (our model's name when they matched).
        file_modules: ``{file_module_name: (our_module_name, shard_id)}`` for reporting.
    """

    modules: dict[str, dict[ShardId, LoRAWeights]]
    matched_modules: int
    ignored_keys: list[str]
    source_format: str
    target_guess: str | None = None
    file_modules: dict[str, tuple[str, ShardId]] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """JSON-able report: matched modules, target layers, ignored key count, format."""
        return {
            "matched_modules": self.matched_modules,
            "target_layers": len(self.modules),
            "ignored_keys": len(self.ignored_keys),
            "source_format": self.source_format,
        }

    def nbytes(self) -> int:
        """Bytes held by all tensors (shared tensors counted once)."""
        seen: dict[int, int] = {}
        for shards in self.modules.values():
            for w in shards.values():
                for t in (w.lora_A, w.lora_B, w.offset):
                    if t is not None:
                        seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())


def _check_finite(t: torch.Tensor, what: str) -> None:
    if not all_finite(t):
        raise LoRAFormatError(f"{what} contains NaN or Inf values")


def _check_dtypes(p: KeyPair, label: str) -> None:
    """Weights (A, B, their biases, LoKr factors) must be floating point; an ``alpha`` a real
    number (an integer alpha, as some extraction scripts store the rank, is fine)."""
    weights = [("lora_A", p.A), ("lora_B", p.B), ("lora_B.bias", p.B_bias), ("diff_b", p.diff_b)]
    weights += [(f"lokr_{part}", t) for part, t in p.lokr.items()]
    for what, t in weights:
        if t is not None and not t.is_floating_point():
            raise LoRAFormatError(
                f"module {label}: {what} has dtype {str(t.dtype).removeprefix('torch.')}; LoRA "
                "weights must be floating point (F32, F16, BF16, F64, or F8_E4M3/F8_E5M2)"
            )
    if p.alpha is not None and (p.alpha.dtype == torch.bool or p.alpha.is_complex()):
        raise LoRAFormatError(
            f"module {label}: alpha has dtype {str(p.alpha.dtype).removeprefix('torch.')}; it "
            "must be a real number"
        )


def _pair_scale(pair: KeyPair, r: int, cfg: AdapterConfig) -> float:
    """scale for one pair: ``.alpha`` tensor, else config (with patterns), else alpha = r."""
    cfg_r, cfg_alpha = cfg.resolve(pair.file_module)
    if cfg_r is not None and pair.alpha is None and cfg_r != r:
        raise LoRAFormatError(
            f"module {pair.file_module!r}: the adapter config says r={cfg_r} "
            f"({', '.join(cfg.sources)}) but the tensors have rank {r}"
        )
    if pair.alpha is not None:
        if pair.alpha.numel() != 1:
            raise LoRAFormatError(
                f"module {pair.file_module!r}: alpha must be a scalar, got shape "
                f"{tuple(pair.alpha.shape)} ({pair.keys['alpha']!r})"
            )
        # an integer alpha is read exactly (2**62 stays 2**62), a float one as float64
        value = pair.alpha.reshape(()).item()
        alpha = float(value)
        if not math.isfinite(alpha):
            raise LoRAFormatError(f"module {pair.file_module!r}: alpha is NaN or Inf")
        check_alpha(alpha, r, f"module {pair.file_module!r} (key {pair.keys['alpha']!r})")
    elif cfg_alpha is not None:
        alpha = cfg_alpha
        check_alpha(alpha, r, f"module {pair.file_module!r} ({cfg.alpha_origin(pair.file_module)})")
    else:
        alpha = float(r)
    return lora_scale(alpha, r, cfg.use_rslora)


def _no_match_error(
    pairs: dict[str, KeyPair], state_dict: Mapping[str, torch.Tensor], spec: LoRAModelSpec
) -> LoRAFormatError:
    guess = guess_architecture(state_dict.keys())
    examples = ", ".join(
        repr(p.keys.get("A") or next(iter(p.keys.values()))) for p in list(pairs.values())[:3]
    )
    seems = f"the keys seem to target {guess}" if guess else "the keys match no known architecture"
    return LoRAFormatError(
        f"LoRA matched 0 of {len(pairs)} modules of {spec.model_name}: {seems} (e.g. {examples})"
    )


def _label(p: KeyPair) -> str:
    our, sid = p.target
    return f"{p.file_module!r} (-> {our}" + (f" shard {sid!r})" if sid is not None else ")")


def _pair_weights(
    p: KeyPair, cfg: AdapterConfig
) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
    """Validated ``(A [r, in], B [out, r], scale)`` of one file module (LoKr converted first);
    ``(None, None, 1.0)`` for a module with a bias delta (``diff_b``) only."""
    label = _label(p)
    _check_dtypes(p, label)
    a, b = p.A, p.B
    if p.diff_b is not None:
        _check_finite(p.diff_b, f"module {label} diff_b")
        if a is None and b is None and not p.lokr and p.B_bias is None:
            return None, None, 1.0
    if p.lokr:
        if a is not None or b is not None or p.B_bias is not None:
            raise LoRAFormatError(f"module {label}: both LoRA and LoKr weights in one module")
        for part, t in p.lokr.items():
            _check_finite(t, f"module {label} lokr_{part}")
        if p.alpha is not None:
            _check_finite(p.alpha, f"module {label} alpha")
        a, b, lokr_scale = lokr_to_lora(p.lokr, p.alpha, p.file_module)
        if p.alpha is not None and not 0 < lokr_scale <= MAX_ALPHA_PER_RANK:
            raise LoRAFormatError(
                f"module {label} (key {p.keys['alpha']!r}): LoKr alpha / rank = {lokr_scale:g} "
                f"is out of range; LoRA alpha must satisfy 0 < alpha <= {MAX_ALPHA_PER_RANK} x "
                "rank",
                param="lora_path",
            )
    if a is None or b is None:
        have = p.keys.get("A") or p.keys.get("B")
        missing = "lora_A/lora_down" if a is None else "lora_B/lora_up"
        raise LoRAFormatError(f"module {label}: {missing} is missing (found {have!r})")
    if not cfg.targets(p.file_module):
        raise LoRAFormatError(
            f"module {p.file_module!r} has LoRA weights but the adapter config's "
            f"target_modules ({cfg.target_modules!r}) does not include it"
        )
    if a.dim() != 2 or b.dim() != 2:
        raise LoRAFormatError(
            f"module {label}: only linear LoRA is supported, got A {tuple(a.shape)} and "
            f"B {tuple(b.shape)} (conv LoRA?)"
        )
    r = a.shape[0]
    if r == 0 or b.shape[1] != r:
        raise LoRAFormatError(
            f"module {label}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
            "share a rank"
        )
    for t, what in ((a, "lora_A"), (b, "lora_B"), (p.B_bias, "lora_B.bias")):
        if t is not None:
            _check_finite(t, f"module {label} {what}")
    scale = lokr_scale if p.lokr else _pair_scale(p, r, cfg)
    return a, b, scale


def _reorder_rows(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t``'s rows cut in ``len(order)`` equal chunks; result chunk ``i`` = chunk ``order[i]``."""
    chunks = t.chunk(len(order), dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


def _at_most_full_rank(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [r, in], B [out, r])`` as stored: unchanged when ``r <= min(in, out)``; else the same
    product ``B @ A`` written exactly at rank ``min(in, out)`` (``(I_in, B @ A)`` or
    ``(B @ A, I_out)``, float32 or wider). A rank above the layer's width adds nothing a rank of
    ``min(in, out)`` cannot express, and would widen the layer's slot columns for every adapter
    (SimpleTuner's ``all+ffs+embedder`` puts its rank on Flux's 64-input ``x_embedder``)."""
    r, out, fan_in = a.shape[0], b.shape[0], a.shape[1]
    if r <= min(out, fan_in) or r == 0:
        return a, b
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    d = b.to(dtype) @ a.to(dtype)
    if fan_in <= out:
        return torch.eye(fan_in, dtype=dtype), d
    return d, torch.eye(out, dtype=dtype)


def _place(
    p: KeyPair,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    scale: float,
    spec: LoRAModelSpec,
    modules: dict[str, dict[ShardId, LoRAWeights]],
    covered: dict[tuple[str, ShardId], str],
) -> None:
    """Check one pair against its target's shapes and store it per shard (fused B split by rows).

    ``a``/``b`` ``None``: a bias delta (``diff_b``) alone, stored as a rank-0 pair with an offset.
    """
    our, sid = p.target
    label = _label(p)
    shapes = spec.module_shapes[our]
    if sid is None:
        shard_ids = spec.shards(our)
    elif isinstance(sid, tuple):
        shard_ids = list(sid)
    else:
        shard_ids = [sid]
    for s in shard_ids:
        if s not in shapes:
            raise LoRAFormatError(f"module {label}: {our} has no shard {s!r}")
        prev = covered.get((our, s))
        if prev is not None:
            raise LoRAFormatError(
                f"{our} shard {s!r} is targeted twice in the file: by {prev!r} and "
                f"{p.file_module!r}"
            )
        covered[(our, s)] = p.file_module
    out_sizes = [shapes[s][0] for s in shard_ids]
    in_size = shapes[shard_ids[0]][1]
    rows = sum(out_sizes)
    if a is None:  # diff_b only
        a = p.diff_b.new_zeros(0, in_size)
        b = p.diff_b.new_zeros(rows, 0)
    r = a.shape[0]
    expect_b = (rows, r)
    if a.shape[1] != in_size or tuple(b.shape) != expect_b:
        raise LoRAFormatError(
            f"module {label}: LoRA shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
            f"the layer; expected A ({r}, {in_size}), B {expect_b}"
        )
    for t, what in ((p.B_bias, "lora_B.bias"), (p.diff_b, "diff_b")):
        if t is not None and tuple(t.shape) != (rows,):
            raise LoRAFormatError(
                f"module {label}: {what} has shape {tuple(t.shape)}, expected ({rows},)"
            )
    # the bias delta: lora_B.bias is scaled with the delta (peft), diff_b at strength only
    offset, offset_scale = p.B_bias, None
    if p.diff_b is not None:
        offset, offset_scale = p.diff_b, 1.0
        if p.B_bias is not None:
            offset = p.B_bias.float() * scale + p.diff_b.float()
    order = spec.row_order(p.file_module)
    if order is not None:  # the file's output rows are in another order (B and biases, not A)
        if rows % len(order):
            raise LoRAFormatError(
                f"module {label}: {rows} output rows do not split into {len(order)} chunks"
            )
        b = _reorder_rows(b, order)
        offset = None if offset is None else _reorder_rows(offset, order)
    a = a.contiguous()
    row = 0
    for s, n in zip(shard_ids, out_sizes):
        off = offset[row : row + n].contiguous() if offset is not None else None
        a_s, b_s = _at_most_full_rank(a, b[row : row + n])
        modules.setdefault(our, {})[s] = LoRAWeights(
            lora_A=a_s,
            lora_B=b_s.contiguous(),
            scale=scale,
            offset=off,
            offset_scale=offset_scale,
        )
        row += n


def convert_to_canonical(
    state_dict: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any] | None,
    model_spec: LoRAModelSpec | set[str],
    name_map: NameMap | None = None,
    module_shapes: Mapping[str, Mapping[ShardId, tuple[int, int]]] | None = None,
    *,
    component: str = "transformer",
    pattern_budget: PatternBudget | None = None,
) -> CanonicalLoRA:
    """Convert a LoRA state dict of any supported format to :class:`CanonicalLoRA`.

    Args:
        state_dict: ``{key: tensor}`` as read from the file (2-D floating-point A/B, a scalar
            alpha that may also be an integer).
        metadata: the loader's metadata (``adapter_config``, ``lora_adapter_metadata``,
            ``safetensors_metadata``) or a raw safetensors header; ``None`` for none.
        model_spec: the target model (:class:`LoRAModelSpec`). For the older call form
            ``(state_dict, metadata, module_names, name_map, module_shapes)`` pass the set of names
            here and the two others after it.
        component: the pipeline component whose ``<component>.`` key prefix is stripped
            (``"transformer"``).
        pattern_budget: the time for the adapter config's regular expressions
            (:class:`~sglang.multimodal_gen.lora.peft_config.PatternBudget`; a fresh one when
            ``None``). Converting one file for several targets should share one.

    Returns:
        CanonicalLoRA with full tensors per (module, shard). A fused ``qkv`` pair (B of height
        ``q+k+v``) is split exactly into the target's shards (A shared); split ``to_q/k/v`` pairs
        land in shards ``q/k/v`` of our fused layer.

    Raises:
        LoRAFormatError: unsupported feature (names it and the first offending key); zero modules
            matched (says which model the keys seem to target); modules not in the model; A/B
            missing, rank mismatch, wrong ``in``/``out`` (names the module and both shapes);
            weights that are not floating point, an alpha that is not a real number (names the
            module and the dtype); NaN/Inf (names the module); conflicting config sources;
            duplicate pairs. Its
            subclass :class:`~sglang.multimodal_gen.errors.LoRAPatternTooExpensiveError`:
            the config's patterns need more than their time budget (names the field).
    """
    if not isinstance(model_spec, LoRAModelSpec):
        if module_shapes is None:
            raise TypeError("convert_to_canonical needs a LoRAModelSpec or module_shapes")
        names = set(model_spec)
        model_spec = LoRAModelSpec.from_shapes(
            {n: s for n, s in module_shapes.items() if n in names}, name_map
        )
    spec = model_spec
    cfg = config_from_sources(metadata, component, pattern_budget)
    pairs, ignored, _ = parse_keys(state_dict, spec, component)

    weighted = {k: p for k, p in pairs.items() if p.has_weights}
    for k, p in pairs.items():
        if k not in weighted:  # an orphan .alpha (or B bias) without weights
            ignored.extend(p.keys.values())
    if not weighted:
        if ignored:
            raise LoRAFormatError(
                f"LoRA matched 0 modules of {spec.model_name} ({component}): the file only has "
                f"{len(ignored)} ignored keys (text encoder, another component, orphan alpha; "
                f"e.g. {ignored[0]!r})"
            )
        raise LoRAFormatError("LoRA file holds no LoRA weights (0 modules matched)")

    unmatched = [p for p in weighted.values() if p.target is None]
    if len(unmatched) == len(weighted):
        raise _no_match_error(weighted, state_dict, spec)
    if unmatched:
        names = ", ".join(repr(p.file_module) for p in unmatched[:5])
        guess = guess_architecture(state_dict.keys())
        seems = f" (the keys seem to target {guess})" if guess else ""
        raise LoRAFormatError(
            f"{len(unmatched)} of {len(weighted)} LoRA modules do not exist in {spec.model_name} "
            f"(e.g. {names}); refusing a partial load{seems}"
        )

    modules: dict[str, dict[ShardId, LoRAWeights]] = {}
    covered: dict[tuple[str, ShardId], str] = {}
    for p in weighted.values():
        a, b, scale = _pair_weights(p, cfg)
        _place(p, a, b, scale, spec, modules, covered)

    if ignored:
        logger.info(
            "LoRA for %s: %d modules matched, %d keys ignored (text encoder / orphan alpha), "
            "e.g. %s",
            spec.model_name,
            len(weighted),
            len(ignored),
            ignored[0],
        )
    return CanonicalLoRA(
        modules=modules,
        matched_modules=len(weighted),
        ignored_keys=ignored,
        source_format="+".join(sorted({p.style for p in weighted.values()})),
        target_guess=spec.model_name,
        file_modules={p.file_module: p.target for p in weighted.values()},
    )
