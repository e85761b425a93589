"""The OpenAI error envelope and the mapping from exceptions to it.

Every error the HTTP server returns has the body::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Exceptions from the layers below (``sglang.multimodal_gen.errors``) carry ``status_code``,
``error_type`` and ``param``; :func:`describe_exception` turns any exception into
``(status, envelope, headers)`` without ever exposing a stack trace: unexpected exceptions become a
500 with a short reference id, and the traceback goes to the log under that id.
"""

from __future__ import annotations

import logging
import uuid

from sglang.multimodal_gen.errors import QueueFullError, SGLangError

logger = logging.getLogger(__name__)

#: ``type`` used for each status when the exception does not say.
DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


#: Longest error message sent (characters); longer ones are cut with a note of how much.
MAX_MESSAGE_CHARS = 2000


def error_body(
    message: str,
    status: int = 400,
    *,
    type: str | None = None,  # noqa: A002 - the OpenAI field is called "type"
    param: str | None = None,
    code: str | int | None = None,
) -> dict:
    """Build the OpenAI error envelope ``{"error": {...}}``.

    Args:
        message: human-readable explanation (never a traceback).
        status: HTTP status, used to pick a default ``type``.
        type: the OpenAI error type; default from :data:`DEFAULT_TYPES`.
        param: the request field at fault, if any.
        code: a short machine-readable code (``"invalid_json"``, ``"queue_full"``, ...).
    """
    # a lone surrogate echoed from a request cannot be encoded as UTF-8: escape it, never fail
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(message) > MAX_MESSAGE_CHARS:  # messages quote the request: never echo a whole body
        cut = len(message) - MAX_MESSAGE_CHARS
        message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} more characters)"
    if param is not None:  # a field name can come from the client as well
        param = param.encode("utf-8", "backslashreplace").decode("utf-8")
        if len(param) > 200:
            param = param[:200] + "..."
    return {
        "error": {
            "message": message,
            "type": type or DEFAULT_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def describe_exception(exc: BaseException) -> tuple[int, dict, dict]:
    """Map an exception raised while serving a request to ``(status, body, headers)``.

    - :class:`~sglang.multimodal_gen.errors.SGLangError`: its ``status_code``/``error_type``/
      ``param``/``code``; ``QueueFullError`` adds ``Retry-After``, other 503s ``Retry-After: 1``.
    - ``ValueError`` (the project's convention for bad input): 400 with its message.
    - ``FileNotFoundError``: 404 with its message (an adapter path that does not exist).
    - ``UnicodeError`` / ``RecursionError`` (text that is not valid Unicode, nesting too deep,
      reaching a library): 400 with our own sentence (the specific checks come first and name
      the field; this is the net behind them).
    - anything else: 500 ``"internal server error (ref <id>)"``; the traceback is logged.
    """
    headers: dict[str, str] = {}
    if isinstance(exc, SGLangError):
        status = int(exc.status_code)
        if isinstance(exc, QueueFullError):
            headers["Retry-After"] = str(max(1, int(exc.retry_after_s)))
        elif status == 503:
            headers["Retry-After"] = "1"
        if status >= 500 and not isinstance(exc, QueueFullError):
            logger.warning("request failed with %s: %s", type(exc).__name__, exc.message)
        body = error_body(exc.message, status, type=exc.error_type, param=exc.param, code=exc.code)
        return status, body, headers
    if isinstance(exc, FileNotFoundError):
        message = str(exc) or "file not found"
        return 404, error_body(message, 404, code="not_found"), headers
    if isinstance(exc, UnicodeError):
        logger.warning("request refused: %s", ascii(str(exc)))
        message = "the request contains text that is not valid Unicode (a lone UTF-16 surrogate?)"
        return 400, error_body(message, 400, code="invalid_text"), headers
    if isinstance(exc, RecursionError):
        return 400, error_body("the request is nested too deeply", 400), headers
    if isinstance(exc, ValueError):
        return 400, error_body(str(exc) or "invalid value", 400), headers
    ref = uuid.uuid4().hex[:12]
    logger.error("internal error ref=%s", ref, exc_info=(type(exc), exc, exc.__traceback__))
    body = error_body(f"internal server error (ref {ref}); see the server log", 500)
    return 500, body, headers
