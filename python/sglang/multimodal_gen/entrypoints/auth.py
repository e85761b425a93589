"""API-key and cross-origin checks for the HTTP server.

With ``--api-key`` every endpoint except ``/health`` and ``/ready`` (probes) requires
``Authorization: Bearer <key>``. With ``--admin-api-key`` the LoRA admin endpoints require that key instead (the admin key is also
accepted on the other endpoints). Keys are compared with :func:`hmac.compare_digest` so the time
taken does not reveal how much of a guess was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from urllib.parse import urlsplit

# Paths that change engine state (they take the admin key when one is configured): the op table's
from sglang.multimodal_gen.engine_ops import ADMIN_PATHS

__all__ = ["ADMIN_PATHS", "PUBLIC_PATHS", "ApiKeyAuth", "bearer_token", "cross_origin_reason"]
#: Paths open to everyone.
PUBLIC_PATHS = frozenset({"/health", "/ready"})


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (scheme case-insensitive)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(token: str | None, key: str | None) -> bool:
    if token is None or key is None:
        return False
    return hmac.compare_digest(token.encode("utf-8"), key.encode("utf-8"))


class ApiKeyAuth:
    """Decides whether a request may reach an endpoint.

    Args:
        api_key: the key of ``--api-key`` or ``None`` (no auth on ordinary endpoints).
        admin_api_key: the key of ``--admin-api-key`` or ``None`` (admin endpoints then follow
            ``api_key``).
    """

    def __init__(self, api_key: str | None = None, admin_api_key: str | None = None):
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    def required_for(self, path: str) -> bool:
        """True when ``path`` needs a key under this configuration."""
        if path in PUBLIC_PATHS:
            return False
        if path in ADMIN_PATHS and self.admin_api_key is not None:
            return True
        return self.api_key is not None

    def check(self, path: str, authorization: str | None) -> str | None:
        """Return ``None`` when allowed, else the reason for a 401."""
        if not self.required_for(path):
            return None
        token = bearer_token(authorization)
        if token is None:
            return (
                "missing API key: send the header 'Authorization: Bearer <key>'"
                if not authorization
                else "malformed Authorization header: expected 'Bearer <key>'"
            )
        if path in ADMIN_PATHS and self.admin_api_key is not None:
            ok = _matches(token, self.admin_api_key)
        else:
            # Evaluate both comparisons so the timing does not say which key was close.
            ok_user = _matches(token, self.api_key)
            ok_admin = _matches(token, self.admin_api_key)
            ok = ok_user or ok_admin
        return None if ok else "invalid API key"


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def cross_origin_reason(method: str, headers: Mapping[bytes, bytes]) -> str | None:
    """Why a request with side effects that a browser sent on behalf of another site is refused
    (``None``: allowed).

    A web page can make a browser POST to this server without asking first (a form, ``text/plain``
    or an untyped body need no CORS preflight), so without an API key any page a user opens could
    generate or change adapters. Browsers say where a request comes from: ``Sec-Fetch-Site`` (all
    current browsers) must be ``same-origin`` or ``none`` (typed by the user); without it, an
    ``Origin`` must name this host. Requests without either header (curl, the SDKs, other servers)
    pass, and so do requests with an ``Authorization`` header (a browser sends one cross-site only
    after a CORS preflight that this server or a proxy in front of it approved). The rules of the Fetch Metadata standard as Go's ``http.CrossOriginProtection`` applies
    them.

    Args:
        headers: lower-case header names to raw values (``host``, ``origin``, ``sec-fetch-site``).
    """
    if method.upper() in _SAFE_METHODS or b"authorization" in headers:
        return (
            None  # a browser adds no Authorization by itself: a CORS-approved caller or no browser
        )
    site = headers.get(b"sec-fetch-site") or None  # empty: as absent
    if site is not None:
        if site in (b"same-origin", b"none"):
            return None
        return (
            f"a browser request from another site (Sec-Fetch-Site: {site.decode('latin-1')}) "
            "may not change anything here; call the server from the same origin or from a "
            "backend"
        )
    origin = headers.get(b"origin")
    if origin is None:
        return None
    host = headers.get(b"host", b"").decode("latin-1").lower()
    try:
        if urlsplit(origin.decode("latin-1")).netloc.lower() == host:
            return None
    except ValueError:  # not a URL (an unclosed IPv6 bracket): not this host
        pass
    return (
        f"a browser request from another origin (Origin: {origin.decode('latin-1')[:100]}) may "
        "not change anything here; call the server from the same origin or from a backend"
    )
