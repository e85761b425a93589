"""The embedded default models: one tiny model directory per family, built once and cached.

``sglang generate`` / ``sglang serve`` without ``--model-path`` serve the default family's tiny
model (:data:`DEFAULT_FAMILY`). Each family declares how to build its own
(``ModelFamily.build_tiny``); this module only caches the result under ``$SGLANG_CACHE_DIR``
(default ``~/.cache/sglang``), written atomically so concurrent first uses are safe.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from sglang.multimodal_gen.models.registry import get_family, resolve_object

DEFAULT_FAMILY = "zimage"
DEFAULT_SEED = 1234

__all__ = ["DEFAULT_FAMILY", "default_cache_dir", "default_model_name", "default_model_path"]


def default_cache_dir() -> str:
    """``$SGLANG_CACHE_DIR`` or ``$XDG_CACHE_HOME/sglang`` or ``~/.cache/sglang``."""
    root = os.environ.get("SGLANG_CACHE_DIR")
    if root:
        return root
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "sglang")


def default_model_name(family: str = DEFAULT_FAMILY) -> str:
    """The served name of ``family``'s tiny model (``sglang-default-zimage-tiny``)."""
    fam = get_family(family)
    return fam.default_model_name or f"sglang-default-{fam.name}-tiny"


def default_model_path(cache_dir: str | None = None, family: str = DEFAULT_FAMILY) -> str:
    """Path of ``family``'s tiny model, building it on first use.

    The directory is written to a temporary sibling and renamed into place, so concurrent first
    uses cannot see a half-written model (the loser of the race discards its copy).

    Raises:
        ValueError: the family declares no tiny model.
    """
    fam = get_family(family)
    if fam.build_tiny is None:
        raise ValueError(f"model family {family!r} has no embedded tiny model")
    build = resolve_object(fam.build_tiny)
    version = getattr(build, "version", "1")
    root = cache_dir or default_cache_dir()
    final = os.path.join(root, f"default-{fam.name}-tiny-v{version}")
    marker = os.path.join(final, "model_index.json")
    if os.path.isfile(marker):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        build(tmp, seed=DEFAULT_SEED)
        with open(os.path.join(tmp, "SGLANG_DEFAULT_MODEL.json"), "w") as f:
            json.dump(
                {
                    "note": "random weights: images are noise by construction",
                    "family": fam.name,
                    "version": version,
                    "seed": DEFAULT_SEED,
                },
                f,
                indent=2,
            )
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isfile(marker):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
