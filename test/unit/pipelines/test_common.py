"""VAE output -> uint8 pixels: ``round(255 * clamp(x / 2 + 0.5, 0, 1))``, to nearest (half to even,
as numpy and diffusers' ``VaeImageProcessor``), channels last.

Expected values are computed by hand. Rounding down instead of to nearest shifts about half of the
pixels by one level, which a PSNR bar can miss (51 dB on the tiny pipeline), so the values here sit
just below and just above ``.5``.
"""

from __future__ import annotations

import numpy as np
import torch
from sglang.multimodal_gen.pipelines.zimage import latents_to_uint8


def _vae_value(level: float) -> float:
    """The VAE output in ``[-1, 1]`` that maps to pixel value ``level`` before rounding."""
    return 2.0 * level / 255.0 - 1.0


# (VAE output, expected uint8), by hand
HAND = [
    (-1.0, 0),
    (1.0, 255),
    (0.0, 128),  # 127.5 exactly: half to even -> 128 (rounding down would give 127)
    (0.5, 191),  # 191.25
    (-0.5, 64),  # 63.75
    (-3.0, 0),  # clamped
    (2.5, 255),  # clamped
    (_vae_value(10.4), 10),
    (_vae_value(10.6), 11),
    (_vae_value(100.45), 100),
    (_vae_value(100.55), 101),
    (_vae_value(200.7), 201),
    (_vae_value(254.6), 255),
    (_vae_value(0.6), 1),
    (_vae_value(0.4), 0),
    (_vae_value(77.9), 78),
]


def test_hand_computed_values_round_to_nearest():
    values = torch.tensor([v for v, _ in HAND], dtype=torch.float32)
    images = values.view(1, 1, 1, -1).expand(1, 3, 1, len(HAND)).contiguous()
    out = latents_to_uint8(images)
    assert out.dtype == np.uint8 and out.shape == (1, 1, len(HAND), 3)
    expected = np.array([e for _, e in HAND], dtype=np.uint8)
    for c in range(3):
        np.testing.assert_array_equal(out[0, 0, :, c], expected)


def test_channels_last_and_batch_order():
    """``[B, 3, H, W]`` -> ``[B, H, W, 3]``: each channel and image keeps its own values."""
    images = torch.empty(2, 3, 2, 3)
    for b in range(2):
        for c in range(3):
            for h in range(2):
                for w in range(3):
                    level = 7 * (b * 18 + c * 6 + h * 3 + w) + 1.3  # distinct, .3 rounds down
                    images[b, c, h, w] = _vae_value(level)
    out = latents_to_uint8(images)
    assert out.shape == (2, 2, 3, 3)
    for b in range(2):
        for c in range(3):
            for h in range(2):
                for w in range(3):
                    assert out[b, h, w, c] == 7 * (b * 18 + c * 6 + h * 3 + w) + 1


def test_random_values_match_the_numpy_formula():
    """Many values, against the formula written with numpy in the same float32 arithmetic."""
    g = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 16, 16, generator=g) * 2.4 - 1.2  # some clamp on both sides
    x = images.permute(0, 2, 3, 1).numpy().astype(np.float32)
    expected = np.round(np.clip(x / np.float32(2) + np.float32(0.5), 0, 1) * np.float32(255))
    np.testing.assert_array_equal(latents_to_uint8(images), expected.astype(np.uint8))
