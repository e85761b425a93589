"""API keys (``entrypoints/auth.py``): the bearer token, the user and admin keys, the open paths."""

from __future__ import annotations

from sglang.multimodal_gen.entrypoints.auth import ApiKeyAuth, bearer_token


def test_bearer_and_auth_rules():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None
    auth = ApiKeyAuth(api_key="k", admin_api_key="adm")
    assert auth.check("/health", None) is None
    assert auth.check("/v1/models", "Bearer k") is None
    assert auth.check("/v1/models", "Bearer adm") is None
    assert auth.check("/v1/models", "Bearer k2") == "invalid API key"
    assert auth.check("/v1/set_lora", "Bearer k") == "invalid API key"
    assert auth.check("/v1/set_lora", "Bearer adm") is None
    assert "missing" in auth.check("/v1/models", None)
    open_auth = ApiKeyAuth()
    assert open_auth.check("/v1/set_lora", "Bearer whatever") is None
    admin_only = ApiKeyAuth(admin_api_key="adm")
    assert admin_only.check("/v1/models", None) is None
    assert admin_only.check("/v1/unset_lora", None) is not None
