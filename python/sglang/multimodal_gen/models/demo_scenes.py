"""The scenes of the embedded demo model: caption grammar, rendering and a semantic check.

A scene is one shape (circle, square, triangle, star) of one colour on a plain background of
another colour, in one quadrant of the picture; its caption reads
``"a red circle on a blue background, top left"``. ``scripts/train_demo_model.py`` trains the
embedded default model on pictures drawn by :func:`render_scene`; :func:`measure_scene` reads a
generated picture back (numpy only: background from the border, shape mask by colour distance (half-way to the object's),
colour by nearest palette entry, position by the mask centroid, shape by the best IoU with the four
shapes' templates, sharp and blurred, stretched to the mask's bounding box) so tests can check that a picture shows its prompt.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

__all__ = [
    "COLORS",
    "POSITIONS",
    "SHAPES",
    "Scene",
    "accuracy",
    "all_scenes",
    "measure_scene",
    "parse_caption",
    "random_scenes",
    "render_scene",
]

# RGB of each colour word (far apart so a nearest-colour read is unambiguous).
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 230),
    "yellow": (245, 215, 30),
    "purple": (140, 40, 190),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
# position word -> centre as a fraction of (width, height)
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
}
SHAPE_RADIUS = 0.2  # half the shape's extent, as a fraction of the picture side
_CAPTION = re.compile(r"^a (\w+) (\w+) on a (\w+) background, (\w+ \w+)$")


@dataclass(frozen=True)
class Scene:
    """One scene: ``color`` and ``shape`` of the object, ``background`` colour, ``position``."""

    color: str
    shape: str
    background: str
    position: str

    @property
    def caption(self) -> str:
        return f"a {self.color} {self.shape} on a {self.background} background, {self.position}"


def parse_caption(caption: str) -> Scene:
    """The :class:`Scene` a caption describes.

    Raises:
        ValueError: the caption does not follow the grammar or names an unknown word.
    """
    m = _CAPTION.match(caption.strip())
    if not m:
        raise ValueError(f"not a demo caption: {caption!r}")
    scene = Scene(*m.groups())
    if (
        scene.color not in COLORS
        or scene.background not in COLORS
        or scene.shape not in SHAPES
        or scene.position not in POSITIONS
    ):
        raise ValueError(f"unknown word in demo caption: {caption!r}")
    return scene


def all_scenes() -> list[Scene]:
    """Every scene of the grammar (object colour != background colour), in a fixed order."""
    return [
        Scene(c, s, b, p)
        for s in SHAPES
        for c in COLORS
        for b in COLORS
        if b != c
        for p in POSITIONS
    ]


def random_scenes(n: int, seed: int) -> list[Scene]:
    """``n`` scenes drawn with replacement by a seeded ``random.Random``."""
    rng = random.Random(seed)
    scenes = all_scenes()
    return [rng.choice(scenes) for _ in range(n)]


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else 0.45 * r
            ang = -np.pi / 2 + k * np.pi / 5
            pts.append((cx + rad * np.cos(ang), cy + rad * np.sin(ang)))
        return pts
    return None


def _draw(shape, size, cx, cy, r, fill, bg, supersample=4):
    from PIL import Image, ImageDraw

    s = supersample
    img = Image.new("RGB", (size * s, size * s), bg)
    d = ImageDraw.Draw(img)
    cx, cy, r = cx * s, cy * s, r * s
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        q = 0.85 * r  # same visual weight as the circle
        d.rectangle([cx - q, cy - q, cx + q, cy + q], fill=fill)
    else:
        d.polygon(_polygon(shape, cx, cy, r), fill=fill)
    return img.resize((size, size), Image.Resampling.BOX) if s > 1 else img


def render_scene(
    scene: Scene, size: int = 64, rng: random.Random | None = None, jitter: float = 0.0
) -> np.ndarray:
    """Draw ``scene`` as an anti-aliased ``uint8`` array ``[size, size, 3]``.

    ``jitter`` (a fraction of ``size``) moves the centre and changes the radius by up to that
    much, drawn from ``rng`` (required when ``jitter > 0``).
    """
    fx, fy = POSITIONS[scene.position]
    cx, cy, r = fx * size, fy * size, SHAPE_RADIUS * size
    if jitter > 0:
        j = jitter * size
        cx += rng.uniform(-j, j)
        cy += rng.uniform(-j, j)
        r += rng.uniform(-j, j) / 2
    img = _draw(scene.shape, size, cx, cy, r, COLORS[scene.color], COLORS[scene.background])
    return np.asarray(img, dtype=np.uint8)


def _templates(n: int = 48) -> list[tuple[str, np.ndarray]]:
    """Each shape drawn to fill an ``n x n`` box, sharp and blurred by about 1 and 2 pixels of a
    64-pixel picture, then cut at half height (how a soft generated edge thresholds)."""
    from PIL import ImageFilter

    out = []
    for shape in SHAPES:
        img = _draw(shape, 4 * n, 2 * n, 2 * n, 1.5 * n, (255,) * 3, (0,) * 3, 1).convert("L")
        for blur in (0, 5, 10):
            m = np.asarray(img.filter(ImageFilter.GaussianBlur(blur)) if blur else img) > 127
            ys, xs = np.nonzero(m)
            out.append((shape, m[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]))
    return out


_TEMPLATES: list[tuple[str, np.ndarray]] | None = None


def _nearest_color(rgb: np.ndarray) -> str:
    names = list(COLORS)
    pal = np.array([COLORS[k] for k in names], dtype=np.float32)
    return names[int(np.argmin(((pal - rgb[None]) ** 2).sum(-1)))]


def measure_scene(image) -> Scene | None:
    """Read the scene a picture shows (the inverse of :func:`render_scene`, for tests).

    Args:
        image: ``uint8`` RGB array ``[H, W, 3]`` (or a PIL image).

    Returns:
        The measured :class:`Scene`, or ``None`` when no object stands out from the background
        (no pixel 80 levels away from it, or fewer than 2 % of the pixels half as far).
    """
    global _TEMPLATES
    img = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
    img = img.astype(np.float32)
    h, w = img.shape[:2]
    b = max(1, h // 32)
    border = np.concatenate(
        [img[:b].reshape(-1, 3), img[-b:].reshape(-1, 3), img[:, :b].reshape(-1, 3)]
        + [img[:, -b:].reshape(-1, 3)]
    )
    bg = np.median(border, axis=0)
    dist = np.sqrt(((img - bg) ** 2).sum(-1))
    # half-way between the background and the object's colour: a blurred edge keeps its place
    top = np.percentile(dist, 99)
    mask = dist > 0.5 * top
    if top < 80.0 or mask.sum() < 0.02 * h * w:
        return None
    ys, xs = np.nonzero(mask)
    color = _nearest_color(np.median(img[mask], axis=0))
    cx, cy = xs.mean() / w, ys.mean() / h
    position = f"{'top' if cy < 0.5 else 'bottom'} {'left' if cx < 0.5 else 'right'}"
    # shape: the template that best overlaps the object's bounding box (outliers trimmed)
    y0, y1 = np.percentile(ys, [1, 99]).astype(int)
    x0, x1 = np.percentile(xs, [1, 99]).astype(int)
    crop = mask[y0 : y1 + 1, x0 : x1 + 1]
    _TEMPLATES = _TEMPLATES or _templates()
    best, best_iou = SHAPES[0], -1.0
    for shape, tpl in _TEMPLATES:
        iy = (np.arange(crop.shape[0]) * tpl.shape[0] / crop.shape[0]).astype(int)
        ix = (np.arange(crop.shape[1]) * tpl.shape[1] / crop.shape[1]).astype(int)
        t = tpl[iy][:, ix]
        iou = (t & crop).sum() / max(1, (t | crop).sum())
        if iou > best_iou:
            best, best_iou = shape, iou
    return Scene(color, best, _nearest_color(bg), position)


def accuracy(images, scenes: list[Scene]) -> dict[str, float]:
    """Share of ``images`` whose measured colour, shape, background and position equal those of
    the matching ``scenes`` (a picture with no object counts wrong for every field)."""
    fields = ("color", "shape", "background", "position")
    hits = dict.fromkeys(fields, 0)
    for img, want in zip(images, scenes, strict=True):
        got = measure_scene(img)
        for k in fields:
            hits[k] += got is not None and getattr(got, k) == getattr(want, k)
    return {k: v / max(1, len(scenes)) for k, v in hits.items()}
