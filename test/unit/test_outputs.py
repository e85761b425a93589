"""Typed outputs (``outputs.py``): image encoding, videos with sound, output files."""

from __future__ import annotations

import io
import math
import os
import wave

import numpy as np
import pytest


def test_encode_image_quality_follows_output_compression():
    from PIL import Image
    from sglang.multimodal_gen.outputs import encode_image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    png = encode_image(img, "png", None)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(img))
    for fmt in ("jpeg", "webp"):
        small, large = encode_image(img, fmt, 0), encode_image(img, fmt, 100)
        assert len(small) < len(large)
        assert Image.open(io.BytesIO(small)).format == fmt.upper()


def _stereo(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    right = 0.25 * np.sin(2 * np.pi * 660 * t)
    return np.stack([left, right]).astype(np.float32)


def test_encode_video_with_stereo_audio_is_an_mp4_with_aac():
    import av
    from sglang.multimodal_gen.outputs import Audio, Video, encode_video

    rate, fps = 44100, 8
    frames = np.random.default_rng(0).integers(0, 256, (8, 32, 48, 3), dtype=np.uint8)
    video = Video(frames=frames, fps=fps, audio=Audio(_stereo(1.0, rate), rate))
    data = encode_video(video)
    with av.open(io.BytesIO(data)) as c:
        assert [s.type for s in c.streams] == ["video", "audio"]
        a = c.streams.audio[0]
        assert a.codec_context.name == "aac" and a.sample_rate == rate
        assert a.codec_context.channels == 2
        decoded = np.concatenate([f.to_ndarray() for f in c.decode(audio=0)], axis=1)
    assert decoded.shape[0] == 2
    seconds = decoded.shape[1] / rate
    assert abs(seconds - video.seconds) < 0.05, seconds  # AAC adds at most one frame's padding
    # the channels carry their own tones (0.5 and 0.25 amplitude sines: RMS 0.354, 0.177)
    rms = np.sqrt((decoded[:, rate // 10 : 9 * rate // 10] ** 2).mean(axis=1))
    assert np.allclose(rms, [0.5 / math.sqrt(2), 0.25 / math.sqrt(2)], rtol=0.05), rms
    with av.open(io.BytesIO(data)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 8
    # without audio: one video stream, as before
    with av.open(io.BytesIO(encode_video(Video(frames=frames, fps=fps)))) as c:
        assert [s.type for s in c.streams] == ["video"]


def test_write_output_of_a_video_with_audio_into_a_folder(tmp_path):
    from PIL import Image
    from sglang.multimodal_gen.outputs import Audio, Video, output_targets, write_output

    rate = 16000
    samples = _stereo(0.25, rate)
    samples[0, :5] = [1.5, -2.0, 1.0, -1.0, 0.99999]  # clipped to [-1, 1] when written
    frames = np.random.default_rng(1).integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    targets = output_targets(str(tmp_path) + "/", 2, "video")
    assert targets == [
        (os.path.join(str(tmp_path) + "/", "video_000"), "frames"),
        (os.path.join(str(tmp_path) + "/", "video_001"), "frames"),
    ]
    path, fmt = targets[0]
    write_output(Video(frames=frames, fps=8, audio=Audio(samples, rate)), path, fmt)
    assert sorted(os.listdir(path)) == [
        "audio.wav", "frame_00000.png", "frame_00001.png", "frame_00002.png",
    ]  # fmt: skip
    for i in range(3):
        png = np.asarray(Image.open(os.path.join(path, f"frame_{i:05d}.png")))
        assert np.array_equal(png, frames[i])
    with wave.open(os.path.join(path, "audio.wav"), "rb") as w:
        assert (w.getsampwidth(), w.getframerate(), w.getnchannels()) == (2, rate, 2)
        assert w.getnframes() == samples.shape[1]
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, 2)
    expected = np.round(32767 * np.clip(samples.astype(np.float64), -1, 1)).astype(np.int16)
    assert np.array_equal(pcm, expected.T)
    assert list(pcm[:5, 0]) == [32767, -32767, 32767, -32767, 32767]
    # without sound: frames only
    write_output(Video(frames=frames, fps=8), targets[1][0], "frames")
    assert "audio.wav" not in os.listdir(targets[1][0])


def test_output_targets_formats():
    from sglang.multimodal_gen.outputs import output_targets

    assert output_targets("a.png", 1) == [("a.png", "png")]
    assert output_targets("a.JPG", 1, "image") == [("a.JPG", "jpeg")]
    assert output_targets("a.webp", 1, "image") == [("a.webp", "webp")]
    assert output_targets("v.mp4", 1, "video") == [("v.mp4", "mp4")]
    assert output_targets("v.gif", 1, "video") == [("v.gif", "gif")]
    assert output_targets("out/", 2, "image") == [
        (os.path.join("out/", "image_000.png"), "png"),
        (os.path.join("out/", "image_001.png"), "png"),
    ]
    for path, count, modality, needle in (
        ("a.mp4", 1, "image", "not a image format"),
        ("a.png", 1, "video", "not a video format"),
        ("a", 1, "image", "no extension"),
        ("a.png", 2, "image", "names one file for 2 outputs"),
    ):
        with pytest.raises(ValueError, match=needle):
            output_targets(path, count, modality)
