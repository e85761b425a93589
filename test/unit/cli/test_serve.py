"""``sglang serve``: ``--help`` and bad flags (exit code 2, one line) in a child process."""

from __future__ import annotations

import subprocess
import sys


def test_cli_help_and_bad_flags():
    out = subprocess.run(
        [sys.executable, "-m", "sglang.cli.main", "serve", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "--model-path" in out.stdout and "--lora-dir" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "sglang.cli.main", "serve", "--tp-size", "0"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "--tp-size must be >= 1" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "sglang.cli.main", "serve", "--dit-cpu-offload", "maybe"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "true or false" in out.stderr
