"""Writing generated images and videos: formats chosen by file extension.

Images: ``.png``, ``.jpg``/``.jpeg``, ``.webp`` (PIL). Videos: ``.mp4`` (H.264 through PyAV,
``yuv420p``, the format every player reads), animated ``.webp`` and ``.gif`` (PIL), or a
directory of PNG frames (lossless, for exact comparison). Used by ``sglang generate`` and the HTTP
server alike.
"""

from __future__ import annotations

import io
import os

import numpy as np

__all__ = [
    "IMAGE_EXTENSIONS",
    "VIDEO_EXTENSIONS",
    "encode_video",
    "is_directory_target",
    "output_format",
    "write_frames_dir",
]

IMAGE_EXTENSIONS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
VIDEO_EXTENSIONS = {".mp4": "mp4", ".webp": "webp", ".gif": "gif"}


def is_directory_target(path: str) -> bool:
    """A trailing slash or an existing directory: write one PNG per image or frame."""
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


def encode_video(frames: np.ndarray, fps: int, fmt: str = "mp4") -> bytes:
    """Encode uint8 ``[F, H, W, 3]`` frames at ``fps`` frames per second.

    Args:
        fmt: ``"mp4"`` (H.264 via PyAV; needs even ``H`` and ``W``), ``"webp"`` or ``"gif"``
            (animated, PIL).

    Raises:
        ValueError: an unknown format, or frames of the wrong shape or dtype.
    """
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    buf = io.BytesIO()
    if fmt == "mp4":
        import av

        with av.open(buf, mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=int(fps))
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    elif fmt in ("webp", "gif"):
        from PIL import Image

        images = [Image.fromarray(f) for f in frames]
        kw = dict(lossless=True) if fmt == "webp" else {}
        images[0].save(
            buf, format=fmt.upper(), save_all=True, append_images=images[1:],
            duration=int(round(1000 / fps)), loop=0, **kw,
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
