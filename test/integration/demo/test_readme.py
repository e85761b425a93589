"""The README's snippets run as written, against the server the README starts.

The README's fenced blocks, in order: ``bash`` blocks are commands (each line with its ``\\``
continuations; ``sglang serve`` is started in the background and waited for), ``python`` blocks
run in a subprocess once the server is up, ``text`` blocks are templates for real models and are
not run. Not run either, each for its reason: ``bash scripts/setup.sh`` (the install this suite
runs after), ``bash scripts/test.sh`` (this suite), ``python scripts/mutants.py`` without
``--list`` (a ten-minute run of its own). Everything runs in a copy of the repository's paths the
snippets name, from a temporary working directory, with the server on its default port 30000.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PORT = 30000
SKIP = ("bash scripts/setup.sh", "bash scripts/test.sh")


def _blocks(text: str) -> list[tuple[str, str]]:
    """``[(language, code)]`` of the fenced blocks, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def _commands(code: str) -> list[str]:
    """The shell commands of a bash block (continuations joined, comments dropped)."""
    out, current = [], ""
    for line in code.splitlines():
        line = line.rstrip()
        if not line or line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        out.append((current + line).strip())
        current = ""
    return out


def _runnable(cmd: str) -> str | None:
    """The part of ``cmd`` to run (the install before ``&&`` is this suite's own), or None."""
    parts = [p.strip() for p in cmd.split("&&")]
    parts = [p for p in parts if not p.startswith(SKIP)]
    if any(p.startswith("python scripts/mutants.py") and "--list" not in p for p in parts):
        return None
    return " && ".join(parts) or None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.slow
def test_readme_snippets_run_as_written(tmp_path):
    if not _port_free(PORT):
        pytest.skip(f"port {PORT} is taken; the README's server listens there")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = _blocks(f.read())
    assert any(lang == "python" for lang, _ in blocks)
    os.symlink(os.path.join(ROOT, "python"), tmp_path / "python")
    os.symlink(os.path.join(ROOT, "scripts"), tmp_path / "scripts")
    (tmp_path / "outputs").mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = None
    ran = []
    try:
        for lang, code in blocks:
            if lang == "bash":
                for cmd in filter(None, map(_runnable, _commands(code))):
                    if cmd.startswith("sglang serve"):
                        server = subprocess.Popen(
                            shlex.split(cmd), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                        )  # fmt: skip
                        _wait_ready(server)
                    else:
                        r = subprocess.run(
                            cmd, shell=True, cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600,
                        )  # fmt: skip
                        assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
                    ran.append(cmd)
            elif lang == "python":
                assert server is not None or "localhost" not in code, "no server for: " + code
                r = subprocess.run(
                    [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                    text=True, timeout=600,
                )  # fmt: skip
                assert r.returncode == 0, f"{code}\n{r.stdout}\n{r.stderr}"
                ran.append(code.splitlines()[0])
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    outputs = sorted(os.listdir(tmp_path / "outputs"))
    assert {"image.png", "swap.png", "swap-engine.png", "openai.png"} <= set(outputs), outputs
    assert any(c.startswith("sglang serve") for c in ran), ran


def _wait_ready(proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("server did not become ready")
