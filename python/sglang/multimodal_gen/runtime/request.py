"""The generation request handed to :class:`~sglang.multimodal_gen.runtime.DiffusionEngine`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.requests import validate_composition


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

    _DEFAULTED = (
        "height",
        "width",
        "num_inference_steps",
        "guidance_scale",
        "true_cfg_scale",
        "max_sequence_length",
    )

    def with_defaults(self, defaults: Mapping[str, Any]) -> GenerationRequest:
        """A copy with every ``None`` field of :attr:`_DEFAULTED` taken from ``defaults`` (the
        family's ``SamplingDefaults.as_dict()``)."""
        fill = {k: defaults[k] for k in self._DEFAULTED if getattr(self, k) is None}
        return replace(self, **fill) if fill else self

    def validate(self, spatial_factor: int = 16, limits: Mapping[str, Any] | None = None) -> None:
        """Check every field that is set (``None`` fields take the family's defaults, see
        :meth:`with_defaults`, which the engine applies before calling this).

        Args:
            spatial_factor: height and width must be multiples of it.
            limits: the family's ``SamplingDefaults.as_dict()`` (``max_image_size``,
                ``max_sequence_length_limit``); ``None``: no upper bounds.

        Raises:
            InvalidRequestError: naming the field (``param``) and the allowed values.
        """
        limits = limits or {}
        if not isinstance(self.prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise InvalidRequestError("negative_prompt must be a string", param="negative_prompt")
        max_side = limits.get("max_image_size")
        for name in ("height", "width"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % spatial_factor:
                raise InvalidRequestError(
                    f"{name} must be a positive multiple of {spatial_factor}, got {v!r}", param=name
                )
            if max_side is not None and v > max_side:
                raise InvalidRequestError(
                    f"{name} must be <= {max_side} for this model, got {v}", param=name
                )
        steps = self.num_inference_steps
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise InvalidRequestError(
                f"num_inference_steps must be an integer >= 1, got {steps!r}",
                param="num_inference_steps",
            )
        for name in ("guidance_scale", "true_cfg_scale"):
            g = getattr(self, name)
            if g is None:
                continue
            if isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g):
                raise InvalidRequestError(f"{name} must be a finite number, got {g!r}", param=name)
        msl = self.max_sequence_length
        top = limits.get("max_sequence_length_limit")
        if msl is not None and (
            isinstance(msl, bool) or not isinstance(msl, int) or msl < 1 or (top and msl > top)
        ):
            raise InvalidRequestError(
                f"max_sequence_length must be an integer in [1, {top}], got {msl!r}",
                param="max_sequence_length",
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            raise InvalidRequestError(
                f"seed must be a non-negative integer or null, got {self.seed!r}", param="seed"
            )
        if self.seed is not None and self.seed >= 2**63:
            raise InvalidRequestError(f"seed must be < 2**63, got {self.seed}", param="seed")
        n = self.num_images
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidRequestError(f"num_images must be an integer >= 1, got {n!r}", param="n")
        validate_composition(self.lora, "lora")
