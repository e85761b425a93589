"""PEFT adapter-config semantics: where ``r``/``lora_alpha`` come from and how they apply per module.

A LoRA file's scale ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA) can be described in three
places, all of which this module reads into one :class:`AdapterConfig`:

- ``adapter_config.json`` next to a peft ``adapter_model.safetensors`` (peft's ``LoraConfig``);
- the ``lora_adapter_metadata`` entry of the safetensors header, a JSON ``LoraConfig`` dict written
  by diffusers (``save_lora_adapter`` writes it bare, a pipeline's ``save_lora_weights`` prefixes every
  field with the component name, e.g. ``transformer.lora_alpha``);
- plain safetensors header entries (``r``, ``lora_alpha``, ... as strings; kohya's ``ss_network_*``
  training notes are ignored, as kohya's own loader ignores them).

When two sources give different values for the same field the file is refused (a
:class:`~sglang.multimodal_gen.errors.LoRAFormatError` naming the field and both values). So is a
field of the wrong kind, in our words and naming the source: ``r`` that is not a positive integer,
``lora_alpha`` (or an ``alpha_pattern`` value) that is not a finite number within float32 range,
a ``rank_pattern`` / ``alpha_pattern`` key or a ``target_modules`` string that is not a valid
regular expression.

Per-module resolution follows peft 0.21 (``LoraModel._create_and_replace`` with
``peft.utils.other.get_pattern_key``): each key of ``rank_pattern`` / ``alpha_pattern`` is a regular
expression that must match the END of the module's dotted name on a segment boundary
(``re.match(r"(.*\\.)?(KEY)$", name)``); the first key in the pattern's order that matches wins; rank
and alpha are looked up independently; a module no key matches uses ``r`` / ``lora_alpha``. Pattern
keys refer to the module names as the file names them (``attention.to_q``, not our fused
``attention.to_qkv``), so resolution happens before any renaming or fusing.

The patterns come from the file, so matching them is bounded in time (see
:mod:`~sglang.multimodal_gen.lora.patterns`: one budget per adapter config, ``re``'s meaning).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.patterns import (
    MAX_PATTERN_CHARS,
    MAX_PATTERN_UNITS,
    PATTERN_BUDGET_S,
    PatternBudget,
    PatternMatcher,
    short_pattern,
)

__all__ = [
    "FP32_MAX",
    "MAX_CONFIG_DEPTH",
    "MAX_PATTERN_CHARS",
    "MAX_PATTERN_UNITS",
    "PATTERN_BUDGET_S",
    "AdapterConfig",
    "PatternBudget",
    "check_config_depth",
    "config_from_sources",
    "get_pattern_key",
    "lora_scale",
]

# Fields of peft's LoraConfig whose non-default value changes what the adapter computes in a way
# the LoRA layers do not implement. Each maps to a predicate "is this value the harmless default".
_UNSUPPORTED_FIELDS: dict[str, str] = {
    "use_dora": "DoRA (use_dora=true): weight-decomposed LoRA needs a per-column magnitude rescale",
    "modules_to_save": "modules_to_save: the adapter replaces whole modules with trained copies",
    "fan_in_fan_out": "fan_in_fan_out=true: weights stored transposed (Conv1D layout)",
    "layer_replication": "layer_replication: the adapter duplicates layers of the base model",
    "target_parameters": "target_parameters: LoRA on raw parameters instead of modules",
    "trainable_token_indices": "trainable_token_indices: trainable embedding rows",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens): token-dependent activation",
    "use_qalora": "QA-LoRA (use_qalora=true): pooled-input LoRA",
    "velora_config": "VeLoRA (velora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
}

_SUPPORTED_PEFT_TYPES = {None, "LORA"}

#: Largest finite float32: LoRA scales are applied in float32 (merge) or the weights' dtype.
FP32_MAX = 3.4028234663852886e38
#: Deepest nesting of objects and lists accepted in an adapter config (``adapter_config.json``,
#: ``lora_adapter_metadata``, a header entry). Real configs nest three levels; JSON nested near
#: the recursion limit would fail later (comparing, hashing) with a RecursionError.
MAX_CONFIG_DEPTH = 32


def check_config_depth(value: Any, what: str) -> None:
    """Refuse JSON nested deeper than :data:`MAX_CONFIG_DEPTH` (iteratively: no recursion).

    Raises:
        LoRAFormatError: naming ``what`` (``param="lora_path"``).
    """
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > MAX_CONFIG_DEPTH:
            raise LoRAFormatError(
                f"{what} is nested more than {MAX_CONFIG_DEPTH} levels deep; an adapter config "
                "nests a few",
                param="lora_path",
            )
        stack.extend((c, depth + 1) for c in children)


# Fields compared across sources and kept in AdapterConfig.
_KNOWN_FIELDS = (
    "r",
    "lora_alpha",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
    "exclude_modules",
    "layers_to_transform",
    "lora_bias",
    "peft_type",
)


def _is_default(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


@dataclass
class AdapterConfig:
    """The PEFT fields that decide each module's rank and scale.

    Attributes:
        r: the default rank (``None`` when no source says; the tensors' rank is then used).
        lora_alpha: the default alpha (``None`` when no source says; alpha then equals the rank).
        use_rslora: scale ``alpha / sqrt(r)`` instead of ``alpha / r`` (Kalajdzievski 2023).
        rank_pattern / alpha_pattern: ``{regex: value}``, resolved by :func:`get_pattern_key`.
        target_modules: peft's ``target_modules`` (``None``, a regex string, ``"all-linear"`` or a
            list of names / name suffixes).
        exclude_modules: peft's ``exclude_modules`` (same forms).
        layers_to_transform: when set, the target check is skipped (peft restricts by layer index).
        sources: which sources contributed, e.g. ``["adapter_config.json"]``.
        origins: the source of each field that has one, for messages
            (``{"target_modules": "adapter_config.json"}``).
        budget: the time left for the config's patterns (:class:`PatternBudget`); matching beyond
            it raises :class:`LoRAPatternTooExpensiveError`.
    """

    r: int | None = None
    lora_alpha: float | None = None
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules: str | list[str] | None = None
    exclude_modules: str | list[str] | None = None
    layers_to_transform: Any = None
    sources: list[str] = field(default_factory=list)
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    budget: PatternBudget = field(default_factory=PatternBudget, compare=False, repr=False)
    _matcher: PatternMatcher | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def matcher(self) -> PatternMatcher:
        if self._matcher is None or self._matcher.budget is not self.budget:
            self._matcher = PatternMatcher(self.budget)
        return self._matcher

    def _what(self, fld: str) -> str:
        return f"{self.origins.get(fld, 'adapter config')}: {fld}"

    @property
    def is_empty(self) -> bool:
        return not self.sources

    def resolve(self, module_name: str) -> tuple[int | None, float | None]:
        """``(r, alpha)`` for one module, by peft's rules (see module docstring).

        ``module_name`` is the file's own dotted module name without wrapper prefixes
        (``layers.0.attention.to_q``). Either value is ``None`` when no source defines it.
        """
        r = self.r
        if self.rank_pattern:
            key = _pattern_key(
                self.rank_pattern, module_name, self.matcher, self._what("rank_pattern") + " key"
            )
            if key is not None:
                r = int(self.rank_pattern[key])
        alpha = self.lora_alpha
        if self.alpha_pattern:
            key = _pattern_key(
                self.alpha_pattern, module_name, self.matcher, self._what("alpha_pattern") + " key"
            )
            if key is not None:
                alpha = float(self.alpha_pattern[key])
        return r, alpha

    def alpha_origin(self, module_name: str) -> str:
        """Where ``module_name``'s alpha comes from, for messages: ``"<source>: alpha_pattern
        ['<key>']"`` or ``"<source>: lora_alpha"``."""
        if self.alpha_pattern:
            key = _pattern_key(
                self.alpha_pattern, module_name, self.matcher, self._what("alpha_pattern") + " key"
            )
            if key is not None:
                return f"{self._what('alpha_pattern')}[{key!r}]"
        return self._what("lora_alpha")

    def targets(self, module_name: str) -> bool:
        """Whether peft would have put a LoRA on ``module_name`` (``True`` when it cannot tell).

        Raises:
            LoRAPatternTooExpensiveError: a string ``target_modules`` / ``exclude_modules``
                needs more than the config's time budget.
        """
        if _matches_module_list(
            self.exclude_modules, module_name, self.matcher, self._what("exclude_modules")
        ):
            return False
        tm = self.target_modules
        if tm is None or self.layers_to_transform not in (None, [], ""):
            return True
        if isinstance(tm, str) and tm == "all-linear":
            return True
        return _matches_module_list(tm, module_name, self.matcher, self._what("target_modules"))


def _matches_module_list(
    spec: str | list[str] | None, name: str, matcher: PatternMatcher, what: str
) -> bool:
    """peft's ``check_target_module_exists`` for one field: a string is a regular expression
    that must match the whole name (``re.fullmatch``); a list holds names and name suffixes."""
    if not spec:
        return False
    if isinstance(spec, str):
        return matcher.fullmatch(spec, name, what)
    return name in spec or any(name.endswith("." + t) for t in spec)


def _pattern_key(
    patterns: Iterable[str], module_name: str, matcher: PatternMatcher, what: str
) -> str | None:
    for key in patterns:
        if matcher.key_matches(key, module_name, what):
            return key
    return None


def get_pattern_key(
    patterns: Iterable[str], module_name: str, budget: PatternBudget | None = None
) -> str | None:
    """The first pattern key that matches the end of ``module_name`` on a dot boundary, else None.

    Same rule as peft's ``get_pattern_key``: ``re.match(rf"(.*\\.)?({key})$", module_name)``; keys are
    regular expressions (with ``re``'s meaning) and are tried in their given order. They are run
    with a time bound (see the module docstring): ``budget`` (a fresh :class:`PatternBudget` when
    ``None``) is spent by the calls.

    Raises:
        LoRAPatternTooExpensiveError: the keys need more than the budget.
    """
    return _pattern_key(
        patterns, module_name, PatternMatcher(budget or PatternBudget()), "pattern key"
    )


def lora_scale(alpha: float, r: int, use_rslora: bool = False) -> float:
    """``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA. ``r`` must be positive."""
    if r <= 0:
        raise LoRAFormatError(f"LoRA rank must be positive, got r={r}")
    return float(alpha) / (math.sqrt(r) if use_rslora else r)


# ---------------------------------------------------------------------------------------------
# Reading sources
# ---------------------------------------------------------------------------------------------


def _decode(value: Any, what: str = "safetensors metadata") -> Any:
    """Safetensors header values are strings; decode JSON where it parses.

    Raises:
        LoRAFormatError: JSON nested too deeply to parse (naming ``what``).
    """
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, TypeError):
            return value
        except RecursionError:
            raise LoRAFormatError(
                f"{what} is JSON nested too deeply",
                param="lora_path",
            ) from None
    return value


def _rank(value: Any, what: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoRAFormatError(f"{what} must be a positive integer, got {value!r}")
    return value


def _alpha(value: Any, what: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or abs(value) > FP32_MAX
    ):
        raise LoRAFormatError(
            f"{what} must be a finite number within float32 range (|alpha| <= 3.4e38), "
            f"got {value!r}"
        )
    return float(value)


def _check_regex(key: Any, what: str, budget: PatternBudget, *, wrap: bool = True) -> str:
    """A pattern of the config: a string, at most :data:`MAX_PATTERN_CHARS` long, that ``re``
    compiles as peft uses it (``wrap``: as a ``rank_pattern``/``alpha_pattern`` key, inside
    ``(.*\\.)?(KEY)$``; else whole, as ``target_modules``). The check is timed by ``budget``."""
    if not isinstance(key, str):
        raise LoRAFormatError(f"{what} {key!r} is not a string")
    if len(key) > MAX_PATTERN_CHARS:
        raise LoRAFormatError(
            f"{what} {short_pattern(key)} is {len(key)} characters long; patterns are at most "
            f"{MAX_PATTERN_CHARS}"
        )
    text = rf"(.*\.)?({key})$" if wrap else key

    def check(_left: float) -> None:
        try:
            re.compile(text)
        except (re.error, RecursionError, OverflowError) as e:
            raise LoRAFormatError(
                f"{what} {short_pattern(key)} is not a valid regular expression ({e})"
            ) from None

    budget.run(what, key, check)
    return key


def _normalize_field(
    name: str, value: Any, source: str = "adapter config", budget: PatternBudget | None = None
) -> Any:
    """One field of one source, checked and in a comparable form.

    Raises:
        LoRAFormatError: a value of the wrong kind, naming ``source`` and the field.
        LoRAPatternTooExpensiveError: checking the field's patterns exhausted ``budget``.
    """
    if value is None:
        return None
    budget = budget or PatternBudget()
    what = f"{source}: {name}"
    if name == "r":
        return _rank(value, what)
    if name == "lora_alpha":
        return _alpha(value, what)
    if name in ("use_rslora", "lora_bias"):
        if isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes")
        return bool(value)
    if name in ("target_modules", "exclude_modules"):
        if isinstance(value, str):
            if value == "all-linear" and name == "target_modules":
                return value
            return _check_regex(value, f"{what} (a regular expression)", budget, wrap=False)
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return sorted(value)
        raise LoRAFormatError(f"{what} must be a string or a list of strings, got {value!r}")
    if name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(value, Mapping):
            raise LoRAFormatError(f"{what} must be an object {{pattern: value}}, got {value!r}")
        check = _rank if name == "rank_pattern" else _alpha
        return {
            _check_regex(k, f"{what} key", budget): check(v, f"{what}[{k!r}]")
            for k, v in value.items()
        }
    return value


def _check_unsupported(source: str, cfg: Mapping[str, Any]) -> None:
    peft_type = cfg.get("peft_type")
    if isinstance(peft_type, str) and peft_type.upper() not in {"LORA"}:
        raise LoRAFormatError(
            f"{source}: peft_type={peft_type!r} is not supported; only plain LoRA adapters load "
            "(LoHa, LoKr, IA3, OFT, ... are refused rather than loaded as something else)"
        )
    for key, what in _UNSUPPORTED_FIELDS.items():
        if key in cfg and not _is_default(cfg[key]):
            raise LoRAFormatError(f"{source}: unsupported LoRA feature {what} ({key}={cfg[key]!r})")


def _from_diffusers_metadata(raw: Mapping[str, Any], component: str) -> dict[str, Any]:
    """Unpack diffusers' ``lora_adapter_metadata``: bare (model-level) or ``component.`` prefixed."""
    prefixed = [k for k in raw if "." in k and k.split(".", 1)[1] in _KNOWN_FIELDS + ("use_dora",)]
    if not prefixed:
        return dict(raw)
    out = {}
    for k, v in raw.items():
        comp, _, fld = k.partition(".")
        if comp == component:
            out[fld] = v
    return out


def _from_safetensors_header(header: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in _KNOWN_FIELDS + tuple(_UNSUPPORTED_FIELDS):
        if k in header:
            out[k] = _decode(header[k], f"safetensors metadata: {k}")
            check_config_depth(out[k], f"safetensors metadata: {k}")
    # kohya's ss_network_dim / ss_network_alpha are training notes, not loading rules: sd-scripts
    # reads each module's own ``.alpha`` tensor (and alpha = rank without one), so they are ignored.
    return out


def config_from_sources(
    metadata: Mapping[str, Any] | None,
    component: str = "transformer",
    budget: PatternBudget | None = None,
) -> AdapterConfig:
    """Build one :class:`AdapterConfig` from the metadata returned by ``load_lora_state_dict``.

    Args:
        metadata: the loader's metadata dict. Reads ``adapter_config`` (dict, from
            ``adapter_config.json``), ``lora_adapter_metadata`` (dict, diffusers) and
            ``safetensors_metadata`` (the raw header ``{str: str}``). A plain header dict (no such keys)
            is accepted as ``safetensors_metadata``.
        component: the pipeline component whose prefixed diffusers metadata applies.
        budget: the time for the config's patterns, checking them here and matching them later
            (:meth:`AdapterConfig.resolve`, :meth:`AdapterConfig.targets`); a fresh
            :class:`PatternBudget` when ``None``. Pass one budget to every conversion of a file.

    Raises:
        LoRAFormatError: two sources disagree on a field; a source declares an unsupported feature
            (DoRA, ``modules_to_save``, ``fan_in_fan_out``, a non-LoRA ``peft_type``, ...).
        LoRAPatternTooExpensiveError: checking the patterns exhausted the budget.
    """
    budget = budget or PatternBudget()
    metadata = dict(metadata or {})
    structured = {"adapter_config", "lora_adapter_metadata", "safetensors_metadata"}
    if metadata and not (structured & metadata.keys()):
        metadata = {"safetensors_metadata": metadata}

    sources: list[tuple[str, dict[str, Any]]] = []
    for key, src in (("adapter_config", "adapter_config.json"), ("lora_adapter_metadata",) * 2):
        check_config_depth(metadata.get(key), src)
    if metadata.get("adapter_config"):
        sources.append(("adapter_config.json", dict(metadata["adapter_config"])))
    header = dict(metadata.get("safetensors_metadata") or {})
    lam = metadata.get("lora_adapter_metadata")
    if lam is None and "lora_adapter_metadata" in header:
        lam = _decode(
            header["lora_adapter_metadata"], "lora_adapter_metadata in the safetensors header"
        )
        check_config_depth(lam, "lora_adapter_metadata in the safetensors header")
    if lam:
        if not isinstance(lam, Mapping):
            raise LoRAFormatError(
                "lora_adapter_metadata in the safetensors header is not a JSON object"
            )
        sources.append(("lora_adapter_metadata", _from_diffusers_metadata(lam, component)))
    hdr = _from_safetensors_header(header)
    if hdr:
        sources.append(("safetensors metadata", hdr))

    merged: dict[str, tuple[str, Any]] = {}
    for src, cfg in sources:
        _check_unsupported(src, cfg)
        for fld in _KNOWN_FIELDS:
            if fld not in cfg or cfg[fld] is None:
                continue
            val = _normalize_field(fld, cfg[fld], src, budget)
            if fld in merged and merged[fld][1] != val:
                raise LoRAFormatError(
                    f"conflicting LoRA config sources for {fld!r}: "
                    f"{merged[fld][0]}={merged[fld][1]!r} vs {src}={val!r}"
                )
            merged.setdefault(fld, (src, val))

    def get(name, default=None):
        return merged[name][1] if name in merged else default

    tm = get("target_modules")
    return AdapterConfig(
        r=get("r"),
        lora_alpha=get("lora_alpha"),
        use_rslora=bool(get("use_rslora", False)),
        rank_pattern={str(k): int(v) for k, v in (get("rank_pattern") or {}).items()},
        alpha_pattern={str(k): float(v) for k, v in (get("alpha_pattern") or {}).items()},
        target_modules=tm,
        exclude_modules=get("exclude_modules"),
        layers_to_transform=get("layers_to_transform"),
        sources=[s for s, _ in sources],
        origins={fld: src for fld, (src, _) in merged.items()},
        budget=budget,
    )
