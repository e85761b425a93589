"""Generated media and how it is written: one module for the CLI, ``/v1/images`` and
``/v1/videos``.

Media: an image is a PIL image; a video is a :class:`Video` (uint8 frames, a frame rate and,
when the model makes sound, an :class:`Audio` track of float samples at a sample rate).

Formats, chosen by file extension (``sglang generate``) or by the request (the server):

* images: ``.png`` (lossless), ``.jpg``/``.jpeg``, ``.webp`` (PIL; :func:`encode_image`);
* videos: ``.mp4`` (H.264 through PyAV, ``yuv420p``, the format every player reads; with an AAC
  audio track when the video has sound), animated ``.webp`` and ``.gif`` (PIL, no sound)
  (:func:`encode_video`);
* a directory (a trailing slash, or an existing one), lossless for exact comparison:
  ``DIR/image_NNN.png`` per image; per video ``DIR/video_NNN/frame_NNNNN.png`` and, with sound,
  ``DIR/video_NNN/audio.wav`` (16-bit PCM at the audio's sample rate and channel count)
  (:func:`output_targets`, :func:`write_output`).
"""

from __future__ import annotations

import io
import os
import wave
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGE_FORMATS",
    "STEP_CACHE_INFO",
    "VIDEO_EXTENSIONS",
    "Audio",
    "Video",
    "encode_image",
    "encode_video",
    "encode_wav",
    "is_directory_target",
    "output_format",
    "output_targets",
    "write_frames_dir",
    "write_output",
]

IMAGE_EXTENSIONS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}
VIDEO_EXTENSIONS = {".mp4": "mp4", ".webp": "webp", ".gif": "gif"}
#: Image formats the server encodes (OpenAI's ``output_format``) and their media types.
IMAGE_FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


@dataclass
class Audio:
    """A sound track.

    Attributes:
        samples: float32 ``[channels, samples]`` in ``[-1, 1]`` (values outside are clipped when
            written as 16-bit PCM).
        sample_rate: samples per second (Hz).
    """

    samples: np.ndarray
    sample_rate: int

    @property
    def channels(self) -> int:
        return int(self.samples.shape[0])

    @property
    def seconds(self) -> float:
        return self.samples.shape[1] / float(self.sample_rate)

    def pcm16(self) -> np.ndarray:
        """int16 ``[samples, channels]`` (interleaved, as WAV stores it): ``round(32767 x)``
        after clipping to ``[-1, 1]``."""
        x = np.clip(np.asarray(self.samples, dtype=np.float32), -1.0, 1.0)
        return np.round(x * 32767.0).astype(np.int16).T.copy()


#: The ``info`` key (PIL ``Image.info`` of an image, :attr:`Video.info` of a video) under
#: which a generated output carries its request's step-cache counts: ``{"method",
#: "steps_computed", "steps_skipped", "blocks_computed", "blocks_skipped"}``
#: (``RequestCache.summary()`` of :mod:`sglang.multimodal_gen.layers.step_cache`); absent when
#: the request ran without step caching.
STEP_CACHE_INFO = "step_cache"


@dataclass
class Video:
    """A generated video.

    Attributes:
        frames: uint8 ``[F, H, W, 3]`` (RGB).
        fps: frames per second.
        audio: the sound track, or ``None``.
        info: facts about how it was made, as PIL's ``Image.info`` holds them for an image
            (:data:`STEP_CACHE_INFO`); not written into the file.
    """

    frames: np.ndarray
    fps: int
    audio: Audio | None = None
    info: dict = field(default_factory=dict, compare=False)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def seconds(self) -> float:
        """Duration at :attr:`fps` (``num_frames / fps``)."""
        return self.num_frames / float(self.fps)


def is_directory_target(path: str) -> bool:
    """A trailing slash or an existing directory: write lossless files into it."""
    return path.endswith(("/", os.sep)) or os.path.isdir(path)


def output_format(path: str, modality: str) -> str:
    """The format of ``path`` for a model of ``modality`` (``"image"`` or ``"video"``).

    Raises:
        ValueError: an extension that is not one of the modality's (names both lists).
    """
    table = VIDEO_EXTENSIONS if modality == "video" else IMAGE_EXTENSIONS
    ext = os.path.splitext(path)[1].lower()
    if ext not in table:
        raise ValueError(
            f"--output-path {path!r}: {ext or 'no extension'} is not a {modality} format of this "
            f"model; use one of {sorted(table)} or a directory (a trailing '/')"
        )
    return table[ext]


def output_targets(path: str, count: int, modality: str = "image") -> list[tuple[str, str]]:
    """``[(path, format)]`` for ``count`` outputs written to ``--output-path``.

    A directory gives ``image_000.png``, ... for images (format ``"png"``) and one folder per
    video (``video_000``, format ``"frames"``): sorted names are in order. A file name needs an
    extension of the model's modality.

    Raises:
        ValueError: an extension of another modality or none, or several outputs for one file.
    """
    if is_directory_target(path):
        if modality == "video":
            return [(os.path.join(path, f"video_{i:03d}"), "frames") for i in range(count)]
        return [(os.path.join(path, f"image_{i:03d}.png"), "png") for i in range(count)]
    fmt = output_format(path, modality)
    if count != 1:
        raise ValueError(f"--output-path {path!r} names one file for {count} outputs")
    return [(path, fmt)]


def encode_image(image: Any, fmt: str = "png", quality: int | None = None) -> bytes:
    """Encode an image (a PIL image or uint8 ``[H, W, 3]``) as PNG (lossless, ``quality``
    ignored), JPEG or WebP.

    Args:
        fmt: ``"png"``, ``"jpeg"`` or ``"webp"``.
        quality: JPEG/WebP quality in ``[0, 100]`` (OpenAI's ``output_compression``; default 95).

    Raises:
        ValueError: an unknown format.
    """
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image))
    buf = io.BytesIO()
    q = 95 if quality is None else int(quality)
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt == "jpeg":
        image.convert("RGB").save(buf, format="JPEG", quality=q)
    elif fmt == "webp":
        image.save(buf, format="WEBP", quality=q)
    else:
        raise ValueError(f"unknown image format {fmt!r}; use png, jpeg or webp")
    return buf.getvalue()


def encode_wav(audio: Audio) -> bytes:
    """``audio`` as a 16-bit PCM WAV file (its sample rate and channel count)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(audio.channels)
        w.setsampwidth(2)
        w.setframerate(int(audio.sample_rate))
        w.writeframes(audio.pcm16().tobytes())
    return buf.getvalue()


_LAYOUTS = {1: "mono", 2: "stereo"}


def encode_video(video: Video | np.ndarray, fps: int | None = None, fmt: str = "mp4") -> bytes:
    """Encode a video.

    Args:
        video: a :class:`Video`, or uint8 ``[F, H, W, 3]`` frames (then ``fps`` is required).
        fps: frames per second (default: the video's).
        fmt: ``"mp4"`` (H.264 via PyAV; needs even ``H`` and ``W``; an AAC track carries the
            audio when there is one), ``"webp"`` or ``"gif"`` (animated, PIL; no sound).

    Raises:
        ValueError: an unknown format, frames of the wrong shape or dtype, audio with more than
            two channels.
    """
    if not isinstance(video, Video):
        if fps is None:
            raise ValueError("encode_video of bare frames needs fps")
        video = Video(frames=np.asarray(video), fps=int(fps))
    frames = np.asarray(video.frames)
    rate = int(fps if fps is not None else video.fps)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    buf = io.BytesIO()
    if fmt == "mp4":
        import av

        audio = video.audio
        if audio is not None and audio.channels not in _LAYOUTS:
            raise ValueError(f"audio with {audio.channels} channels; mp4 takes 1 or 2 here")
        with av.open(buf, mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=rate)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            astream = None
            if audio is not None:
                astream = container.add_stream("aac", rate=int(audio.sample_rate))
                astream.layout = _LAYOUTS[audio.channels]
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
            if astream is not None:
                samples = np.ascontiguousarray(np.clip(audio.samples, -1, 1), dtype=np.float32)
                aframe = av.AudioFrame.from_ndarray(
                    samples, format="fltp", layout=_LAYOUTS[audio.channels]
                )
                aframe.sample_rate, aframe.pts = int(audio.sample_rate), 0
                for packet in astream.encode(aframe):
                    container.mux(packet)
                for packet in astream.encode():
                    container.mux(packet)
    elif fmt in ("webp", "gif"):
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        kw = dict(lossless=True) if fmt == "webp" else {}
        images[0].save(
            buf, format=fmt.upper(), save_all=True, append_images=images[1:],
            duration=int(round(1000 / rate)), loop=0, **kw,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown video format {fmt!r}; use mp4, webp or gif")
    return buf.getvalue()


def write_frames_dir(frames: np.ndarray, directory: str, prefix: str = "frame") -> list[str]:
    """Write uint8 ``[F, H, W, 3]`` frames as ``<prefix>_00000.png``, ... (sorted names are frame
    order); returns the paths."""
    from PIL import Image

    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, f in enumerate(np.asarray(frames)):
        p = os.path.join(directory, f"{prefix}_{i:05d}.png")
        Image.fromarray(f).save(p, format="PNG")
        paths.append(p)
    return paths


def write_output(item: Any, path: str, fmt: str) -> None:
    """Write one output as :func:`output_targets` named it, creating the parent folder.

    Args:
        item: a PIL image, or a :class:`Video`.
        fmt: an image format (``png``, ``jpeg``, ``webp``), a video format (``mp4``, ``webp``,
            ``gif``) or ``"frames"`` (a folder of PNG frames plus ``audio.wav`` with sound).
    """
    if fmt == "frames":
        write_frames_dir(item.frames, path)
        if item.audio is not None:
            with open(os.path.join(path, "audio.wav"), "wb") as f:
                f.write(encode_wav(item.audio))
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = encode_video(item, fmt=fmt) if isinstance(item, Video) else encode_image(item, fmt)
    with open(path, "wb") as f:
        f.write(data)
