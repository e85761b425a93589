"""Request bodies read and parsed with bounds on everything a client controls.

Bodies are parsed here, not by FastAPI, so invalid JSON is a 400 that says where (line and
column), schema errors are a 422 in our own words (:mod:`.schema_errors`), and JSON that no field
can take (deep nesting, lone surrogates, huge integers) a 400 naming the field; all in the OpenAI
error envelope, never with a stack trace. A body is refused with 413 from its ``Content-Length``
before it is read, or as soon as a chunked body passes the limit; a body that does not arrive in
time gets 408 (:func:`read_body`).
"""

from __future__ import annotations

import asyncio
import json
import re
import typing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from sglang.multimodal_gen.entrypoints.schema_errors import schema_error_message
from sglang.multimodal_gen.errors import (
    InvalidRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
    SGLangError,
)

#: Largest request body accepted (bytes).
MAX_BODY_BYTES = 1 << 20
#: Deepest JSON nesting accepted (the schemas need 3: body, ``lora`` list, adapter object).
MAX_JSON_DEPTH = 32
#: Longest integer literal accepted in a body (no field takes more than 20 digits).
MAX_INT_DIGITS = 100
# ``\uD800``-``\uDFFF`` escapes: only bodies that contain one are walked for lone surrogates
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")


class ClientGoneError(SGLangError):
    """The client closed the connection before its answer was ready, or while it was still
    sending its body (status 499, not sent)."""

    status_code = 499
    error_type = "client_closed_request"


class BodyError(InvalidRequestError):
    """The body is not a JSON document (HTTP 400, ``code="invalid_json"``)."""


class SchemaError(InvalidRequestError):
    """The JSON does not match the endpoint's schema (HTTP 422)."""

    status_code = 422


def _json_hint(text: str, pos: int) -> str:
    """A hint for the two mistakes users make most: a trailing comma, a shell continuation."""
    before = text[:pos].rstrip()
    if "`" in text[max(0, pos - 2) : pos + 1] or (before.endswith("`")):
        return " (a shell line-continuation backtick ` is not part of JSON)"
    if before.endswith(",") and text[pos : pos + 1] in ("}", "]"):
        return " (trailing comma before the closing bracket; remove it)"
    return ""


class _LongInt(str):
    """An integer literal longer than :data:`MAX_INT_DIGITS` (kept as text, refused after parsing;
    ``int()`` of 4,300+ digits raises a library error)."""


def _parse_int(text: str) -> int | _LongInt:
    if len(text) > MAX_INT_DIGITS:
        return _LongInt(text)
    return int(text)


def _nested_too_deep_key(text: str, limit: int) -> str | None:
    """The top-level key under which ``text`` nests deeper than ``limit`` (None: at the top)."""
    depth, key, i, n = 0, None, 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            if depth == 1 and text[j + 1 : j + 40].lstrip().startswith(":"):
                key = text[i + 1 : j]
            i = j + 1
            continue
        if c in "[{":
            depth += 1
            if depth > limit:
                return key
        elif c in "]}":
            depth -= 1
        i += 1
    return key


def _check_parsed(obj: Any, walk: bool) -> None:
    """Refuse what JSON allows but no field can take: nesting deeper than
    :data:`MAX_JSON_DEPTH`, lone UTF-16 surrogates (``"\\ud800"``), integers of more than
    :data:`MAX_INT_DIGITS` digits. ``walk=False``: nothing of the kind can be there (checked on
    the raw text), so the walk is skipped.

    Raises:
        BodyError: 400, ``param`` the top-level field holding the value.
    """
    if not walk:
        return
    stack: list[tuple[Any, tuple, int]] = [(obj, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        param = str(path[0]) if path else None
        where = ".".join(str(p) for p in path) or "the body"
        if depth > MAX_JSON_DEPTH:
            raise BodyError(
                f"{f'field {param!r}' if param else 'the body'} is nested more than "
                f"{MAX_JSON_DEPTH} levels deep; no field takes that",
                param=param,
                code="invalid_json",
            )
        if isinstance(value, _LongInt):
            raise BodyError(
                f"{where} is an integer of {len(value.lstrip('-'))} digits; no field takes "
                f"more than {MAX_INT_DIGITS}",
                param=param,
            )
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise BodyError(
                    f"{where} is not valid Unicode text: character {e.start} is a lone UTF-16 "
                    f"surrogate ({ascii(value[e.start])}); send UTF-8 text or paired "
                    "\\uXXXX escapes",
                    param=param,
                    code="invalid_json",
                ) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, path, depth + 1))  # keys are checked as text at their level
                stack.append((v, (*path, k), depth + 1))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                stack.append((v, (*path, i), depth + 1))


def parse_json_body(
    raw: bytes, model: type[BaseModel], *, allow_empty: bool = False, limit: int = MAX_BODY_BYTES
) -> Any:
    """Decode ``raw`` as JSON and validate it against ``model``.

    Raises:
        PayloadTooLargeError: 413; more than ``limit`` bytes (default :data:`MAX_BODY_BYTES`;
            a route taking base64 images allows more).
        BodyError: 400; invalid UTF-8 or JSON, with line and column of the first error; a key
            given twice in one object; nesting, integers or text no field can take
            (:func:`_check_parsed`).
        SchemaError: 422; the JSON does not fit ``model`` (one sentence per field at fault,
            :func:`~.schema_errors.schema_error_message`).
    """
    if len(raw) > limit:
        raise PayloadTooLargeError(
            f"request body larger than {limit} bytes", code="request_too_large"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(
            f"request body is not valid UTF-8 ({e.reason} at byte {e.start})", code="invalid_json"
        ) from e
    if not text.strip():
        if not allow_empty:
            raise BodyError("request body is empty; expected a JSON object", code="invalid_json")
        text = "{}"
    long_ints: list[bool] = []

    def parse_int(digits: str) -> int | _LongInt:
        out = _parse_int(digits)
        if isinstance(out, _LongInt):
            long_ints.append(True)
        return out

    duplicates: list[str] = []

    def object_pairs(pairs: list[tuple[str, Any]]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs) and not duplicates:
            seen: set[str] = set()
            duplicates.append(next(k for k, _ in pairs if k in seen or seen.add(k)))
        return out

    try:
        obj = json.loads(text, parse_int=parse_int, object_pairs_hook=object_pairs)
    except json.JSONDecodeError as e:
        raise BodyError(
            f"invalid JSON in request body at line {e.lineno}, column {e.colno}: "
            f"{e.msg}{_json_hint(text, e.pos)}",
            code="invalid_json",
        ) from e
    except RecursionError:
        key = _nested_too_deep_key(text, MAX_JSON_DEPTH)
        where = f"field {key!r}" if key else "the body"
        raise BodyError(
            f"{where} is nested more than {MAX_JSON_DEPTH} levels deep; no field takes that",
            param=key,
            code="invalid_json",
        ) from None
    if duplicates:  # {"n": 100, "n": 1}: which one a client meant is anybody's guess
        raise BodyError(
            f"field {duplicates[0]!r} appears more than once in a JSON object",
            param=duplicates[0],
            code="invalid_json",
        )
    _check_parsed(
        obj,
        walk=bool(long_ints)
        or _SURROGATE_ESCAPE.search(text) is not None
        or text.count("[") + text.count("{") > MAX_JSON_DEPTH,
    )
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        message, param = schema_error_message(e.errors(), model)
        raise SchemaError(message, param=param, code="invalid_schema") from e


async def read_body(
    request: Request, limit: int = MAX_BODY_BYTES, timeout_s: float | None = None
) -> bytes:
    """The request body, read with bounds on its size and on the time it takes to arrive.

    A ``Content-Length`` above ``limit`` is refused before anything is read; a body without one
    (chunked) is refused as soon as it passes ``limit``.

    Raises:
        PayloadTooLargeError: 413.
        RequestTimeoutError: 408; the body did not arrive within ``timeout_s``.
        BodyError: 400; a ``Content-Length`` that is not a number.
        ClientGoneError: 499; the client closed the connection before the body was complete.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise BodyError(f"invalid Content-Length header {declared[:40]!r}")
        if int(declared) > limit:
            raise PayloadTooLargeError(
                f"request body of {int(declared)} bytes (Content-Length) is larger than the "
                f"limit of {limit} bytes",
                code="request_too_large",
            )
    chunks: list[bytes] = []
    total = 0

    async def receive_all() -> None:
        nonlocal total
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise PayloadTooLargeError(
                    f"request body larger than the limit of {limit} bytes",
                    code="request_too_large",
                )
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive_all(), timeout_s)
    except ClientDisconnect:
        raise ClientGoneError(
            f"the client disconnected while sending its body ({total} bytes received)"
        ) from None
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within {timeout_s:g} s ({total} bytes received)",
            code="request_timeout",
        ) from None
    return b"".join(chunks)


def _takes_text(annotation: Any) -> bool:
    """Whether a field's type admits a string (``Annotated`` and unions looked through)."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) is typing.Annotated:
        return _takes_text(typing.get_args(annotation)[0])
    return any(_takes_text(a) for a in typing.get_args(annotation))


def _boundary(content_type: str) -> str:
    """The ``boundary`` parameter of a multipart ``Content-Type`` (1-70 characters of RFC 2046's
    set, quoted or not).

    Raises:
        BodyError: 400; none, or one with other characters.
    """
    for param in content_type.split(";")[1:]:
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary":
            value = value.strip().strip('"')
            if re.fullmatch(r"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]", value):
                return value
            break
    raise BodyError(
        "multipart/form-data needs a boundary parameter of 1-70 letters, digits or '()+_,-./:=?",
        param="Content-Type",
        code="invalid_form",
    )


def _close_delimiter_end(raw: bytes, boundary: bytes) -> int | None:
    """Where the close delimiter (``--boundary--``) of a multipart body ends, or ``None`` when it
    has none: at the very start (a form without parts) or after a line break."""
    close = b"--" + boundary + b"--"
    if raw.startswith(close):
        return len(close)
    pos = raw.find(b"\r\n" + close)
    return None if pos < 0 else pos + 2 + len(close)


def _form_text(data: bytes, what: str, param: str | None) -> str:
    """A part's name or value as UTF-8 text (as a JSON body's text must be).

    Raises:
        BodyError: 400 naming ``param``; not valid UTF-8.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(
            f"{what} is not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text",
            param=param,
            code="invalid_form",
        ) from None


@dataclass(frozen=True, eq=False)
class FormFile:
    """A file part of a ``multipart/form-data`` body (a part with a ``filename``).

    Attributes:
        data: the file's bytes, as sent.
        filename: the name the client gave (shown in nothing but messages).
    """

    data: bytes
    filename: str

    def __repr__(self) -> str:
        return f"FormFile({self.filename!r}, {len(self.data)} bytes)"


def _parse_multipart(
    raw: bytes, boundary: str, max_fields: int, files: bool = False
) -> list[tuple[str, str | FormFile | None]]:
    """The ``(name, value)`` parts of a multipart body, strictly: the body must end with its
    close delimiter (nothing but line breaks after it), every name and value must be UTF-8 text;
    a file part has the value ``None``, or with ``files`` a :class:`FormFile`.

    Raises:
        BodyError: 400; not valid multipart, no close delimiter, text that is not UTF-8, more
            than ``max_fields`` parts.
    """
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header

    parts: list[tuple[str, str | None]] = []
    current: dict[str, Any] = {}
    header_name, header_value = bytearray(), bytearray()

    def on_part_begin() -> None:
        current.clear()
        current.update(disposition=b"", data=bytearray())

    def on_header_field(data: bytes, start: int, end: int) -> None:
        header_name.extend(data[start:end])

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header_value.extend(data[start:end])

    def on_header_end() -> None:
        if bytes(header_name).lower() == b"content-disposition":
            current["disposition"] = bytes(header_value)
        header_name.clear()
        header_value.clear()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        current["data"].extend(data[start:end])

    def on_part_end() -> None:
        _, options = parse_options_header(current.get("disposition", b""))
        if b"name" not in options:
            raise BodyError(
                "a multipart/form-data part has no name (Content-Disposition: form-data; "
                'name="...")',
                code="invalid_form",
            )
        raw_name = options[b"name"]
        shown = raw_name.decode("utf-8", "backslashreplace")
        name = _form_text(raw_name, f"the form field name {shown!r}", None)
        if len(parts) >= max_fields:
            raise BodyError(
                f"the form has more than {max_fields} fields", param=name, code="invalid_form"
            )
        if b"filename" in options:
            filename = options[b"filename"].decode("utf-8", "replace")
            parts.append((name, FormFile(bytes(current["data"]), filename) if files else None))
        else:
            parts.append((name, _form_text(bytes(current["data"]), f"field {name!r}", name)))

    parser = MultipartParser(
        boundary.encode("latin-1"),
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    try:
        parser.write(raw)
        parser.finalize()
    except FormParserError as e:
        raise BodyError(f"invalid multipart/form-data body: {e}", code="invalid_form") from None
    end = _close_delimiter_end(raw, boundary.encode("latin-1"))
    if end is None:  # a cut body: its last part never ended, and must not pass as absent
        raise BodyError(
            f"the multipart/form-data body does not end with its closing boundary "
            f"'--{boundary}--'; it was cut short or is not multipart",
            code="invalid_form",
        )
    if raw[end:].strip(b"\r\n"):
        raise BodyError(
            "the multipart/form-data body continues after its closing boundary",
            code="invalid_form",
        )
    return parts


async def parse_form_body(
    raw: bytes, content_type: str, model: type[BaseModel], max_fields: int = 64
) -> Any:
    """Decode a ``multipart/form-data`` body (what the ``openai`` client sends for
    ``videos.create``) and validate it against ``model`` as :func:`parse_json_body` does.

    Parsed strictly (:func:`_parse_multipart`): a body cut short (no closing boundary) is
    refused rather than read without its last field, and text that is not UTF-8 is refused as in
    a JSON body, naming the field (never read as Latin-1). Only the boundary is taken from the
    ``Content-Type``: a ``charset=`` there is ignored (everything is UTF-8).

    Form values are text: a field whose type takes a string keeps it; any other value is read as
    JSON (``"4"`` -> 4, ``"3.5"`` -> 3.5, a ``lora`` object), or kept as text when it is not JSON,
    so the schema error names the field.

    Raises:
        BodyError: 400; a body that is not valid multipart or not UTF-8, one without its closing
            boundary, a field given twice, more than ``max_fields`` fields.
        InvalidRequestError: 400; a file part (``param`` its field: files are not taken).
        SchemaError: 422, and the other errors of :func:`parse_json_body`.
    """
    if len(raw) > MAX_BODY_BYTES:
        raise PayloadTooLargeError(
            f"request body larger than {MAX_BODY_BYTES} bytes", code="request_too_large"
        )
    boundary = _boundary(content_type)
    fields: dict[str, Any] = {}
    nested = _BracketedFields()
    for name, value in _parse_multipart(raw, boundary, max_fields):
        if value is None:
            raise InvalidRequestError(
                f"{name}: file uploads are not supported here (send the fields only)", param=name
            )
        _take_text_field(fields, nested, model, name, value)
    return parse_json_body(json.dumps(_merged(fields, nested)).encode(), model)


def _take_text_field(
    fields: dict[str, Any], nested: _BracketedFields, model: type[BaseModel], name: str, value: str
) -> None:
    """One text part of a form: a bracketed name into ``nested``, any other into ``fields``
    typed by ``model`` (:func:`_form_value`).

    Raises:
        BodyError: the field appears twice.
    """
    if nested.add(name, value):
        return
    if name in fields:
        raise BodyError(
            f"field {name!r} appears more than once in the form",
            param=name,
            code="invalid_form",
        )
    fields[name] = _form_value(model, name, value)


def _merged(fields: dict[str, Any], nested: _BracketedFields) -> dict[str, Any]:
    both = sorted(set(fields) & set(nested.values))
    if both:
        raise BodyError(
            f"field {both[0]!r} appears more than once in the form",
            param=both[0],
            code="invalid_form",
        )
    return {**fields, **nested.values}


_BRACKETS = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])+)$")


class _BracketedFields:
    """Form fields whose names carry brackets, rebuilt into the JSON value they stand for: the
    ``openai`` client sends a nested ``extra_body`` value of a multipart request that way
    (``lora[][name]=a``, ``lora[][strength]=0.5`` for ``"lora": [{"name": "a", "strength":
    0.5}]``; ``k[sub]`` for an object, ``k[]`` for a list of values). In a list of objects the
    n-th value of a key belongs to the n-th object, whatever the order of the parts. Values are
    read as JSON where they parse (numbers, ``true``), else kept as text.
    """

    def __init__(self):
        self.values: dict[str, Any] = {}
        self._seen: dict[str, int] = {}

    def add(self, name: str, text: str) -> bool:
        """Take the field ``name`` if its name carries brackets; ``False`` otherwise.

        Raises:
            BodyError: a shape other than ``k[]``, ``k[sub]`` and ``k[][sub]``, or one field
                spelt in two shapes.
        """
        m = _BRACKETS.match(name)
        if m is None:
            return False
        top, path = m.group(1), re.findall(r"\[([^\[\]]*)\]", m.group(2))
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if path == [""]:  # k[]: a list of values
            current = self._of(top, list, name)
            current.append(value)
        elif len(path) == 1:  # k[sub]: an object
            self._of(top, dict, name)[path[0]] = value
        elif len(path) == 2 and path[0] == "" and path[1]:  # k[][sub]: a list of objects
            current = self._of(top, list, name)
            # the n-th ``k[][sub]`` belongs to the n-th object: the client may send the objects
            # one after the other or (openai's multipart serializer) every key's values together
            index = self._seen.get(name, 0)
            self._seen[name] = index + 1
            while len(current) <= index:
                current.append({})
            current[index][path[1]] = value
        else:
            raise BodyError(
                f"form field {name!r}: nested form names are k[], k[key] or k[][key]",
                param=top,
                code="invalid_form",
            )
        return True

    def _of(self, top: str, kind: type, name: str):
        current = self.values.setdefault(top, kind())
        if not isinstance(current, kind):
            raise BodyError(
                f"form field {name!r}: {top} is spelt both as a list and as an object",
                param=top,
                code="invalid_form",
            )
        return current


def _form_value(model: type[BaseModel], name: str, value: str) -> Any:
    """A form field's text as ``model`` takes it: kept as text where the field takes a string,
    else read as JSON (kept as text when it is not JSON, so the schema error names it)."""
    field = model.model_fields.get(name)
    if field is None or _takes_text(field.annotation):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_form_with_files(
    raw: bytes,
    content_type: str,
    model: type[BaseModel],
    file_fields: dict[str, bool],
    *,
    limit: int,
    max_fields: int = 64,
) -> tuple[Any, dict[str, list[tuple[str, str | FormFile]]]]:
    """A ``multipart/form-data`` body with files (``/v1/images/edits``, ``/v1/videos``' input
    reference), parsed as strictly as :func:`parse_form_body`.

    The parts named in ``file_fields`` (a file, or text: a base64 image or a URL) are set apart
    in arrival order; their names may carry ``[]`` (``image[]``, as the ``openai`` client sends
    a list of files). Every other part is a text field validated against ``model`` as
    :func:`parse_form_body` validates it.

    Args:
        file_fields: the field names that take files, each with whether it may repeat.
        limit: the body's largest size (bytes).

    Returns:
        ``(body, inputs)``: the validated model and ``{field: [(form name, FormFile or text)]}``.

    Raises:
        PayloadTooLargeError: 413; more than ``limit`` bytes.
        BodyError: 400; as :func:`parse_form_body`; a non-repeatable file field given twice.
        InvalidRequestError: 400; a file part in another field (``param`` its name).
        SchemaError: 422; the text fields do not fit ``model``.
    """
    if len(raw) > limit:
        raise PayloadTooLargeError(
            f"request body larger than {limit} bytes", code="request_too_large"
        )
    boundary = _boundary(content_type)
    fields: dict[str, Any] = {}
    inputs: dict[str, list[tuple[str, str | FormFile]]] = {}
    nested = _BracketedFields()
    for name, value in _parse_multipart(raw, boundary, max_fields, files=True):
        base = name[:-2] if name.endswith("[]") else name
        if base in file_fields:
            got = inputs.setdefault(base, [])
            if got and not file_fields[base]:
                raise BodyError(
                    f"field {base!r} appears more than once in the form; it takes one file",
                    param=base,
                    code="invalid_form",
                )
            got.append((name, value))
            continue
        if isinstance(value, FormFile):
            raise InvalidRequestError(
                f"{name}: this field takes no file (files go in "
                f"{', '.join(repr(f) for f in file_fields)})",
                param=name,
            )
        _take_text_field(fields, nested, model, name, value)
    return parse_json_body(json.dumps(_merged(fields, nested)).encode(), model), inputs
