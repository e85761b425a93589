"""Video requests are checked, and brought to what the model produces, before a job exists.

On the tiny two-expert Wan model (rotary tables of 32 patches per axis, a VAE that compresses
time by 4):

- a job without ``size`` gets the model's default size shrunk to what the rotary tables cover,
  and runs; a ``size`` beyond them is a 400 naming ``size`` and no job is created;
- a frame count not of the model's form ``4k + 1`` is brought to it as diffusers does
  (``n // 4 * 4 + 1``) when the request is resolved: the job reports the frames and seconds it
  will produce, and its MP4 has exactly those frames; ``seconds`` become ``round(seconds * fps)
  + 1`` frames before that (not truncated);
- ``sglang generate`` says so on stderr and writes that many frames.
"""

from __future__ import annotations

import io
import os
import time

import httpx
import numpy as np
import pytest
from fixtures.server import assert_envelope, running_server
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.runtime import DiffusionEngine

FAST = dict(prompt="a paper boat", num_inference_steps=2, seed=3, guidance_scale=0.0)


@pytest.fixture(scope="module")
def served(tiny_wan_a14b_dir):
    with DiffusionEngine(tiny_wan_a14b_dir, device="cpu") as engine:
        with running_server(engine, ServerArgs(model_path=tiny_wan_a14b_dir)) as (url, _, _):
            yield url, engine


def _wait(url, job_id, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/videos/{job_id}", timeout=30).json()
        if job["status"] in ("completed", "failed"):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish")


def _frames(mp4: bytes) -> int:
    import av

    with av.open(io.BytesIO(mp4)) as c:
        return sum(1 for _ in c.decode(c.streams.video[0]))


def _jobs(url) -> int:
    return len(httpx.get(f"{url}/v1/videos", timeout=30).json()["data"])


def test_default_size_fits_the_rotary_tables_and_a_larger_one_is_refused(served):
    url, engine = served
    top = engine.spec.limits.max_image_size
    assert top == 32 * engine.spec.spatial_factor  # rope_max_seq_len patches per axis
    job = httpx.post(f"{url}/v1/videos", json=dict(FAST, num_frames=5), timeout=30).json()
    w, h = (int(v) for v in job["size"].split("x"))
    assert max(w, h) <= top, job
    assert _wait(url, job["id"])["status"] == "completed"
    before = _jobs(url)
    big = f"{top + engine.spec.spatial_factor}x{engine.spec.spatial_factor}"
    r = httpx.post(f"{url}/v1/videos", json=dict(FAST, size=big, num_frames=5), timeout=30)
    assert_envelope(r, 400, param="size")
    assert _jobs(url) == before  # no job was created


@pytest.mark.parametrize(
    "ask, frames",
    [
        (dict(num_frames=6), 5),
        (dict(num_frames=8), 9),
        (dict(num_frames=9), 9),
        # 0.26 s at 10 fps: round(2.6) + 1 = 4 frames -> 5; truncating gives 3 -> 1
        (dict(seconds="0.26", fps=10), 5),
    ],
)
def test_frames_are_brought_to_the_models_form_before_the_job(served, ask, frames):
    url, _ = served
    body = dict(FAST, size="32x32", **ask)
    job = httpx.post(f"{url}/v1/videos", json=body, timeout=30).json()
    assert job["num_frames"] == frames, job
    assert float(job["seconds"]) == pytest.approx((frames - 1) / job["fps"]), job
    done = _wait(url, job["id"])
    assert done["status"] == "completed", done
    mp4 = httpx.get(f"{url}/v1/videos/{job['id']}/content", timeout=30).content
    assert _frames(mp4) == frames


def test_cli_says_when_it_brings_the_frame_count_to_the_models_form(tiny_wan_a14b_dir, tmp_path):
    from sglang.cli.generate import main

    out = tmp_path / "frames"
    argv = ["--model-path", tiny_wan_a14b_dir, "--prompt", "a boat", "--num-frames", "6",
            "--height", "32", "--width", "32", "--num-inference-steps", "2", "--seed", "1",
            "--guidance-scale", "0", "--device", "cpu", "--no-progress",
            "--output-path", f"{out}/"]  # fmt: skip
    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 0
    assert "num_frames is 5, not 6" in err.getvalue(), err.getvalue()
    assert len(os.listdir(out / "video_000")) == 5
    assert np.asarray(sorted(os.listdir(out / "video_000")))[0] == "frame_00000.png"
