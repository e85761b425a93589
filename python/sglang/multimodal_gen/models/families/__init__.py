"""Model-family declarations: one module per family (``<family>.py``), each calling
``register_family`` once, and ``tiny/`` with the families' tiny-model builders.

The registry imports every module of this package (:func:`import_declarations`): a new family
adds its own declaration module here and edits no shared file, not even this one.
"""

from __future__ import annotations

import importlib
import pkgutil

__all__ = ["import_declarations"]


def import_declarations() -> list[str]:
    """Import every declaration module of this package (sorted by name, so families register in
    the same order everywhere); returns their names. Subpackages (``tiny``) are not
    declarations and are not imported."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.ispkg)
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    return names
