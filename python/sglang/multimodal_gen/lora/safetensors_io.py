"""Reading one safetensors file (and an ``adapter_config.json``) safely.

Nothing is read before it is known to be bounded: a file must be a regular file (``stat`` first,
so a FIFO or ``/dev/zero`` never blocks or floods a read); the header length is checked against
:data:`~sglang.multimodal_gen.lora.limits.MAX_HEADER_BYTES` and the file size, its tensor count
against the caller's bound before it is parsed, and the whole header (dtypes, shapes, offsets,
``__metadata__`` and its size) is validated, and the caller's check of the tensor names run, before
any tensor is read; tensors are then read one by one, in file order, from the same open file
(straight into tensors the file's size allows). The checks are ours (not the safetensors library's) so that a refusal
names what the file actually is (empty, a Git LFS pointer, an HTML page, a pickle or zip
checkpoint) and the tensor at fault. Float8 tensors (``F8_E4M3``, ``F8_E5M2``, which diffusers
loads too) are upcast to float32 when read. Dtypes that hold no real numbers a LoRA could use are
refused by kind, naming the tensor: booleans, complex numbers, ``F8_E8M0`` scales and the
``F4``/``F6`` packed formats. Integer tensors are read (an ``alpha`` may be stored as an integer);
the conversion refuses them as weights (``lora.formats``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Callable
from typing import Any

import torch

from sglang.multimodal_gen.errors import LoRAFormatError
from sglang.multimodal_gen.lora.limits import (
    MAX_HEADER_BYTES,
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_TENSORS,
)
from sglang.multimodal_gen.lora.peft_config import check_config_depth

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_HEADER_BYTES",
    "READ_STATS",
    "open_regular",
    "read_config",
    "read_safetensors",
]

#: Files read by :func:`read_safetensors` and their bytes (tests count reads with it).
READ_STATS = {"files": 0, "bytes": 0}
#: Largest ``adapter_config.json`` read.
MAX_CONFIG_BYTES = 1 << 20
# safetensors dtypes read: bytes per element. Floats are weights (float8 upcast to float32 on
# read); integers are read as numbers (an integer alpha) and refused as weights by the conversion.
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_INT_DTYPES = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1}
_DTYPES = {**_FLOAT_DTYPES, **_INT_DTYPES}
_TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
}
_UPCAST = ("F8_E4M3", "F8_E5M2")
# Every other dtype of the safetensors format: no real numbers a LoRA could use.
_NOT_WEIGHTS = {
    "BOOL": "booleans, not numbers",
    "C64": "complex numbers",
    "F8_E8M0": "an exponent-only scale format (MX block scales), not weights",
    "F4": "a packed 4-bit format that needs its block scales",
    "F6_E2M3": "a packed 6-bit format that needs its block scales",
    "F6_E3M2": "a packed 6-bit format that needs its block scales",
}


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str) -> tuple[Any, int]:
    """Open ``path`` for reading if, and only if, it is a regular file: ``(file, size)``.

    ``stat`` comes first, so a FIFO, ``/dev/zero`` or a socket is refused without being opened
    (a read would block forever or never end); the open is non-blocking and checked again with
    ``fstat`` in case the path changed in between.

    Raises:
        LoRAFormatError: not a regular file, or it cannot be opened (``param="lora_path"``).
    """
    name = os.path.basename(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise LoRAFormatError(
                f"{name!r} is {_file_kind(st.st_mode)}, not a regular file; LoRA files must be "
                "regular files",
                param="lora_path",
            )
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise LoRAFormatError(
            f"cannot open {name!r}: {e.strerror or e}", param="lora_path"
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise LoRAFormatError(
            f"{name!r} is {_file_kind(st.st_mode)}, not a regular file", param="lora_path"
        )
    return os.fdopen(fd, "rb"), st.st_size


def _what_is_it(head: bytes, size: int) -> str:
    """Why a file is not safetensors, from its first bytes: what it actually is."""
    if size == 0:
        return "the file is empty"
    text = head.lstrip().lower()
    if head.startswith(b"version https://git-lfs"):
        return (
            "it is a Git LFS pointer file, not the weights: the download is incomplete (fetch "
            "the file itself, e.g. `git lfs pull`)"
        )
    if b"/annex/objects/" in head or b".git/annex" in head:
        return "it is a git-annex pointer, not the weights: the content was not fetched"
    if text.startswith((b"<!doctype html", b"<html", b"<head", b"<?xml")):
        return "it is an HTML page (a download that saved an error or login page?)"
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive (a PyTorch checkpoint renamed?); only safetensors is read"
    if head[:1] == b"\x80":
        return (
            "it is a Python pickle (a .pt/.bin/.ckpt checkpoint renamed?); pickles are never loaded"
        )
    if text.startswith((b"{", b"[")):
        return "it is a JSON document, not weights"
    return "its first bytes are not a safetensors header"


def _not_safetensors(name: str, why: str) -> LoRAFormatError:
    return LoRAFormatError(f"{name!r} is not a safetensors file: {why}", param="lora_path")


def _cannot_read(name: str, why: str) -> LoRAFormatError:
    return LoRAFormatError(f"cannot read safetensors file {name!r}: {why}", param="lora_path")


def json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return "an object"


def _check_header(name: str, header: Any, data_bytes: int) -> dict[str, str]:
    """Validate a parsed safetensors header against the bytes that follow it; return its
    ``__metadata__`` (``{str: str}``).

    Raises:
        LoRAFormatError: naming the tensor or entry at fault.
    """
    if not isinstance(header, dict):
        raise _cannot_read(name, f"its header is {json_kind(header)}, not a JSON object")
    meta = header.get("__metadata__")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise _cannot_read(
            name, f"its __metadata__ is {json_kind(meta)}; it must be an object of strings"
        )
    for k, v in meta.items():
        if not isinstance(v, str):
            raise _cannot_read(
                name, f"__metadata__ entry {k!r} is {json_kind(v)}; entries must be strings"
            )
    if len(meta) > MAX_METADATA_ENTRIES:
        raise _cannot_read(
            name,
            f"its __metadata__ has {len(meta)} entries (e.g. {next(iter(meta))!r}); at most "
            f"{MAX_METADATA_ENTRIES} are read (trainers write about a hundred)",
        )
    chars = sum(len(k) + len(v) for k, v in meta.items())
    if chars > MAX_METADATA_BYTES:
        big = max(meta, key=lambda k: len(k) + len(meta[k]))
        raise _cannot_read(
            name,
            f"its __metadata__ holds {chars} characters (entry {big!r}: {len(meta[big])}); at "
            f"most {MAX_METADATA_BYTES} are read",
        )
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise _cannot_read(name, f"tensor {key!r}: its entry is {json_kind(info)}")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype in _NOT_WEIGHTS:
            raise LoRAFormatError(
                f"{name!r}: tensor {key!r} has dtype {dtype}, {_NOT_WEIGHTS[dtype]}; LoRA "
                "weights must be F32, F16, BF16, F64, or F8_E4M3/F8_E5M2 (read as F32)",
                param="lora_path",
            )
        if dtype not in _DTYPES:
            raise _cannot_read(name, f"tensor {key!r} has an unknown dtype {dtype!r}")
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise _cannot_read(name, f"tensor {key!r} has an invalid shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise _cannot_read(name, f"tensor {key!r} has invalid data_offsets {offsets!r}")
        need = math.prod(shape) * _DTYPES[dtype]
        if offsets[1] - offsets[0] != need:
            raise _cannot_read(
                name,
                f"tensor {key!r} ({dtype} {shape}) needs {need} bytes but its data_offsets "
                f"span {offsets[1] - offsets[0]}",
            )
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise _cannot_read(name, f"tensor {key!r}: data offsets overlap or leave a gap")
        end = stop
    if end != data_bytes:
        if end > data_bytes:
            raise _cannot_read(
                name,
                f"the file is truncated: its header describes {end} bytes of tensor data but "
                f"only {data_bytes} follow (an incomplete download?)",
            )
        raise _cannot_read(name, f"{data_bytes - end} unexpected bytes after the last tensor")
    return dict(meta)


def read_safetensors(
    path: str,
    max_tensors: int | None = None,
    check_keys: Callable[[list[str]], None] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """Read a safetensors file: ``(tensors, header metadata, content digest)``.

    The file must be a regular file. Before any tensor is read: its header length is bounded by
    :data:`~sglang.multimodal_gen.lora.limits.MAX_HEADER_BYTES` and the file size; its tensor
    count by ``max_tensors`` (counted in the raw header, before it is parsed, so a header of a
    hundred thousand entries costs no parsing and no memory); the parsed header is validated
    (dtypes, shapes, contiguous offsets, ``__metadata__`` within
    :data:`~sglang.multimodal_gen.lora.limits.MAX_METADATA_ENTRIES` /
    :data:`~sglang.multimodal_gen.lora.limits.MAX_METADATA_BYTES`); and ``check_keys`` is called
    with the tensor names in file order (the LoRA loader refuses keys it cannot use there). The
    tensors are then read one by one, in file order, from the same open file, each straight into
    its own tensor (float8 upcast to float32 afterwards). The digest (BLAKE2b-128 of the file's
    bytes: the 8-byte length, the header and the tensor data in file order, which
    :func:`_check_header` proved contiguous) is computed from those same bytes as they are read, so
    the file is read once. It identifies the content for the merge cache and adapter reuse: a file
    rewritten in place with the same size and mtime still gets a new one. Every call that gets to
    the tensors adds one to ``READ_STATS["files"]`` and the file size to ``READ_STATS["bytes"]``.

    Args:
        max_tensors: most tensors the file may hold
            (:data:`~sglang.multimodal_gen.lora.limits.MAX_TENSORS` when ``None``).
        check_keys: called with the tensor names before any tensor is read; raises to refuse.
    """
    name = os.path.basename(path)
    limit = MAX_TENSORS if max_tensors is None else int(max_tensors)
    f, size = open_regular(path)
    with f:
        head = f.read(64)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        if len(head) < 9 or head[8:9] not in (b"{", b" ") or n < 2:
            raise _not_safetensors(name, _what_is_it(head, size))
        if 8 + n > size:
            raise _not_safetensors(
                name,
                f"its header would be {n} bytes long in a file of {size} bytes "
                f"({_what_is_it(head, size)})",
            )
        if n > MAX_HEADER_BYTES:
            raise _cannot_read(
                name,
                f"its header is {n} bytes; a LoRA file's header is at most {MAX_HEADER_BYTES} "
                "(its tensor entries and metadata)",
            )
        f.seek(8)
        raw = f.read(n)
        # every tensor entry has exactly one "data_offsets" key (the text cannot occur unescaped
        # inside a JSON string), so counting it bounds the entries before anything is parsed
        entries = raw.count(b'"data_offsets"')
        if entries > limit:
            raise _too_many(name, entries, limit)
        try:
            header = json.loads(raw)
        except ValueError as e:
            raise _cannot_read(name, f"its header is not valid JSON ({e})") from None
        except RecursionError:
            raise _cannot_read(name, "its header is JSON nested too deeply") from None
        meta = _check_header(name, header, size - 8 - n)
        order = sorted(
            (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0]
        )
        if len(order) > limit:
            raise _too_many(name, len(order), limit)
        if check_keys is not None:
            check_keys(order)
        digest = hashlib.blake2b(head[:8], digest_size=16)
        digest.update(raw)
        del raw
        READ_STATS["files"] += 1
        READ_STATS["bytes"] += size
        sd: dict[str, torch.Tensor] = {}
        try:
            for key in order:
                info = header[key]
                t = torch.empty(info["shape"], dtype=_TORCH_DTYPES[info["dtype"]])
                want = info["data_offsets"][1] - info["data_offsets"][0]
                if want:
                    buf = t.reshape(-1).view(torch.uint8).numpy()
                    if f.readinto(memoryview(buf)) != want:
                        raise _cannot_read(
                            name, f"tensor {key!r}: the file ended early (changed while read?)"
                        )
                    digest.update(buf)
                if info["dtype"] in _UPCAST:
                    t = t.float()  # as diffusers' load into fp32 LoRA layers: exact
                sd[key] = t
        except LoRAFormatError:
            raise
        except (OSError, ValueError, RuntimeError) as e:
            raise _cannot_read(name, str(e)) from None
    return sd, meta, digest.hexdigest()


def _too_many(name: str, count: int, limit: int) -> LoRAFormatError:
    return _cannot_read(
        name,
        f"it holds {count} tensors; at most {limit} are read for this model (a LoRA has a few "
        "per layer it targets; see docs/lora.md, 'Bounds')",
    )


def read_config(path: str) -> dict:
    """``adapter_config.json``: a regular file of at most :data:`MAX_CONFIG_BYTES`, a JSON
    object nested at most :data:`~sglang.multimodal_gen.lora.peft_config.MAX_CONFIG_DEPTH`
    levels."""
    name = os.path.basename(path)
    f, size = open_regular(path)
    with f:
        if size > MAX_CONFIG_BYTES:
            raise LoRAFormatError(
                f"{name!r} is {size} bytes; an adapter config is at most {MAX_CONFIG_BYTES}",
                param="lora_path",
            )
        data = f.read(MAX_CONFIG_BYTES + 1)
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "the file is empty" if not data.strip() else f"not valid JSON ({e})"
        if isinstance(e, RecursionError):
            why = "it is JSON nested too deeply"
        raise LoRAFormatError(f"cannot parse {name!r}: {why}", param="lora_path") from None
    if not isinstance(config, dict):
        raise LoRAFormatError(
            f"{name!r} is {json_kind(config)}, not a JSON object", param="lora_path"
        )
    check_config_depth(config, repr(name))
    return config
