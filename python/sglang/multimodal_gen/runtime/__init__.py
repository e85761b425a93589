"""Generation runtime: the engine (in process or TP workers) and its request object."""

from sglang.multimodal_gen.configs.sampling_params import SamplingParams
from sglang.multimodal_gen.runtime.engine import DiffusionEngine

__all__ = ["DiffusionEngine", "SamplingParams"]
