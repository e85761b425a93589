"""TP 2 LoRA changes: rank 0 reads the files and sends them, and a change is all-or-nothing.

A test hook (``fixtures.tp_engine.strict_ranks``, the worker hook of the session's shared TP 2
engine) makes rank 1 fail deterministically while applying one ``set_lora`` (after rank 0 applied
it), and makes any file read on rank 1 an error.
Both ranks must then be in the state of before the call (the TP image is made of both ranks'
weights, so it is bit-identical to the one of before only if both are), and later changes must
work on both.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixtures.tp_engine import FAIL_ON
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.runtime import SamplingParams

REQ = SamplingParams(
    prompt="a lighthouse at dusk", height=32, width=32, num_inference_steps=2, seed=9
)


def _image(engine):
    return np.asarray(engine.generate(REQ)[0])


def _state(engine):
    listed = engine.list_loras()
    return listed["loaded"], listed["active"]


def test_tp2_lora_change_failing_on_one_rank_changes_no_rank(zimage_tp2_engine, tiny_zimage_loras):
    a, b = tiny_zimage_loras
    engine = zimage_tp2_engine
    base = _image(engine)
    engine.set_lora("a", a, strength=0.7, merge_mode="merge")
    before_image, before_state = _image(engine), _state(engine)
    assert not np.array_equal(before_image, base)

    # reload "a" from another file, add "c", switch to dynamic: rank 0 applies it, rank 1
    # fails, rank 0 must undo all of it
    with pytest.raises(InvalidRequestError, match="simulated failure") as e:
        engine.set_lora(["a", FAIL_ON], [b, b], strength=[0.5, 1.3], merge_mode="dynamic")
    assert e.value.param == "lora_path"
    assert _state(engine) == before_state
    assert np.array_equal(_image(engine), before_image)

    # a file rank 0 cannot read: answered by rank 0 alone, nothing changes
    with pytest.raises(InvalidRequestError) as e:
        engine.set_lora("x", a + ".missing.safetensors")
    assert e.value.param == "lora_path"
    assert np.array_equal(_image(engine), before_image)

    # both ranks still take changes together (rank 1 never reads a file itself)
    engine.set_lora(["a", "b"], [None, b], strength=[0.7, 1.3], merge_mode="dynamic")
    assert not np.array_equal(_image(engine), before_image)
    engine.unset_lora()
    assert np.array_equal(_image(engine), base)
    assert engine.is_alive()
