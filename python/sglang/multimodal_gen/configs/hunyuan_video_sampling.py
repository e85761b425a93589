"""Request fields of HunyuanVideo (1.0) models (``HunyuanVideoPipeline``; FastHunyuan too).

diffusers' ``HunyuanVideoPipeline.__call__`` (diffusers 0.42.1,
``pipelines/hunyuan_video/pipeline_hunyuan_video.py``) has two guidance knobs: ``guidance_scale``
is the embedded (distilled) guidance the DiT's guidance embedding receives (x 1000), one forward
per step; ``true_cfg_scale`` > 1 together with a ``negative_prompt`` runs real classifier-free
guidance (two branches per step). The common ``guidance_scale`` field carries the first; this
class adds the second under diffusers' name.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang.multimodal_gen.configs.sampling_params import VideoSamplingParams, param

__all__ = ["HunyuanVideoSamplingParams"]


@dataclass(frozen=True)
class HunyuanVideoSamplingParams(VideoSamplingParams):
    """Request fields of HunyuanVideo models: those of every video model (``guidance_scale`` is
    the embedded guidance) plus real classifier-free guidance (``true_cfg_scale``, used only
    with a ``negative_prompt``, as diffusers does)."""

    true_cfg_scale: float | None = param(
        "scale",
        "real classifier-free guidance weight, used with negative_prompt when > 1 (1: off)",
    )
