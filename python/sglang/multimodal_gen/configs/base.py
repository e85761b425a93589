"""What every DiT architecture config shares: reading a diffusers ``config.json``.

A family's config is a dataclass whose fields carry diffusers' names and defaults, plus
``extra`` (unknown keys, kept for messages). It sets :attr:`DiffusersConfig.DIFFUSERS_CLASS` to
the ``_class_name`` it reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any, ClassVar

__all__ = ["DiffusersConfig"]


class DiffusersConfig:
    """Mixin for ``@dataclass`` architecture configs with an ``extra: dict`` field."""

    DIFFUSERS_CLASS: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, cfg: dict) -> Any:
        """Build from a diffusers config dict; keys starting with ``_`` are metadata (dropped, but
        ``_sglang_*`` keys, our own, which diffusers ignores), unknown keys are kept in ``extra``.

        Raises:
            ValueError: an invalid value (the dataclass's own checks).
        """
        names = {f.name for f in fields(cls)} - {"extra"}
        known = {k: v for k, v in cfg.items() if k in names}
        extra = {
            k: v
            for k, v in cfg.items()
            if k not in names and (not k.startswith("_") or k.startswith("_sglang_"))
        }
        return cls(**known, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> Any:
        """Read a denoiser's ``config.json``.

        Raises:
            FileNotFoundError: the file does not exist.
            ValueError: invalid JSON, not an object, a ``_class_name`` other than
                :attr:`DIFFUSERS_CLASS`, or an invalid value.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"transformer config not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: expected a JSON object")
        cls_name = cfg.get("_class_name", cls.DIFFUSERS_CLASS)
        if cls_name != cls.DIFFUSERS_CLASS:
            raise ValueError(
                f"{path}: _class_name {cls_name!r} is not supported here "
                f"(expected {cls.DIFFUSERS_CLASS!r})"
            )
        try:
            return cls.from_dict(cfg)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e
