"""``SamplingParams``: one generation request, the same object from the edge to the pipeline.

A request is built once at each edge (the HTTP body or form, ``sglang generate``'s arguments, the
Python API), resolved once against the served model (:meth:`RequestSpec.resolve`: the model's
defaults filled in, every value checked, the seed drawn) and handed as that object to the
pipeline. There is no second defaults pass and no other validation.

The fields every model takes are declared here (:class:`SamplingParams`; :class:`VideoSamplingParams`
adds the frame count and rate of video models). A model family declares the fields it adds as a
frozen dataclass subclass in its own config module, each field made with :func:`param`, so that
the HTTP schema, the CLI flags, the ``/v1/models`` entry and the checks derive from the
declaration; shared code never names a family's field. A field the served model does not
declare is refused naming it (:class:`~sglang.multimodal_gen.errors.InvalidRequestError`, HTTP 400).

Field kinds (``param(kind=...)``) and their rules, checked by :meth:`SamplingParams.validate`:

==========  =========================================================================
``text``    a string of at most :data:`MAX_PROMPT_CHARS` characters, valid Unicode
``size``    pixels: a positive multiple of the model's spatial factor, at most the
            smaller of the model's and the server's largest side
``count``   an integer >= 1, at most the limit its ``limit=`` names (if any)
``scale``   a finite number >= 0 (guidance weights)
``seed``    an integer in ``[0, MAX_SEED]`` (``torch.Generator.manual_seed``)
``lora``    a per-request adapter composition (``lora.requests.validate_composition``)
``image``   decoded input images (:class:`~sglang.multimodal_gen.image_inputs.InputImage`),
            at most ``max_input_images`` of them; only for a model whose ``inputs`` name it
``fraction`` a finite number in ``(0, 1]`` (an edit ``strength``)
``flag``    ``true`` or ``false`` (a switch)
``indices`` a list of integers >= 0 (e.g. block indices); kept as a tuple
``cache``   step caching of the DiT blocks (:func:`step_cache_value`): a method name
            (``"none"``, ``"fbcache"``, ``"dbcache"``) or ``{method, threshold, fn, bn,
            warmup}``; resolved to a ``StepCacheConfig``, supported by the model (its
            :attr:`RequestSpec.cache_blocks`) and allowed by the server
            (:attr:`RequestSpec.request_cache`)
==========  =========================================================================

Conditioning beyond text is declared by the model (:attr:`RequestSpec.inputs`, e.g. ``("text",
"image", "mask")``; :attr:`RequestSpec.required_inputs`, e.g. ``("image",)`` for an edit model).
A request that gives an input the model does not take, or leaves out one it requires, is refused
naming the field (``image``, ``mask_image``); so is a ``strength`` without an image, or for a
model whose defaults have no ``strength`` (it does not re-noise its input image).
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.requests import validate_composition

__all__ = [
    "MAX_FPS",
    "MAX_PROMPT_CHARS",
    "MAX_SEED",
    "RequestLimits",
    "RequestSpec",
    "SamplingParams",
    "VideoSamplingParams",
    "cache_json",
    "check_size",
    "check_text",
    "param",
    "step_cache_value",
]

#: Longest accepted ``prompt`` / ``negative_prompt`` (characters).
MAX_PROMPT_CHARS = 20000
#: Largest accepted ``seed`` (``torch.Generator.manual_seed`` takes 64-bit values).
MAX_SEED = 2**63 - 1
#: Largest accepted ``fps`` (frames per second of a video).
MAX_FPS = 120

_KINDS = (
    "text", "size", "count", "scale", "seed", "lora", "image", "fraction", "flag", "indices",
    "cache",
)  # fmt: skip


def param(
    kind: str,
    help: str,
    *,
    default: Any = None,
    limit: str | None = None,
    per_row: bool = False,
    cli: bool = True,
) -> Any:
    """A :class:`SamplingParams` field with its declaration.

    Args:
        kind: one of ``text``, ``size``, ``count``, ``scale``, ``seed``, ``lora`` (the rules in
            the module docstring).
        help: one sentence for ``--help``, the docs and ``/v1/models`` (no model names: the
            models that declare a field are listed next to it).
        default: ``None`` means "the model's default" (resolved by :meth:`RequestSpec.resolve`).
        limit: for ``count`` fields, the :class:`RequestLimits` attribute that bounds it.
        per_row: the field may differ between the requests of one batch (prompts, seeds,
            adapters); every other field must be equal for requests to share a denoising loop.
        cli: ``sglang generate`` takes it as ``--name-with-dashes``.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in _KINDS:
        raise ValueError(f"unknown parameter kind {kind!r}; one of {_KINDS}")
    meta = {"kind": kind, "help": help, "limit": limit, "per_row": per_row, "cli": cli}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RequestLimits:
    """Upper bounds of a request: the model's (what its position tables and text encoder cover)
    combined with the server's (``--max-image-size``, ``--max-n``, ``--max-steps``,
    ``--max-pixel-steps``). ``None``: no bound.

    Attributes:
        max_image_size: largest height / width (pixels).
        max_num_frames: largest ``num_frames`` (video models; 1 for image models).
        max_sequence_length: largest ``max_sequence_length`` (text-encoder tokens).
        max_inference_steps: largest ``num_inference_steps``.
        max_num_outputs_per_prompt: largest ``num_outputs_per_prompt`` (HTTP ``n``).
        max_pixel_steps: largest ``n x num_frames x width x height x num_inference_steps``.
        max_input_images: largest number of input images (``image``) a request may give.
    """

    max_image_size: int | None = 4096
    max_num_frames: int | None = 1
    max_sequence_length: int | None = 512
    max_inference_steps: int | None = None
    max_num_outputs_per_prompt: int | None = None
    max_pixel_steps: int | None = None
    max_input_images: int | None = 1

    def tightened(self, other: RequestLimits) -> RequestLimits:
        """The smaller bound of each pair (``None`` counts as no bound)."""

        def low(a, b):
            return b if a is None else a if b is None else min(a, b)

        return RequestLimits(
            **{f.name: low(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)}
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _range(low: int, high: int | None) -> str:
    return f"in [{low}, {high}]" if high is not None else f">= {low}"


def check_count(value: Any, name: str, high: int | None = None) -> int:
    """``value``: an integer in ``[1, high]`` (``high`` ``None``: no upper bound).

    Raises:
        InvalidRequestError: ``param=name``.
    """
    if not _is_int(value) or value < 1 or (high is not None and value > high):
        raise InvalidRequestError(
            f"{name} must be an integer {_range(1, high)}, got {value!r}", param=name
        )
    return value


def check_text(value: Any, name: str, max_chars: int = MAX_PROMPT_CHARS) -> str:
    """A prompt-like field: a string of at most ``max_chars`` characters that is valid Unicode.

    A lone UTF-16 surrogate (``"\\ud800"`` in JSON, or a byte that is not UTF-8 in a command
    line argument, which Python decodes to one) cannot be encoded for the tokenizer, the log or
    the answer, so it is refused here, where the field can be named.

    Raises:
        InvalidRequestError: ``param=name``.
    """
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"{name} must be a string, got {type(value).__name__}", param=name
        )
    if len(value) > max_chars:
        raise InvalidRequestError(
            f"{name} is longer than {max_chars} characters ({len(value)})", param=name
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{name} is not valid Unicode text: character {e.start} is a lone UTF-16 surrogate "
            f"({ascii(value[e.start])}), from an unpaired \\uXXXX escape or bytes that are not "
            "UTF-8",
            param=name,
        ) from None
    return value


def check_size(value: Any, name: str, spatial_factor: int, max_side: int | None = None) -> int:
    """A height or width: a positive integer multiple of ``spatial_factor``, at most ``max_side``.

    Raises:
        InvalidRequestError: ``param=name``.
    """
    if not _is_int(value) or value <= 0 or value % spatial_factor:
        raise InvalidRequestError(
            f"{name} must be a positive multiple of {spatial_factor}, got {value!r}", param=name
        )
    if max_side is not None and value > max_side:
        raise InvalidRequestError(f"{name} must be <= {max_side}, got {value}", param=name)
    return value


def check_scale(value: Any, name: str) -> float:
    """A guidance weight: a finite number >= 0.

    Raises:
        InvalidRequestError: ``param=name``.
    """
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise InvalidRequestError(f"{name} must be a finite number >= 0, got {value!r}", param=name)
    return float(value)


def check_fraction(value: Any, name: str) -> float:
    """A fraction such as an edit strength: a finite number in ``(0, 1]``.

    Raises:
        InvalidRequestError: ``param=name``.
    """
    if not _is_number(value) or not math.isfinite(value) or not 0 < value <= 1:
        raise InvalidRequestError(f"{name} must be a number in (0, 1], got {value!r}", param=name)
    return float(value)


def check_flag(value: Any, name: str) -> bool:
    """A switch: ``True`` or ``False`` (not ``1`` / ``"true"``).

    Raises:
        InvalidRequestError: ``param=name``.
    """
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def check_indices(value: Any, name: str) -> tuple[int, ...]:
    """A list (or tuple) of integers >= 0, such as block indices.

    Raises:
        InvalidRequestError: ``param=name``.
    """
    if not isinstance(value, list | tuple) or not all(_is_int(v) and v >= 0 for v in value):
        raise InvalidRequestError(
            f"{name} must be a list of integers >= 0, got {value!r}", param=name
        )
    return tuple(value)


def step_cache_value(value: Any, name: str = "cache"):
    """A request's step-cache choice as a ``StepCacheConfig``
    (:mod:`sglang.multimodal_gen.layers.step_cache`): the method's preset with the knobs given.

    Args:
        value: a method name (``"none"``, ``"fbcache"``, ``"dbcache"``, ...), a mapping
            ``{"method", <knob>: value, ...}`` whose knobs are ``StepCacheConfig``'s fields
            (``threshold``, ``fn``, ``bn``, ``warmup``, ...; each optional, ``method``
            required), or a ``StepCacheConfig`` (checked the same way). The knobs' ranges and
            which methods take them are ``StepCacheConfig.of``'s (the ``--cache-*`` flags'
            rules).
        name: the field, named by every error.

    Returns:
        The ``StepCacheConfig`` (method ``"none"``: no caching).

    Raises:
        InvalidRequestError: ``param=name``, the message starting with ``name`` (a knob as
            ``name.knob``): another type, an unknown key, a method that is unknown or not
            implemented, knobs given with ``"none"``, a knob of the wrong type, out of its range
            or of another method.
    """
    from sglang.multimodal_gen.layers.step_cache import (
        CACHE_METHODS,
        IMPLEMENTED_CACHE_METHODS,
        StepCacheConfig,
    )

    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(message, param=name)

    def shown(v: Any) -> str:  # a client's value, kept short in the message
        text = repr(v)
        return text if len(text) <= 60 else text[:57] + "..."

    types = {  # a server setting (MagCache's ratios file) is no request's knob
        f.name: str(f.type)
        for f in fields(StepCacheConfig)
        if f.name != "method" and not f.metadata.get("server")
    }
    if isinstance(value, StepCacheConfig):
        method, knobs = value.method, {}
        if value.enabled and method in IMPLEMENTED_CACHE_METHODS:
            # the knobs that differ from the method's preset or the class defaults (those of
            # another method keep the class defaults: not given)
            # (a knob the preset sets and the method does not take, e.g. magcache's fn = 0,
            # is no knob given)
            # a step limit of None is "no limit", given as -1 (None would be "the preset's")
            preset = StepCacheConfig.of(method)
            knobs = {}
            for k in types:
                v = getattr(value, k)
                if v == getattr(preset, k):
                    continue
                if v is not None:
                    knobs[k] = v
                elif k in ("max_cached_steps", "max_continuous_cached_steps"):
                    knobs[k] = -1
    elif isinstance(value, str):
        method, knobs = value, {}
    elif isinstance(value, Mapping):
        unknown = [k for k in value if k != "method" and k not in types]
        if unknown:
            raise bad(
                f"{name} has no key {shown(unknown[0])}; its keys: method, {', '.join(types)}"
            )
        method = value.get("method")
        if method is None:
            raise bad(f"{name}.method is required: one of {', '.join(IMPLEMENTED_CACHE_METHODS)}")
        if not isinstance(method, str):
            raise bad(
                f"{name}.method must be a string, one of {', '.join(IMPLEMENTED_CACHE_METHODS)}; "
                f"got {shown(method)}"
            )
        knobs = {k: value[k] for k in types if value.get(k) is not None}
    else:
        raise bad(
            f"{name} must be a method name or an object {{method, {', '.join(types)}}}, got "
            f"{type(value).__name__}"
        )
    if method not in CACHE_METHODS:
        raise bad(
            f"{name}.method {shown(method)} is unknown; choose from {', '.join(CACHE_METHODS)}"
        )
    if method not in IMPLEMENTED_CACHE_METHODS:
        raise bad(
            f"{name}.method {method!r} is not implemented yet; implemented: "
            f"{', '.join(IMPLEMENTED_CACHE_METHODS)}"
        )
    if method == "none":
        if knobs:
            raise bad(f"{name}: method 'none' takes no {', '.join(knobs)}")
        return StepCacheConfig()
    for k, v in knobs.items():  # JSON types; the ranges are StepCacheConfig.of's
        t = types[k]
        ok = (
            _is_number(v) and math.isfinite(v)
            if t.startswith("float")
            else _is_int(v)
            if t.startswith("int")
            else isinstance(v, str)
            if t.startswith("str")
            else True
        )
        if not ok:
            what = "a finite number" if t.startswith("float") else t.split(" ")[0]
            what = {"int": "an integer", "str": "a string"}.get(what, what)
            raise bad(f"{name}.{k} must be {what}, got {shown(v)}")
    try:
        return StepCacheConfig.of(method, **knobs)
    except ValueError as e:  # its messages name the --cache-* flags: name the request's keys
        message = re.sub(r"--cache-method\b", f"{name}.method", str(e))
        message = re.sub(
            r"--cache-(?:taylor-)?([a-z][a-z-]*)",
            lambda m: f"{name}.{m.group(1).replace('-', '_')}",
            message,
        )
        raise bad(message) from None


def cache_json(value: Any) -> Any:
    """A ``cache`` value as JSON: a ``StepCacheConfig`` as the request object that resolves to
    it (``StepCacheConfig.as_request``: the method's own knobs, no server setting, ``-1`` for
    no step limit; ``{"method": "none"}`` when off), other values as they are."""
    if hasattr(value, "as_request") and hasattr(value, "enabled"):
        return value.as_request()
    return value


def _check_cache(value: Any, name: str, spec: RequestSpec) -> None:
    """A ``cache`` value's own rules (:func:`step_cache_value`) and the model's: caching needs
    DiT blocks the model declares (:attr:`RequestSpec.cache_blocks`), ``fn + bn`` fewer than
    them.

    Raises:
        InvalidRequestError: ``param=name``.
    """
    cfg = step_cache_value(value, name)
    blocks = spec.cache_blocks
    if not cfg.enabled or blocks is None:
        return
    if blocks == 0:
        raise InvalidRequestError(
            f"{name}: {spec.display_name} models do not support step caching; send "
            f'{name}: "none" or leave it out',
            param=name,
        )
    fn = cfg.head_blocks(blocks)  # the dbcache preset's Fn scales with the blocks
    if fn + cfg.bn >= blocks:
        raise InvalidRequestError(
            f"{name}: fn {fn} + bn {cfg.bn} leave none of this model's {blocks} blocks to "
            "cache; lower fn or bn",
            param=name,
        )


def _check_images(value: Any, name: str, high: int | None) -> None:
    from sglang.multimodal_gen.image_inputs import InputImage

    many = name == "image"
    items = value if many else (value,)
    if many and (not isinstance(value, tuple) or not value):
        raise InvalidRequestError(f"{name} must be one or more images", param=name)
    if many and high is not None and len(items) > high:
        raise InvalidRequestError(
            f"{name}: {len(items)} images given; this model takes at most {high}", param=name
        )
    for x in items:
        if not isinstance(x, InputImage) or x.is_mask == many:
            what = "input images" if many else "a mask"
            raise InvalidRequestError(
                f"{name} must be {what} decoded at the edge (sglang.multimodal_gen.image_inputs)",
                param=name,
            )


def _check_steps_left(params: SamplingParams) -> None:
    """An image re-noised at ``strength`` runs the last ``n - int(n - n * strength)`` of its
    ``n`` steps (diffusers' ``get_timesteps``); a strength so small that none is left is refused
    here, before the request is queued.

    Raises:
        InvalidRequestError: ``param="strength"``.
    """
    s, n = params.strength, params.num_inference_steps
    if not params.image or s is None or n is None:
        return
    if n - int(max(n - min(n * s, n), 0)) < 1:
        raise InvalidRequestError(
            f"strength {s:g} x num_inference_steps {n} leaves no denoising step; raise "
            "strength or num_inference_steps",
            param="strength",
        )


def _images_as_inputs(params: SamplingParams) -> SamplingParams:
    """The Python API's spellings of images made :class:`InputImage` values: one image or a
    list for ``image`` (a tuple), Pillow images converted (no limits: the caller's own)."""
    from sglang.multimodal_gen.image_inputs import InputImage

    def one(x, i):
        if hasattr(x, "mode") and hasattr(x, "size") and not isinstance(x, InputImage):
            return InputImage.from_pil(x, f"image[{i}]")
        return x

    changes: dict[str, Any] = {}
    img = params.image
    if img is not None and not isinstance(img, tuple):
        img = tuple(img) if isinstance(img, list) else (img,)
    if img is not None:
        img = tuple(one(x, i) for i, x in enumerate(img))
        if img != params.image:
            changes["image"] = img
    mask = params.mask_image
    if mask is not None and hasattr(mask, "mode") and not isinstance(mask, InputImage):
        from sglang.multimodal_gen.image_inputs import mask_pixels

        changes["mask_image"] = InputImage(mask_pixels(mask), source="mask_image")
    return params.replace(**changes) if changes else params


@dataclass(frozen=True)
class SamplingParams:
    """One generation request (the fields every model takes).

    Fields left ``None`` take the served model's defaults when the request is resolved
    (:meth:`RequestSpec.resolve`); a resolved request has every field set and a seed. Families
    subclass it to declare their own fields (see the module docstring); build one for a served
    model with ``engine.spec.params(**fields)`` or pass this base class to the engine, which
    converts it.

    Attributes:
        prompt: the text prompt.
        negative_prompt: the text guided away from under classifier-free guidance.
        height, width: pixels, positive multiples of the model's spatial factor.
        num_inference_steps: denoising steps.
        guidance_scale: the model's guidance weight (the CFG weight, or the embedded guidance of
            guidance-distilled models).
        max_sequence_length: text-encoder tokens.
        seed: seeds the initial noise (``torch.Generator.manual_seed``); ``None`` draws one.
        num_outputs_per_prompt: images (or videos) for the prompt (HTTP ``n``).
        lora: per-request adapter composition ``((nickname, strength), ...)`` of loaded adapters
            (``{"name", "strength"}`` entries are accepted; ``scale`` is an alias of
            ``strength``); ``None`` uses the globally active composition, ``()`` none at all.
        image: input images (:class:`~sglang.multimodal_gen.image_inputs.InputImage`, RGB):
            the image to edit or re-noise, or the reference images of an edit model.
        mask_image: the inpainting mask (:class:`~sglang.multimodal_gen.image_inputs.InputImage`,
            255 = edit), the size of the first image.
        strength: how much of the input image is re-noised (diffusers' ``strength``: 1 starts
            from pure noise, 0.3 keeps most of the image; ``strength x num_inference_steps``
            steps run).
        cache: this request's step caching of the DiT blocks: a method name or ``{method,
            threshold, fn, bn, warmup}`` (:func:`step_cache_value`), resolved to a
            ``StepCacheConfig``; ``None`` takes the served model's (``--cache-method``). The
            server may refuse the field (:attr:`RequestSpec.request_cache`).
    """

    prompt: str = param("text", "the text prompt", per_row=True)
    negative_prompt: str | None = param(
        "text", "the prompt guided away from under classifier-free guidance", per_row=True
    )
    height: int | None = param("size", "image height in pixels")
    width: int | None = param("size", "image width in pixels")
    num_inference_steps: int | None = param("count", "denoising steps", limit="max_inference_steps")
    guidance_scale: float | None = param(
        "scale",
        "the guidance weight: the CFG weight, or the embedded guidance of guidance-distilled "
        "models",
    )
    max_sequence_length: int | None = param(
        "count", "text-encoder tokens", limit="max_sequence_length"
    )
    seed: int | None = param("seed", "seed of the initial noise (default: random)", per_row=True)
    num_outputs_per_prompt: int | None = param(
        "count",
        "images (or videos) generated for the prompt",
        default=1,
        limit="max_num_outputs_per_prompt",
    )
    lora: tuple[tuple[str, float], ...] | None = param(
        "lora",
        "adapters for this request: [{name, strength}] of loaded adapters; null: the active ones",
        per_row=True,
        cli=False,
    )
    image: tuple[Any, ...] | None = param(
        "image", "input images: the image to edit or re-noise, or reference images",
        per_row=True, cli=False,
    )  # fmt: skip
    mask_image: Any = param(
        "image", "inpainting mask, the size of the first image: white (or transparent) is edited",
        per_row=True, cli=False,
    )  # fmt: skip
    strength: float | None = param(
        "fraction",
        "how much of the input image is re-noised: 1 starts from noise, lower keeps more of it",
    )
    cache: Any = param(
        "cache",
        "step caching of the DiT blocks for this request: a method (none, fbcache, dbcache) or "
        "{method, threshold, fn, bn, warmup}; null: the server's",
        cli=False,
    )

    # ------------------------------------------------------------------ declarations
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every field of this class, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def declared(cls, name: str) -> dataclasses.Field | None:
        """The field ``name`` of this class, or ``None``."""
        return next((f for f in fields(cls) if f.name == name), None)

    @classmethod
    def own_fields(cls) -> tuple[str, ...]:
        """Fields this class adds to :class:`SamplingParams` (a family's or a modality's)."""
        base = {f.name for f in fields(SamplingParams)}
        return tuple(f.name for f in fields(cls) if f.name not in base)

    @classmethod
    def per_row_fields(cls) -> frozenset[str]:
        """Fields that may differ between the requests of one batch."""
        return frozenset(f.name for f in fields(cls) if f.metadata.get("per_row"))

    # ------------------------------------------------------------------ values
    def set_fields(self) -> dict[str, Any]:
        """``{name: value}`` of the fields that are not ``None``."""
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` (an unresolved request: it is resolved again when used)."""
        return dataclasses.replace(self, **changes)

    @property
    def resolved(self) -> bool:
        """Whether :meth:`RequestSpec.resolve` produced this object (every field set)."""
        return self.__dict__.get("_resolved_for") is not None

    def validate(self, spec: RequestSpec) -> None:
        """Check every field that is set against ``spec``: the one set of value rules.

        Types are strict: ``True`` is not an integer nor a number, ``"2"`` is not an integer.
        The pixel-steps budget is checked once height, width and steps are known.

        Raises:
            InvalidRequestError: naming the field (``param``) and the allowed values.
        """
        limits = spec.limits
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name != "prompt":
                continue
            kind = f.metadata.get("kind")
            if kind == "text":
                check_text(value, f.name)
            elif kind == "size":
                check_size(value, f.name, spec.spatial_factor, limits.max_image_size)
            elif kind == "count":
                top = getattr(limits, f.metadata["limit"]) if f.metadata.get("limit") else None
                check_count(value, f.name, top)
            elif kind == "scale":
                check_scale(value, f.name)
            elif kind == "seed":
                if not _is_int(value) or not 0 <= value <= MAX_SEED:
                    raise InvalidRequestError(
                        f"seed must be an integer in [0, {MAX_SEED}] or null, got {value!r}",
                        param="seed",
                    )
            elif kind == "lora":
                validate_composition(value, f.name)
            elif kind == "image":
                _check_images(value, f.name, limits.max_input_images)
            elif kind == "fraction":
                check_fraction(value, f.name)
            elif kind == "flag":
                check_flag(value, f.name)
            elif kind == "indices":
                check_indices(value, f.name)
            elif kind == "cache":
                _check_cache(value, f.name, spec)
        self._check_budget(limits)
        self.check(spec)

    def check(self, spec: RequestSpec) -> None:
        """Rules of a family's own fields beyond their kind's (default: none)."""

    def conform(self, spec: RequestSpec) -> dict[str, Any]:
        """Changes that bring a valid request to what the model actually produces (default:
        none); :meth:`RequestSpec.resolve` applies them, so the resolved request says what the
        output will be."""
        return {}

    def _check_budget(self, limits: RequestLimits) -> None:
        budget = limits.max_pixel_steps
        steps = self.num_inference_steps
        if budget is None or None in (self.height, self.width, steps):
            return
        n = self.num_outputs_per_prompt or 1
        frames = getattr(self, "num_frames", None) or 1
        cost = n * frames * self.height * self.width * steps
        if cost <= budget:
            return
        param_name = (
            "num_outputs_per_prompt"
            if n > 1
            else "num_frames"
            if frames > 1
            else "num_inference_steps"
        )
        what = "n x num_frames" if frames > 1 else "n"
        count = f"{n} x {frames}" if frames > 1 else f"{n}"
        raise InvalidRequestError(
            f"this request costs {what} x width x height x num_inference_steps = "
            f"{count} x {self.width} x {self.height} x {steps} = {cost} pixel-steps, "
            f"over this server's budget of {budget} (--max-pixel-steps); lower {what}, "
            "size or num_inference_steps",
            param=param_name,
        )

    def batch_key(self) -> tuple:
        """Requests with equal keys can share a denoising loop: every field must match but the
        per-row ones (prompts, seed, adapters, input images); the presence of a negative prompt
        and the sizes of the input images and mask count too (they change CFG and the shapes).
        Of a ``cache`` only what one DiT call needs common counts: on or off and, when on,
        ``fn`` and ``bn`` (the step cache decides per request, with each request's method,
        threshold and warmup, so those may differ within a batch)."""
        fixed = tuple(
            (f.name, _batch_part(f, getattr(self, f.name)))
            for f in fields(self)
            if not f.metadata.get("per_row")
        )
        shapes = tuple(x.size for x in self.image or ())
        mask = self.mask_image.size if self.mask_image is not None else None
        return (type(self), fixed, self.negative_prompt is None, shapes, mask)

    def guidance_values(self) -> dict[str, float]:
        """``{name: value}`` of the guidance weights that are set (fields of kind ``scale``)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.metadata.get("kind") == "scale" and getattr(self, f.name) is not None
        }


def _batch_part(f: dataclasses.Field, value: Any) -> Any:
    """What of a non-per-row field's value requests sharing a denoising loop must agree on: a
    resolved ``cache`` only its ``(fn, bn)`` (``None``: off), any other field all of it."""
    if f.metadata.get("kind") != "cache" or not hasattr(value, "enabled"):
        return value
    return (value.fn, value.bn) if value.enabled else None


@dataclass(frozen=True)
class VideoSamplingParams(SamplingParams):
    """The fields of a video model: :class:`SamplingParams` plus the frame count and rate."""

    num_frames: int | None = param("count", "frames of the video", limit="max_num_frames")
    fps: int | None = param("count", "frames per second of the video", limit=None)

    def check(self, spec: RequestSpec) -> None:
        if self.fps is not None:
            check_count(self.fps, "fps", MAX_FPS)

    def conform(self, spec: RequestSpec) -> dict[str, Any]:
        """``num_frames`` brought to the model's form ``frame_step x k + 1`` (a video VAE that
        compresses time by ``frame_step`` keeps the first frame alone) as diffusers' video
        pipelines do, ``n // frame_step x frame_step + 1``: at ``frame_step`` 4, 6 frames are 5
        and 8 are 9."""
        n, step = self.num_frames, spec.frame_step
        if n is None or step <= 1 or n % step == 1:
            return {}
        return {"num_frames": n // step * step + 1}


@dataclass(frozen=True)
class RequestSpec:
    """What one served model accepts: its parameter class, defaults and limits.

    Built by the pipeline from its family's declaration (:meth:`for_model`), and tightened with
    the server's bounds (:meth:`with_limits`). Picklable (TP workers send it to the engine).

    Attributes:
        family: the family id (``/v1/models``'s ``family``).
        display_name: the family's name in messages.
        params_class: the family's :class:`SamplingParams` subclass.
        defaults: an instance of ``params_class`` holding the model's default of every field.
        limits: the bounds (:class:`RequestLimits`).
        spatial_factor: height and width must be multiples of it.
        outputs: ``"image"`` or ``"video"``.
        inputs: the conditioning the model takes (``("text",)``; ``"image"``, ``"mask"``).
        required_inputs: the conditioning every request must give (``("text",)``; an edit
            model adds ``"image"``).
        frame_step: a video model makes ``frame_step x k + 1`` frames (its VAE's temporal
            compression); other frame counts are rounded down to that form when resolved.
        cache_blocks: the blocks step caching may span (the fewest of the model's denoisers'
            block sequences); 0: the model does not support step caching (a request asking
            for it is refused), ``None``: not known (no check).
        request_cache: whether a request may choose its own step caching (the ``cache``
            field); ``False`` (``sglang serve --cache-request-policy deny``) refuses a request
            that sets it, and every request runs with the model's default (the server's
            ``--cache-method``).
    """

    family: str
    display_name: str
    params_class: type[SamplingParams]
    defaults: SamplingParams
    limits: RequestLimits
    spatial_factor: int = 16
    outputs: str = "image"
    inputs: tuple[str, ...] = ("text",)
    frame_step: int = 1
    required_inputs: tuple[str, ...] = ("text",)
    cache_blocks: int | None = None
    request_cache: bool = True

    @classmethod
    def generic(cls) -> RequestSpec:
        """A spec of no particular model: the common fields, spatial factor 1, no bounds (the
        checks that can run before a model is loaded: ``sglang generate`` runs them first)."""
        none = RequestLimits(**{f.name: None for f in fields(RequestLimits)})
        return cls("", "any", SamplingParams, SamplingParams(), none, spatial_factor=1)

    def check_values(self, values: Mapping[str, Any]) -> None:
        """Check the ``values`` of the fields this spec's class declares (others are left to
        the model's spec), without defaults.

        Raises:
            InvalidRequestError: as :meth:`SamplingParams.validate`.
        """
        names = set(self.params_class.field_names())
        self.params_class(**{k: v for k, v in values.items() if k in names}).validate(self)

    def with_limits(self, limits: RequestLimits) -> RequestSpec:
        """This spec with ``limits`` applied on top (each bound the smaller of the two)."""
        return dataclasses.replace(self, limits=self.limits.tightened(limits))

    # ------------------------------------------------------------------ building requests
    def params(self, **values: Any) -> SamplingParams:
        """A request of this model from field values (an edge: HTTP, CLI, Python).

        Raises:
            InvalidRequestError: a field this model does not declare (``param`` names it);
                ``prompt`` missing.
        """
        self._check_names(values)
        if "prompt" not in values:
            raise InvalidRequestError("prompt is required", param="prompt")
        return self.params_class(**values)

    def _check_names(self, values: Mapping[str, Any]) -> None:
        known = set(self.params_class.field_names())
        unknown = [k for k in values if k not in known]
        if unknown:
            raise InvalidRequestError(
                f"{unknown[0]} is not a parameter of {self.display_name} models; their "
                f"parameters: {', '.join(sorted(known))}",
                param=unknown[0],
            )

    def convert(self, params: SamplingParams) -> SamplingParams:
        """``params`` as an instance of this model's class (a base :class:`SamplingParams`
        from the Python API, or another family's class whose extra fields are unset).

        Raises:
            InvalidRequestError: a set field this model does not declare.
        """
        if type(params) is self.params_class:
            return params
        values = params.set_fields()
        if "num_outputs_per_prompt" in values and values["num_outputs_per_prompt"] == 1:
            values.pop("num_outputs_per_prompt")
        self._check_names(values)
        return self.params_class(**{"prompt": params.prompt, **values})

    def resolve(self, params: SamplingParams) -> SamplingParams:
        """The request as the pipeline runs it: this model's class, every unset field from the
        model's defaults, checked (:meth:`SamplingParams.validate`), brought to what the model
        produces (:meth:`SamplingParams.conform`: a video's frame count), the seed drawn when unset
        (the one place a seed is drawn), the adapter composition normalised. A request already
        resolved for this model (under these limits or tighter ones: the server's) is returned
        as is, so a request is validated once.

        Raises:
            InvalidRequestError: as :meth:`SamplingParams.validate` and :meth:`convert`.
        """
        if self.accepts(params):
            return params
        params = _images_as_inputs(self.convert(params))
        self._check_inputs(params)
        self._check_cache_choice(params)
        fill = {
            f.name: getattr(self.defaults, f.name)
            for f in fields(params)
            if getattr(params, f.name) is None and getattr(self.defaults, f.name) is not None
        }
        if not params.image:  # the strength of an input image: none, none to fill
            fill.pop("strength", None)
        filled = params.replace(**fill)
        filled.validate(self)  # checked before anything else is drawn
        _check_steps_left(filled)
        changes: dict[str, Any] = dict(fill)
        conformed = filled.conform(self)
        if conformed:  # e.g. more frames than asked for: within the bounds too
            filled.replace(**conformed).validate(self)
            changes.update(conformed)
        if params.seed is None:
            changes["seed"] = secrets.randbits(63)
        for f in fields(params):  # ``lora`` and a family's own adapter fields (kind ``lora``)
            value = getattr(params, f.name)
            if f.metadata.get("kind") == "lora" and value is not None:
                changes[f.name] = tuple(validate_composition(value, f.name))
        for f in fields(params):  # ``cache``: the StepCacheConfig it stands for
            value = changes.get(f.name, getattr(params, f.name))
            if f.metadata.get("kind") == "cache" and value is not None:
                changes[f.name] = step_cache_value(value, f.name)
        params = dataclasses.replace(params, **changes)  # a new object, never the caller's
        object.__setattr__(params, "_resolved_for", (self.key, self.limits))
        return params

    def _check_cache_choice(self, params: SamplingParams) -> None:
        """A ``cache`` the request sets itself, on a server that does not allow it.

        Raises:
            InvalidRequestError: ``param`` the field.
        """
        if self.request_cache:
            return
        for f in fields(params):
            if f.metadata.get("kind") == "cache" and getattr(params, f.name) is not None:
                raise InvalidRequestError(
                    f"{f.name}: this server does not let a request choose its step caching "
                    f"(--cache-request-policy deny); leave {f.name} out",
                    param=f.name,
                )

    def _check_inputs(self, params: SamplingParams) -> None:
        """The conditioning of a request against what the model takes and requires."""
        takes_image = "image" in self.inputs
        if params.image is not None and not takes_image:
            raise InvalidRequestError(
                f"{self.display_name} models take no input image (their inputs: "
                f"{', '.join(self.inputs)})",
                param="image",
            )
        if "image" in self.required_inputs and not params.image:
            raise InvalidRequestError(
                f"{self.display_name} models need an input image (image)", param="image"
            )
        if params.mask_image is not None:
            if "mask" not in self.inputs:
                raise InvalidRequestError(
                    f"{self.display_name} models take no mask (their inputs: "
                    f"{', '.join(self.inputs)})",
                    param="mask_image",
                )
            if not params.image:
                raise InvalidRequestError(
                    "mask_image needs the image it masks (image)", param="mask_image"
                )
            _check_images(params.mask_image, "mask_image", None)
            _check_images(params.image, "image", None)
            if params.mask_image.size != params.image[0].size:
                (mw, mh), (iw, ih) = params.mask_image.size, params.image[0].size
                raise InvalidRequestError(
                    f"mask_image is {mw}x{mh} but the image is {iw}x{ih}; they must be the "
                    "same size",
                    param="mask_image",
                )
        if params.strength is not None:
            if self.defaults.strength is None:
                raise InvalidRequestError(
                    f"{self.display_name} models do not re-noise their input image: strength "
                    "does not apply",
                    param="strength",
                )
            if not params.image:
                raise InvalidRequestError(
                    "strength applies to an input image; give image", param="strength"
                )

    def accepts(self, params: SamplingParams) -> bool:
        """Whether ``params`` was resolved for this model under limits at least as tight as
        this spec's (the server's are): then it is valid here as it is."""
        mark = params.__dict__.get("_resolved_for")
        if mark is None or mark[0] != self.key:
            return False
        used = mark[1]
        return used.tightened(self.limits) == used

    @property
    def key(self) -> tuple:
        """The model a request is resolved for (family, parameter class, spatial factor)."""
        return (self.family, self.params_class.__qualname__, self.spatial_factor)

    # ------------------------------------------------------------------ describing
    def parameters(self) -> list[dict[str, Any]]:
        """``[{name, kind, help, default}]`` of this model's fields (``/v1/models``)."""
        out = []
        for f in fields(self.params_class):
            default = cache_json(getattr(self.defaults, f.name))
            out.append(
                {
                    "name": f.name,
                    "kind": f.metadata.get("kind"),
                    "help": f.metadata.get("help"),
                    "default": list(default) if isinstance(default, tuple) else default,
                }
            )
        return out

    def as_dict(self) -> dict[str, Any]:
        """The model's defaults and limits as one flat JSON-able dict (``engine.defaults``):
        every field's default, ``max_image_size``, ``max_num_frames``,
        ``max_sequence_length_limit``, ``modality`` (``outputs``) and ``inputs``."""
        out = {
            f.name: cache_json(getattr(self.defaults, f.name))
            for f in fields(self.params_class)
            if f.name not in ("prompt", "lora", "seed", "image", "mask_image")
        }
        out.update(
            max_image_size=self.limits.max_image_size,
            max_num_frames=self.limits.max_num_frames,
            max_sequence_length_limit=self.limits.max_sequence_length,
            modality=self.outputs,
            inputs=list(self.inputs),
            required_inputs=list(self.required_inputs),
        )
        return out
