"""Error types shared by every layer of the engine.

Everything below the HTTP layer raises these; ``entrypoints`` maps them to OpenAI-style error
envelopes (``{"error": {"message", "type", "param", "code"}}``) and status codes. Each error names the
offending field in ``param`` when there is one.
"""

from __future__ import annotations


class SGLangError(Exception):
    """Base class. ``param`` names the offending request field (or ``None``)."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(SGLangError, ValueError):
    """A value the caller sent is wrong (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class NotFoundError(SGLangError, LookupError):
    """A named thing (adapter nickname, model) does not exist (HTTP 404)."""

    status_code = 404
    error_type = "not_found_error"


class LoRAFormatError(InvalidRequestError):
    """A LoRA file cannot be loaded as given: unknown/unsupported keys, shapes, NaN/Inf (HTTP 400)."""


class QueueFullError(SGLangError):
    """The request queue is full; retry later (HTTP 503 with ``Retry-After``)."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, code="queue_full")
        self.retry_after_s = retry_after_s


class EngineDeadError(SGLangError):
    """A worker process died; the engine cannot serve (HTTP 503)."""

    status_code = 503
    error_type = "server_error"
