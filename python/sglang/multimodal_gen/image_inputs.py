"""Images given as conditioning (edits, image-to-image, inpainting masks, image-to-video): decoded
once, at the edge that receives them, into :class:`InputImage` values with bounded cost.

Every edge (the HTTP form or JSON body, ``sglang generate --image-path``, the Python API) calls
:func:`decode_image` (or :func:`decode_mask`); the request then carries decoded pixels, so no
later hop parses a file again. The rules, each refused with an
:class:`~sglang.multimodal_gen.errors.InvalidRequestError` naming the field:

* formats PNG, JPEG and WebP only (the file's content decides, not its name); an animated PNG or
  WebP is refused (which frame would be meant is not clear); a JPEG carrying further pictures
  (MPO: depth maps, HDR gain maps) is read as its first picture;
* at most :attr:`ImageLimits.max_file_bytes` per file and :attr:`ImageLimits.max_request_bytes`
  per request;
* the pixel count read from the header (before any pixel is decoded: a decompression bomb costs
  nothing) at most :attr:`ImageLimits.max_pixels`, each side at least
  :attr:`ImageLimits.min_side`;
* a truncated or corrupt file is refused (Pillow's ``LOAD_TRUNCATED_IMAGES`` is not used).

Conversions (documented, not refused): the EXIF orientation is applied as diffusers'
``load_image`` does (``ImageOps.exif_transpose``); CMYK, palette, grey and alpha images become
RGB as ``load_image``'s ``convert("RGB")`` makes them (alpha dropped); 16-bit grey images keep their
top 8 bits (Pillow's own conversion would clip them).

Masks (:func:`decode_mask`) follow one of two conventions, told apart by the file itself:

* a mask with transparency (an alpha channel with at least one pixel below 255) follows OpenAI's
  ``/v1/images/edits``: the **transparent** pixels are the ones to edit (edit weight
  ``1 - alpha / 255``); its colours are ignored;
* a mask without transparency follows diffusers' inpainting pipelines: **white** is edited,
  black kept (its luminance, ``L`` of Pillow).

URLs are not fetched unless the server names the hosts it may fetch from
(:func:`image_from_reference` with ``allowed_hosts``; redirects are not followed), so a request
cannot make the server reach its own network.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, field

import numpy as np

from sglang.multimodal_gen.errors import InvalidRequestError

__all__ = [
    "IMAGE_INPUT_FORMATS",
    "ImageBudget",
    "ImageLimits",
    "InputImage",
    "decode_image",
    "decode_mask",
    "image_from_reference",
    "read_image_file",
]

#: Pillow format names accepted, and how they are spelled in messages.
IMAGE_INPUT_FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP"}


@dataclass(frozen=True)
class ImageLimits:
    """Bounds of the images of one request.

    Attributes:
        max_file_bytes: bytes of one encoded file (default 20 MiB).
        max_request_bytes: encoded bytes of all the images and the mask of a request (64 MiB).
        max_pixels: width x height of one image, read from its header (default 4096 x 4096).
        min_side: smallest accepted width or height (pixels).
        max_images: images in one request (reference images; the mask not counted).
    """

    max_file_bytes: int = 20 << 20
    max_request_bytes: int = 64 << 20
    max_pixels: int = 4096 * 4096
    min_side: int = 8
    max_images: int = 16


@dataclass(frozen=True, eq=False)
class InputImage:
    """One decoded input image.

    Attributes:
        pixels: uint8 ``[H, W, 3]`` RGB for an image; uint8 ``[H, W]`` for a mask, where 255 is
            "edit" and 0 "keep" (the convention already applied, see the module docstring).
        source: how the image reached us, for messages (``"image[1]"``, a file name).
        digest: the first 16 hex characters of the pixels' SHA-256, to tell images apart in
            logs and tests.
    """

    pixels: np.ndarray
    source: str = "image"
    digest: str = field(default="")

    def __post_init__(self):
        a = np.ascontiguousarray(self.pixels, dtype=np.uint8)
        if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] != 3):
            raise ValueError(f"pixels must be [H, W, 3] or [H, W] uint8, got {a.shape}")
        a.setflags(write=False)
        object.__setattr__(self, "pixels", a)
        if not self.digest:
            object.__setattr__(self, "digest", hashlib.sha256(a.tobytes()).hexdigest()[:16])

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` in pixels (Pillow's order)."""
        return int(self.pixels.shape[1]), int(self.pixels.shape[0])

    @property
    def is_mask(self) -> bool:
        return self.pixels.ndim == 2

    def to_pil(self):
        """A Pillow image: mode ``RGB`` (an image) or ``L`` (a mask, white = edit)."""
        from PIL import Image

        return Image.fromarray(self.pixels, "L" if self.is_mask else "RGB")

    @classmethod
    def from_pil(cls, image, source: str = "image") -> InputImage:
        """An :class:`InputImage` of a Pillow image already in memory (the Python API): converted
        to RGB as :func:`decode_image` converts a file; no limits are applied."""
        return cls(np.asarray(_to_rgb(image)), source=source)

    def __repr__(self) -> str:
        w, h = self.size
        kind = "mask" if self.is_mask else "image"
        return f"InputImage({kind} {w}x{h}, {self.source}, sha256 {self.digest})"

    def __reduce__(self):  # pickled to TP workers with its digest (no recomputation)
        return (InputImage, (self.pixels, self.source, self.digest))


class ImageBudget:
    """The running byte count of one request's images (:attr:`ImageLimits.max_request_bytes`).

    Args:
        limits: the bounds.
    """

    def __init__(self, limits: ImageLimits):
        self.limits = limits
        self.used = 0

    def spend(self, nbytes: int, field_name: str) -> None:
        """Count ``nbytes`` more.

        Raises:
            InvalidRequestError: the request's images exceed the limit (``param=field_name``).
        """
        self.used += nbytes
        if self.used > self.limits.max_request_bytes:
            raise InvalidRequestError(
                f"the images of this request are {self.used} bytes in all, over the limit of "
                f"{self.limits.max_request_bytes} bytes",
                param=field_name,
            )


def _open_checked(data: bytes, field_name: str, limits: ImageLimits, budget: ImageBudget | None):
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidRequestError(f"{field_name} must be an image file", param=field_name)
    data = bytes(data)
    if len(data) > limits.max_file_bytes:
        raise InvalidRequestError(
            f"{field_name} is {len(data)} bytes, over the limit of {limits.max_file_bytes} bytes "
            "per image",
            param=field_name,
        )
    if not data:
        raise InvalidRequestError(f"{field_name} is an empty file", param=field_name)
    if budget is not None:
        budget.spend(len(data), field_name)
    formats = ", ".join(IMAGE_INPUT_FORMATS.values())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(IMAGE_INPUT_FORMATS))
    except UnidentifiedImageError:
        raise InvalidRequestError(
            f"{field_name} is not a {formats} image", param=field_name
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequestError(
            f"{field_name} declares more than {limits.max_pixels} pixels", param=field_name
        ) from None
    except Exception as e:  # a header Pillow cannot parse
        raise InvalidRequestError(
            f"{field_name} is not a readable {formats} image ({type(e).__name__})",
            param=field_name,
        ) from None
    w, h = img.size
    if w * h > limits.max_pixels:
        raise InvalidRequestError(
            f"{field_name} is {w}x{h} = {w * h} pixels, over the limit of {limits.max_pixels} "
            "pixels per image",
            param=field_name,
        )
    if min(w, h) < limits.min_side:
        raise InvalidRequestError(
            f"{field_name} is {w}x{h}; each side must be at least {limits.min_side} pixels",
            param=field_name,
        )
    # a JPEG with further pictures after its own (MPO: phones' depth maps and HDR gain maps)
    # opens as "MPO": it is the JPEG's first picture, as diffusers' load_image reads it
    kind = IMAGE_INPUT_FORMATS.get("JPEG" if img.format == "MPO" else img.format, img.format)
    if img.format == "MPO":
        img.seek(0)
    elif getattr(img, "n_frames", 1) > 1:
        raise InvalidRequestError(
            f"{field_name} is an animated {kind} ({img.n_frames} frames); give a still image",
            param=field_name,
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
    except Exception as e:
        raise InvalidRequestError(
            f"{field_name} is a truncated or corrupt {kind} file ({type(e).__name__})",
            param=field_name,
        ) from None
    from PIL import ImageOps

    try:
        img = ImageOps.exif_transpose(img)  # as diffusers.utils.load_image
    except Exception:  # a malformed EXIF block: keep the stored orientation
        pass
    return img


def _to_rgb(img):
    """RGB as diffusers' ``load_image`` converts, but 16-bit grey keeps its top 8 bits."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        a = np.asarray(img, dtype=np.int64)
        top = 65535 if img.mode.startswith("I;16") or a.max(initial=0) > 255 else 255
        a = np.clip(np.rint(a * (255.0 / top)), 0, 255).astype(np.uint8)
        return np.repeat(a[:, :, None], 3, axis=2)
    if img.mode != "RGB":
        img = img.convert("RGBA" if img.mode == "P" and "transparency" in img.info else img.mode)
        img = img.convert("RGB")
    return img


def decode_image(
    data: bytes,
    field_name: str = "image",
    limits: ImageLimits | None = None,
    budget: ImageBudget | None = None,
) -> InputImage:
    """Decode one input image file (see the module docstring for the rules).

    Args:
        data: the encoded file.
        field_name: the request field, for messages (``"image"``, ``"image[2]"``).
        limits: the bounds (default :class:`ImageLimits`).
        budget: the request's byte count, shared by its images.

    Returns:
        An :class:`InputImage` holding uint8 ``[H, W, 3]`` RGB pixels.

    Raises:
        InvalidRequestError: a rule is broken (``param=field_name``).
    """
    limits = limits or ImageLimits()
    img = _open_checked(data, field_name, limits, budget)
    return InputImage(np.asarray(_to_rgb(img)), source=field_name)


def decode_mask(
    data: bytes,
    field_name: str = "mask",
    limits: ImageLimits | None = None,
    budget: ImageBudget | None = None,
) -> InputImage:
    """Decode an inpainting mask (the two conventions of the module docstring).

    Returns:
        An :class:`InputImage` holding uint8 ``[H, W]``: 255 where the image is edited, 0 where
        it is kept.

    Raises:
        InvalidRequestError: as :func:`decode_image`.
    """
    limits = limits or ImageLimits()
    img = _open_checked(data, field_name, limits, budget)
    return InputImage(mask_pixels(img), source=field_name)


def mask_pixels(img) -> np.ndarray:
    """uint8 ``[H, W]`` edit weights of a Pillow mask image (255 = edit): ``255 - alpha`` when
    the image has a transparent pixel (OpenAI's convention), else its luminance (white = edit,
    diffusers' convention)."""
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        alpha = np.asarray(img.getchannel("A"))
        if (alpha < 255).any():
            return (255 - alpha).astype(np.uint8)
    if img.mode.startswith("I"):
        return np.asarray(_to_rgb(img))[:, :, 0]
    return np.asarray(img.convert("L"), dtype=np.uint8)


def read_image_file(
    path: str,
    field_name: str,
    limits: ImageLimits | None = None,
    budget: ImageBudget | None = None,
    mask: bool = False,
) -> InputImage:
    """Decode the image (or mask) at ``path`` (``sglang generate --image-path`` / ``--mask-path``);
    the size is checked before the file is read.

    Raises:
        InvalidRequestError: no such file, or as :func:`decode_image` (``param=field_name``).
    """
    limits = limits or ImageLimits()
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise InvalidRequestError(
            f"{field_name}: cannot read {path!r} ({e.strerror or e})", param=field_name
        ) from None
    if size > limits.max_file_bytes:
        raise InvalidRequestError(
            f"{field_name}: {path!r} is {size} bytes, over the limit of {limits.max_file_bytes} "
            "bytes per image",
            param=field_name,
        )
    with open(path, "rb") as f:
        data = f.read(limits.max_file_bytes + 1)
    decode = decode_mask if mask else decode_image
    return decode(data, field_name, limits, budget)


def image_from_reference(
    value: str,
    field_name: str,
    limits: ImageLimits | None = None,
    budget: ImageBudget | None = None,
    mask: bool = False,
    allowed_hosts: tuple[str, ...] = (),
    timeout_s: float = 10.0,
) -> InputImage:
    """An image given as text in a JSON body: a ``data:image/...;base64,`` URL, bare base64, or
    an ``http(s)://`` URL whose host is in ``allowed_hosts`` (fetched with at most
    ``max_file_bytes`` read; no URL is fetched when ``allowed_hosts`` is empty).

    Raises:
        InvalidRequestError: not base64, a URL that may not be fetched or cannot be, or as
            :func:`decode_image` (``param=field_name``).
    """
    limits = limits or ImageLimits()
    decode = decode_mask if mask else decode_image
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"{field_name} must be a base64 string or a data URL", param=field_name
        )
    text = value.strip()
    if text.startswith(("http://", "https://")):
        return decode(_fetch(text, field_name, limits, allowed_hosts, timeout_s), field_name,
                      limits, budget)  # fmt: skip
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or ";base64" not in head:
            raise InvalidRequestError(
                f"{field_name}: a data URL must be base64 (data:image/png;base64,...)",
                param=field_name,
            )
    # base64 of the largest accepted file is 4/3 its size: refuse longer text before decoding
    if len(text) > limits.max_file_bytes * 4 // 3 + 8:
        raise InvalidRequestError(
            f"{field_name} is over the limit of {limits.max_file_bytes} bytes per image",
            param=field_name,
        )
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(
            f"{field_name} is not base64 (give the file base64-encoded, or a data URL)",
            param=field_name,
        ) from None
    return decode(data, field_name, limits, budget)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # urllib then raises HTTPError for the 3xx


def _fetch(url, field_name, limits, allowed_hosts, timeout_s) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not allowed_hosts or host not in {h.lower() for h in allowed_hosts}:
        raise InvalidRequestError(
            f"{field_name}: this server does not fetch image URLs"
            + (f" from {host!r}" if allowed_hosts else "")
            + "; send the image itself (a file part or base64)",
            param=field_name,
        )
    # redirects are not followed: an allowed host must not hand the fetch on to another one
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=timeout_s) as resp:  # allow-listed host
            data = resp.read(limits.max_file_bytes + 1)
    except Exception as e:
        raise InvalidRequestError(
            f"{field_name}: could not fetch the image URL ({type(e).__name__})", param=field_name
        ) from None
    return data
