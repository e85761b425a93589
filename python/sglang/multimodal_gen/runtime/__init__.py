"""Generation runtime: requests, the engine (TP workers), the embedded default model."""

from sglang.multimodal_gen.runtime.engine import DiffusionEngine
from sglang.multimodal_gen.runtime.request import GenerationRequest

__all__ = ["DiffusionEngine", "GenerationRequest"]
