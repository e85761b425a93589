"""The base of the server's links (``entrypoints/public_url.py``): ``--public-url``, else the address
the server listens on; never a request header."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.configs.server_args import ServerArgs, check_public_url
from sglang.multimodal_gen.entrypoints.public_url import PublicUrl

# what a request says about the server: ignored however it is spelt
HOSTILE_SCOPE = {
    "server": ("10.0.0.5", 30000),
    "headers": [(b"host", b"evil.example"), (b"x-forwarded-host", b"evil.example")],
}


def test_the_configured_url_wins():
    base = PublicUrl("https://images.example.com/sglang/", "0.0.0.0", 30000)
    assert base.base(HOSTILE_SCOPE) == "https://images.example.com/sglang"


@pytest.mark.parametrize(
    "host,port,scope,expected",
    [
        ("127.0.0.1", 8080, HOSTILE_SCOPE, "http://127.0.0.1:8080"),
        ("images.local", 8080, HOSTILE_SCOPE, "http://images.local:8080"),
        ("::1", 8080, None, "http://[::1]:8080"),
        # every address: the one the client connected to (the server's own socket)
        ("0.0.0.0", 8080, HOSTILE_SCOPE, "http://10.0.0.5:8080"),
        ("::", 8080, {"server": ("fe80::1", 8080)}, "http://[fe80::1]:8080"),
        ("0.0.0.0", 8080, None, "http://localhost:8080"),
        ("0.0.0.0", 8080, {"server": ("/run/sglang.sock", None)}, "http://localhost:8080"),
        # --port 0: the port the connection came in on
        ("127.0.0.1", 0, {"server": ("127.0.0.1", 41234)}, "http://127.0.0.1:41234"),
    ],
)
def test_without_it_the_bound_address(host, port, scope, expected):
    assert PublicUrl(None, host, port).base(scope) == expected


def test_the_flag_is_checked_and_normalised():
    assert check_public_url("https://img.example.com/") == "https://img.example.com"
    assert check_public_url("http://h:8080/p/") == "http://h:8080/p"
    for bad in ("img.example.com", "ftp://x", "https://", "https://u:p@x", "https://x/?a=1",
                "https://x/#f", "http://x:port"):  # fmt: skip
        with pytest.raises(ValueError, match="--public-url"):
            check_public_url(bad)
    assert ServerArgs(public_url="https://a.example/").public_url == "https://a.example"
    assert ServerArgs().public_url is None
