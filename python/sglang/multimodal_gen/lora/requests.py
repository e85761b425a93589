"""The one place where LoRA request arguments are checked and normalised.

Used by the HTTP layer (``entrypoints/protocol.py``), the engine (``runtime/engine.py``,
``runtime/request.py``) and the :class:`~sglang.multimodal_gen.lora.manager.LoRAManager`, so the
same call is accepted or refused with the same message wherever it enters. Nothing here imports
torch.

Rules of ``set_lora`` (:func:`normalize_set_lora`):

- ``lora_nickname`` is one non-empty string or a non-empty list of at most
  :data:`MAX_ADAPTERS_PER_CALL` of them (the call's nicknames become the active composition);
- ``lora_path``, ``target`` and ``strength`` are each a scalar or a list. A scalar or a
  one-element list applies to every nickname; otherwise the list needs one entry per nickname
  (the message names both fields and both lengths);
- ``lora_path`` entries are non-empty strings, or ``null`` to reuse the adapter loaded under that
  nickname; one nickname cannot be given two different paths in one call;
- ``strength`` entries are finite numbers within float32 range (the LoRA manager also checks
  ``strength x alpha / r`` against the weights' dtype); ``merge_mode`` is ``null`` or one of
  :data:`MERGE_MODES`; targets are checked against the model's targets when those are known;
- a nickname may appear once per target (``"all"`` counts as every target), so the same adapter
  can be set on ``transformer`` and ``transformer_2`` of a two-expert model in one call.

Rules of a per-request composition (:func:`validate_composition`): a list of ``{name, scale}``
entries (mappings, where ``strength`` may stand for ``scale``; objects with ``name``/``scale``
attributes; or ``(name, scale)`` pairs), or one such entry, at most :data:`MAX_ADAPTERS_PER_CALL` of them; names are non-empty and distinct,
scales finite numbers (default 1.0).

Every refusal is an :class:`~sglang.multimodal_gen.errors.InvalidRequestError` whose ``param``
names the request field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.peft_config import FP32_MAX

__all__ = [
    "ALL_TARGETS",
    "MAX_ADAPTERS_PER_CALL",
    "MERGE_MODES",
    "SetLoRAArgs",
    "check_merge_mode",
    "check_target",
    "normalize_set_lora",
    "validate_composition",
]

MERGE_MODES = ("auto", "merge", "dynamic")
ALL_TARGETS = "all"
#: Most adapters one ``set_lora`` call names (entries of ``lora_nickname``) and most adapters in
#: one request's composition (``lora``): each costs a file conversion, a copy on the layers or
#: LoRA work in every forward, so an unbounded list would hold the engine for minutes.
MAX_ADAPTERS_PER_CALL = 64


def _number(value: Any, what: str, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{what} must be a finite number, got {value!r}", param=param)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{what} must be a finite number, got {value}", param=param)
    if abs(value) > FP32_MAX:  # finite in Python, not where it is used (float32 and below)
        raise InvalidRequestError(
            f"{what} must be a finite number within float32 range (|x| <= 3.4e38), got {value:g}",
            param=param,
        )
    return float(value)


def check_target(target: Any, valid_targets: Sequence[str] | None = None) -> str:
    """Check one ``target`` value (a string; one of ``valid_targets`` when given).

    Raises:
        InvalidRequestError: ``param="target"``, listing the model's valid targets.
    """
    if not isinstance(target, str):
        raise InvalidRequestError(f"target must be a string, got {target!r}", param="target")
    if valid_targets is not None and target not in valid_targets:
        raise InvalidRequestError(
            f"target {target!r} does not exist on this model; valid targets: "
            f"{', '.join(repr(t) for t in valid_targets)}",
            param="target",
        )
    return target


def check_merge_mode(merge_mode: Any) -> str | None:
    """``None`` or one of :data:`MERGE_MODES`.

    Raises:
        InvalidRequestError: ``param="merge_mode"``.
    """
    if merge_mode is not None and merge_mode not in MERGE_MODES:
        raise InvalidRequestError(
            f"merge_mode must be one of {list(MERGE_MODES)} or null, got {merge_mode!r}",
            param="merge_mode",
        )
    return merge_mode


@dataclass(frozen=True)
class SetLoRAArgs:
    """Normalised ``set_lora`` arguments: one entry per nickname in every list."""

    nicknames: list[str]
    paths: list[str | None]
    targets: list[str]
    strengths: list[float]
    merge_mode: str | None


def _spread(value: Any, param: str, n: int) -> list:
    if isinstance(value, (list, tuple)):
        values = list(value)
        if len(values) == 1:
            return values * n
        if len(values) != n:
            raise InvalidRequestError(
                f"{param} has {len(values)} entries but lora_nickname has {n}; give one value "
                "for all, or one per nickname",
                param=param,
            )
        return values
    return [value] * n


def normalize_set_lora(
    lora_nickname: Any,
    lora_path: Any = None,
    target: Any = ALL_TARGETS,
    strength: Any = 1.0,
    merge_mode: Any = None,
    *,
    valid_targets: Sequence[str] | None = None,
) -> SetLoRAArgs:
    """Check ``set_lora`` arguments and spread them to one entry per nickname (rules above).

    Args:
        valid_targets: the model's ``target`` values including ``"all"`` (e.g.
            ``LoRAManager.target_names``); ``None`` checks only that targets are strings.

    Raises:
        InvalidRequestError: ``param`` is the offending field (``lora_nickname``, ``lora_path``,
            ``target``, ``strength``, ``merge_mode``).
    """
    if isinstance(lora_nickname, str):
        names = [lora_nickname]
    elif isinstance(lora_nickname, (list, tuple)):
        names = list(lora_nickname)
    else:
        raise InvalidRequestError(
            f"lora_nickname must be a string or a list of strings, got {lora_nickname!r}",
            param="lora_nickname",
        )
    if not names:
        raise InvalidRequestError("lora_nickname must name at least one adapter", "lora_nickname")
    if len(names) > MAX_ADAPTERS_PER_CALL:
        raise InvalidRequestError(
            f"lora_nickname names {len(names)} adapters; one set_lora call takes at most "
            f"{MAX_ADAPTERS_PER_CALL} (they become the active composition)",
            param="lora_nickname",
        )
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(
                f"lora_nickname entries must be non-empty strings, got {name!r}", "lora_nickname"
            )
    n = len(names)
    paths = _spread(lora_path, "lora_path", n)
    targets = [check_target(t, valid_targets) for t in _spread(target, "target", n)]
    strengths = [_number(s, "strength", "strength") for s in _spread(strength, "strength", n)]
    mode = check_merge_mode(merge_mode)

    given: dict[str, str] = {}
    for name, path in zip(names, paths):
        if path is None:
            continue
        if not isinstance(path, str) or not path.strip():
            raise InvalidRequestError(
                f"lora_path must be a non-empty string, or null to reuse the adapter loaded as "
                f"{name!r}; got {path!r}",
                param="lora_path",
            )
        if given.setdefault(name, path) != path:
            raise InvalidRequestError(
                f"adapter {name!r} is given two different paths", param="lora_path"
            )

    seen: set[tuple[str, str]] = set()
    for name, t in zip(names, targets):
        if t == ALL_TARGETS and valid_targets is not None:
            covers = [c for c in valid_targets if c != ALL_TARGETS]
        else:
            covers = [t]  # without the model's targets, "all" overlaps every target
        for c in covers:
            if (
                (name, c) in seen
                or (name, ALL_TARGETS) in seen
                or (c == ALL_TARGETS and any(s == name for s, _ in seen))
            ):
                where = "every target" if c == ALL_TARGETS else f"target {c!r}"
                raise InvalidRequestError(
                    f"adapter {name!r} is listed twice for {where}; a nickname may appear once "
                    "per target",
                    param="lora_nickname",
                )
            seen.add((name, c))
    return SetLoRAArgs(names, paths, targets, strengths, mode)


def _entry(item: Any, i: int, param: str) -> tuple[Any, Any]:
    if isinstance(item, Mapping):
        if "scale" in item and "strength" in item:
            raise InvalidRequestError(
                f"{param}[{i}] gives both scale and strength; give one of them", param=param
            )
        return item.get("name"), item.get("scale", item.get("strength", 1.0))
    if hasattr(item, "name") and hasattr(item, "scale"):
        return item.name, item.scale
    if isinstance(item, (list, tuple)) and len(item) == 2:
        return item[0], item[1]
    raise InvalidRequestError(
        f"{param}[{i}] must be {{name, scale}} (or a (name, scale) pair), got {item!r}", param=param
    )


def validate_composition(lora: Any, param: str = "lora") -> list[tuple[str, float]] | None:
    """Check a per-request adapter composition and return it as ``[(name, scale), ...]``.

    ``None`` (use the global composition) is returned as ``None``; ``[]`` means no adapter.
    Whether the adapters are loaded is checked by the LoRA manager (``NotFoundError``).

    Raises:
        InvalidRequestError: ``param`` (default ``"lora"``): more than
            :data:`MAX_ADAPTERS_PER_CALL` entries, an entry that is not a name and a scale, an
            empty name, a repeated name, a scale that is not a finite number.
    """
    if lora is None:
        return None
    if isinstance(lora, Mapping) or (hasattr(lora, "name") and hasattr(lora, "scale")):
        items = [lora]
    elif isinstance(lora, (list, tuple)):
        items = list(lora)
    else:
        raise InvalidRequestError(
            f"{param} must be a list of {{name, scale}} entries, got {lora!r}", param=param
        )
    if len(items) > MAX_ADAPTERS_PER_CALL:
        raise InvalidRequestError(
            f"{param} names {len(items)} adapters; a request's composition has at most "
            f"{MAX_ADAPTERS_PER_CALL}",
            param=param,
        )
    out: list[tuple[str, float]] = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        name, scale = _entry(item, i, param)
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(
                f"{param}[{i}].name must be a non-empty adapter nickname, got {name!r}",
                param=param,
            )
        if name in seen:
            raise InvalidRequestError(
                f"{param} names the adapter {name!r} more than once", param=param
            )
        seen.add(name)
        out.append((name, _number(scale, f"{param}[{i}].scale", param)))
    return out
