"""API keys (``entrypoints/auth.py``): a user key on an admin route is told it is not an admin key
(403), every key is compared every time, and a request acts for the owner of its key."""

from __future__ import annotations

import hmac

import pytest
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.entrypoints.auth import (
    ANONYMOUS,
    ApiKeyAuth,
    AuthRefusal,
    Principal,
    bearer_token,
    key_owner,
)


def test_bearer_and_auth_rules():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None
    auth = ApiKeyAuth(api_key="k", admin_api_key="adm")
    assert auth.check("/health", None) is None
    assert auth.check("/v1/models", "Bearer k") is None
    assert auth.check("/v1/models", "Bearer adm") is None
    assert auth.check("/v1/models", "Bearer k2") == "invalid API key"
    assert auth.check("/v1/set_lora", "Bearer k").startswith("this key is not an admin key")
    assert auth.check("/v1/set_lora", "Bearer k2") == "invalid API key"
    assert auth.check("/v1/set_lora", "Bearer adm") is None
    assert "missing" in auth.check("/v1/models", None)
    open_auth = ApiKeyAuth()
    assert open_auth.check("/v1/set_lora", "Bearer whatever") is None
    admin_only = ApiKeyAuth(admin_api_key="adm")
    assert admin_only.check("/v1/models", None) is None
    assert admin_only.check("/v1/unset_lora", None) is not None


def test_a_user_key_on_an_admin_route_is_not_an_admin_key():
    auth = ApiKeyAuth(api_key="user", admin_api_key="adm")
    refused = auth.authenticate("/v1/set_lora", "Bearer user")
    assert isinstance(refused, AuthRefusal)
    assert (refused.status, refused.code) == (403, "insufficient_permissions")
    assert "not an admin key" in refused.message and "invalid" not in refused.message
    wrong = auth.authenticate("/v1/set_lora", "Bearer nope")
    assert (wrong.status, wrong.code, wrong.message) == (401, "invalid_api_key", "invalid API key")
    assert auth.authenticate("/v1/set_lora", "Bearer adm") == Principal(key_owner("adm"), True)
    missing = auth.authenticate("/v1/set_lora", None)
    assert missing.status == 401 and "missing" in missing.message


def test_every_key_is_compared_every_time(monkeypatch):
    """Constant time in which key matched: the admin key and every user key are compared
    whatever the token and the route."""
    compared = []

    def counting(a, b):
        compared.append(b)
        return a == b

    monkeypatch.setattr(hmac, "compare_digest", counting)
    auth = ApiKeyAuth(api_key=["u1", "u2"], admin_api_key="adm")
    for path in ("/v1/set_lora", "/v1/models"):
        for token in ("u1", "u2", "adm", "nope"):
            compared.clear()
            auth.authenticate(path, f"Bearer {token}")
            assert sorted(compared) == [b"adm", b"u1", b"u2"], (path, token)


def test_each_key_is_its_own_owner_and_the_key_is_not_kept_in_it():
    auth = ApiKeyAuth(api_key=["u1", "u2"], admin_api_key="adm")
    one = auth.authenticate("/v1/videos", "Bearer u1")
    two = auth.authenticate("/v1/videos", "Bearer u2")
    admin = auth.authenticate("/v1/videos", "Bearer adm")
    assert one.owner != two.owner and not one.admin and admin.admin
    assert "u1" not in repr(one) and one.owner == key_owner("u1") and len(one.owner) == 64
    assert one.may_see(one.owner) and not one.may_see(two.owner) and not one.may_see(None)
    assert admin.may_see(one.owner) and admin.may_see(two.owner) and admin.may_see(None)
    # no keys: everybody is anonymous and sees everything created without a key
    assert ApiKeyAuth().authenticate("/v1/videos", "Bearer whatever") == ANONYMOUS
    assert ANONYMOUS.may_see(None)
    # an admin key on an open route still names the admin
    admin_only = ApiKeyAuth(admin_api_key="adm")
    assert admin_only.authenticate("/v1/videos", None) == ANONYMOUS
    assert admin_only.authenticate("/v1/videos", "Bearer adm").admin


def test_api_key_flag_repeats():
    parser = ServerArgs.add_cli_args(__import__("argparse").ArgumentParser())
    one = ServerArgs.from_cli_args(parser.parse_args(["--api-key", "a"]))
    assert one.api_key == "a" and one.user_api_keys == ("a",)
    two = ServerArgs.from_cli_args(parser.parse_args(["--api-key", "a", "--api-key", "b"]))
    assert two.user_api_keys == ("a", "b")
    assert "'a'" not in str(two.redacted()) and two.redacted()["api_key"] == ["***", "***"]
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        ServerArgs(api_key=["a", ""])
