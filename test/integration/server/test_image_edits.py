"""``POST /v1/images/edits`` and ``/v1/videos``' ``input_reference`` through a real server
(uvicorn): the official ``openai`` client's ``images.edit`` (a multipart form) and a JSON body
with base64 give exactly the pixels the engine's Python API gives for the same request, with and
without a mask, on the tiny Flux.1 model; hostile files are each a 4xx naming the field, without
the server's memory growing; a model that takes no image refuses one naming the field.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import time

import httpx
import numpy as np
import pytest
from fixtures.server import (
    FAKE_SPEC,
    FAKE_VIDEO_SPEC,
    FakeEngine,
    FakeVideoEngine,
    assert_envelope,
    running_server,
)
from fixtures.tiny_models import psnr
from PIL import Image, ImageOps
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.image_inputs import InputImage

KB = 1 << 10
# small byte limits, so the limit cases need small bodies (the flags are what is tested)
LIMITS = dict(max_input_image_bytes=256 * KB, max_input_bytes=400 * KB)
# strength 0.5 of 2 steps: one step from the schedule's middle, where the tiny model's output
# depends on the image (at 0.7 the first step's noise level hides the image entirely)
STEPS = dict(seed=3, num_inference_steps=2, strength=0.5)
# a wrong input (mask ignored, another image) lands far below identical pixels (measured: 16 dB
# for the mask left out, 26 dB for another image)
FAR = 40.0


def png(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def scene(w: int = 48, h: int = 32, seed: int = 1) -> Image.Image:
    """Gradients and a bright square (structure the model's output depends on)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x * y) % 256], -1)
    x0, y0 = rng.integers(0, w // 2), rng.integers(0, h // 2)
    a[y0 : y0 + h // 3, x0 : x0 + w // 3] = rng.integers(0, 256, 3)
    return Image.fromarray(a.astype(np.uint8))


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


def right_half_mask(w: int = 48, h: int = 32) -> np.ndarray:
    a = np.zeros((h, w), np.uint8)
    a[:, w // 2 :] = 255
    return a


def decoded(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def png_header(width: int, height: int) -> bytes:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + (
        chunk(b"IEND", b"")
    )  # fmt: skip


@pytest.fixture(scope="module")
def flux(tiny_flux_dev_dir):
    from sglang.multimodal_gen.runtime import DiffusionEngine

    args = ServerArgs(model_path=tiny_flux_dev_dir, **LIMITS)
    with DiffusionEngine(tiny_flux_dev_dir, device="cpu") as engine:
        with running_server(engine, args) as (url, _, _):
            yield url, engine


def engine_pixels(engine, image: Image.Image, mask: np.ndarray | None = None, **kw) -> np.ndarray:
    params = engine.spec.params(
        prompt="a red fox", image=InputImage.from_pil(image), width=48, height=32,
        mask_image=None if mask is None else InputImage(mask, source="mask"), **STEPS, **kw,
    )  # fmt: skip
    return np.asarray(engine.generate(params)[0].convert("RGB"))


def test_openai_client_and_json_edits_are_the_engines_images(flux):
    import openai

    url, engine = flux
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    src, mask = scene(), right_half_mask()
    extra = dict(STEPS)
    plain = client.images.edit(
        image=("fox.png", png(src), "image/png"), prompt="a red fox", size="48x32",
        extra_body=extra,
    )  # fmt: skip
    assert plain.size == "48x32" and plain.seed == 3 and len(plain.data) == 1
    expected = engine_pixels(engine, src)
    np.testing.assert_array_equal(decoded(plain.data[0].b64_json), expected)

    # OpenAI's mask convention (transparent = edit) as a file part; the colours are ignored
    rgba = np.zeros((32, 48, 4), np.uint8)
    rgba[:, :, 3] = 255 - mask
    masked = client.images.edit(
        image=("fox.png", png(src), "image/png"), mask=("m.png", png(Image.fromarray(rgba))),
        prompt="a red fox", size="48x32", extra_body=extra,
    )  # fmt: skip
    expected_masked = engine_pixels(engine, src, mask)  # diffusers' convention: white = edit
    got_masked = decoded(masked.data[0].b64_json)
    np.testing.assert_array_equal(got_masked, expected_masked)
    assert psnr(got_masked, expected) < FAR  # a mask left out would be caught

    # JSON: base64 and a data URL, the same pixels; another image gives another picture
    b64 = base64.b64encode(png(src)).decode()
    body = dict(prompt="a red fox", size="48x32", **extra)
    r = httpx.post(f"{url}/v1/images/edits", json={**body, "image": b64}, timeout=120)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(decoded(r.json()["data"][0]["b64_json"]), expected)
    other = base64.b64encode(png(ImageOps.invert(src).transpose(Image.FLIP_LEFT_RIGHT))).decode()
    r = httpx.post(
        f"{url}/v1/images/edits",
        json={**body, "image": f"data:image/png;base64,{other}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert psnr(decoded(r.json()["data"][0]["b64_json"]), expected) < FAR  # the image matters


def test_field_names_of_refusals_on_the_edit_route(flux):
    import openai

    url, _ = flux
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    f = ("a.png", png(scene()), "image/png")
    with pytest.raises(openai.BadRequestError) as e:  # image[] parts: Flux takes one image
        client.images.edit(image=[f, f], prompt="x", size="48x32")
    assert e.value.body["param"] == "image" and "takes at most 1" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the engine's mask_image is HTTP's mask
        client.images.edit(image=f, mask=("m.png", png(scene(32, 32))), prompt="x")
    assert e.value.body["param"] == "mask", e.value.body
    assert "mask is 32x32 but the image is 48x32" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.images.edit(image=f, prompt="x", extra_body={"strength": 1.5})
    assert e.value.body["param"] == "strength"
    r = httpx.post(f"{url}/v1/images/edits", json={"prompt": "x"}, timeout=30)
    assert_envelope(r, 400, "image")
    r = httpx.post(f"{url}/v1/images/edits", json={"prompt": "x", "image": 3}, timeout=30)
    assert_envelope(r, 422, "image")
    card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    assert card["inputs"] == ["text", "image", "mask"] and card["required_inputs"] == ["text"]


def _hostile_cases() -> list[tuple[str, dict, int, str]]:
    """``(what, request kwargs for httpx.post, status, param)``."""
    ok = png(scene())
    full = png(noise(64, 64))
    frames = [noise(16, 16, 0), noise(16, 16, 1)]
    animated = dict(save_all=True, append_images=frames[1:], duration=50)
    big = png(noise(300, 300))  # about 270 KB of noise: over the 256 KB per file
    assert 256 * KB < len(big) < 400 * KB
    half = png(noise(280, 280))  # about 230 KB: two of them pass per file, not per request
    assert 200 * KB < len(half) < 256 * KB
    form = {"prompt": "x", "size": "48x32"}

    def files(*parts):
        return {"files": list(parts), "data": form}

    cases = [
        ("bomb header 30000x30000", files(("image", ("b.png", png_header(30000, 30000)))), 400,
         "image"),
        ("bomb header 20000x20000", files(("image", ("b.png", png_header(20000, 20000)))), 400,
         "image"),
        ("palette bomb 5000x5000", files(("image", ("b.png", png(Image.new("P", (5000, 5000)),
                                                                 optimize=True)))), 400, "image"),
        ("truncated", files(("image", ("t.png", full[: len(full) // 2]))), 400, "image"),
        ("animated png", files(("image", ("a.png", png(frames[0], **animated)))), 400, "image"),
        ("animated webp", files(("image", ("a.webp", png(frames[0], "WEBP", **animated)))), 400,
         "image"),
        ("1x1", files(("image", ("p.png", png(noise(1, 1))))), 400, "image"),
        ("text file", files(("image", ("a.png", b"hello, not an image\n" * 10))), 400, "image"),
        ("text mask", files(("image", ("a.png", ok)), ("mask", ("m.png", b"nope"))), 400, "mask"),
        ("mask of another size", files(("image", ("a.png", ok)), ("mask", ("m.png", png(
            noise(48, 64)))),), 400, "mask"),
        ("64 images", files(*[("image[]", (f"{i}.png", ok)) for i in range(64)]), 400, "image"),
        ("file over the per-file cap", files(("image", ("big.png", big))), 400, "image"),
        ("image and mask over the request cap", files(("image", ("a.png", half)),
                                                      ("mask", ("m.png", half))), 400, "mask"),
        ("body over the limit", files(("image", ("a.png", b"x" * (1500 * KB)))), 413, None),
        ("two masks", files(("image", ("a.png", ok)), ("mask", ("m.png", ok)),
                            ("mask", ("m.png", ok))), 400, "mask"),
        ("a file in a text field", files(("image", ("a.png", ok)), ("seed", ("s.txt", b"3"))),
         400, "seed"),
        ("json: not base64", {"json": {"prompt": "x", "image": "%%%"}}, 400, "image"),
        ("json: a url (none fetched)", {"json": {"prompt": "x", "image": "http://127.0.0.1/a"}},
         400, "image"),
        ("json: bomb", {"json": {"prompt": "x", "image": base64.b64encode(
            png_header(30000, 30000)).decode()}}, 400, "image"),
    ]  # fmt: skip
    # conversions, not refusals: the file decodes and the request reaches its value checks
    # (a size no model takes: 400 naming size, not the image)
    src = scene()
    grey16 = Image.fromarray(np.asarray(src.convert("L"), np.uint16) * 257)
    for what, data in (
        ("cmyk jpeg", png(src.convert("CMYK"), "JPEG")),
        ("16-bit png", png(grey16)),
        ("palette png", png(src.convert("P", palette=Image.Palette.ADAPTIVE))),
    ):
        kw = {"files": [("image", ("i", data))], "data": {**form, "size": "47x32"}}
        cases.append((what, kw, 400, "size"))
    return cases


def test_hostile_images_are_refused_naming_the_field_and_memory_stays_bounded(flux):
    import psutil

    url, _ = flux
    cases = _hostile_cases()
    proc = psutil.Process()  # the server runs in this process (uvicorn in a thread)
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    with httpx.Client(timeout=60) as client:
        for what, kw, status, param in cases:
            r = client.post(f"{url}/v1/images/edits", **kw)
            err = assert_envelope(r, status, param)
            assert "Traceback" not in err["message"], what
        growth = proc.memory_info().rss - rss0
        print(f"RSS growth over {len(cases)} hostile requests: {growth / 2**20:.1f} MiB")
        assert growth < 200 << 20, f"RSS grew by {growth >> 20} MB"
        assert time.perf_counter() - t0 < 60
        assert client.get(f"{url}/health").status_code == 200
        ok = client.post(
            f"{url}/v1/images/edits",
            files=[("image", ("a.png", png(scene(50, 33))))],
            data={"prompt": "x", "seed": "1", "num_inference_steps": "1"},
        )
        assert ok.status_code == 200, ok.text
        # no size: the input's, rounded down to the model's factor (16)
        assert ok.json()["size"] == "48x32"
        assert decoded(ok.json()["data"][0]["b64_json"]).shape == (32, 48, 3)


def test_image_limits_name_the_image_at_fault():
    """``image[i]`` names the one image of several at fault (a model taking up to four)."""
    engine = FakeEngine()
    limits = dataclasses.replace(FAKE_SPEC.limits, max_input_images=4)
    engine.spec = dataclasses.replace(FAKE_SPEC, inputs=("text", "image"), limits=limits)
    ok, bad = png(scene(32, 32)), png(noise(32, 32))[:200]
    with running_server(engine, ServerArgs()) as (url, _, _):
        r = httpx.post(f"{url}/v1/images/edits", data={"prompt": "x"}, timeout=30,
                       files=[("image[]", ("a.png", ok)), ("image[]", ("b.png", bad))])  # fmt: skip
        assert_envelope(r, 400, "image[1]")
        r = httpx.post(f"{url}/v1/images/edits", json={"prompt": "x", "image": [ok.hex()]})
        assert_envelope(r, 400, "image")  # a list of one: named as one
        r = httpx.post(
            f"{url}/v1/images/edits",
            json={"prompt": "x", "image": [base64.b64encode(ok).decode()] * 5},
        )
        err = assert_envelope(r, 400, "image")
        assert "this model takes at most 4" in err["message"]
        assert engine.calls == []
        # the openai client's image[] parts reach the engine in order
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        a, b = scene(32, 32, seed=1), scene(32, 32, seed=2)
        client.images.edit(image=[("a.png", png(a)), ("b.png", png(b))], prompt="x",
                           size="32x32", extra_body={"seed": 1})  # fmt: skip
        ((req, _),) = engine.generate_log
        assert [x.source for x in req.image] == ["image[0]", "image[1]"]
        np.testing.assert_array_equal(req.image[0].pixels, np.asarray(a))
        np.testing.assert_array_equal(req.image[1].pixels, np.asarray(b))
    # the server's own bound (--max-input-images) below the model's
    with running_server(engine, ServerArgs(max_input_images=2)) as (url, _, _):
        r = httpx.post(
            f"{url}/v1/images/edits",
            json={"prompt": "x", "image": [base64.b64encode(bad).decode()] * 3},
        )
        err = assert_envelope(r, 400, "image")  # counted before any image is decoded
        assert "this server takes at most 2 per request" in err["message"]


def test_models_without_image_inputs_refuse_images_naming_the_field():
    text_only = FakeEngine()
    f = png(scene(32, 32))
    with running_server(text_only, ServerArgs()) as (url, _, _):
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        assert card["inputs"] == ["text"] and card["required_inputs"] == ["text"]
        r = httpx.post(f"{url}/v1/images/edits", files=[("image", ("a.png", f))],
                       data={"prompt": "x"}, timeout=30)  # fmt: skip
        assert_envelope(r, 400, "image")
        r = httpx.post(f"{url}/v1/images/edits", json={"prompt": "x", "image": "AAAA"})
        assert_envelope(r, 400, "image")
        big = {"files": [("image", ("a.png", b"x" * (1100 * KB)))], "data": {"prompt": "x"}}
        r = httpx.post(f"{url}/v1/images/edits", timeout=30, **big)
        assert_envelope(r, 413, None)  # no room for images a model does not take
        r = httpx.post(f"{url}/v1/videos", json={"prompt": "x"}, timeout=30)
        assert_envelope(r, 400, "model")  # an image model
    video = FakeVideoEngine()
    with running_server(video, ServerArgs()) as (url, _, _):
        r = httpx.post(f"{url}/v1/images/edits", files=[("image", ("a.png", f))],
                       data={"prompt": "x"}, timeout=30)  # fmt: skip
        assert_envelope(r, 400, "model")  # a video model, as on /v1/images/generations
        r = httpx.post(f"{url}/v1/videos", files=[("input_reference", ("a.png", f))],
                       data={"prompt": "x"}, timeout=30)  # fmt: skip
        assert_envelope(r, 400, "input_reference")
        b64 = base64.b64encode(f).decode()
        r = httpx.post(f"{url}/v1/videos", json={"prompt": "x", "input_reference": b64})
        assert_envelope(r, 400, "input_reference")
        assert video.calls == []


def test_input_reference_reaches_an_image_taking_video_model_as_its_image():
    import openai

    engine = FakeVideoEngine()
    engine.spec = dataclasses.replace(FAKE_VIDEO_SPEC, inputs=("text", "image"))
    src = scene(32, 32)
    with running_server(engine, ServerArgs()) as (url, _, _):
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        assert card["inputs"] == ["text", "image"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            job = client.videos.create(prompt="x", size="32x32",
                                       input_reference=("r.png", png(src), "image/png"))  # fmt: skip
            with pytest.raises(openai.BadRequestError) as e:
                client.videos.create(prompt="x", input_reference=("r.png", b"not an image"))
        assert e.value.body["param"] == "input_reference"
        data_url = "data:image/png;base64," + base64.b64encode(png(src)).decode()
        r = httpx.post(f"{url}/v1/videos", timeout=30,
                       json={"prompt": "y", "size": "32x32", "input_reference": {"image_url": data_url}})  # fmt: skip
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while len(engine.generate_log) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert job.status == "queued"
    for req, _ in engine.generate_log:
        (image,) = req.image
        np.testing.assert_array_equal(image.pixels, np.asarray(src))
