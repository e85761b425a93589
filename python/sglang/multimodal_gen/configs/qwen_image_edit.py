"""Request fields of the Qwen-Image edit models (``QwenImageEditPipeline``,
``QwenImageEditPlusPipeline``) and the image geometry they share with their pipeline.

The DiT is Qwen-Image's (``configs/qwen_image.py``). What differs is the request: an input image
is required, and the output size, unless given, follows the (last) input image's aspect ratio at
about 1024 x 1024 pixels, as diffusers 0.42.1 computes it (``calculate_dimensions`` of
``pipelines/qwenimage/pipeline_qwenimage_edit.py`` and ``..._edit_plus.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sglang.multimodal_gen.configs.qwen_image import QwenImageSamplingParams

__all__ = [
    "CONDITION_IMAGE_AREA",
    "VAE_IMAGE_AREA",
    "QwenImageEditSamplingParams",
    "calculate_dimensions",
]

#: pixels of an input image as the VAE encodes it (and of the default output)
VAE_IMAGE_AREA = 1024 * 1024
#: pixels of an input image as the Plus pipeline's vision encoder sees it
CONDITION_IMAGE_AREA = 384 * 384


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """``(width, height)`` of about ``target_area`` pixels at aspect ratio ``ratio = w / h``,
    each rounded to a multiple of 32 (diffusers' ``calculate_dimensions``: ``w = sqrt(area *
    ratio)``, ``h = w / ratio``, Python's ``round`` of ``x / 32``, halves to even)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


@dataclass(frozen=True)
class QwenImageEditSamplingParams(QwenImageSamplingParams):
    """Qwen-Image's request fields (true CFG included) for an edit model: ``image`` holds the
    image(s) to edit; ``height`` / ``width`` default to the last image's aspect ratio at about
    1024 x 1024 pixels (:meth:`conform`). ``max_sequence_length`` is accepted and, as in
    diffusers' edit pipelines, does not cut the prompt."""

    def conform(self, spec: Any) -> dict[str, Any]:
        """The output size when the request leaves it out: ``calculate_dimensions(1024 * 1024,
        w / h)`` of the last input image, rounded down to the model's spatial factor (diffusers
        rounds to ``vae_scale_factor * 2`` the same way); a given side is kept."""
        if (self.height is not None and self.width is not None) or not self.image:
            return {}
        w, h = self.image[-1].size
        cw, ch = calculate_dimensions(VAE_IMAGE_AREA, w / h)
        f = max(int(spec.spatial_factor), 1)
        out: dict[str, Any] = {}
        if self.height is None:
            out["height"] = max(ch // f * f, f)
        if self.width is None:
            out["width"] = max(cw // f * f, f)
        return out
