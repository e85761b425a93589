"""The default models: ``sglang generate`` / ``sglang serve`` without ``--model-path``.

The default family (:func:`default_family`) is the registered family that ships a trained demo
model inside the package (``ModelFamily.embedded_model``; today Z-Image's
``models/demo/zimage-shapes``, made by ``scripts/train_demo_model.py``; it draws simple captioned
scenes, see ``models/demo_scenes.py``), with a demo LoRA next to it (``ModelFamily.embedded_lora``,
:func:`demo_lora_path`). A family without one gets a seeded tiny random-weight model
(``ModelFamily.build_tiny``), built once under ``$SGLANG_CACHE_DIR`` (default
``~/.cache/sglang``), written atomically so concurrent first uses are safe. Nothing here names a
family: everything comes from the registry.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile

from sglang.multimodal_gen.models.registry import (
    ModelFamily,
    get_family,
    list_families,
    resolve_object,
)

DEFAULT_SEED = 1234

__all__ = [
    "default_cache_dir",
    "default_family",
    "default_model_name",
    "default_model_path",
    "demo_lora_path",
]


def default_family() -> ModelFamily:
    """The family whose embedded model is the default model: the one registered family that
    declares ``embedded_model``.

    Raises:
        ValueError: no family, or more than one, declares an embedded model (both named).
    """
    embedded = [f for f in list_families() if f.embedded_model is not None]
    if len(embedded) != 1:
        names = [f.name for f in embedded]
        raise ValueError(
            "exactly one model family must ship an embedded default model "
            f"(ModelFamily.embedded_model); found {len(embedded)}: {names}"
        )
    return embedded[0]


def _family(family: str | None) -> ModelFamily:
    return default_family() if family is None else get_family(family)


def _package_path(spec: str) -> str:
    """``"package:relative/path"`` -> the absolute path inside the installed package."""
    package, _, rel = spec.partition(":")
    root = os.path.dirname(os.path.abspath(importlib.import_module(package).__file__))
    return os.path.join(root, *rel.split("/"))


def demo_lora_path() -> str:
    """Folder of the demo LoRA of the embedded default model (the default family's
    ``embedded_lora``; Z-Image's "swap colours": the object takes the background's colour and
    the background the object's; diffusers ``pytorch_lora_weights.safetensors``).

    Raises:
        ValueError: the default family ships no demo LoRA.
        FileNotFoundError: the package was installed without its package data.
    """
    fam = default_family()
    if fam.embedded_lora is None:
        raise ValueError(f"the default model family {fam.name!r} ships no demo LoRA")
    path = _package_path(fam.embedded_lora)
    if not os.path.isfile(os.path.join(path, "pytorch_lora_weights.safetensors")):
        raise FileNotFoundError(f"demo LoRA missing at {path}: reinstall the package")
    return path


def default_cache_dir() -> str:
    """``$SGLANG_CACHE_DIR`` or ``$XDG_CACHE_HOME/sglang`` or ``~/.cache/sglang``."""
    root = os.environ.get("SGLANG_CACHE_DIR")
    if root:
        return root
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "sglang")


def default_model_name(family: str | None = None) -> str:
    """The served name of ``family``'s default model (``None``: the :func:`default_family`'s,
    e.g. ``sglang-default-zimage-tiny``)."""
    fam = _family(family)
    return fam.default_model_name or f"sglang-default-{fam.name}-tiny"


def default_model_path(cache_dir: str | None = None, family: str | None = None) -> str:
    """Path of ``family``'s default model (``None``: the :func:`default_family`): its embedded
    trained model, else its tiny random model, built on first use.

    The tiny model is written to a temporary sibling and renamed into place, so concurrent first
    uses cannot see a half-written model (the loser of the race discards its copy).

    Raises:
        ValueError: the family declares neither.
        FileNotFoundError: the embedded model is missing (package installed without its data).
    """
    fam = _family(family)
    if fam.embedded_model is not None:
        path = _package_path(fam.embedded_model)
        if not os.path.isfile(os.path.join(path, "model_index.json")):
            raise FileNotFoundError(
                f"embedded default model missing at {path}: reinstall the package "
                "(the model ships as package data)"
            )
        return path
    if fam.build_tiny is None:
        raise ValueError(f"model family {fam.name!r} has no default model")
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
