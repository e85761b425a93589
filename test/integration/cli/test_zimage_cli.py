"""``sglang generate`` end to end: same PNG as the Python entry; the embedded default model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from sglang.cli.main import main as sglang_main
from sglang.multimodal_gen.outputs import write_output
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams

ARGS = dict(prompt="a paper boat on a lake", seed=7, steps=2, height=32, width=48, guidance=1.5)


def _cli_args(model_dir, out):
    args = ["generate"]
    if model_dir is not None:
        args += ["--model-path", model_dir]
    return args + [
        "--prompt", ARGS["prompt"], "--seed", str(ARGS["seed"]),
        "--num-inference-steps", str(ARGS["steps"]), "--height", str(ARGS["height"]),
        "--width", str(ARGS["width"]), "--guidance-scale", str(ARGS["guidance"]),
        "--output-path", str(out), "--no-progress",
    ]  # fmt: skip


def _python_entry_png(model_dir, out):
    req = SamplingParams(
        prompt=ARGS["prompt"],
        seed=ARGS["seed"],
        num_inference_steps=ARGS["steps"],
        height=ARGS["height"],
        width=ARGS["width"],
        guidance_scale=ARGS["guidance"],
    )
    with DiffusionEngine(model_dir) as engine:
        write_output(engine.generate(req)[0], str(out), "png")


def test_cli_writes_same_png_as_python_entry(tiny_zimage_dir, tmp_path):
    exe = shutil.which("sglang")
    cmd = (
        [exe]
        if exe
        else [
            sys.executable,
            "-c",
            "import sys; from sglang.cli.main import main; sys.exit(main())",
        ]
    )
    out_cli = tmp_path / "sub" / "cli.png"
    proc = subprocess.run(
        cmd + _cli_args(tiny_zimage_dir, out_cli), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # no library noise: importing diffusers' schedule helpers made transformers warn about
    # torchvision-backed image processors that no family uses
    assert "[transformers]" not in proc.stderr, proc.stderr[-2000:]
    out_py = tmp_path / "py.png"
    _python_entry_png(tiny_zimage_dir, out_py)
    a = np.asarray(Image.open(out_cli))
    b = np.asarray(Image.open(out_py))
    assert a.shape == (ARGS["height"], ARGS["width"], 3)
    assert np.array_equal(a, b)
    assert out_cli.read_bytes() == out_py.read_bytes()


def test_cli_without_model_path_uses_the_embedded_default_model(tmp_path, monkeypatch):
    from sglang.multimodal_gen.models.default_model import default_model_path

    cache = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_CACHE_DIR", str(cache))
    out1, out2 = tmp_path / "d1.png", tmp_path / "d2.png"
    assert sglang_main(_cli_args(None, out1)) == 0
    assert not cache.exists()  # the trained demo model ships in the package: nothing is built
    assert sglang_main(_cli_args(None, out2)) == 0
    assert out1.read_bytes() == out2.read_bytes()
    _python_entry_png(default_model_path(), tmp_path / "py.png")  # the same model as the CLI's
    assert (tmp_path / "py.png").read_bytes() == out1.read_bytes()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--height", "40"], "height must be a positive multiple of 16"),
        (["--lora-scale", "0.5"], "--lora-scale given without --lora-path"),
        # the server's rules: one validation for the CLI, the Python API and HTTP
        (["--guidance-scale", "-1"], "guidance_scale must be a finite number >= 0, got -1.0"),
        (["--height", "16384"], "height must be <= 1024, got 16384"),  # the model's maximum
        (["--device", "tpu9"], "--device 'tpu9' is not a device; use cpu, cuda or cuda:N"),
        (["--lora-path", "/dev/zero"], "'zero' is a character device, not a regular file"),
        (["--prompt", "caf\udcff"], "prompt is not valid Unicode text"),  # argv byte 0xff
    ],
)
def test_cli_bad_arguments_exit_2(tiny_zimage_dir, tmp_path, capsys, extra, message):
    code = sglang_main(_cli_args(tiny_zimage_dir, tmp_path / "x.png") + extra)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("sglang generate: error: ") and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.png").exists()


def test_cli_errors_are_one_line_with_the_servers_codes(tiny_zimage_dir, tmp_path, capsys):
    import torch

    bad = tmp_path / "bad_meta.safetensors"
    raw = b'{"__metadata__": 5}'
    bad.write_bytes(len(raw).to_bytes(8, "little") + raw)
    cases = [(["--lora-path", str(bad)], "its __metadata__ is a number")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "CUDA is not available on this machine"))
    for extra, message in cases:
        code = sglang_main(_cli_args(tiny_zimage_dir, tmp_path / "x.png") + extra)
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    # an existing directory as --output-path: one PNG per image in it
    out = tmp_path / "out"
    out.mkdir()
    assert sglang_main(_cli_args(tiny_zimage_dir, out)) == 0
    assert sorted(os.listdir(out)) == ["image_000.png"]
    assert Image.open(out / "image_000.png").size == (ARGS["width"], ARGS["height"])


def test_cli_lora_flags_match_python_entry(tiny_zimage_dir, tiny_zimage_loras, tmp_path):
    out_cli, out_py, out_base = tmp_path / "l.png", tmp_path / "lp.png", tmp_path / "b.png"
    lora_flags = ["--lora-path", *tiny_zimage_loras, "--lora-scale", "0.7", "1.3"]
    assert sglang_main(_cli_args(tiny_zimage_dir, out_cli) + lora_flags) == 0
    req = SamplingParams(
        prompt=ARGS["prompt"],
        seed=ARGS["seed"],
        num_inference_steps=ARGS["steps"],
        height=ARGS["height"],
        width=ARGS["width"],
        guidance_scale=ARGS["guidance"],
    )
    with DiffusionEngine(tiny_zimage_dir) as engine:
        write_output(engine.generate(req)[0], str(out_base), "png")
        engine.set_lora(["x", "y"], list(tiny_zimage_loras), strength=[0.7, 1.3])
        write_output(engine.generate(req)[0], str(out_py), "png")
    assert out_cli.read_bytes() == out_py.read_bytes()
    assert out_cli.read_bytes() != out_base.read_bytes()


def test_ctrl_c_during_generation_exits_130(tiny_zimage_dir, tmp_path):
    """SIGINT while the (in-process) engine loads or denoises (the model loads in about 3 s
    here, the loop would run for hours): one "interrupted" line and exit code 130, soon; not an
    abort from a thread still inside a torch op while the interpreter exits."""
    import signal
    import time

    cmd = [sys.executable, "-m", "sglang.cli.generate", "--model-path", tiny_zimage_dir,
           "--prompt", "a fox", "--num-inference-steps", "100000", "--height", "32",
           "--width", "32", "--device", "cpu",
           "--output-path", str(tmp_path / "out.png")]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("seed:"):  # printed once the model is loaded
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "generate exited before loading"
        time.sleep(8.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err[-500:])
    assert "interrupted" in err and "terminate called" not in err, err[-500:]
