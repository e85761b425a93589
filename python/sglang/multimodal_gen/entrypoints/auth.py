"""API-key and cross-origin checks for the HTTP server.

With ``--api-key`` every endpoint except ``/health`` and ``/ready`` (probes) requires
``Authorization: Bearer <key>``; several ``--api-key`` values are several keys. With
``--admin-api-key`` the LoRA admin endpoints require that key instead (the admin key is also
accepted on the other endpoints); a user key there is told it is not an admin key (403), any other
token that it is invalid (401). Keys are compared with :func:`hmac.compare_digest`, and every key
is compared with the token every time, so the time taken says neither how much of a guess was
right nor which key it was close to.

A request that passes acts for a :class:`Principal`: the key's owner id (a hash of the key, never
the key) and whether it holds the admin key. Video jobs and stored images belong to the owner that
created them (:meth:`Principal.may_see`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

# Paths that change engine state (they take the admin key when one is configured): the op table's
from sglang.multimodal_gen.engine_ops import ADMIN_PATHS

__all__ = [
    "ADMIN_PATHS",
    "ANONYMOUS",
    "PUBLIC_PATHS",
    "ApiKeyAuth",
    "AuthRefusal",
    "Principal",
    "bearer_token",
    "cross_origin_reason",
    "key_owner",
]
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


def key_owner(key: str) -> str:
    """The owner id of ``key``: its SHA-256 (what jobs and images are stored under)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who a request acts for.

    Attributes:
        owner: the owner id of its key (:func:`key_owner`); ``None``: no key (a server, or a route,
            without keys).
        admin: it holds ``--admin-api-key``: it sees what every key created.
    """

    owner: str | None = None
    admin: bool = False

    def may_see(self, owner: str | None) -> bool:
        """Whether a job or image created under ``owner`` is visible to this principal: its own,
        or any for the admin key. Without keys every owner is ``None``: all are visible."""
        return self.admin or owner == self.owner


#: The principal of a request without a key.
ANONYMOUS = Principal()


@dataclass(frozen=True)
class AuthRefusal:
    """Why a request may not reach its endpoint: ``status`` 401 (no valid key) or 403 (a valid
    key without the right), the ``message`` and the envelope's ``code``."""

    status: int
    message: str
    code: str


class ApiKeyAuth:
    """Decides whether a request may reach an endpoint, and for whom it acts.

    Args:
        api_key: the key or keys of ``--api-key``, or ``None`` (no auth on ordinary endpoints).
        admin_api_key: the key of ``--admin-api-key`` or ``None`` (admin endpoints then follow
            ``api_key``).
    """

    def __init__(
        self, api_key: str | Iterable[str] | None = None, admin_api_key: str | None = None
    ):
        keys = () if api_key is None else (api_key,) if isinstance(api_key, str) else api_key
        self.api_keys: tuple[str, ...] = tuple(keys)
        self.admin_api_key = admin_api_key
        self._owners = tuple(key_owner(k) for k in self.api_keys)
        self._admin = (
            None if admin_api_key is None else Principal(key_owner(admin_api_key), admin=True)
        )

    @property
    def api_key(self) -> str | None:
        """The first ``--api-key`` (``None`` without one)."""
        return self.api_keys[0] if self.api_keys else None

    def required_for(self, path: str) -> bool:
        """True when ``path`` needs a key under this configuration."""
        if path in PUBLIC_PATHS:
            return False
        if path in ADMIN_PATHS and self.admin_api_key is not None:
            return True
        return bool(self.api_keys)

    def _identify(self, token: str | None) -> tuple[Principal | None, Principal | None]:
        """``(admin principal or None, user principal or None)`` of ``token``; every key is
        compared, whichever matches (constant time in which key, if any, it is)."""
        ok_admin = _matches(token, self.admin_api_key)
        users = [_matches(token, k) for k in self.api_keys]  # all of them, no short cut
        user = next((Principal(o) for o, ok in zip(self._owners, users) if ok), None)
        return (self._admin if ok_admin else None), user

    def authenticate(self, path: str, authorization: str | None) -> Principal | AuthRefusal:
        """The principal a request to ``path`` acts for, or why it is refused.

        On a route that needs no key, a known key still names its principal (an admin key sees
        everything there too); anything else is :data:`ANONYMOUS`.
        """
        token = bearer_token(authorization)
        admin, user = self._identify(token)
        if not self.required_for(path):
            return admin or user or ANONYMOUS
        if token is None:
            return AuthRefusal(
                401,
                "missing API key: send the header 'Authorization: Bearer <key>'"
                if not authorization
                else "malformed Authorization header: expected 'Bearer <key>'",
                "invalid_api_key",
            )
        if path in ADMIN_PATHS and self.admin_api_key is not None:
            if admin is not None:
                return admin
            if user is not None:
                return AuthRefusal(
                    403,
                    f"this key is not an admin key: {path} needs the key of --admin-api-key",
                    "insufficient_permissions",
                )
            return AuthRefusal(401, "invalid API key", "invalid_api_key")
        found = admin or user
        return (
            found if found is not None else AuthRefusal(401, "invalid API key", "invalid_api_key")
        )

    def check(self, path: str, authorization: str | None) -> str | None:
        """``None`` when allowed, else the message of the refusal (:meth:`authenticate`)."""
        result = self.authenticate(path, authorization)
        return result.message if isinstance(result, AuthRefusal) else None


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
