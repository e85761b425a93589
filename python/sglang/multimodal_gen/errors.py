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


class LoRAPatternTooExpensiveError(LoRAFormatError):
    """An adapter config's regular expressions (``target_modules``, ``rank_pattern`` keys, ...)
    need more than their time budget to match, or are too large to compile (HTTP 400)."""


class PayloadTooLargeError(InvalidRequestError):
    """The request body is larger than the server accepts (HTTP 413); refused before reading it."""

    status_code = 413


class RequestTimeoutError(InvalidRequestError):
    """The client did not send its request (headers or body) within the bound (HTTP 408)."""

    status_code = 408


class NonFiniteOutputError(InvalidRequestError):
    """A generation's latents or pixels became NaN/Inf (HTTP 400, ``code="non_finite_output"``).

    Raised instead of returning a blank image; the request's values (a huge ``guidance_scale``, an
    adapter with extreme weights) are the usual cause. The engine stays healthy.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message, param=param, code=code or "non_finite_output")


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
