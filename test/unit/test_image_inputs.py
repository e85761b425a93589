"""The input-image decoder (``image_inputs``) against hostile and unusual files: each refusal is
an ``InvalidRequestError`` naming the field, each conversion gives the pixels documented (what
diffusers' ``load_image`` gives, 16-bit grey its top 8 bits), and the mask conventions are told
apart by the file itself."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from sglang.multimodal_gen.errors import InvalidRequestError
from sglang.multimodal_gen.image_inputs import (
    ImageBudget,
    ImageLimits,
    decode_image,
    decode_mask,
    image_from_reference,
)


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def rgb(w: int = 16, h: int = 12, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width x height`` (8-bit RGB) and whose data is one empty
    deflate stream: a few dozen bytes claiming gigabytes of pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


def refused(data: bytes, field: str = "image[1]", match: str = "", **kw) -> str:
    decode = kw.pop("decode", decode_image)
    with pytest.raises(InvalidRequestError, match=match) as e:
        decode(data, field, **kw)
    assert e.value.param == field
    return e.value.message


@pytest.mark.parametrize("side", [30000, 20000])
def test_a_header_declaring_too_many_pixels_is_refused_before_decoding(side):
    data = png_header(side, side)
    assert len(data) < 100
    refused(data, match="pixels")  # Pillow's own bomb guard, worded as ours


def test_a_real_decompression_bomb_is_refused_from_its_header():
    # 5000x5000 palette pixels deflate to a few KB; the header is read, the pixels never are
    bomb = encode(Image.new("P", (5000, 5000)), optimize=True)
    assert len(bomb) < 64 << 10
    refused(bomb, match="5000x5000 = 25000000 pixels, over the limit")


def test_truncated_corrupt_and_non_image_files_are_refused():
    full = encode(rgb(64, 64))
    refused(full[: len(full) // 2], match="truncated or corrupt PNG")
    refused(b"just some text, not an image\n" * 4, match="is not a PNG, JPEG, WebP image")
    refused(b"", match="empty file")
    refused(encode(rgb(), "GIF"), match="is not a PNG, JPEG, WebP image")  # format by content


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_animated_images_are_refused(fmt):
    frames = [rgb(seed=0), rgb(seed=1)]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100)
    refused(data, match="animated .* \\(2 frames\\)")


def test_sides_below_the_minimum_are_refused():
    refused(encode(rgb(1, 1)), match="1x1; each side must be at least 8")
    refused(encode(rgb(64, 7)), match="64x7")


def test_byte_limits_per_file_and_per_request():
    data = encode(rgb(32, 32))
    limits = ImageLimits(max_file_bytes=len(data) - 1)
    refused(data, match=f"{len(data)} bytes, over the limit", limits=limits)
    budget = ImageBudget(ImageLimits(max_request_bytes=2 * len(data) - 1))
    decode_image(data, "image[0]", budget.limits, budget)
    refused(data, "mask", "in all, over the limit", limits=budget.limits, budget=budget)


def test_cmyk_palette_and_grey_images_become_rgb_as_load_image_makes_them():
    src = rgb(24, 16, seed=3)
    for img, fmt in (
        (src.convert("CMYK"), "JPEG"),
        (src.convert("P", palette=Image.Palette.ADAPTIVE, colors=16), "PNG"),
        (src.convert("L"), "PNG"),
        (src.convert("RGBA"), "PNG"),
    ):
        data = encode(img, fmt)
        got = decode_image(data).pixels
        expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # diffusers' load_image
        assert got.shape == (16, 24, 3) and got.dtype == np.uint8
        np.testing.assert_array_equal(got, expected)
    # the CMYK JPEG is still the picture (not inverted or channel-swapped)
    cmyk = decode_image(encode(src.convert("CMYK"), "JPEG", quality=95)).pixels.astype(float)
    assert np.abs(cmyk - np.asarray(src, float)).mean() < 12


def test_a_16_bit_png_keeps_its_top_8_bits():
    a = np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257
    data = encode(Image.fromarray(a))  # a uint16 array is mode I;16
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    got = decode_image(data).pixels
    np.testing.assert_array_equal(got[:, :, 0], (a >> 8).astype(np.uint8))
    assert (got[:, :, 0] == got[:, :, 2]).all()
    # Pillow's own conversion would clip every value above 255 to white
    assert (np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[:, :, 0] == 255).mean() > 0.9


def test_exif_orientation_is_applied():
    img = rgb(24, 16)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    got = decode_image(encode(img, "JPEG", exif=exif, quality=95))
    assert got.size == (16, 24)


def test_mask_conventions_are_told_apart_by_the_file():
    keep_left = np.zeros((16, 16), np.uint8)
    keep_left[:, 8:] = 255
    # diffusers: white is edited (no transparency)
    white = decode_mask(encode(Image.fromarray(keep_left, "L")))
    np.testing.assert_array_equal(white.pixels, keep_left)
    assert white.is_mask and white.size == (16, 16)
    # OpenAI: transparent is edited, the colours ignored (black everywhere here)
    rgba = np.zeros((16, 16, 4), np.uint8)
    rgba[:, :, 3] = 255 - keep_left
    openai_mask = decode_mask(encode(Image.fromarray(rgba, "RGBA")))
    np.testing.assert_array_equal(openai_mask.pixels, keep_left)
    # an alpha channel without a transparent pixel is the white-is-edited convention
    rgba[:, :, :3] = keep_left[:, :, None]
    rgba[:, :, 3] = 255
    np.testing.assert_array_equal(decode_mask(encode(Image.fromarray(rgba))).pixels, keep_left)
    # a mask file is refused as an image is
    refused(png_header(30000, 30000), "mask", "pixels", decode=decode_mask)


def test_references_base64_data_urls_and_no_url_fetched_by_default():
    import base64

    data = encode(rgb())
    b64 = base64.b64encode(data).decode()
    expected = decode_image(data).pixels
    np.testing.assert_array_equal(image_from_reference(b64, "image").pixels, expected)
    got = image_from_reference(f"data:image/png;base64,{b64}", "image").pixels
    np.testing.assert_array_equal(got, expected)
    for bad, match in (
        ("not base64 !!", "is not base64"),
        ("data:image/png,abc", "data URL must be base64"),
        ("http://169.254.169.254/latest/meta-data", "does not fetch image URLs"),
    ):
        with pytest.raises(InvalidRequestError, match=match) as e:
            image_from_reference(bad, "image[2]")
        assert e.value.param == "image[2]"
    with pytest.raises(InvalidRequestError, match="from 'evil.example'") as e:
        image_from_reference("https://evil.example/a.png", "mask", allowed_hosts=("ok.example",))
    assert e.value.param == "mask"


def test_a_jpeg_with_further_pictures_is_its_first_picture():
    """MPO (a JPEG followed by more pictures: phones' depth maps, HDR gain maps) opens as its
    first picture, as diffusers' ``load_image`` reads it; it is not an animation."""
    import io

    from PIL import Image
    from sglang.multimodal_gen.image_inputs import decode_image

    buf = io.BytesIO()
    first = Image.new("RGB", (64, 48), (200, 10, 10))
    first.save(buf, "MPO", save_all=True, append_images=[Image.new("RGB", (64, 48), (0, 0, 255))])
    got = decode_image(buf.getvalue(), "image")
    assert got.size == (64, 48)
    assert abs(int(got.pixels[10, 10, 0]) - 200) < 8 and got.pixels[10, 10, 2] < 30
