"""A video with sound end to end: LTX-2.3 (the tiny random-weight directory of its family) through
``/v1/videos`` with the official ``openai`` client.

- ``/v1/videos``: the MP4 has an H.264 video stream and an AAC audio stream; PyAV decodes the
  audio at the vocoder's sample rate, its duration is the video's (``num_frames / fps``, within
  the AAC encoder's priming / last-frame padding), and its samples follow the engine's own
  waveform: decoded, it equals the engine's waveform through our (deterministic) AAC encoder,
  and it is within the codec's loss of the waveform itself.

``sglang generate`` with sound (``--output-path DIR/``: lossless frames and ``audio.wav``; an MP4
with its AAC track) is tested with the family's pipeline parity
(``test/integration/families/test_ltx2_pipeline_parity.py``).

A nearby wrong case is asserted apart: another seed's track, encoded the same way, differs.
"""

from __future__ import annotations

import io
import time
import warnings

import numpy as np
import pytest
from fixtures.server import running_server
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.models.families.tiny.ltx2 import build_ltx2_dir
from sglang.multimodal_gen.outputs import encode_video
from sglang.multimodal_gen.runtime import DiffusionEngine

PROMPT = "waves on a pebble beach"
FIELDS = dict(num_frames=9, fps=8, num_inference_steps=2, seed=5)


@pytest.fixture(scope="module")
def ltx2_dir(tmp_path_factory):
    return build_ltx2_dir(tmp_path_factory.mktemp("ltx2_videos") / "model")


@pytest.fixture(scope="module")
def served(ltx2_dir):
    with DiffusionEngine(ltx2_dir, device="cpu") as engine:
        with running_server(engine, ServerArgs(model_path=ltx2_dir)) as (url, _, _):
            yield url, engine


def _direct(engine, **fields):
    params = engine.spec.params(prompt=PROMPT, height=32, width=32, **dict(FIELDS, **fields))
    return engine.generate(params)[0]


def _streams(mp4: bytes):
    """``(frames uint8 [F, H, W, 3], audio float32 [channels, samples], sample_rate, seconds)``."""
    import av

    with av.open(io.BytesIO(mp4)) as c:
        assert len(c.streams.video) == 1 and len(c.streams.audio) == 1
        assert c.streams.audio[0].codec_context.name == "aac"
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    with av.open(io.BytesIO(mp4)) as c:
        rate = c.streams.audio[0].rate
        chunks = [f.to_ndarray() for f in c.decode(audio=0)]
    audio = np.concatenate(chunks, axis=1).astype(np.float32)
    return frames, audio, rate, audio.shape[1] / rate


def test_v1_videos_with_the_openai_client_returns_an_mp4_with_sound(served):
    import openai

    url, engine = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    with warnings.catch_warnings():  # the SDK marks its video methods deprecated
        warnings.simplefilter("ignore")
        video = client.videos.create(prompt=PROMPT, size="32x32", extra_body=FIELDS)
        for _ in range(1500):
            video = client.videos.retrieve(video.id)
            if video.status in ("completed", "failed"):
                break
            time.sleep(0.2)
        assert video.status == "completed", video
        content = client.videos.download_content(video.id).read()
    frames, audio, rate, seconds = _streams(content)
    direct = _direct(engine)
    assert direct.audio is not None
    assert frames.shape == direct.frames.shape == (9, 32, 32, 3)
    assert rate == direct.audio.sample_rate  # the vocoder's output rate
    expected = FIELDS["num_frames"] / FIELDS["fps"]
    assert abs(direct.audio.seconds - expected) < 0.1, direct.audio.seconds
    # AAC pads to whole 1024-sample frames (plus its priming): at most ~0.15 s more here
    assert expected - 0.02 <= seconds <= expected + 0.2, (seconds, expected)
    # the job's sound is the engine's waveform through our encoder (AAC is deterministic for the
    # same samples): decoded, it equals the direct waveform's encoding decoded
    _, expected_audio, _, _ = _streams(encode_video(direct))
    np.testing.assert_allclose(audio, expected_audio, atol=1e-6)
    # lossy, but close to the waveform itself (measured rms 0.047 on a track of rms 0.62)
    n = direct.audio.samples.shape[1]
    assert float(np.sqrt(np.mean((audio[:, :n] - direct.audio.samples) ** 2))) < 0.1
    # another seed's track, encoded the same way, is not the job's (measured: 0.04 rms apart)
    _, other_audio, _, _ = _streams(encode_video(_direct(engine, seed=6)))
    assert float(np.abs(other_audio - audio).max()) > 1e-2
