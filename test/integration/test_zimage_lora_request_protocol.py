"""Per-request LoRA compositions on the real engine: guarded restore, TP all-or-nothing.

- TP 1 behind the HTTP server: a restore that fails after a generation with its own ``lora``
  (simulated out-of-memory in a layer) makes the engine dead: the generation gets HTTP 503,
  ``/health`` turns 503, and later calls are refused with 503 instead of running on mixed weights.
- TP 2: a per-request composition whose application fails on rank 1 only fails the request on
  every rank and leaves both ranks as before (the TP image depends on both ranks' weights, so it
  is bit-identical to the one of before only if both are); a restore failing on rank 1 stops the
  engine on every rank.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from server_helpers import assert_envelope, running_server
from sglang.multimodal_gen.errors import EngineDeadError, InvalidRequestError
from sglang.multimodal_gen.layers.lora import BaseLayerWithLoRA
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

REQ = dict(prompt="a lighthouse at dusk", height=32, width=32, num_inference_steps=2, seed=9)
FAIL_ON = "b"  # per-request compositions naming this adapter fail on rank 1


def _failing_clear(self):
    """``clear_overlay`` that fails whenever it has an overlay to end (as an OOM would)."""
    if self.overlay is not None:
        raise torch.cuda.OutOfMemoryError("simulated: out of memory while restoring")
    self._drop_overlay()


def test_failed_request_restore_turns_the_server_503(
    tiny_zimage_dir, tiny_zimage_loras, monkeypatch
):
    a, b = tiny_zimage_loras
    with DiffusionEngine(tiny_zimage_dir, device="cpu") as engine:
        engine.set_lora(["a", "b"], [a, b], strength=[0.8, 0.0], merge_mode="merge")
        with running_server(engine) as (url, _app, _server):
            http_req = dict(prompt=REQ["prompt"], size="32x32", num_inference_steps=2, seed=9)
            body = dict(http_req, response_format="b64_json", lora=[{"name": "b", "scale": 1.0}])
            ok = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
            assert ok.status_code == 200, ok.text  # the overlay path works before the failure
            monkeypatch.setattr(BaseLayerWithLoRA, "clear_overlay", _failing_clear)
            r = httpx.post(f"{url}/v1/images/generations", json=body, timeout=120)
            assert_envelope(r, 503)
            assert httpx.get(f"{url}/health", timeout=30).status_code == 503
            assert_envelope(httpx.get(f"{url}/v1/list_loras", timeout=30), 503)
            plain = dict(http_req, response_format="b64_json")
            r = httpx.post(f"{url}/v1/images/generations", json=plain, timeout=60)
            assert_envelope(r, 503)
            assert "sglang_engine_alive 0.0" in httpx.get(f"{url}/metrics", timeout=30).text
        assert not engine.is_alive()
        # every layer was reset to its base weight (a known state): none merged or overlaid
        for layer in engine._executor.runner.lora_manager.layers("transformer").values():
            assert not layer.merged and not layer.active and layer.overlay is None


def _rank1_fails_requests(runner, rank):
    """Worker hook: on rank 1, per-request compositions naming ``FAIL_ON`` fail while applied."""
    if rank != 1:
        return
    manager = runner.lora_manager
    apply = manager._apply

    def failing_apply(tname, comp, mode, *args, **kwargs):
        apply(tname, comp, mode, *args, **kwargs)  # layers really change before the failure
        if mode == "request" and any(n == FAIL_ON for n, _ in comp):
            raise InvalidRequestError("simulated failure on TP rank 1", param="lora")

    manager._apply = failing_apply


def _rank1_fails_restores(runner, rank):
    if rank == 1:
        BaseLayerWithLoRA.clear_overlay = _failing_clear  # this worker process only


def _image(engine, **kw):
    return np.asarray(engine.generate(SamplingParams(**REQ, **kw))[0])


@pytest.mark.slow
def test_tp2_request_composition_is_all_or_nothing(tiny_zimage_dir, tiny_zimage_loras):
    a, b = tiny_zimage_loras
    with DiffusionEngine(
        tiny_zimage_dir, tp_size=2, device="cpu", _worker_setup=_rank1_fails_requests
    ) as engine:
        engine.set_lora(["a", "b"], [a, b], strength=[0.7, 0.0], merge_mode="merge")
        before_image, before_state = _image(engine), engine.list_loras()["active"]
        with pytest.raises(InvalidRequestError, match="simulated failure") as e:
            _image(engine, lora=[{"name": "b", "scale": 1.0}])
        assert e.value.param == "lora"
        assert engine.list_loras()["active"] == before_state
        assert np.array_equal(_image(engine), before_image)
        # a composition rank 1 accepts runs on both ranks, and both restore
        with_a = _image(engine, lora=[{"name": "a", "scale": 0.2}])
        assert not np.array_equal(with_a, before_image)
        assert np.array_equal(_image(engine), before_image)
        assert engine.is_alive()


@pytest.mark.slow
def test_tp2_failed_request_restore_on_one_rank_stops_the_engine(
    tiny_zimage_dir, tiny_zimage_loras
):
    a, b = tiny_zimage_loras
    with DiffusionEngine(
        tiny_zimage_dir, tp_size=2, device="cpu", _worker_setup=_rank1_fails_restores
    ) as engine:
        engine.set_lora(["a", "b"], [a, b], strength=[0.7, 0.0], merge_mode="merge")
        with pytest.raises(EngineDeadError):
            _image(engine, lora=[{"name": "b", "scale": 1.0}])
        assert not engine.is_alive()
        with pytest.raises(EngineDeadError):
            engine.list_loras()
