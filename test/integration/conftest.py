"""Shared fixtures of the integration tests: tiny Z-Image models and LoRA files (built once per
session with the reference libraries; see ``test/fixtures/tiny_models.py``), and one TP 2 engine
on the tiny Z-Image shared by the TP 2 tests (``test/fixtures/tp_engine.py``)."""

from __future__ import annotations

import pytest
from fixtures.tiny_flux import build_tiny_flux
from fixtures.tiny_models import build_tiny_zimage, make_lora
from fixtures.tiny_qwen_image import build_tiny_qwen_image
from fixtures.tiny_wan import build_tiny_wan
from fixtures.tp_engine import strict_ranks


@pytest.fixture(scope="session")
def tiny_zimage_dir(tmp_path_factory) -> str:
    """A tiny diffusers-format Z-Image pipeline directory (sharded transformer)."""
    return build_tiny_zimage(str(tmp_path_factory.mktemp("tiny_zimage")), seed=0)


@pytest.fixture(scope="session")
def tiny_zimage_loras(tiny_zimage_dir, tmp_path_factory) -> tuple[str, str]:
    """Two diffusers-format LoRA folders for :func:`tiny_zimage_dir` (ranks 4 and 2)."""
    root = tmp_path_factory.mktemp("tiny_zimage_loras")
    a = make_lora(tiny_zimage_dir, str(root / "lora_a"), seed=11, rank=4, alpha=8.0)
    b = make_lora(tiny_zimage_dir, str(root / "lora_b"), seed=22, rank=2, alpha=2.0)
    return a, b


@pytest.fixture(scope="session")
def tiny_flux_dev_dir(tmp_path_factory) -> str:
    """A tiny diffusers-format FLUX.1-dev-like directory (guidance embedding, dynamic shift)."""
    return build_tiny_flux(str(tmp_path_factory.mktemp("tiny_flux_dev")), guidance_embeds=True)


@pytest.fixture(scope="session")
def tiny_flux_schnell_dir(tmp_path_factory) -> str:
    """A tiny diffusers-format FLUX.1-schnell-like directory (no guidance embedding)."""
    return build_tiny_flux(
        str(tmp_path_factory.mktemp("tiny_flux_schnell")), guidance_embeds=False, seed=1
    )


@pytest.fixture(scope="session")
def tiny_wan_a14b_dir(tmp_path_factory) -> str:
    """A tiny Wan2.2 T2V-A14B-like directory: two experts, ``boundary_ratio`` 0.875."""
    return build_tiny_wan(str(tmp_path_factory.mktemp("tiny_wan_a14b")), layout="a14b")


@pytest.fixture(scope="session")
def tiny_wan_ti2v_dir(tmp_path_factory) -> str:
    """A tiny Wan2.2 TI2V-5B-like directory: one expert, per-token timesteps, Wan2.2 VAE."""
    return build_tiny_wan(str(tmp_path_factory.mktemp("tiny_wan_ti2v")), layout="ti2v", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen_image_dir(tmp_path_factory) -> str:
    """A tiny diffusers-format Qwen-Image directory (Qwen2.5-VL text encoder, 5-D VAE)."""
    return build_tiny_qwen_image(str(tmp_path_factory.mktemp("tiny_qwen_image")))


@pytest.fixture(scope="session")
def _zimage_tp2_holder():
    holder: dict = {}
    yield holder
    engine = holder.get("engine")
    if engine is not None:
        with engine:  # leaving the block shuts the engine and its workers down
            procs = list(engine._executor.workers.procs)
        assert not engine.is_alive() and not any(p.is_alive() for p in procs)


@pytest.fixture
def zimage_tp2_engine(_zimage_tp2_holder, tiny_zimage_dir):
    """A TP 2 engine (two gloo workers) on :func:`tiny_zimage_dir`, started once per session with
    the worker hook ``fixtures.tp_engine.strict_ranks``; each test gets it alive with no adapter
    active (adapters loaded by earlier tests stay loaded: ``a`` and ``b`` are always
    :func:`tiny_zimage_loras`). A test that leaves it dead gets the next test a new one."""
    from sglang.multimodal_gen.runtime import DiffusionEngine

    engine = _zimage_tp2_holder.get("engine")
    if engine is not None and not engine.is_alive():
        engine.shutdown()
        engine = None
    if engine is None:
        engine = DiffusionEngine(
            tiny_zimage_dir, tp_size=2, device="cpu", _worker_setup=strict_ranks
        )
        _zimage_tp2_holder["engine"] = engine
    engine.unset_lora()
    return engine
