"""``sglang generate``'s transformer weight flags: refused before any model is read, one line
naming the flag, exit 2."""

from __future__ import annotations

import pytest
from fixtures.cli import generate_errors


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--transformer-path", "/a", "--transformer-weights-path", "/b.safetensors"],
            "--transformer-path and --transformer-weights-path are exclusive",
        ),
        (["--quantization", "int8"], "--quantization 'int8' is not supported; choose from fp8"),
    ],
)
def test_bad_weight_flags_exit_2_before_loading(flags, message, tmp_path, capsys, monkeypatch):
    err = generate_errors(flags, tmp_path, capsys, monkeypatch)
    assert err == [f"sglang generate: error: {err[0].split('error: ', 1)[1]}"]
    assert message in err[0]
