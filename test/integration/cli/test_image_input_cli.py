"""``sglang generate --image-path IMG --strength S`` on the embedded demo model (a tiny Z-Image):
the input image enters the picture (image-to-image)."""

from __future__ import annotations

import numpy as np
from fixtures.input_images import scene
from fixtures.tiny_models import psnr
from PIL import Image
from sglang.cli.main import main as sglang_main

ARGS = ["--prompt", "a green square on a yellow background, top left", "--seed", "7",
        "--num-inference-steps", "2", "--height", "32", "--width", "32", "--no-progress"]  # fmt: skip


def test_generate_with_an_input_image_differs_from_text_alone(tmp_path):
    src = tmp_path / "x.png"
    scene(48, 40, 3).save(src)  # resized to the request's 32x32
    text, edited = tmp_path / "text.png", tmp_path / "edited.png"
    assert sglang_main(["generate", *ARGS, "--output-path", str(text)]) == 0
    assert sglang_main(["generate", *ARGS, "--image-path", str(src), "--strength", "0.5",
                        "--output-path", str(edited)]) == 0  # fmt: skip
    a, b = np.asarray(Image.open(text)), np.asarray(Image.open(edited))
    assert a.shape == b.shape == (32, 32, 3)
    # measured: 15.0 dB apart (same seed; the image's latents and the last half of the schedule)
    assert psnr(a, b) < 25, psnr(a, b)
