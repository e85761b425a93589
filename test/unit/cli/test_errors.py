"""The CLI's exit codes (``sglang.cli.errors``), shared by ``generate`` and ``serve``: 2 for bad
input, 1 for a failure of ours, 130 for Ctrl-C; one line per error."""

from __future__ import annotations

from sglang.multimodal_gen.errors import (
    EngineDeadError,
    InvalidRequestError,
    LoRAFormatError,
    NotFoundError,
)


def test_cli_exit_codes_are_shared():
    from sglang.cli.errors import exit_code, one_line
    from sglang.multimodal_gen.errors import NonFiniteOutputError

    for exc in (
        InvalidRequestError("x", param="n"),
        LoRAFormatError("bad file"),
        NotFoundError("no adapter"),
        NonFiniteOutputError("nan"),
        ValueError("--tp-size"),
        FileNotFoundError("no model"),
        UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed"),
    ):
        assert exit_code(exc) == 2, exc
    for exc in (
        EngineDeadError("dead"),
        RuntimeError("CUDA error"),
        MemoryError(),
        OSError(28, "disk full"),
    ):
        assert exit_code(exc) == 1, exc
    assert exit_code(KeyboardInterrupt()) == 130
    assert one_line(RuntimeError("boom\nTraceback (most recent call last):\n ...")) == (
        "RuntimeError: boom"
    )
