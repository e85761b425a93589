"""Request and response models of the HTTP API, and the value checks behind them.

Two levels of checking, mirroring the status codes of the design:

- *schema* (pydantic in strict mode, HTTP 422): a field has the wrong JSON type (``"n": "2"``,
  ``"seed": true`` and ``"guidance_scale": true`` are refused, an integer is accepted where a
  number is expected), a required field is missing, or an unknown field is sent (a misspelt
  ``num_inference_step`` must not be silently ignored).
  :func:`~.schema_errors.schema_error_message` words each error as one sentence naming the field
  (no pydantic type paths);
- *values* (:func:`validate_generation`, :func:`validate_set_lora`, HTTP 400): the type is right but
  the value is outside its range; each error names the field in ``param`` and states the range.
  The generation rules are :meth:`GenerationRequest.validate
  <sglang.multimodal_gen.runtime.request.GenerationRequest.validate>`'s, which the CLI and the
  Python API apply too; the LoRA rules (``set_lora`` list pairing, per-request ``lora``) are those
  of :mod:`sglang.multimodal_gen.lora.requests`, which the engine and the LoRA manager apply too.

OpenAI fields we accept but do not act on (``quality``, ``style``, ``background``, ``moderation``)
are declared so that the official client's requests validate. Nothing here imports FastAPI.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.requests import (
    check_target,
    normalize_set_lora,
    validate_composition,
)
from sglang.multimodal_gen.runtime.request import (
    MAX_PROMPT_CHARS,
    MAX_SEED,
    GenerationRequest,
    check_size,
)

__all__ = ["MAX_PROMPT_CHARS", "MAX_SEED"]  # re-exported: the rules live in runtime.request

RESPONSE_FORMATS = ("b64_json", "url")
OUTPUT_FORMATS = ("png", "jpeg", "webp")
DEFAULT_SIZE = "1024x1024"
# at most 6 digits per side: bounded before int() (a 5,000-digit side is refused as a form error)
# ASCII digits only (``\d`` alone takes full-width and other scripts' digits)
_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$", re.ASCII)


class _Strict(BaseModel):
    """Base: unknown fields are a schema error (422); types are strict (no ``"2"`` -> 2, no
    ``true`` -> 1; an integer is accepted where a number is expected)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class LoRASpec(_Strict):
    """One adapter of a per-request composition: a loaded ``name`` and its ``scale`` (strength)."""

    name: str
    scale: float = 1.0


class ImageGenerationRequest(_Strict):
    """Body of ``POST /v1/images/generations`` (OpenAI fields + engine extensions)."""

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
    # Engine extensions.
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    max_sequence_length: int | None = None
    negative_prompt: str | None = None
    lora: LoRASpec | list[LoRASpec] | None = None


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
    tp_sizes: list[int] | None = None
    # the layout in use: tp_size, ulysses_degree, ring_degree, cfg_degree
    parallel: dict[str, int] | None = None


class ModelList(BaseModel):
    """Response of ``GET /v1/models``."""

    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# value checks (HTTP 400)


@dataclass(frozen=True)
class Limits:
    """Bounds the server enforces on generation requests.

    Attributes:
        spatial_factor: width and height must be multiples of this (the model's VAE x patch size).
        max_image_size: largest width or height.
        max_images: largest ``n``.
        max_steps: largest ``num_inference_steps``.
        max_pixel_steps: largest ``n x num_frames x width x height x num_inference_steps``
            (``None``: no bound).
    """

    spatial_factor: int = 16
    max_image_size: int = 2048
    max_images: int = 8
    max_steps: int = 1000
    max_pixel_steps: int | None = None

    def request_limits(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The ``limits`` of :meth:`GenerationRequest.validate`: the model's (``defaults``) with
        the server's bounds on top (the server's image size is never above the model's)."""
        out = dict(defaults or {})
        out.update(
            max_image_size=self.max_image_size,
            max_num_images=self.max_images,
            max_inference_steps=self.max_steps,
            max_pixel_steps=self.max_pixel_steps,
        )
        return out


@dataclass(frozen=True)
class GenerationParams:
    """A validated generation request, in engine terms, plus the output options.

    ``engine_kwargs`` holds only the fields the client gave (others keep the engine's defaults) and
    is passed to ``GenerationRequest(**engine_kwargs)``.
    """

    engine_kwargs: dict
    width: int
    height: int
    n: int
    response_format: str
    output_format: str
    output_compression: int | None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def composition_key(self) -> tuple | None:
        """The per-request composition as a hashable key (``None`` = the global one)."""
        lora = self.engine_kwargs.get("lora")
        return None if lora is None else tuple(lora)


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _size_form(limits: Limits) -> str:
    f, top = limits.spatial_factor, limits.max_image_size
    example = max(f, min(1024, top) // f * f)  # an example this server accepts
    return (
        f"expected 'WxH' with W and H multiples of {f} in [{f}, {top}], e.g. '{example}x{example}'"
    )


def parse_size(size: str, limits: Limits) -> tuple[int, int]:
    """Parse ``"WxH"`` and check it against ``limits`` (the rules of
    :func:`~sglang.multimodal_gen.runtime.request.check_size`).

    Returns:
        ``(width, height)``.

    Raises:
        InvalidRequestError: ``param="size"``; the message gives the allowed form.
    """
    allowed = _size_form(limits)
    m = _SIZE_RE.match(size)
    if not m:
        shown = size if len(size) <= 40 else size[:40] + "..."
        raise _bad(f"invalid size {shown!r}: {allowed}", "size")
    width, height = int(m.group(1)), int(m.group(2))
    if width < 1 or height < 1:
        raise _bad(f"invalid size {size!r}: {allowed}", "size")
    try:
        check_size(height, width, limits.spatial_factor, limits.max_image_size)
    except InvalidRequestError:
        raise _size_error(size, width, height, limits) from None
    return width, height


def _size_error(size: str, width: int, height: int, limits: Limits) -> InvalidRequestError:
    """A ``height``/``width`` refusal of :func:`check_size`, worded for the HTTP ``size`` field."""
    if max(width, height) > limits.max_image_size:
        reason = (
            f"larger than the server's maximum {limits.max_image_size} per side (--max-image-size)"
        )
    else:
        reason = f"width and height must be multiples of {limits.spatial_factor} for this model"
    return _bad(f"invalid size {size!r}: {reason}; {_size_form(limits)}", "size")


def validate_generation(
    req: ImageGenerationRequest, limits: Limits, defaults: Mapping[str, Any] | None = None
) -> GenerationParams:
    """Check every value of a generation request and translate it for the engine.

    The output options (``response_format``, ``output_format``, ...) are the HTTP layer's; every
    generation value is checked by :meth:`GenerationRequest.validate
    <sglang.multimodal_gen.runtime.request.GenerationRequest.validate>` (the CLI's and the Python
    API's rules) with the server's bounds (:meth:`Limits.request_limits`).

    Args:
        defaults: the model's sampling defaults (``engine.defaults``): the default step count
            enters the pixel-steps budget.

    Returns:
        :class:`GenerationParams`; ``engine_kwargs`` uses the names of ``GenerationRequest``
        (``height``, ``width``, ``num_images``, ``lora`` as ``[(name, scale)]``...).

    Raises:
        InvalidRequestError: naming the field (``param``) and its allowed range.
    """
    d = defaults or {}
    if req.size in (None, "auto") and d.get("width") and d.get("height"):
        # the model's own default size (a family's, or a model directory's, e.g. the demo's 64x64)
        f, cap = limits.spatial_factor, limits.max_image_size
        w, h = (min(int(d[k]), cap) // f * f for k in ("width", "height"))
        size = f"{w}x{h}"
    elif req.size in (None, "auto"):
        # DEFAULT_SIZE, shrunk when the server's own limit is smaller.
        side = min(1024, limits.max_image_size // limits.spatial_factor * limits.spatial_factor)
        size = f"{side}x{side}"
    else:
        size = req.size
    width, height = parse_size(size, limits)

    response_format = req.response_format or "b64_json"
    if response_format not in RESPONSE_FORMATS:
        raise _bad(
            f"response_format must be one of {list(RESPONSE_FORMATS)}, got {response_format!r}",
            "response_format",
        )
    output_format = (req.output_format or "png").lower()
    if output_format == "jpg":
        output_format = "jpeg"
    if output_format not in OUTPUT_FORMATS:
        raise _bad(
            f"output_format must be one of {list(OUTPUT_FORMATS)}, got {req.output_format!r}",
            "output_format",
        )
    if req.output_compression is not None and not 0 <= req.output_compression <= 100:
        raise _bad(
            f"output_compression must be an integer in [0, 100], got {req.output_compression}",
            "output_compression",
        )
    if req.stream:
        raise _bad("stream=true is not supported; omit it or send false", "stream")

    kwargs: dict[str, Any] = {
        "prompt": req.prompt,
        "height": height,
        "width": width,
        "num_images": req.n,
    }
    for name in (
        "seed",
        "num_inference_steps",
        "guidance_scale",
        "true_cfg_scale",
        "max_sequence_length",
        "negative_prompt",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = float(value) if name.endswith("_scale") else value
    if req.lora is not None:
        kwargs["lora"] = validate_composition(req.lora, "lora")
    try:
        request = GenerationRequest(**kwargs).with_defaults(defaults or {})
        request.validate(limits.spatial_factor, limits.request_limits(defaults))
    except InvalidRequestError as e:
        if e.param in ("height", "width"):
            raise _size_error(size, width, height, limits) from None
        raise
    return GenerationParams(
        engine_kwargs=kwargs,
        width=width,
        height=height,
        n=req.n,
        response_format=response_format,
        output_format=output_format,
        output_compression=req.output_compression,
    )


def validate_target(target: str, valid_targets: tuple[str, ...] | list[str]) -> str:
    """Check a LoRA ``target`` against the model's targets.

    Raises:
        InvalidRequestError: ``param="target"``, listing the valid targets for this model.
    """
    return check_target(target, valid_targets)


def validate_set_lora(req: SetLoRARequest, valid_targets: tuple[str, ...] | list[str]) -> dict:
    """Check a ``set_lora`` body; return the keyword arguments for ``engine.set_lora``.

    The rules are :func:`~sglang.multimodal_gen.lora.requests.normalize_set_lora`'s: a scalar or a
    one-element list applies to every nickname, other lists need one entry per nickname, and a
    nickname may appear once per target.

    Returns:
        ``lora_nickname``, ``lora_path``, ``target``, ``strength`` as lists with one entry per
        nickname, and ``merge_mode``.

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
    ).engine_kwargs()
