"""Per-request LoRA compositions on the real engine: a request changes no weight, anywhere.

A request with its own ``lora`` is computed per row in the forward (its selection of slots); the
layers' weights, merge state and active compositions are never touched, so there is nothing to
restore after it and nothing a failure could leave half done.

- TP 1 behind the HTTP server, a global adapter merged at a large strength: a request with
  another composition (and one with none) leaves every layer's weight bit-identical and merged as
  before; the server stays healthy.
- TP 2: rank 0 selects a request's adapters and sends the selection with the command, so the
  ranks cannot disagree (a rank that would select differently is never asked: on the session's
  shared TP 2 engine, rank 1 selecting is an error, ``fixtures.tp_engine``), and a refused
  composition (an unknown adapter) fails before any rank starts; nothing changes either way: the
  next requests give the images of before (the TP image depends on both ranks' weights).
"""

from __future__ import annotations

import hashlib

import httpx
import numpy as np
import pytest
from fixtures.server import running_server
from sglang.multimodal_gen.errors import NotFoundError
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

REQ = dict(prompt="a lighthouse at dusk", height=32, width=32, num_inference_steps=2, seed=9)


def _layer_state(engine) -> dict:
    """``{module: (weight digest, merged, active composition)}`` of every LoRA layer."""
    manager = engine._executor.runner.lora_manager
    out = {}
    for name, layer in manager.layers("transformer").items():
        w = layer.base_layer.weight.detach().contiguous().numpy().tobytes()
        out[name] = (hashlib.sha256(w).hexdigest(), layer.merged, layer.active_composition)
    return out


def test_a_request_composition_changes_no_weight(tiny_zimage_dir, tiny_zimage_loras):
    a, b = tiny_zimage_loras
    with DiffusionEngine(tiny_zimage_dir, device="cpu") as engine:
        engine.set_lora(["a", "b"], [a, b], strength=[1000.0, 0.0], merge_mode="merge")
        before = _layer_state(engine)
        assert all(merged for _, merged, _ in before.values() if merged)
        assert any(merged for _, merged, _ in before.values())
        with running_server(engine) as (url, _app, _server):
            http_req = dict(prompt=REQ["prompt"], size="32x32", num_inference_steps=2, seed=9)
            for lora in ([{"name": "b", "strength": 1.0}], [], [{"name": "a", "scale": 0.5}]):
                body = dict(http_req, response_format="b64_json", lora=lora)
                r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
                assert r.status_code == 200, r.text
                assert _layer_state(engine) == before
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def _image(engine, **kw):
    return np.asarray(engine.generate(SamplingParams(**REQ, **kw))[0])


@pytest.mark.slow
def test_tp2_rank0_selects_and_a_refusal_changes_nothing(zimage_tp2_engine, tiny_zimage_loras):
    a, b = tiny_zimage_loras
    engine = zimage_tp2_engine
    engine.set_lora(["a", "b"], [a, b], strength=[0.7, 0.0], merge_mode="merge")
    before_image, before_state = _image(engine), engine.list_loras()["active"]
    with pytest.raises(NotFoundError) as e:
        _image(engine, lora=[{"name": "nope", "strength": 1.0}])
    assert e.value.param == "lora"
    assert engine.list_loras()["active"] == before_state
    assert np.array_equal(_image(engine), before_image)
    with_b = _image(engine, lora=[{"name": "b", "strength": 1.0}])
    assert not np.array_equal(with_b, before_image)
    batch = engine.generate_batch([SamplingParams(**REQ, lora=[("b", 1.0)]), SamplingParams(**REQ)])
    assert np.array_equal(np.asarray(batch[0][0]), with_b)
    assert np.array_equal(np.asarray(batch[1][0]), before_image)
    assert np.array_equal(_image(engine), before_image)
    assert engine.is_alive()
