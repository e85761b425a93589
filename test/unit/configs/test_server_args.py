"""``ServerArgs``: the seed's command line, LoRA, cost and connection flags, their errors, and the
model type detected from a local directory or the Hub cache."""

from __future__ import annotations

import argparse
import json

import pytest
from fixtures.hub_cache import cache_snapshot
from sglang.multimodal_gen.configs.server_args import ServerArgs, detect_model_type


def _parse(argv):
    return ServerArgs.from_cli_args(
        ServerArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    )


def test_seed_command_line_parses(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    argv = f"--model-path {model} --model-type diffusion --dit-cpu-offload false --num-gpus 1 "
    argv += "--port 8080 --host localhost"
    a = _parse(argv.split())
    assert (a.model_path, a.model_type, a.dit_cpu_offload, a.tp_size, a.port, a.host) == (
        str(model), "diffusion", False, 1, 8080, "localhost"
    )  # fmt: skip
    assert _parse(["--model-path", str(model)]).model_type == "diffusion"  # detected
    assert _parse(["--num-gpus", "4", "--tp-size", "2"]).tp_size == 2
    assert _parse(["--num-gpus", "2"]).tp_size == 2
    assert _parse(["--dit-cpu-offload", "true"]).dit_cpu_offload is True


def test_model_type_detected_from_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ValueError, match="no model_index.json"):
        detect_model_type("Owner/Some-Model")
    index = {"model_index.json": json.dumps({"_class_name": "ZImagePipeline"})}
    cache_snapshot(tmp_path / "hf" / "hub", "Owner/Some-Model", index)
    assert detect_model_type("Owner/Some-Model") == "diffusion"
    index = {"model_index.json": json.dumps({"_class_name": "LlamaForCausalLM"})}
    cache_snapshot(tmp_path / "hf" / "hub", "Owner/Some-Model", index)
    with pytest.raises(ValueError, match="not a diffusers pipeline"):
        detect_model_type("Owner/Some-Model")


def test_server_args_loras_and_errors(tmp_path):
    a = _parse(["--lora-path", "/x/pixel.safetensors", "/y/style/", "--lora-dir", str(tmp_path)])
    assert a.startup_loras == [("pixel", "/x/pixel.safetensors", 1.0), ("style", "/y/style/", 1.0)]
    assert a.lora_dirs == [str(tmp_path)]
    a = _parse(["--lora-path", "p1", "p2", "--lora-nickname", "a", "b", "--lora-scale", "0.5", "1"])
    assert a.startup_loras == [("a", "p1", 0.5), ("b", "p2", 1.0)]
    with pytest.raises(ValueError, match="--lora-nickname"):
        _parse(["--lora-path", "p1", "p2", "--lora-nickname", "a"])
    with pytest.raises(ValueError, match="--lora-dir"):
        _parse(["--lora-dir", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--tp-size"):
        _parse(["--tp-size", "0"])
    with pytest.raises(ValueError, match="model_index.json"):
        detect_model_type(str(tmp_path))
    assert "***" in str(ServerArgs(api_key="secret").redacted()) and "secret" not in str(
        ServerArgs(api_key="secret").redacted()
    )


def test_server_args_cost_and_connection_flags():
    a = _parse(
        ["--max-n", "2", "--max-steps", "50", "--max-pixel-steps", "0", "--limit-concurrency",
         "16", "--timeout-keep-alive", "3", "--timeout-headers", "4", "--timeout-body", "6",
         "--health-stall-timeout", "0", "--timeout-graceful-shutdown", "7.5"]
    )  # fmt: skip
    assert (a.max_images_per_request, a.max_inference_steps, a.max_pixel_steps) == (2, 50, 0)
    assert (a.limit_concurrency, a.timeout_keep_alive_s, a.timeout_headers_s) == (16, 3, 4)
    assert (a.timeout_body_s, a.health_stall_timeout_s, a.max_image_size) == (6, 0, None)
    assert a.graceful_shutdown_timeout_s == 7.5
    assert _parse([]).graceful_shutdown_timeout_s == 300
    for bad, needle in (
        (["--max-n", "0"], "--max-n"),
        (["--timeout-body", "-1"], "--timeout-body"),
        (["--timeout-graceful-shutdown", "-1"], "--timeout-graceful-shutdown"),
        (["--timeout-graceful-shutdown", "inf"], "--timeout-graceful-shutdown"),
    ):
        with pytest.raises(ValueError, match=needle):
            _parse(bad)


def test_transformer_weight_flags_parse_and_refuse_at_parse_time(tmp_path):
    """``--transformer-path``, ``--transformer-weights-path``, ``--quantization``: the fields they
    set; the two paths together, an unknown quantization or an empty path is one ValueError
    naming the flag, before any model is read."""
    a = _parse(["--transformer-path", "/q/transformer", "--quantization", "fp8"])
    assert (a.transformer_path, a.transformer_weights_path, a.quantization) == (
        "/q/transformer", None, "fp8"
    )  # fmt: skip
    a = _parse(["--transformer-weights-path", "owner/flux-fp8/model.safetensors"])
    assert (a.transformer_path, a.transformer_weights_path, a.quantization) == (
        None, "owner/flux-fp8/model.safetensors", None
    )  # fmt: skip
    assert _parse([]).transformer_path is None and _parse([]).quantization is None
    with pytest.raises(ValueError, match="--transformer-path and --transformer-weights-path"):
        _parse(["--transformer-path", "/a", "--transformer-weights-path", "/b.safetensors"])
    with pytest.raises(
        ValueError, match=r"--quantization 'int4' is not supported; choose from fp8"
    ):
        _parse(["--quantization", "int4"])
    with pytest.raises(ValueError, match="--transformer-weights-path must not be empty"):
        _parse(["--transformer-weights-path", " "])
    with pytest.raises(ValueError, match="--quantization 'FP8'"):
        ServerArgs(quantization="FP8")
