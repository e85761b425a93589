"""Schema errors (HTTP 422) in our own words: pydantic's errors as one sentence per field.

The request models of :mod:`.protocol` are strict (wrong JSON types, missing and unknown fields
are refused); :func:`schema_error_message` says which field is at fault and what it takes, in
JSON terms (``n must be an integer, got the string '2'``), without pydantic's type paths.
"""

from __future__ import annotations

from typing import Any

#: What each field takes, for the 422 message (JSON terms).
_EXPECTED = {
    "prompt": "a string",
    "negative_prompt": "a string",
    "model": "a string",
    "size": "a string 'WxH'",
    "response_format": "a string",
    "output_format": "a string",
    "user": "a string",
    "quality": "a string",
    "style": "a string",
    "background": "a string",
    "moderation": "a string",
    "n": "an integer",
    "output_compression": "an integer",
    "seed": "an integer",
    "num_inference_steps": "an integer",
    "max_sequence_length": "an integer",
    "num_frames": "an integer",
    "fps": "an integer",
    "seconds": "a number or a numeric string",
    "guidance_scale": "a number",
    "stream": "true or false",
    "lora": 'an object {"name": string, "strength": number}, a list of them, or null',
    "name": "a string",
    "scale": "a number",
    "lora_nickname": "a string or a list of strings",
    "lora_path": "a string, a list of strings (or nulls), or null",
    "target": "a string",
    "strength": "a number or a list of numbers",
    "merge_mode": "a string or null",
    # a request's step caching: the whole value (the object's keys and types are value rules,
    # 400 naming cache.<key>)
    "cache": 'a method name (a string) or an object {"method": string, <knob>: value, ...}',
}
#: What one element of a list field takes.
_ELEMENT = {
    "lora": 'an object {"name": string, "strength": number}',
    "lora_nickname": "a string",
    "lora_path": "a string or null",
    "strength": "a number",
}
_FIELD_NAMES = frozenset(_EXPECTED)
#: What a field takes, by its annotation (fields of the declarations not in the table above).
_BY_TYPE = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _holds_adapters(model: Any, name: str) -> bool:
    """Whether field ``name`` of ``model`` takes adapter objects as ``lora`` does (a family's
    own adapter field, e.g. LTX-2's ``stage_2_lora``): its annotation holds a model with
    ``name`` and ``strength`` fields."""
    field = getattr(model, "model_fields", {}).get(name)
    args = _type_args(field.annotation) if field else []
    return any({"name", "strength"} <= set(getattr(a, "model_fields", {})) for a in args)


def _expected(model: Any, name: str) -> str:
    """What field ``name`` takes: the table's words, else its annotation's type in JSON terms."""
    if name in _EXPECTED:
        return _EXPECTED[name]
    if _holds_adapters(model, name):
        return _EXPECTED["lora"]
    field = getattr(model, "model_fields", {}).get(name)
    args = [a for a in _type_args(field.annotation) if a is not type(None)] if field else []
    kinds = {_BY_TYPE.get(a) for a in args} - {None}
    return kinds.pop() if len(kinds) == 1 else "a value of another type"


def model_field_names(model: Any) -> set[str]:
    """The field names of a pydantic ``model`` and of the models its fields hold (a field
    missing from the table above still gets named as the ``param``)."""
    names: set[str] = set()
    todo = [model] if model is not None and hasattr(model, "model_fields") else []
    while todo:
        m = todo.pop()
        for name, field in m.model_fields.items():
            names.add(name)
            for arg in _type_args(field.annotation):
                if hasattr(arg, "model_fields") and arg is not m:
                    todo.append(arg)
    return names


def _type_args(tp: Any) -> list[Any]:
    args = list(getattr(tp, "__args__", ()) or ())
    return [tp] + [a for arg in args for a in _type_args(arg)]


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string" if len(value) > 40 else f"the string {value!r}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def schema_error_message(errors: list[dict], model: Any = None) -> tuple[str, str | None]:
    """Word pydantic's errors as our sentences: ``(message, param)``.

    One sentence per field at fault (at most five), e.g. ``n must be an integer, got the string
    '2'``, ``num_inference_step: unknown field``, ``prompt is required``. pydantic's union member
    tags (``lora.list[LoRASpec].0``) never appear: paths keep field names and list positions.
    ``param`` is the first top-level field at fault.
    """
    by_field: dict[str, tuple[int, str]] = {}
    order: dict[str, None] = {}  # fields in order of first error (a dict: 80k unknown keys
    # in one body made a list's `in` checks take 25 s, with the event loop blocked)
    fields = _FIELD_NAMES | model_field_names(model)
    for err in errors:
        loc = tuple(err.get("loc", ()))
        kind = err.get("type", "")
        if loc and loc[0] in ("body", "query", "path") and model is None:
            loc = loc[1:]  # FastAPI's own validation prefixes the source
        if kind == "extra_forbidden" and loc:
            parent = [x for x in loc[:-1] if isinstance(x, int) or x in fields]
            top = str(parent[0]) if parent else str(loc[-1])
            where = ".".join(str(x) for x in parent)
            sentence = (
                f"{where}: unknown field {str(loc[-1])!r}" if where else f"{loc[-1]}: unknown field"
            )
            rank = 100  # an unknown field is the most telling
        else:
            path = [x for x in loc if isinstance(x, int) or x in fields]
            if not path:
                by_field.setdefault("", (0, "the body must be a JSON object"))
                order.setdefault("")
                continue
            top = str(path[0])
            where = ".".join(str(x) for x in path)
            if kind == "missing":
                sentence, rank = f"{where} is required", 50
            else:
                leaf = path[-1]
                if isinstance(leaf, int):
                    parent = next((p for p in reversed(path) if isinstance(p, str)), top)
                    adapters = _holds_adapters(model, parent)
                    expected = _ELEMENT.get(
                        "lora" if adapters else parent, "a value of another type"
                    )
                else:
                    expected = _expected(model, leaf)
                sentence = f"{where} must be {expected}, got {_json_kind(err.get('input'))}"
                rank = len(path)  # the most specific of a union's alternatives
        order.setdefault(top)
        if top not in by_field or rank > by_field[top][0]:
            by_field[top] = (rank, sentence)
    sentences = [by_field[f][1] for f in list(order)[:5]]
    param = next((f for f in order if f), None)
    return "request body does not match the schema: " + "; ".join(sentences), param
