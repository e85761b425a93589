"""What every family pipeline shares besides the loop: the NaN/Inf check, pixels as diffusers'
image processor returns them, the schedule helpers, and the marker rank 0 sends when a prompt
cannot be encoded."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = [
    "EncodingFailed",
    "check_finite",
    "check_schedule",
    "flow_shift_helpers",
    "latents_to_uint8",
]


def latents_to_uint8(images: torch.Tensor) -> np.ndarray:
    """VAE output ``[B, 3, H, W]`` in ``[-1, 1]`` -> ``[B, H, W, 3]`` uint8, as diffusers' image
    processor does (``postprocess`` to ``[0, 1]`` floats, then ``round(255 x)``, half to even)."""
    from diffusers.image_processor import VaeImageProcessor

    check_finite(images, "decoded pixels")  # NaN/Inf would become a black image, never sent
    x = VaeImageProcessor(do_normalize=True).postprocess(images.float(), output_type="np")
    return (x * 255).round().astype("uint8")


def check_finite(x: torch.Tensor, what: str, params: Any = None) -> None:
    """Fail a generation whose ``x`` holds NaN/Inf instead of returning a blank image.

    One reduction per generation (after the loop, after decoding). ``param`` names a guidance
    weight of the request (its ``scale`` fields) when it is the likely cause (>= 1000); the
    engine stays healthy either way.

    Raises:
        NonFiniteOutputError: 400, ``code="non_finite_output"``.
    """
    if bool(torch.isfinite(x).all()):
        return
    from sglang.multimodal_gen.errors import NonFiniteOutputError

    param, hint = None, ""
    values = params.guidance_values() if params is not None else {}
    for name, value in values.items():
        if abs(value) >= 1000:
            param, hint = name, f" ({name}={value:g} is the likely cause)"
            break
    raise NonFiniteOutputError(
        f"the generation produced NaN/Inf {what}{hint}; no image is returned. Usual causes: a "
        "very large guidance weight, or an active LoRA with extreme weights or strength",
        param=param,
    )


def check_schedule(scheduler: Any, timesteps: torch.Tensor, num_inference_steps: int) -> None:
    """Refuse a request whose schedule is not finite before any step runs (the cause is then
    the schedule, not the guidance or an adapter): e.g. a flow-matching scheduler with
    ``shift_terminal`` (Qwen-Image's 0.02) stretches a one-step schedule by ``0 / 0``, in
    diffusers too.

    Raises:
        InvalidRequestError: ``param="num_inference_steps"``.
    """
    sigmas = getattr(scheduler, "sigmas", None)
    values = [timesteps] + ([sigmas] if isinstance(sigmas, torch.Tensor) else [])
    if all(bool(torch.isfinite(v.float()).all()) for v in values):
        return
    from sglang.multimodal_gen.errors import InvalidRequestError

    config = dict(getattr(scheduler, "config", {}) or {})
    why = ""
    if config.get("shift_terminal"):
        why = (
            f" (the scheduler's shift_terminal={config['shift_terminal']:g} stretches the schedule "
            "to a terminal sigma, which needs at least 2 steps; diffusers' pipeline gives NaN too)"
        )
    raise InvalidRequestError(
        f"the model's schedule at num_inference_steps={num_inference_steps} is not finite"
        f"{why}; use more steps",
        param="num_inference_steps",
    )


@dataclass(frozen=True)
class EncodingFailed:
    """What rank 0 broadcasts instead of the conditioning when encoding a request failed, so
    that every rank fails that request (and leaves the broadcast) instead of waiting forever.

    Attributes:
        message: ``"Type: text"`` of the error, for the other ranks.
        error: the exception itself, on rank 0 only (not sent: a copy arrives without it), so
            rank 0 fails the request with it (its type decides the HTTP status).
    """

    message: str
    error: BaseException | None = field(default=None, compare=False)

    def __reduce__(self):
        return (EncodingFailed, (self.message,))


@functools.cache
def flow_shift_helpers(module: str):
    """``(calculate_shift, retrieve_timesteps)`` of the diffusers pipeline module ``module``
    (e.g. ``"diffusers.pipelines.z_image.pipeline_z_image"``): the schedule helpers the family's
    reference pipeline calls (diffusers keeps one copy per pipeline module).

    Importing a pipeline module imports transformers' model classes (about 1.7 s on a 2-core
    CPU; without torchvision transformers warns that their image processors fall back to PIL,
    processors no family here uses). Pipelines that need the helpers call this when they are
    built, so no request pays the import, and those warnings are kept out of the log.
    """
    import importlib

    tf_logger = logging.getLogger("transformers")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        mod = importlib.import_module(module)
    finally:
        tf_logger.setLevel(level)
    return mod.calculate_shift, mod.retrieve_timesteps
