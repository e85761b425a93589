"""Where the server's links point: the base URL of ``response_format: "url"`` answers.

A link is built from the server's configuration, never from what a request says about the
server (``Host``, ``X-Forwarded-Host``, ...): a client could otherwise have the answers point
wherever it likes (``Host: evil.example``), and so could anything between another client and the
server that rewrites headers.

- ``--public-url URL`` (``https://images.example.com``, a path prefix allowed): links are
  ``URL/v1/images/files/<name>``; what a deployment behind a proxy or a TLS terminator sets.
- otherwise ``http://HOST:PORT`` of ``--host`` / ``--port``. When the server listens on every
  address (``0.0.0.0``, ``::``), the host is the local address of the connection the request
  came in on (the server's own socket: the address the client reached, not a header), and
  ``localhost`` when there is none; with ``--port 0`` the port is the connection's as well.
"""

from __future__ import annotations

import ipaddress

__all__ = ["PublicUrl"]

#: ``--host`` values meaning "every address".
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def _host_part(host: str) -> str:
    """``host`` as it goes in a URL (an IPv6 address in brackets)."""
    host = host.strip("[]")
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass  # a name
    return host


def _is_ip(value: object) -> bool:
    try:
        ipaddress.ip_address(str(value).strip("[]"))
    except ValueError:
        return False
    return value is not None


class PublicUrl:
    """The base of the server's links (no trailing ``/``).

    Args:
        public_url: ``--public-url`` (already checked by ``ServerArgs``), or ``None``.
        host: ``--host``.
        port: ``--port``.
    """

    def __init__(self, public_url: str | None, host: str, port: int):
        self.public_url = public_url.rstrip("/") if public_url else None
        self.host = host
        self.port = int(port)

    def base(self, scope: dict | None = None) -> str:
        """The base URL for a request with ASGI ``scope`` (only its ``server``, the local
        socket address, is read, and only when the configuration leaves the address open)."""
        if self.public_url:
            return self.public_url
        local = (scope or {}).get("server") or (None, None)
        host, port = self.host, self.port
        if host in _WILDCARDS:
            host = local[0] if _is_ip(local[0]) else "localhost"  # a unix socket: no address
        if port == 0 and isinstance(local[1], int):
            port = local[1]
        return f"http://{_host_part(host)}:{port}"
