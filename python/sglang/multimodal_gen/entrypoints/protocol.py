"""Request and response models of the HTTP API, and the value checks behind them.

Two levels of checking, mirroring the status codes of the design:

- *schema* (pydantic, HTTP 422): a field has the wrong JSON type, a required field is missing, or an
  unknown field is sent (a misspelt ``num_inference_step`` must not be silently ignored);
- *values* (:func:`validate_generation`, :func:`validate_set_lora`, HTTP 400): the type is right but
  the value is outside its range; each error names the field in ``param`` and states the range.
  The LoRA rules (``set_lora`` list pairing, per-request ``lora``) are those of
  :mod:`sglang.multimodal_gen.lora.requests`, which the engine and the LoRA manager apply too.

OpenAI fields we accept but do not act on (``quality``, ``style``, ``background``, ``moderation``)
are declared so that the official client's requests validate. Nothing here imports FastAPI.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.requests import (
    check_target,
    normalize_set_lora,
    validate_composition,
)

RESPONSE_FORMATS = ("b64_json", "url")
OUTPUT_FORMATS = ("png", "jpeg", "webp")
DEFAULT_SIZE = "1024x1024"
MAX_PROMPT_CHARS = 20000
MAX_SEED = 2**63 - 1
_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


class _Strict(BaseModel):
    """Base: unknown fields are a schema error (422)."""

    model_config = ConfigDict(extra="forbid")


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
    """

    spatial_factor: int = 16
    max_image_size: int = 2048
    max_images: int = 8
    max_steps: int = 1000


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


def parse_size(size: str, limits: Limits) -> tuple[int, int]:
    """Parse ``"WxH"`` and check it against ``limits``.

    Returns:
        ``(width, height)``.

    Raises:
        InvalidRequestError: ``param="size"``; the message gives the allowed form.
    """
    allowed = (
        f"expected 'WxH' with W and H multiples of {limits.spatial_factor} in "
        f"[{limits.spatial_factor}, {limits.max_image_size}], e.g. '1024x1024'"
    )
    m = _SIZE_RE.match(size)
    if not m:
        raise _bad(f"invalid size {size!r}: {allowed}", "size")
    width, height = int(m.group(1)), int(m.group(2))
    if width < 1 or height < 1:
        raise _bad(f"invalid size {size!r}: {allowed}", "size")
    if width % limits.spatial_factor or height % limits.spatial_factor:
        raise _bad(
            f"invalid size {size!r}: width and height must be multiples of "
            f"{limits.spatial_factor} for this model; {allowed}",
            "size",
        )
    if width > limits.max_image_size or height > limits.max_image_size:
        raise _bad(
            f"invalid size {size!r}: larger than the server's maximum {limits.max_image_size} "
            f"per side (--max-image-size); {allowed}",
            "size",
        )
    return width, height


def _finite(value: float, param: str, low: float | None = None) -> float:
    if not math.isfinite(value) or (low is not None and value < low):
        bound = f">= {low}" if low is not None else ""
        raise _bad(f"{param} must be a finite number {bound}, got {value}".strip(), param)
    return float(value)


def validate_generation(req: ImageGenerationRequest, limits: Limits) -> GenerationParams:
    """Check every value of a generation request and translate it for the engine.

    Returns:
        :class:`GenerationParams`; ``engine_kwargs`` uses the names of ``GenerationRequest``
        (``height``, ``width``, ``num_images``, ``lora`` as ``[(name, scale)]``...).

    Raises:
        InvalidRequestError: naming the field (``param``) and its allowed range.
    """
    if len(req.prompt) > MAX_PROMPT_CHARS:
        raise _bad(f"prompt is longer than {MAX_PROMPT_CHARS} characters", "prompt")
    if not 1 <= req.n <= limits.max_images:
        raise _bad(f"n must be an integer in [1, {limits.max_images}], got {req.n}", "n")
    if req.size in (None, "auto"):
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
    if req.seed is not None:
        if not 0 <= req.seed <= MAX_SEED:
            raise _bad(f"seed must be an integer in [0, {MAX_SEED}], got {req.seed}", "seed")
        kwargs["seed"] = req.seed
    if req.num_inference_steps is not None:
        if not 1 <= req.num_inference_steps <= limits.max_steps:
            raise _bad(
                f"num_inference_steps must be an integer in [1, {limits.max_steps}], "
                f"got {req.num_inference_steps}",
                "num_inference_steps",
            )
        kwargs["num_inference_steps"] = req.num_inference_steps
    if req.guidance_scale is not None:
        kwargs["guidance_scale"] = _finite(req.guidance_scale, "guidance_scale", low=0.0)
    if req.true_cfg_scale is not None:
        kwargs["true_cfg_scale"] = _finite(req.true_cfg_scale, "true_cfg_scale", low=0.0)
    if req.max_sequence_length is not None:
        if req.max_sequence_length < 1:
            raise _bad(
                f"max_sequence_length must be an integer >= 1, got {req.max_sequence_length}",
                "max_sequence_length",
            )
        kwargs["max_sequence_length"] = req.max_sequence_length
    if req.negative_prompt is not None:
        if len(req.negative_prompt) > MAX_PROMPT_CHARS:
            raise _bad(
                f"negative_prompt is longer than {MAX_PROMPT_CHARS} characters", "negative_prompt"
            )
        kwargs["negative_prompt"] = req.negative_prompt
    if req.lora is not None:
        kwargs["lora"] = validate_composition(req.lora, "lora")
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
