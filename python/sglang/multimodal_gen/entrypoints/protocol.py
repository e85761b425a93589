"""Request and response models of the HTTP API, and the translation of a request body into the
engine's request object (:class:`~sglang.multimodal_gen.configs.sampling_params.SamplingParams`).

Two levels of checking, mirroring the status codes of the design:

- *schema* (pydantic in strict mode, HTTP 422): a field has the wrong JSON type (``"n": "2"``,
  ``"seed": true`` and ``"guidance_scale": true`` are refused, an integer is accepted where a
  number is expected), a required field is missing, or a field no model declares is sent (a
  misspelt ``num_inference_step`` must not be silently ignored).
  :func:`~.schema_errors.schema_error_message` words each error as one sentence naming the field
  (no pydantic type paths). The generation fields of the request models derive from the
  declarations: the fields every model takes and the fields each registered family adds
  (``ModelFamily.sampling_params``);
- *values* (HTTP 400): the body becomes the served model's ``SamplingParams`` and is resolved
  once (:meth:`RequestSpec.resolve`: the one set of value rules, which the CLI and the Python API
  apply too); a field the served model does not declare is refused naming it. The LoRA admin
  rules (``set_lora`` list pairing) are those of :mod:`sglang.multimodal_gen.lora.requests`.

OpenAI fields we accept but do not act on (``quality``, ``style``, ``background``, ``moderation``)
are declared so that the official client's requests validate. Nothing here imports FastAPI.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, create_model

from sglang.multimodal_gen.configs.sampling_params import (
    MAX_PROMPT_CHARS,
    MAX_SEED,
    RequestSpec,
    SamplingParams,
    check_size,
)
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.requests import check_target, normalize_set_lora
from sglang.multimodal_gen.models.registry import list_families
from sglang.multimodal_gen.outputs import IMAGE_FORMATS

__all__ = ["MAX_PROMPT_CHARS", "MAX_SEED"]  # re-exported: the rules live in configs

RESPONSE_FORMATS = ("b64_json", "url")
OUTPUT_FORMATS = tuple(IMAGE_FORMATS)
DEFAULT_SIZE = "1024x1024"
# at most 6 digits per side: bounded before int() (a 5,000-digit side is refused as a form error)
# ASCII digits only (``\d`` alone takes full-width and other scripts' digits)
_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$", re.ASCII)


class _Strict(BaseModel):
    """Base: unknown fields are a schema error (422); types are strict (no ``"2"`` -> 2, no
    ``true`` -> 1; an integer is accepted where a number is expected)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class LoRASpec(_Strict):
    """One adapter of a per-request composition: a loaded ``name`` and its ``strength``
    (``scale`` is accepted as an alias, as OpenAI-style clients of this API send it)."""

    name: str
    strength: float | None = None
    scale: float | None = None

    def as_pair(self) -> tuple[str, float]:
        """``(name, strength)``; both given and different is an error.

        Raises:
            InvalidRequestError: ``param="lora"``.
        """
        if self.strength is not None and self.scale is not None and self.strength != self.scale:
            raise InvalidRequestError(
                f"lora entry {self.name!r} gives strength {self.strength:g} and scale "
                f"{self.scale:g}; scale is an alias of strength: give one",
                param="lora",
            )
        value = self.strength if self.strength is not None else self.scale
        return self.name, 1.0 if value is None else value


#: JSON type of each field kind of a ``SamplingParams`` declaration.
_KIND_TYPES = {
    "text": str,
    "size": int,
    "count": int,
    "seed": int,
    "scale": float,
    "fraction": float,
    "flag": bool,
    "indices": list[int],
    "lora": LoRASpec | list[LoRASpec],
    # a method name or {method, threshold, fn, bn, warmup}: every rule is a value rule (400
    # naming the field), so the object's keys and types are checked there
    "cache": str | dict[str, Any],
}
#: Generation fields whose HTTP spelling is another (``n``, ``size``, ``seconds``).
_HTTP_SPELLED = ("prompt", "num_outputs_per_prompt", "height", "width")


def declared_fields() -> dict[str, dataclasses.Field]:
    """Every generation field a request body may carry: the fields every model takes and the
    ones each registered family adds, by name (first declaration wins). A field the served model
    does not declare passes the schema and is refused by the value check naming it (400); a
    field no model declares is a schema error (422)."""
    out: dict[str, dataclasses.Field] = {}
    for fam in list_families():
        for f in dataclasses.fields(fam.params_class()):
            out.setdefault(f.name, f)
    for f in dataclasses.fields(SamplingParams):
        out.setdefault(f.name, f)
    # input images arrive as files (the edits route, /v1/videos' input_reference), not as
    # generation fields
    return {
        k: v for k, v in out.items() if k not in _HTTP_SPELLED and v.metadata.get("kind") != "image"
    }


def with_declared_fields(base: type[BaseModel], name: str) -> type[BaseModel]:
    """A request model called ``name``: ``base`` plus every declared generation field
    (:func:`declared_fields`) as an optional field of its kind's JSON type; the fields ``base``
    has keep its types."""
    extra = {
        field_name: (_KIND_TYPES[f.metadata["kind"]] | None, None)
        for field_name, f in declared_fields().items()
        if field_name not in base.model_fields
    }
    return create_model(name, __base__=base, __doc__=base.__doc__, **extra)


class _ImageGenerationBody(_Strict):
    """Body of ``POST /v1/images/generations``: OpenAI's fields, plus every declared generation
    field (:func:`with_declared_fields`: ``seed``, ``num_inference_steps``, ``guidance_scale``,
    ``negative_prompt``, ``max_sequence_length``, ``lora`` and the families' own)."""

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = None
    response_format: str | None = None
    output_format: str | None = None
    output_compression: int | None = None
    user: str | None = None
    # OpenAI fields accepted for compatibility, without effect on this engine.
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    stream: bool | None = None


ImageGenerationRequest = with_declared_fields(_ImageGenerationBody, "ImageGenerationRequest")


class _ImageEditBody(_ImageGenerationBody):
    """Body of ``POST /v1/images/edits``: the generation body plus the input images. In a
    multipart form (OpenAI's) ``image`` / ``image[]`` and ``mask`` are file parts and never
    reach this model; in a JSON body they are text here: base64, a data URL, or a URL of an
    allowed host (:func:`~sglang.multimodal_gen.image_inputs.image_from_reference`)."""

    image: str | list[str] | None = None
    mask: str | None = None
    # OpenAI edit fields accepted for compatibility, without effect on this engine.
    input_fidelity: str | None = None
    partial_images: int | None = None
    safety_identifier: str | None = None


ImageEditRequest = with_declared_fields(_ImageEditBody, "ImageEditRequest")


class SetLoRARequest(_Strict):
    """Body of ``POST /v1/set_lora``.

    ``lora_nickname`` and ``lora_path`` are a name or a list; ``lora_path`` ``null`` (or a ``null``
    entry) reuses an adapter already loaded under that nickname. ``lora_path`` and ``strength``
    given as a scalar or a one-element list apply to every nickname; otherwise they need one entry
    per nickname (:func:`~sglang.multimodal_gen.lora.requests.normalize_set_lora`).
    """

    lora_nickname: str | list[str]
    lora_path: str | list[str | None] | None = None
    target: str = "all"
    strength: float | list[float] = 1.0
    merge_mode: str | None = None


class TargetRequest(_Strict):
    """Body of ``/v1/unset_lora``, ``/v1/merge_lora_weights``, ``/v1/unmerge_lora_weights``."""

    target: str = "all"


class UnloadLoRARequest(_Strict):
    """Body of ``POST /v1/unload_lora``."""

    lora_nickname: str


class ImageData(BaseModel):
    """One generated image: ``b64_json`` or ``url``."""

    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImageGenerationResponse(BaseModel):
    """Response of ``POST /v1/images/generations``."""

    created: int
    data: list[ImageData]
    output_format: str
    size: str
    seed: int | None = None
    # the request's step caching, when it ran with one: {"method", "steps_computed",
    # "steps_skipped", "blocks_computed", "blocks_skipped"}
    step_cache: dict[str, Any] | None = None


class StatusResponse(BaseModel):
    """Response of the LoRA admin endpoints."""

    status: str = "ok"
    message: str
    detail: Any = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "sglang"
    root: str | None = None
    family: str | None = None
    pipeline_class: str | None = None
    modality: str | None = None
    # the conditioning the model takes ("text"; later "image")
    inputs: list[str] | None = None
    required_inputs: list[str] | None = None
    # the request fields it takes: [{name, kind, help, default}] (the common ones and its
    # family's own)
    parameters: list[dict[str, Any]] | None = None
    tp_sizes: list[int] | None = None
    # the layout in use: tp_size, ulysses_degree, ring_degree, cfg_degree
    parallel: dict[str, int] | None = None
    # how the transformer's weights are stored: "modelopt fp8", "modelopt nvfp4", "comfyui fp8",
    # "online fp8" (--quantization fp8); null: unquantized
    quantization: str | None = None


class ModelList(BaseModel):
    """Response of ``GET /v1/models``."""

    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# value checks (HTTP 400)


@dataclass(frozen=True)
class ImageJob:
    """A validated ``/v1/images/generations`` request: the engine's request and the output
    options (HTTP-only).

    Attributes:
        params: the resolved request (every field set, the seed drawn).
        response_format: ``b64_json`` or ``url``.
        output_format: ``png``, ``jpeg`` or ``webp``.
        output_compression: JPEG/WebP quality (``None``: the encoder's default).
    """

    params: SamplingParams
    response_format: str
    output_format: str
    output_compression: int | None

    @property
    def size(self) -> str:
        return f"{self.params.width}x{self.params.height}"


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _size_form(spec: RequestSpec) -> str:
    f, top = spec.spatial_factor, spec.limits.max_image_size or 4096
    example = max(f, min(1024, top) // f * f)  # an example this server accepts
    return (
        f"expected 'WxH' with W and H multiples of {f} in [{f}, {top}], e.g. '{example}x{example}'"
    )


def parse_size(size: str, spec: RequestSpec) -> tuple[int, int]:
    """Parse ``"WxH"`` and check it against the model and server bounds of ``spec`` (the rules
    of ``check_size``).

    Returns:
        ``(width, height)``.

    Raises:
        InvalidRequestError: ``param="size"``; the message gives the allowed form.
    """
    allowed = _size_form(spec)
    m = _SIZE_RE.match(size)
    if not m:
        shown = size if len(size) <= 40 else size[:40] + "..."
        raise _bad(f"invalid size {shown!r}: {allowed}", "size")
    width, height = int(m.group(1)), int(m.group(2))
    if width < 1 or height < 1:
        raise _bad(f"invalid size {size!r}: {allowed}", "size")
    try:
        check_size(height, "height", spec.spatial_factor, spec.limits.max_image_size)
        check_size(width, "width", spec.spatial_factor, spec.limits.max_image_size)
    except InvalidRequestError:
        raise _size_error(size, width, height, spec) from None
    return width, height


def _size_error(size: str, width: int, height: int, spec: RequestSpec) -> InvalidRequestError:
    """A ``height``/``width`` refusal of ``check_size``, worded for the HTTP ``size`` field: the
    server's bound when ``check_size`` with it alone (a factor of 1) refuses a side, else the
    model's factor."""
    top = spec.limits.max_image_size
    try:
        for name, value in (("height", height), ("width", width)):
            check_size(value, name, 1, top)
    except InvalidRequestError:
        reason = f"larger than the server's maximum {top} per side (--max-image-size)"
    else:
        reason = f"width and height must be multiples of {spec.spatial_factor} for this model"
    return _bad(f"invalid size {size!r}: {reason}; {_size_form(spec)}", "size")


def default_size(spec: RequestSpec) -> tuple[int, int]:
    """``(width, height)`` of a request without ``size``: the model's own default (a family's,
    or a model directory's, e.g. the demo's 64x64), shrunk to the server's largest side."""
    f, cap = spec.spatial_factor, spec.limits.max_image_size
    w, h = spec.defaults.width or 1024, spec.defaults.height or 1024
    if cap is not None:
        w, h = (max(f, min(v, cap) // f * f) for v in (w, h))
    return w, h


def sampling_params(
    body: BaseModel, spec: RequestSpec, size: tuple[int, int] | None, **fields: Any
) -> SamplingParams:
    """The served model's resolved request from a parsed body: every declared generation field
    the client set (:func:`declared_fields`), ``size`` as ``(width, height)``, and ``fields``
    (what the route spells otherwise: ``num_outputs_per_prompt`` from ``n``, ``num_frames``
    from ``seconds``).

    Raises:
        InvalidRequestError: a field the served model does not declare (naming it); every value
            rule of ``SamplingParams.validate`` (a ``height``/``width`` refusal is worded for
            ``size``).
    """
    values: dict[str, Any] = {"prompt": body.prompt}
    for name in body.model_fields_set:
        if name in _HTTP_SPELLED or name not in _GENERATION_FIELDS:
            continue
        value = getattr(body, name)
        if value is None:
            continue
        if _GENERATION_FIELDS[name].metadata.get("kind") == "lora":  # lora, stage_2_lora
            items = value if isinstance(value, list) else [value]
            value = [item.as_pair() for item in items]
        elif _GENERATION_FIELDS[name].metadata.get("kind") == "cache":
            value = _cache_text(value, name)
        values[name] = float(value) if isinstance(value, int) and _is_scale(name) else value
    if size is not None:
        values["width"], values["height"] = size
    values.update({k: v for k, v in fields.items() if v is not None})
    params = spec.params(**values)
    try:
        return spec.resolve(params)
    except InvalidRequestError as e:
        if e.param in ("height", "width") and size is not None:
            raise _size_error(f"{size[0]}x{size[1]}", size[0], size[1], spec) from None
        raise


def _cache_text(value: Any, name: str) -> Any:
    """A ``cache`` sent as the text of a JSON object (a form field: ``cache={"method":
    "fbcache"}``) as that object; other values as they are.

    Raises:
        InvalidRequestError: text that starts like an object but is not JSON (``param=name``).
    """
    if not isinstance(value, str) or not value.lstrip().startswith("{"):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        raise InvalidRequestError(
            f"{name} must be a method name or a JSON object {{method, threshold, fn, bn, "
            f"warmup}}, got {value[:60]!r}",
            param=name,
        ) from None


#: Every generation field any registered family declares (HTTP spelling aside).
_GENERATION_FIELDS = declared_fields()


def _is_scale(name: str) -> bool:
    f = _GENERATION_FIELDS.get(name)
    return f is not None and f.metadata.get("kind") == "scale"


def size_for_input(spec: RequestSpec, width: int, height: int) -> tuple[int, int]:
    """``(width, height)`` of an edit without ``size``: the input image's, scaled down (aspect
    kept) to the server's largest side and rounded down to the model's spatial factor."""
    f, cap = spec.spatial_factor, spec.limits.max_image_size
    scale = 1.0 if cap is None else min(1.0, cap / max(width, height))
    return tuple(max(f, int(v * scale) // f * f) for v in (width, height))


def image_job(
    body: BaseModel, spec: RequestSpec, auto_size: tuple[int, int] | None = None, **inputs: Any
) -> ImageJob:
    """Check a ``/v1/images/generations`` (or ``/edits``) body and translate it for the engine.

    The output options (``response_format``, ``output_format``, ...) are the HTTP layer's; every
    generation value is checked once, by :meth:`RequestSpec.resolve` (the CLI's and the Python
    API's rules) with the server's bounds (``spec`` carries them).

    Args:
        auto_size: ``(width, height)`` when the body has no ``size`` (or ``"auto"``); ``None``:
            the model's default (:func:`default_size`). An edit model (one that requires an
            image) given its images and no size makes the size its own rule gives (its
            defaults, or a size from the images), as from the CLI and the Python API.
        inputs: request fields the route decoded itself (``image``, ``mask_image``).

    Raises:
        InvalidRequestError: naming the field (``param``) and its allowed range.
    """
    if body.size in (None, "auto"):
        # an edit model sizes its output by its own rule (its defaults, or from the images)
        own_rule = "image" in spec.required_inputs and "image" in inputs
        size = None if own_rule else auto_size or default_size(spec)
    else:
        size = parse_size(body.size, spec)
    response_format = body.response_format or "b64_json"
    if response_format not in RESPONSE_FORMATS:
        raise _bad(
            f"response_format must be one of {list(RESPONSE_FORMATS)}, got {response_format!r}",
            "response_format",
        )
    output_format = (body.output_format or "png").lower()
    if output_format == "jpg":
        output_format = "jpeg"
    if output_format not in OUTPUT_FORMATS:
        raise _bad(
            f"output_format must be one of {list(OUTPUT_FORMATS)}, got {body.output_format!r}",
            "output_format",
        )
    if body.output_compression is not None and not 0 <= body.output_compression <= 100:
        raise _bad(
            f"output_compression must be an integer in [0, 100], got {body.output_compression}",
            "output_compression",
        )
    if body.stream:
        raise _bad("stream=true is not supported; omit it or send false", "stream")
    try:
        params = sampling_params(body, spec, size, num_outputs_per_prompt=body.n, **inputs)
    except InvalidRequestError as e:
        if e.param == "num_outputs_per_prompt":  # the HTTP spelling
            e.param = "n"
            e.message = e.message.replace("num_outputs_per_prompt", "n")
            e.args = (e.message,)
        raise
    return ImageJob(params, response_format, output_format, body.output_compression)


def validate_target(target: str, valid_targets: tuple[str, ...] | list[str]) -> str:
    """Check a LoRA ``target`` against the model's targets.

    Raises:
        InvalidRequestError: ``param="target"``, listing the valid targets for this model.
    """
    return check_target(target, valid_targets)


def validate_set_lora(req: SetLoRARequest, valid_targets: tuple[str, ...] | list[str]):
    """Check a ``set_lora`` body and normalise it, once, for ``engine.set_lora``.

    The rules are :func:`~sglang.multimodal_gen.lora.requests.normalize_set_lora`'s: a scalar or a
    one-element list applies to every nickname, other lists need one entry per nickname, and a
    nickname may appear once per target.

    Returns:
        ``SetLoRAArgs``: one entry per nickname in every list.

    Raises:
        InvalidRequestError: naming the field and the mismatch (``param`` is the field).
    """
    return normalize_set_lora(
        req.lora_nickname,
        req.lora_path,
        req.target,
        req.strength,
        req.merge_mode,
        valid_targets=valid_targets,
    )
