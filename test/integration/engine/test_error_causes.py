"""Errors name their real cause.

- Qwen-Image at one step: the schedule itself is NaN (``shift_terminal`` stretches a one-step
  schedule by 0 / 0; diffusers' pipeline gives NaN too): a 400 naming ``num_inference_steps``
  before any step runs, not a NaN-output error blaming guidance or adapters;
- a request naming an adapter that is not loaded is told to load it with ``set_lora`` (the images
  API has no ``lora_path``).
"""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.errors import InvalidRequestError, NotFoundError
from sglang.multimodal_gen.runtime import DiffusionEngine


def test_one_step_qwen_image_names_the_schedule(tiny_qwen_image_dir):
    with DiffusionEngine(tiny_qwen_image_dir, device="cpu") as engine:
        with pytest.raises(InvalidRequestError) as e:
            engine.generate(prompt="a fox", height=32, width=32, num_inference_steps=1)
        assert e.value.param == "num_inference_steps"
        assert "shift_terminal" in e.value.message and "at least 2 steps" in e.value.message
        assert len(engine.generate(prompt="a fox", height=32, width=32, num_inference_steps=2))


def test_an_unknown_per_request_adapter_says_to_load_it_with_set_lora(tiny_zimage_dir):
    with DiffusionEngine(tiny_zimage_dir, device="cpu") as engine:
        with pytest.raises(NotFoundError) as e:
            engine.generate(prompt="a fox", height=32, width=32, lora=[("nope", 1.0)])
        assert e.value.param == "lora"
        assert "set_lora" in e.value.message and "lora_path" not in e.value.message
