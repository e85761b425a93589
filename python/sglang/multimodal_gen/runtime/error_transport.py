"""How errors cross process boundaries: a TP worker's exception as a plain, picklable dict and back.

A worker process packs what it raised (:func:`pack_error`); the engine (or a follower launcher)
unpacks it (:func:`unpack_error`) into the same :mod:`~sglang.multimodal_gen.errors` type with its
``message``, ``param`` and ``code``, so the HTTP layer maps it exactly as if it had been raised in
process. Other exceptions come back as the closest built-in (``FileNotFoundError``,
``ValueError``, ``LookupError``) or a ``RuntimeError`` carrying the worker's traceback.
"""

from __future__ import annotations

import traceback

from sglang.multimodal_gen import errors as errors_mod
from sglang.multimodal_gen.distributed.multinode import RendezvousTimeoutError
from sglang.multimodal_gen.errors import SGLangError

__all__ = ["first_error", "pack_error", "unpack_error"]


def pack_error(e: BaseException) -> dict:
    """``e`` as a dict of plain values: its type name, whether it is an ``SGLangError`` (then
    ``message``, ``param`` and ``code``), whether it is a ``ValueError`` / ``LookupError``, and
    its formatted traceback."""
    return {
        "type": type(e).__name__,
        "sglang": isinstance(e, SGLangError),
        "message": getattr(e, "message", None) or str(e),
        "param": getattr(e, "param", None),
        "code": getattr(e, "code", None),
        "value_error": isinstance(e, ValueError),
        "lookup_error": isinstance(e, LookupError),
        "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
    }


def unpack_error(d: dict, rank: int | None = None) -> BaseException:
    """The exception a :func:`pack_error` dict describes (to be raised by the caller).

    ``SGLangError`` types are rebuilt as themselves; other types become ``FileNotFoundError``,
    ``RendezvousTimeoutError``, ``ValueError``, ``LookupError`` or ``RuntimeError`` (with the
    worker's traceback); their message is prefixed with ``rank N:`` when ``rank`` is given.
    """
    cls = getattr(errors_mod, d["type"], None) if d["sglang"] else None
    if cls is not None and issubclass(cls, SGLangError):
        try:
            return cls(d["message"], param=d["param"], code=d["code"])
        except TypeError:
            return cls(d["message"])
    msg = d["message"] if rank is None else f"rank {rank}: {d['message']}"
    if d["type"] == "FileNotFoundError":
        return FileNotFoundError(msg)
    if d["type"] == "RendezvousTimeoutError":  # a node missing at start-up: its own line suffices
        return RendezvousTimeoutError(d["message"])
    if d["value_error"]:
        return ValueError(msg)
    if d["lookup_error"]:
        return LookupError(msg)
    return RuntimeError(f"{d['type']}: {msg}\n{d['traceback']}")


def first_error(errs: list) -> tuple[int, dict] | None:
    """``(rank, packed error)`` of the first rank whose entry is not ``None``, else ``None``."""
    for r, e in enumerate(errs):
        if e is not None:
            return r, e
    return None
