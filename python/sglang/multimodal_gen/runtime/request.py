"""The generation request handed to :class:`~sglang.multimodal_gen.runtime.DiffusionEngine`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.lora.requests import validate_composition


@dataclass
class GenerationRequest:
    """One text-to-image request.

    Attributes:
        prompt: the text prompt.
        negative_prompt: used only when ``guidance_scale > 0`` (default ``""`` then).
        height, width: pixels, positive multiples of the engine's ``spatial_factor`` (16).
        num_inference_steps: denoising steps (>= 1).
        guidance_scale: classifier-free guidance weight; ``0`` disables CFG (Z-Image-Turbo).
        seed: seeds the initial latents (``torch.Generator().manual_seed``); ``None`` draws one.
        num_images: images for this prompt (one latent batch).
        lora: per-request adapter composition ``[(nickname, strength), ...]`` of loaded
            adapters; ``None`` uses the globally active composition, ``[]`` none at all (rules:
            :func:`~sglang.multimodal_gen.lora.requests.validate_composition`).
    """

    prompt: str
    negative_prompt: str | None = None
    height: int = 1024
    width: int = 1024
    num_inference_steps: int = 8
    guidance_scale: float = 0.0
    seed: int | None = None
    num_images: int = 1
    lora: list[tuple[str, float]] | None = None

    def validate(self, spatial_factor: int = 16) -> None:
        """Check every field.

        Raises:
            InvalidRequestError: naming the field (``param``) and the allowed values.
        """
        if not isinstance(self.prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise InvalidRequestError("negative_prompt must be a string", param="negative_prompt")
        for name in ("height", "width"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % spatial_factor:
                raise InvalidRequestError(
                    f"{name} must be a positive multiple of {spatial_factor}, got {v!r}", param=name
                )
        steps = self.num_inference_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidRequestError(
                f"num_inference_steps must be an integer >= 1, got {steps!r}",
                param="num_inference_steps",
            )
        g = self.guidance_scale
        if isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g):
            raise InvalidRequestError(
                f"guidance_scale must be a finite number, got {g!r}", param="guidance_scale"
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
