"""The generation request handed to :class:`~sglang.multimodal_gen.runtime.DiffusionEngine`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.requests import validate_composition

__all__ = ["MAX_PROMPT_CHARS", "MAX_SEED", "GenerationRequest", "check_size", "check_text"]

#: Longest accepted ``prompt`` / ``negative_prompt`` (characters).
MAX_PROMPT_CHARS = 20000
#: Largest accepted ``seed`` (``torch.Generator.manual_seed`` takes 64-bit values).
MAX_SEED = 2**63 - 1


@dataclass
class GenerationRequest:
    """One text-to-image request. Fields left ``None`` take the model family's defaults
    (:meth:`with_defaults`; e.g. 8 steps and guidance 0 for Z-Image-Turbo, 28 steps and
    guidance 3.5 for Flux.1 [dev]).

    Attributes:
        prompt: the text prompt.
        negative_prompt: used by CFG (Z-Image: when ``guidance_scale > 0``; Flux: with
            ``true_cfg_scale > 1``).
        height, width: pixels, positive multiples of the engine's ``spatial_factor``.
        num_inference_steps: denoising steps (>= 1).
        guidance_scale: the family's guidance: the CFG weight (Z-Image; ``0`` disables CFG) or
            the distilled guidance embedding (Flux.1 [dev]).
        true_cfg_scale: real CFG weight for families with embedded guidance (``1``: off).
        max_sequence_length: text-encoder token length.
        num_frames: frames of a video (video models; 1 for images).
        fps: frames per second of the written video (video models; output only).
        guidance_scale_2: guidance of the second (low-noise) expert of two-expert models.
        seed: seeds the initial latents (``torch.Generator().manual_seed``); ``None`` draws one.
        num_images: images for this prompt (one latent batch).
        lora: per-request adapter composition ``[(nickname, strength), ...]`` of loaded
            adapters; ``None`` uses the globally active composition, ``[]`` none at all (rules:
            :func:`~sglang.multimodal_gen.lora.requests.validate_composition`).
    """

    prompt: str
    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    num_images: int = 1
    lora: list[tuple[str, float]] | None = None
    true_cfg_scale: float | None = None
    max_sequence_length: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    guidance_scale_2: float | None = None

    _DEFAULTED = (
        "height",
        "width",
        "num_inference_steps",
        "guidance_scale",
        "true_cfg_scale",
        "max_sequence_length",
        "num_frames",
        "fps",
        "guidance_scale_2",
    )

    def with_defaults(self, defaults: Mapping[str, Any]) -> GenerationRequest:
        """A copy with every ``None`` field of :attr:`_DEFAULTED` taken from ``defaults`` (the
        family's ``SamplingDefaults.as_dict()``)."""
        fill = {k: defaults.get(k) for k in self._DEFAULTED if getattr(self, k) is None}
        return replace(self, **fill) if fill else self

    def validate(self, spatial_factor: int = 16, limits: Mapping[str, Any] | None = None) -> None:
        """Check every field that is set: the one set of value rules of a generation.

        The CLI (``sglang generate``), the Python API (:meth:`DiffusionEngine.generate`) and the
        HTTP server all call this, so a value is accepted or refused with the same message
        wherever it enters. Types are strict: ``True`` is not an integer nor a number, ``"2"`` is
        not an integer. ``None`` fields take the family's defaults (see :meth:`with_defaults`,
        which the engine applies before calling this).

        Args:
            spatial_factor: height and width must be multiples of it.
            limits: upper bounds; every key is optional (absent or ``None``: no bound). The
                family's ``SamplingDefaults.as_dict()`` gives ``max_image_size``,
                ``max_num_frames`` and ``max_sequence_length_limit``; the server adds
                ``max_num_images`` (``n``), ``max_inference_steps`` and ``max_pixel_steps``
                (``n x num_frames x width x height x steps``, checked once height, width and
                steps are all known; ``num_frames`` unset counts as 1).

        Raises:
            InvalidRequestError: naming the field (``param``) and the allowed values.
        """
        limits = limits or {}
        check_text(self.prompt, "prompt")
        if self.negative_prompt is not None:
            check_text(self.negative_prompt, "negative_prompt")
        check_size(self.height, self.width, spatial_factor, limits.get("max_image_size"))
        steps, frames = self.num_inference_steps, self.num_frames
        if steps is not None:
            _check_count(steps, "num_inference_steps", limits.get("max_inference_steps"))
        if frames is not None:
            _check_count(frames, "num_frames", limits.get("max_num_frames"))
        for name in ("guidance_scale", "true_cfg_scale", "guidance_scale_2"):
            g = getattr(self, name)
            if g is None:
                continue
            if not _is_number(g) or not math.isfinite(g) or g < 0:
                raise InvalidRequestError(
                    f"{name} must be a finite number >= 0, got {g!r}", param=name
                )
        if self.max_sequence_length is not None:
            top = limits.get("max_sequence_length_limit") or None
            _check_count(self.max_sequence_length, "max_sequence_length", top)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequestError(
                f"seed must be an integer in [0, {MAX_SEED}] or null, got {self.seed!r}",
                param="seed",
            )
        n = self.num_images
        _check_count(n, "n (images per request)", limits.get("max_num_images"), param="n")
        budget = limits.get("max_pixel_steps")
        if budget is not None and None not in (self.height, self.width, steps):
            frames = frames or 1
            cost = n * frames * self.height * self.width * steps
            if cost > budget:
                param = "n" if n > 1 else "num_frames" if frames > 1 else "num_inference_steps"
                what = "n x num_frames" if frames > 1 else "n"
                count = f"{n} x {frames}" if frames > 1 else f"{n}"
                raise InvalidRequestError(
                    f"this request costs {what} x width x height x num_inference_steps = "
                    f"{count} x {self.width} x {self.height} x {steps} = {cost} pixel-steps, "
                    f"over this server's budget of {budget} (--max-pixel-steps); lower {what}, "
                    "size or num_inference_steps",
                    param=param,
                )
        validate_composition(self.lora, "lora")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _range(low: int, high: int | None) -> str:
    return f"in [{low}, {high}]" if high is not None else f">= {low}"


def _check_count(value: Any, what: str, high: int | None, param: str | None = None) -> None:
    """``value``: an integer in ``[1, high]`` (``high`` ``None``: no upper bound).

    Raises:
        InvalidRequestError: ``param`` (default ``what``) names the field.
    """
    if not _is_int(value) or value < 1 or (high is not None and value > high):
        raise InvalidRequestError(
            f"{what} must be an integer {_range(1, high)}, got {value!r}", param=param or what
        )


def check_text(value: Any, param: str, max_chars: int = MAX_PROMPT_CHARS) -> str:
    """A prompt-like field: a string of at most ``max_chars`` characters that is valid Unicode.

    A lone UTF-16 surrogate (``"\\ud800"`` in JSON, or a byte that is not UTF-8 in a command
    line argument, which Python decodes to one) cannot be encoded for the tokenizer, the log or
    the answer, so it is refused here, where the field can be named.

    Raises:
        InvalidRequestError: ``param`` names the field.
    """
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"{param} must be a string, got {type(value).__name__}", param=param
        )
    if len(value) > max_chars:
        raise InvalidRequestError(
            f"{param} is longer than {max_chars} characters ({len(value)})", param=param
        )
    bad = _first_surrogate(value)
    if bad is not None:
        raise InvalidRequestError(
            f"{param} is not valid Unicode text: character {bad} is a lone UTF-16 surrogate "
            f"({ascii(value[bad])}), from an unpaired \\uXXXX escape or bytes that are not "
            "UTF-8",
            param=param,
        )
    return value


def _first_surrogate(text: str) -> int | None:
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def check_size(height: Any, width: Any, spatial_factor: int, max_side: int | None = None) -> None:
    """``height`` and ``width`` (each may be ``None``): positive integer multiples of
    ``spatial_factor``, at most ``max_side``.

    Raises:
        InvalidRequestError: ``param`` is ``"height"`` or ``"width"``.
    """
    for name, v in (("height", height), ("width", width)):
        if v is None:
            continue
        if not _is_int(v) or v <= 0 or v % spatial_factor:
            raise InvalidRequestError(
                f"{name} must be a positive multiple of {spatial_factor}, got {v!r}", param=name
            )
        if max_side is not None and v > max_side:
            raise InvalidRequestError(f"{name} must be <= {max_side}, got {v}", param=name)
