"""What a hostile client sends changes nothing it should not (real uvicorn, fake engines): a
credential or body header sent twice is refused, a user key on an admin route is told it is not an
admin key, links never follow the request's ``Host``, and a multipart body cut short is refused."""

from __future__ import annotations

import socket

import httpx
import pytest
from fixtures.server import (
    FakeEngine,
    FakeVideoEngine,
    assert_envelope,
    running_server,
    write_lora_file,
)
from sglang.multimodal_gen.configs.server_args import ServerArgs

USER = "Bearer user-key"
ADMIN = "Bearer admin-key"


@pytest.fixture
def lora_dir(tmp_path):
    write_lora_file(str(tmp_path / "a.safetensors"), seed=1)
    return str(tmp_path)


def _raw(url: str, request: bytes) -> bytes:
    """The whole answer to ``request`` (sent with ``Connection: close``: read until closed)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


@pytest.mark.parametrize("order", [(USER, ADMIN), (ADMIN, USER), (ADMIN, ADMIN)])
def test_two_authorization_headers_are_refused_not_the_last_taken(lora_dir, order):
    args = ServerArgs(api_key="user-key", admin_api_key="admin-key", lora_dirs=[lora_dir])
    engine = FakeEngine(lora_dirs=[lora_dir])
    with running_server(engine, args) as (url, _, _):
        body = {"lora_nickname": "a", "lora_path": "a.safetensors"}
        headers = [("Authorization", order[0]), ("Authorization", order[1])]
        r = httpx.post(f"{url}/v1/set_lora", json=body, headers=headers)
        err = assert_envelope(r, 400, param="Authorization")
        assert err["code"] == "duplicate_header"
        r = httpx.get(f"{url}/v1/models", headers=headers)  # on every route
        assert_envelope(r, 400, param="Authorization")
        assert engine.loaded == {} and engine.calls == []
        r = httpx.post(f"{url}/v1/set_lora", json=body, headers={"Authorization": ADMIN})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "header",
    [
        b"Content-Type: application/json\r\nContent-Type: multipart/form-data; boundary=x",
        b"Origin: http://evil.example\r\nOrigin: http://127.0.0.1",
        b"Sec-Fetch-Site: cross-site\r\nSec-Fetch-Site: same-origin",
    ],
)
def test_other_headers_that_decide_a_request_are_refused_twice(header):
    engine = FakeEngine()
    with running_server(engine) as (url, _, _):
        body = b'{"prompt": "x", "size": "64x64", "num_inference_steps": 1}'
        request = (
            b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
            + body
        )  # fmt: skip
        answer = _raw(url, request)
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        assert b"duplicate_header" in answer
        assert engine.calls == []


def test_a_user_key_on_an_admin_route_is_403_not_an_admin_key(lora_dir):
    args = ServerArgs(api_key="user-key", admin_api_key="admin-key", lora_dirs=[lora_dir])
    with running_server(FakeEngine(lora_dirs=[lora_dir]), args) as (url, _, _):
        r = httpx.post(f"{url}/v1/unset_lora", headers={"Authorization": USER})
        err = assert_envelope(r, 403, param=None)
        assert err["type"] == "permission_error" and err["code"] == "insufficient_permissions"
        assert "not an admin key" in err["message"]
        r = httpx.post(f"{url}/v1/unset_lora", headers={"Authorization": "Bearer guess"})
        assert assert_envelope(r, 401)["message"] == "invalid API key"


def _url_image(url: str, **headers) -> str:
    body = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "response_format": "url"}
    r = httpx.post(f"{url}/v1/images/generations", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["url"]


def test_links_never_follow_the_request_host():
    with running_server(FakeEngine()) as (url, _, _):
        for headers in ({"Host": "evil.example"}, {"X-Forwarded-Host": "evil.example"}, {}):
            link = _url_image(url, **headers)
            assert link.startswith(f"{url}/v1/images/files/"), link
            assert httpx.get(link).status_code == 200


def test_links_use_the_public_url():
    args = ServerArgs(public_url="https://images.example.com/gen/")
    with running_server(FakeEngine(), args) as (url, _, _):
        link = _url_image(url, Host="evil.example")
        prefix = "https://images.example.com/gen/v1/images/files/"
        assert link.startswith(prefix), link
        name = link.removeprefix(prefix)
        assert httpx.get(f"{url}/v1/images/files/{name}").status_code == 200


def test_a_multipart_body_cut_short_creates_no_job():
    with running_server(FakeVideoEngine()) as (url, app, _):
        boundary = "xyz"
        full = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nboat\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="negative_prompt"\r\n\r\n'
            "blurry\r\n"
        ).encode()
        ctype = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        r = httpx.post(f"{url}/v1/videos", content=full, headers=ctype)
        err = assert_envelope(r, 400)
        assert err["code"] == "invalid_form" and "does not end with its closing" in err["message"]
        latin = full.replace(b"blurry", b"caf\xe9") + f"--{boundary}--\r\n".encode()
        r = httpx.post(f"{url}/v1/videos", content=latin, headers=ctype)
        assert_envelope(r, 400, param="negative_prompt")
        assert httpx.get(f"{url}/v1/videos").json()["data"] == []
        complete = full + f"--{boundary}--\r\n".encode()
        r = httpx.post(f"{url}/v1/videos", content=complete, headers=ctype)
        assert r.status_code == 200, r.text
        assert [j["id"] for j in httpx.get(f"{url}/v1/videos").json()["data"]] == [r.json()["id"]]
