"""The key grammar of LoRA files: which keys are a LoRA pair's ``A`` / ``B`` / bias / alpha / LoKr
factor / bias delta, which are skipped (text encoders, another pipeline component) and which are
refused (DoRA, LoHa, OFT, ...), and which module of the model each names.

:func:`parse_keys` groups a state dict's keys into one :class:`KeyPair` per module;
``lora/formats.py`` turns those into our canonical form (the table of accepted spellings is in
its docstring).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec
from sglang.multimodal_gen.models.name_map import ShardGroup, ShardId
from sglang.multimodal_gen.models.registry import list_families

__all__ = [
    "KeyPair",
    "architecture_signatures",
    "best_architecture",
    "check_key_names",
    "guess_architecture",
    "parse_keys",
    "unsupported_error",
]

_TEXT_ENCODER_PREFIXES = (
    "lora_te",  # lora_te_, lora_te1_, lora_te2_, lora_te3_ (kohya)
    "text_encoder.",
    "text_encoder_2.",
    "text_encoder_3.",
    "text_encoders.",
    "te.",
    "te1.",
    "te2.",
    "cond_stage_model.",
    "conditioner.",
    "bundle_emb.",  # OneTrainer: textual-inversion vectors bundled for the text encoders
)

# (regex on the key, feature name) -- checked before the LoRA grammar
_UNSUPPORTED_KEYS = (
    (re.compile(r"\.dora_scale$"), "DoRA (dora_scale)"),
    (re.compile(r"\.lora_magnitude_vector(\.|$)"), "DoRA (lora_magnitude_vector)"),
    (re.compile(r"\.lokr_t[12]$"), "LoKr with a Tucker core (lokr_t1/lokr_t2)"),
    (re.compile(r"\.hada_(w1|w2|t1|t2)(_a|_b)?$"), "LoHa (LyCORIS Hadamard product)"),
    (re.compile(r"\.lora_embedding_[AB](\.|$)"), "embedding LoRA (lora_embedding_A/B)"),
    (re.compile(r"\.modules_to_save(\.|$)"), "modules_to_save (full trained module copies)"),
    (re.compile(r"\.diff$"), "full weight difference (diff)"),
    (re.compile(r"\.lora_mid\.weight$"), "LoCon/Tucker mid weight (lora_mid)"),
    (re.compile(r"\.(oft_\w+|boft_\w+|oft_blocks|oft_diag)$"), "OFT/BOFT"),
    (re.compile(r"\.ia3_l(\.|$)"), "IA3"),
)

_PEFT_RE = re.compile(r"^(?P<m>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[^.]+))?\.(?P<p>weight|bias)$")
_KOHYA_RE = re.compile(r"^(?P<m>.+)\.lora_(?P<ab>down|up)\.(?P<p>weight)$")
_KOHYA_DOT_RE = re.compile(r"^(?P<m>.+)\.lora\.(?P<ab>down|up)\.(?P<p>weight)$")
# LoRALinearLayer-style processors (XLabs ``processor.qkv_lora1.down.weight``)
_PROCESSOR_RE = re.compile(r"^(?P<m>.+_lora\d*)\.(?P<ab>down|up)\.(?P<p>weight)$")
# ``<m>.alpha``, and the per-weight spellings ``<m>.lora_A.weight.alpha`` / ``.lora_down.weight...``
_ALPHA_RE = re.compile(r"^(?P<m>.+?)(?:\.lora_(?:A|down)(?:\.[^.]+)?\.weight)?\.alpha$")
_DIFF_B_RE = re.compile(r"^(?P<m>.+)\.diff_b$")
_LOKR_RE = re.compile(r"^(?P<m>.+)\.lokr_(?P<part>w1|w2|w1_a|w1_b|w2_a|w2_b)$")

# ``transformer.`` / ``transformer_2.``: pipeline components of (two-expert) DiT pipelines; keys of
# a component other than the one being converted are skipped and counted like text-encoder keys.
_COMPONENT_RE = re.compile(r"^(transformer(?:_\d+)?)\.")

# ``lora_unet__`` (two underscores): VideoX-Fun's LoRANetwork names modules ``lora_unet`` + "." +
# the (empty) name of the transformer root + "." + the module, flattened (videox_fun/utils/
# lora_utils.py); longest first, so the extra underscore is never taken for part of the name.
_FLAT_PREFIXES = ("lora_unet__", "lora_unet_", "lora_transformer_", "lycoris_")
_ROLE = {"A": "A", "down": "A", "B": "B", "up": "B"}

# Architectures we do not serve, for "the keys seem to target X" (the families we serve declare
# their own patterns: ModelFamily.lora_signature). (name, regexes searched in each key)
_OTHER_ARCH_SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Stable Diffusion 3", (r"joint_blocks[._]\d+|context_block",)),
    (
        "Stable Diffusion UNet (SD 1.x/2.x/XL)",
        (r"(down_blocks|up_blocks|mid_block|input_blocks|output_blocks|middle_block)",),
    ),
)


def architecture_signatures() -> list[tuple[str, tuple[str, ...]]]:
    """``(name, regexes)`` of every architecture :func:`guess_architecture` knows: the served
    families' ``lora_signature`` (from the registry, named by their ``lora_architecture`` or
    ``display_name``), then the non-served architectures of this module."""
    served = [
        (fam.lora_architecture or fam.display_name, tuple(fam.lora_signature))
        for fam in list_families()
        if fam.lora_signature
    ]
    return served + list(_OTHER_ARCH_SIGNATURES)


def best_architecture(
    keys: Iterable[str], signatures: Iterable[tuple[str, Iterable[str | re.Pattern]]]
) -> str | None:
    """The architecture of ``signatures`` whose regexes match the most ``keys``, or None.

    Every architecture counts the keys that at least one of its regexes matches (``re.search``;
    a key may count for several architectures). The rule, independent of the order of
    ``signatures`` (so of the order families are registered in):

    1. the most matching keys wins;
    2. on a tie, the more specific signature: the one that matched the longest piece of a key
       (``double_blocks.0.img_attn_qkv`` is more specific than ``double_blocks.0``);
    3. then the name that sorts first.

    Args:
        keys: the LoRA file's keys.
        signatures: ``(name, regexes)`` pairs (strings or compiled patterns); a name given twice
            counts once per key.
    """
    compiled = [(name, [re.compile(p) for p in pats]) for name, pats in signatures]
    votes: Counter[str] = Counter()
    longest: dict[str, int] = {}  # name -> longest matched piece of a key
    for k in keys:
        matched: dict[str, int] = {}
        for name, pats in compiled:
            for p in pats:
                if (m := p.search(k)) is not None:
                    matched[name] = max(matched.get(name, 0), m.end() - m.start())
        for name, span in matched.items():
            votes[name] += 1
            longest[name] = max(longest.get(name, 0), span)
    if not votes:
        return None
    return min(votes, key=lambda name: (-votes[name], -longest[name], name))


def guess_architecture(keys: Iterable[str]) -> str | None:
    """Best guess of the model a list of LoRA keys was trained for (:func:`best_architecture`
    over :func:`architecture_signatures`), or None when no signature matches."""
    return best_architecture(keys, architecture_signatures())


@dataclass
class KeyPair:
    """The pieces of one LoRA pair as found in the file."""

    file_module: str  # dotted, wrapper prefixes removed
    style: str
    target: tuple[str, ShardId | ShardGroup] | None
    A: torch.Tensor | None = None
    B: torch.Tensor | None = None
    B_bias: torch.Tensor | None = None
    diff_b: torch.Tensor | None = None  # bias delta added at the user's strength (no alpha)
    alpha: torch.Tensor | None = None
    lokr: dict[str, torch.Tensor] = field(default_factory=dict)  # "w1", "w2_a", ... -> tensor
    keys: dict[str, str] = field(default_factory=dict)  # role -> key

    @property
    def has_weights(self) -> bool:
        return (
            self.A is not None or self.B is not None or bool(self.lokr) or self.diff_b is not None
        )


def _strip_prefixes(name: str, spec: LoRAModelSpec, component: str) -> tuple[str, list[str]]:
    """Remove wrapper prefixes (``base_model.model.``, ``transformer.``, ``diffusion_model.``, ...)."""
    prefixes = ["base_model.model.", f"{component}.", "model.diffusion_model.", "diffusion_model."]
    if spec.name_map is not None:
        prefixes += list(spec.name_map.strip_prefixes)
    seen: list[str] = []
    changed = True
    while changed:
        changed = False
        if name in spec.vocabulary:  # a real module name that happens to start like a prefix
            break
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p) :]
                seen.append(p)
                changed = True
                break
    return name, seen


def _style(prefixes: list[str], weight_style: str, flat: bool) -> str:
    if flat:
        return "kohya"
    if "diffusion_model." in prefixes or "model.diffusion_model." in prefixes:
        return "comfyui"
    if "base_model.model." in prefixes:
        return "peft"
    return "diffusers" if weight_style == "peft" else "kohya-dotted"


def _resolve_module(
    raw_module: str, spec: LoRAModelSpec, component: str, weight_style: str
) -> tuple[str, str, tuple[str, ShardId] | None]:
    """``(dotted_file_module, style, target_or_None)`` for the module part of a key."""
    name, prefixes = _strip_prefixes(raw_module, spec, component)
    for p in _FLAT_PREFIXES:
        if name.startswith(p):
            flat = name[len(p) :].replace(".", "_")
            dotted = spec.flat_vocabulary.get(flat)
            style = "lokr" if weight_style == "lokr" else "kohya"
            if dotted is None:
                return flat, style, None
            return dotted, style, spec.vocabulary[dotted]
    target = spec.lookup(name)
    if target is None and "_" in name:
        # a flattened name without the lora_unet_ prefix
        dotted = spec.flat_vocabulary.get(name.replace(".", "_"))
        if dotted is not None:
            return dotted, "kohya", spec.vocabulary[dotted]
    if weight_style in ("lokr", "xlabs"):
        return name, weight_style, target
    return name, _style(prefixes, weight_style, False), target


def _skipped(key: str, component: str) -> bool:
    """Whether ``key`` belongs to a text encoder, or to a pipeline component other than
    ``component`` (``transformer_2.`` while converting ``transformer``): skipped and reported."""
    bare = key[len("base_model.model.") :] if key.startswith("base_model.model.") else key
    if bare.startswith(_TEXT_ENCODER_PREFIXES):
        return True
    m = _COMPONENT_RE.match(bare)
    return m is not None and m.group(1) != component


def _key_role(key: str, keys: Iterable[str]) -> tuple[str, re.Match, str]:
    """``(role, match, weight style)`` of a key from its name alone: ``A``/``B``/``B_bias``,
    ``alpha``, ``diff_b`` or ``lokr_<part>``; the match's ``m`` group is the module part.

    Raises:
        LoRAFormatError: an unsupported feature (listing ``keys`` that use it) or an unrecognized
            key.
    """
    for pat, feature in _UNSUPPORTED_KEYS:
        if pat.search(key):
            raise unsupported_error(feature, pat, key, keys)
    m = _PEFT_RE.match(key)
    weight_style = "peft"
    if m is None:
        m = _KOHYA_RE.match(key) or _KOHYA_DOT_RE.match(key)
        weight_style = "kohya"
    if m is None and (m := _PROCESSOR_RE.match(key)) is not None:
        weight_style = "xlabs"
    if m is not None:
        role = _ROLE[m.group("ab")]
        if m.group("p") == "bias":
            if role != "B":
                raise LoRAFormatError(f"unsupported LoRA key {key!r}: a bias on lora_A")
            role = "B_bias"
        return role, m, weight_style
    if (m := _LOKR_RE.match(key)) is not None:
        return "lokr_" + m.group("part"), m, "lokr"
    if (m := _DIFF_B_RE.match(key)) is not None:
        return "diff_b", m, "kohya"
    if (m := _ALPHA_RE.match(key)) is not None:
        return "alpha", m, weight_style
    raise LoRAFormatError(
        f"unrecognized LoRA key {key!r}: expected lora_A/lora_B, lora_down/lora_up, lokr_* or "
        ".alpha entries"
    )


def check_key_names(keys: Iterable[str]) -> None:
    """Refuse, from the names alone, what :func:`parse_keys` would refuse whatever the model:
    an unsupported feature (DoRA, LoHa, ...) or an unrecognized key. Keys of a text encoder or of
    another pipeline component than ``transformer`` are left to the conversion, which skips and
    reports them. The loader runs it on the header's names before any tensor is read, so such a
    file costs no read.

    Raises:
        LoRAFormatError: naming the first offending key (as :func:`parse_keys` does).
    """
    keys = list(keys)
    for key in keys:
        if not _skipped(key, "transformer"):
            _key_role(key, keys)


def parse_keys(
    state_dict: Mapping[str, torch.Tensor], spec: LoRAModelSpec, component: str
) -> tuple[dict[str, KeyPair], list[str], list[str]]:
    """Group keys into pairs. Returns ``(pairs by file module, ignored keys, adapter names)``."""
    pairs: dict[str, KeyPair] = {}
    ignored: list[str] = []
    adapters: set[str] = set()
    for key, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise LoRAFormatError(f"LoRA key {key!r} is not a tensor ({type(tensor).__name__})")
        if _skipped(key, component):
            ignored.append(key)  # a text encoder's, or the other expert's of a two-expert model
            continue
        role, m, weight_style = _key_role(key, state_dict)
        if m.groupdict().get("adapter"):
            adapters.add(m.group("adapter"))
        file_module, style, target = _resolve_module(m.group("m"), spec, component, weight_style)
        pair = pairs.get(file_module)
        if pair is None:
            pair = pairs[file_module] = KeyPair(file_module, style, target)
        if role in pair.keys:
            raise LoRAFormatError(
                f"module {file_module!r} has two {role} entries: {pair.keys[role]!r} and {key!r} "
                "(the same module in two namings)"
            )
        if role in ("A", "B") or role.startswith("lokr_"):
            pair.style = style
        pair.keys[role] = key
        if role.startswith("lokr_"):
            pair.lokr[role[len("lokr_") :]] = tensor
        else:
            setattr(pair, role, tensor)
    if len(adapters) > 1:
        raise LoRAFormatError(
            f"the file holds several PEFT adapters ({sorted(adapters)}); save one adapter per file"
        )
    return pairs, ignored, sorted(adapters)


def unsupported_error(
    feature: str, pat: re.Pattern, key: str, state_dict: Iterable[str] | Mapping[str, Any]
) -> LoRAFormatError:
    """The refusal of a feature, listing the file's keys (``state_dict``: the keys, or a
    mapping of them) that use it (the first few)."""
    keys = [k for k in state_dict if pat.search(k)]
    shown = ", ".join(repr(k) for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
    return LoRAFormatError(
        f"unsupported LoRA feature: {feature}; first offending key {key!r} "
        f"({len(keys)} such key{'s' if len(keys) != 1 else ''}: {shown})"
    )
