"""Video jobs and stored images belong to the key that created them (real uvicorn, fake engines):
another key gets 404 for them and does not see them listed, cannot delete them; the admin key
sees and deletes every one; without keys everything is everyone's, as before keys existed."""

from __future__ import annotations

import httpx
from fixtures.server import FakeEngine, FakeVideoEngine, assert_envelope, running_server, wait_until
from sglang.multimodal_gen.configs.server_args import ServerArgs

KEYS = ServerArgs(api_key=["key-one", "key-two"], admin_api_key="key-admin")
ONE = {"Authorization": "Bearer key-one"}
TWO = {"Authorization": "Bearer key-two"}
ADMIN = {"Authorization": "Bearer key-admin"}
VIDEO = {"prompt": "a paper boat", "num_inference_steps": 1}


def _ids(url, headers) -> list[str]:
    r = httpx.get(f"{url}/v1/videos", headers=headers)
    assert r.status_code == 200, r.text
    return [j["id"] for j in r.json()["data"]]


def _done(url, job_id, headers) -> dict:
    def finished():
        job = httpx.get(f"{url}/v1/videos/{job_id}", headers=headers).json()
        return job["status"] in ("completed", "failed")

    wait_until(finished, "the job did not finish")
    return httpx.get(f"{url}/v1/videos/{job_id}", headers=headers).json()


def test_video_jobs_are_the_creating_keys():
    with running_server(FakeVideoEngine(), KEYS) as (url, _, _):
        mine = httpx.post(f"{url}/v1/videos", json=VIDEO, headers=ONE).json()["id"]
        theirs = httpx.post(f"{url}/v1/videos", json=VIDEO, headers=TWO).json()["id"]
        assert _done(url, mine, ONE)["status"] == "completed"
        assert _ids(url, ONE) == [mine] and _ids(url, TWO) == [theirs]
        assert _ids(url, ADMIN) == [mine, theirs]
        for path in (f"/v1/videos/{mine}", f"/v1/videos/{mine}/content"):
            r = httpx.get(url + path, headers=TWO)
            err = assert_envelope(r, 404, param="video_id")
            assert err["message"] == f"video job {mine!r} not found"  # as if it never existed
            assert httpx.get(url + path, headers=ONE).status_code == 200
            assert httpx.get(url + path, headers=ADMIN).status_code == 200
        assert_envelope(httpx.delete(f"{url}/v1/videos/{mine}", headers=TWO), 404)
        assert _ids(url, ONE) == [mine]  # still there
        r = httpx.delete(f"{url}/v1/videos/{theirs}", headers=ADMIN)
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert _ids(url, TWO) == [] and _ids(url, ADMIN) == [mine]
        # the prompt of another key's job is nowhere in its answers
        assert "paper boat" not in httpx.get(f"{url}/v1/videos", headers=TWO).text


def test_stored_images_are_the_creating_keys():
    body = {"prompt": "x", "size": "64x64", "num_inference_steps": 1, "response_format": "url"}
    with running_server(FakeEngine(), KEYS) as (url, _, _):
        r = httpx.post(f"{url}/v1/images/generations", json=body, headers=ONE, timeout=30)
        link = r.json()["data"][0]["url"]
        assert httpx.get(link, headers=ONE).status_code == 200
        assert httpx.get(link, headers=ADMIN).status_code == 200
        assert_envelope(httpx.get(link, headers=TWO), 404, param="name")
        assert_envelope(httpx.get(link), 401)


def test_without_keys_everything_is_everyones():
    with running_server(FakeVideoEngine()) as (url, _, _):
        job = httpx.post(f"{url}/v1/videos", json=VIDEO).json()["id"]
        other = {"Authorization": "Bearer anything"}  # ignored without keys
        assert _ids(url, other) == [job] and _ids(url, {}) == [job]
        assert _done(url, job, other)["status"] == "completed"
        assert httpx.delete(f"{url}/v1/videos/{job}", headers=other).status_code == 200
