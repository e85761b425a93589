"""``/v1/videos`` through a real server (uvicorn) on the tiny two-expert Wan engine, with httpx.

The content of a job must be the engine's own frames, encoded (the MP4 bytes equal our encoder's
output for the frames the engine returns directly; the lossless path is tested by the CLI), jobs
run concurrently with other requests, survive the client, and bad input is a 4xx that creates
nothing.
"""

from __future__ import annotations

import io
import time

import httpx
import numpy as np
import pytest
from fixtures.server import FakeEngine, assert_envelope, running_server
from fixtures.tiny_models import psnr
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.configs.wan import WanSamplingParams
from sglang.multimodal_gen.entrypoints.scheduler import Scheduler
from sglang.multimodal_gen.outputs import Video, encode_video
from sglang.multimodal_gen.runtime import DiffusionEngine

BODY = dict(prompt="a paper boat", size="32x32", num_frames=5, fps=8, num_inference_steps=2,
            seed=11, guidance_scale=3.0, negative_prompt="blurry")  # fmt: skip


# the server's own bounds (below the model's): the video route must apply them as the image one
SERVER_LIMITS = dict(max_inference_steps=50, max_pixel_steps=32 * 32 * 9 * 50)


@pytest.fixture(scope="module")
def served(tiny_wan_a14b_dir):
    args = ServerArgs(model_path=tiny_wan_a14b_dir, **SERVER_LIMITS)
    with DiffusionEngine(tiny_wan_a14b_dir, device="cpu") as engine:
        with running_server(engine, args) as (url, app, _):
            yield url, engine


def _wait(url, job_id, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/videos/{job_id}", timeout=30).json()
        if job["status"] in ("completed", "failed"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish")


def _decode(mp4: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(mp4)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])


def test_job_lifecycle_and_content(served):
    url, engine = served
    r = httpx.post(f"{url}/v1/videos", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] == "queued"  # as created
    assert (job["size"], job["num_frames"], job["fps"], job["seconds"]) == ("32x32", 5, 8, "0.5")
    assert _wait(url, job["id"])["status"] == "completed"
    content = httpx.get(f"{url}/v1/videos/{job['id']}/content", timeout=30)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames = _decode(content.content)
    req = WanSamplingParams(prompt=BODY["prompt"], height=32, width=32, num_frames=5, fps=8,
                            num_inference_steps=2, seed=11, guidance_scale=3.0,
                            negative_prompt="blurry")  # fmt: skip
    video = engine.generate(req)[0]
    direct = video.frames
    assert frames.shape == direct.shape == (5, 32, 32, 3) and video.fps == 8
    # the job's MP4 is our encoder's output for the engine's frames (x264 is deterministic for
    # the same frames and settings); once in a full CI run the frames differed by rounding (a
    # different mdat size), so a byte mismatch must still decode within 40 dB of the direct MP4
    expected = encode_video(video)  # at the video's own 8 fps
    assert expected == encode_video(direct, 8, "mp4")
    if content.content != expected:
        assert psnr(frames, _decode(expected)) >= 40, psnr(frames, _decode(expected))
    other = engine.generate(req.replace(seed=12))[0].frames
    assert content.content != encode_video(other, 8, "mp4")
    assert psnr(frames, _decode(encode_video(other, 8, "mp4"))) < 30  # another seed: far off
    assert psnr(frames, direct) > psnr(frames, other)
    listed = httpx.get(f"{url}/v1/videos", timeout=30).json()
    assert job["id"] in [j["id"] for j in listed["data"]]
    assert httpx.delete(f"{url}/v1/videos/{job['id']}", timeout=30).json()["deleted"] is True
    gone = httpx.get(f"{url}/v1/videos/{job['id']}", timeout=30)
    assert_envelope(gone, 404, param="video_id")


def test_concurrent_jobs_and_seconds(served):
    url, _ = served
    ids = []
    for seed in (1, 2, 3):
        body = dict(BODY, seed=seed, seconds="0.5")
        del body["num_frames"]
        r = httpx.post(f"{url}/v1/videos", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["num_frames"] == 5  # 0.5 s at 8 fps + the first frame
        ids.append(r.json()["id"])
    contents = []
    for jid in ids:
        assert _wait(url, jid)["status"] == "completed"
        contents.append(httpx.get(f"{url}/v1/videos/{jid}/content", timeout=30).content)
    assert len(set(contents)) == 3


@pytest.mark.parametrize(
    "patch,status,param",
    [
        (dict(size="30x32"), 400, "size"),
        (dict(seconds="abc"), 400, "seconds"),
        (dict(fps=0), 400, "fps"),
        (dict(num_frames=0), 400, "num_frames"),
        (dict(num_frames=100_000_001), 400, "num_frames"),  # over the rotary tables' reach
        (dict(num_frames=13, num_inference_steps=50), 400, "num_frames"),  # --max-pixel-steps
        (dict(num_inference_steps=51), 400, "num_inference_steps"),  # --max-steps
        (dict(guidance_scale_2=-1), 400, "guidance_scale_2"),
        (dict(guidance_scale=float("inf")), 400, None),
        (dict(unknown_field=1), 422, None),
        (dict(model="another-model"), 404, "model"),
    ],
)
def test_bad_input_creates_nothing(served, patch, status, param):
    url, _ = served
    before = len(httpx.get(f"{url}/v1/videos", timeout=30).json()["data"])
    body = dict(BODY, **patch)
    if patch.get("guidance_scale") == float("inf"):
        r = httpx.post(f"{url}/v1/videos", content=b'{"prompt": "x", "guidance_scale": 1e999}',
                       headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    else:
        r = httpx.post(f"{url}/v1/videos", json=body, timeout=30)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
    assert len(httpx.get(f"{url}/v1/videos", timeout=30).json()["data"]) == before


def test_image_endpoint_on_video_model_and_content_before_done(served):
    url, _ = served
    r = httpx.post(f"{url}/v1/images/generations", json=dict(prompt="x", size="32x32"), timeout=60)
    assert_envelope(r, 400, param="model")
    assert "video model" in r.json()["error"]["message"]
    job = httpx.post(f"{url}/v1/videos", json=dict(BODY, num_inference_steps=3), timeout=30).json()
    early = httpx.get(f"{url}/v1/videos/{job['id']}/content", timeout=30)
    if early.status_code != 200:  # still queued or running
        assert_envelope(early, 409, param="video_id")
    assert _wait(url, job["id"])["status"] == "completed"


def test_video_requests_batched_by_the_scheduler_get_their_own_videos(served):
    """Two video requests that share a batch (``engine.generate_continuous``) each get their own
    ``Video``, as alone; the image route never reaches the scheduler on a video model (it is
    refused in its handler: ``test_image_endpoint_on_video_model_and_content_before_done``)."""
    _, engine = served
    reqs = [
        engine.spec.resolve(engine.spec.params(
            prompt=p, height=32, width=32, num_frames=5, fps=8, num_inference_steps=2, seed=s,
        ))
        for p, s in (("a boat", 1), ("a cat", 2))
    ]  # fmt: skip
    alone = [engine.generate(r)[0] for r in reqs]
    counting = _CountingBatches(engine)
    scheduler = Scheduler(counting, max_batch_size=2)
    futures = [scheduler.submit_generation(r) for r in reqs]
    scheduler.start()  # both queued first: they form one batch
    try:
        got = [f.result(timeout=120) for f in futures]
    finally:
        scheduler.stop(timeout=60)
    assert counting.batches == [2]
    for (video,), ref in zip(got, alone):
        assert isinstance(video, Video) and video.fps == 8
        assert psnr(video.frames, ref.frames) >= 45
    assert psnr(got[0][0].frames, got[1][0].frames) < 35  # the rows really differ


class _CountingBatches:
    """The engine, recording the size of every batch the scheduler hands it."""

    def __init__(self, engine):
        self.engine, self.batches = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate_batch(self, reqs, progress=None):
        self.batches.append(len(reqs))
        return self.engine.generate_batch(reqs, progress)

    def generate_continuous(self, reqs, admit, on_done, progress=None):
        self.batches.append(len(reqs))  # the requests it starts with (none join here)
        return self.engine.generate_continuous(reqs, admit, on_done, progress)


def test_video_routes_on_an_image_model():
    with running_server(FakeEngine()) as (url, _, _):
        r = httpx.post(f"{url}/v1/videos", json=BODY, timeout=30)
        assert_envelope(r, 400, param="model")
        assert "image model" in r.json()["error"]["message"]


def test_progress_counts_the_jobs_denoising_steps(served):
    """``progress`` goes 0 -> (share of the steps done, at most 99) -> 100, never backwards."""
    url, _ = served
    body = dict(BODY, num_inference_steps=50)
    job = httpx.post(f"{url}/v1/videos", json=body, timeout=30).json()
    seen = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = httpx.get(f"{url}/v1/videos/{job['id']}", timeout=30).json()
        seen.append((state["status"], state["progress"]))
        if state["status"] in ("completed", "failed"):
            break
        time.sleep(0.01)
    assert seen[-1] == ("completed", 100), seen[-1]
    progress = [p for _, p in seen]
    assert progress == sorted(progress), progress  # never backwards
    running = [p for s, p in seen if s == "in_progress"]
    assert any(0 < p < 100 for p in running), seen  # a share, not 0 then 100
    assert all(p <= 99 for p in running)


def test_the_openai_client_creates_polls_and_downloads_a_video(served):
    """``client.videos.create`` always sends multipart/form-data (fields as text); the job, its
    polling and its content work as with a JSON body, and the frames are the engine's."""
    import warnings

    import openai

    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    extra = dict(num_frames=5, fps=8, num_inference_steps=2, seed=11, guidance_scale=3.0,
                 negative_prompt="blurry")  # fmt: skip
    with warnings.catch_warnings():  # the SDK marks its video methods deprecated
        warnings.simplefilter("ignore")
        video = client.videos.create(prompt=BODY["prompt"], size="32x32", extra_body=extra)
        assert video.status == "queued" and video.size == "32x32"
        for _ in range(600):
            video = client.videos.retrieve(video.id)
            if video.status in ("completed", "failed"):
                break
            time.sleep(0.2)
        assert video.status == "completed" and video.progress == 100, video
        content = client.videos.download_content(video.id).read()
        with pytest.raises(openai.UnprocessableEntityError) as e:  # text where a number goes
            client.videos.create(prompt="x", size="32x32", extra_body={"fps": "fast"})
        assert e.value.body["param"] == "fps"
        with pytest.raises(openai.BadRequestError) as e:  # image-to-video is not offered
            client.videos.create(prompt="x", size="32x32", input_reference=b"\x89PNG....")
        assert e.value.body["param"] == "input_reference"
    req = WanSamplingParams(prompt=BODY["prompt"], height=32, width=32, num_frames=5,
                            num_inference_steps=2, seed=11, guidance_scale=3.0,
                            negative_prompt="blurry")  # fmt: skip
    expected = encode_video(engine.generate(req)[0].frames, 8, "mp4")
    if content != expected:  # rounding of the frames: see test_job_lifecycle_and_content
        assert psnr(_decode(content), _decode(expected)) >= 40
