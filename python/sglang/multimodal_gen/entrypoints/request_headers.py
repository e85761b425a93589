"""A request's headers, read without ambiguity.

HTTP lets a client send a header twice; which copy a reader then takes differs between readers
(``dict(scope["headers"])`` keeps the last one, Starlette's ``request.headers.get`` the first,
a proxy in front may join them). For the headers that decide who a request acts for, where it
comes from and how its body is read, such a request has no single meaning: two ``Authorization``
headers, a user key then the admin key, must not be taken as either. It is refused before
anything else (HTTP 400 naming the header, :func:`duplicated_header`).

``X-Request-Id`` is not among them: it only labels the log line, and a duplicated one is replaced
by an id of the server's own (:mod:`.request_log`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SINGLE_HEADERS", "duplicated_header", "single_headers"]

#: Headers a request may carry at most once (lower case), with their usual spelling.
SINGLE_HEADERS = {
    b"authorization": "Authorization",  # the API key: who the request acts for
    b"proxy-authorization": "Proxy-Authorization",
    b"host": "Host",  # the cross-origin check compares Origin with it
    b"origin": "Origin",
    b"sec-fetch-site": "Sec-Fetch-Site",
    b"content-type": "Content-Type",  # JSON or multipart: how the body is read
    b"content-length": "Content-Length",
    b"transfer-encoding": "Transfer-Encoding",
}


def duplicated_header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The first of :data:`SINGLE_HEADERS` that ``headers`` (raw ASGI pairs, lower-case names)
    carry more than once, in its usual spelling; ``None`` when there is none."""
    seen: set[bytes] = set()
    for name, _ in headers:
        name = name.lower()
        if name in SINGLE_HEADERS:
            if name in seen:
                return SINGLE_HEADERS[name]
            seen.add(name)
    return None


def single_headers(headers: Iterable[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Lower-case name -> value, for a request :func:`duplicated_header` let through (every
    header the checks read appears once; of another header repeated, the first)."""
    out: dict[bytes, bytes] = {}
    for name, value in headers:
        out.setdefault(name.lower(), value)
    return out
