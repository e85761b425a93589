"""Exit codes and the one-line error message of the ``sglang`` commands.

``sglang generate`` and ``sglang serve`` classify a failure the same way, so the same error gives
the same exit code whichever command met it:

====  =========================================================================================
0     success (``serve``: a clean shutdown, also after SIGTERM/SIGINT)
1     a runtime failure: the engine died, out of memory, a disk or device error, an unexpected
      exception
2     bad arguments or input: a flag out of range, a device this machine does not have, a model
      or LoRA path that does not exist or cannot be used (bad file, bad metadata, not a regular
      file), a prompt that is not valid text, a generation the request's values make non-finite
130   interrupted (Ctrl-C) before the work finished
====  =========================================================================================

The message is one line, ``sglang <command>: error: <message>``, with no traceback (set
``SGLANG_CLI_TRACEBACK=1`` to also print it, for a bug report).
"""

from __future__ import annotations

import os
import sys
import traceback

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def exit_code(exc: BaseException) -> int:
    """The exit code for ``exc`` (table in the module docstring)."""
    from sglang.multimodal_gen.errors import InvalidRequestError, NotFoundError, SGLangError

    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, InvalidRequestError | NotFoundError):
        return EXIT_USAGE
    if isinstance(exc, SGLangError):  # engine dead, queue full: not the arguments' fault
        return EXIT_FAILURE
    # ValueError covers UnicodeError and the loaders' ModelLoadError; LookupError an unknown name
    if isinstance(exc, ValueError | LookupError | FileNotFoundError | NotADirectoryError):
        return EXIT_USAGE
    return EXIT_FAILURE


def one_line(exc: BaseException) -> str:
    """``exc`` as one printable line: its own message (first line only; a TP worker's error
    carries its traceback after it), with the type for unexpected errors."""
    message = getattr(exc, "message", None) or str(exc) or ""
    lines = [ln for ln in message.splitlines() if ln.strip()]
    message = lines[0].strip() if lines else ""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if exit_code(exc) == EXIT_FAILURE and not _is_sglang(exc):
        message = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return message or type(exc).__name__


def _is_sglang(exc: BaseException) -> bool:
    from sglang.multimodal_gen.errors import SGLangError

    return isinstance(exc, SGLangError)


def report(command: str, exc: BaseException) -> int:
    """Print ``sglang <command>: error: <one line>`` to stderr; return the exit code.

    Text that cannot be encoded for the terminal (a lone surrogate from a non-UTF-8 argument) is
    escaped, never a second error.
    """
    line = f"sglang {command}: error: {one_line(exc)}"
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    line = line.encode(encoding, "backslashreplace").decode(encoding, "replace")
    if os.environ.get("SGLANG_CLI_TRACEBACK"):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(line, file=sys.stderr)
    return exit_code(exc)
