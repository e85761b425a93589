"""Reading LoRA files from disk: safetensors only, inside the allowed roots, offline Hub cache.

``load_lora_state_dict`` accepts:

- a ``.safetensors`` file;
- a folder written by diffusers' ``save_lora_weights`` / ``save_lora_adapter``
  (``pytorch_lora_weights.safetensors``; the adapter config sits in the file's
  ``lora_adapter_metadata`` header entry);
- a folder written by peft's ``save_pretrained`` (``adapter_model.safetensors`` +
  ``adapter_config.json``);
- a folder holding exactly one ``.safetensors`` file;
- a Hugging Face Hub repo id (``owner/name``, or ``owner/name/file.safetensors`` for one file of
  it) already present in the local Hub cache
  (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``). Nothing is
  downloaded.

Pickle-based files (``.bin``, ``.pt``, ``.pth``, ``.ckpt``, ``.pkl``) are refused without being
opened: unpickling runs arbitrary code. Local paths are resolved with ``os.path.realpath`` (so
``..`` and symlinks are followed first) and must lie inside one of ``allowed_roots`` when those are
given.

Nothing is read before it is known to be bounded: a file must be a regular file (``stat`` first,
so a FIFO or ``/dev/zero`` never blocks or floods a read); the safetensors header length is checked
against :data:`MAX_HEADER_BYTES` and the file size, and the whole header (dtypes, shapes, offsets,
``__metadata__``) is validated before any tensor is read; tensors are then read one by one with
``safetensors.safe_open``. A file that is not safetensors is named for what it is (empty, a Git LFS
pointer, an HTML page, a pickle or zip checkpoint). Float8 tensors (``F8_E4M3``, ``F8_E5M2``, which
diffusers loads too) are upcast to float32 when read; other dtypes that are not weights
(``F8_E8M0`` scales, ``F4``/``F6`` packed formats) are refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Iterable
from typing import Any

import torch

from sglang.multimodal_gen.errors import InvalidRequestError, LoRAFormatError

__all__ = ["OutsideLoRARootsError", "hf_hub_cache_dir", "load_lora_state_dict", "resolve_lora_path"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: Largest safetensors JSON header read (the safetensors library's own bound).
MAX_HEADER_BYTES = 100_000_000
#: Largest ``adapter_config.json`` read.
MAX_CONFIG_BYTES = 1 << 20
# safetensors dtype -> (torch dtype name, bytes per element); float8 is upcast to float32 on read
_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
_UPCAST = ("F8_E4M3", "F8_E5M2")
_NOT_WEIGHTS = {
    "F8_E8M0": "an exponent-only scale format (MX block scales), not weights",
    "F4": "a packed 4-bit format that needs its block scales",
    "F6_E2M3": "a packed 6-bit format that needs its block scales",
    "F6_E3M2": "a packed 6-bit format that needs its block scales",
    "C64": "complex numbers",
}
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
# ``owner/name`` optionally followed by ``/path/in/repo.safetensors``
_REPO_ID_RE = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*)"
    r"(?:/(?P<file>[A-Za-z0-9_.\-/]+\.safetensors))?$"
)


def is_hub_id(path: str) -> bool:
    """Whether ``path`` is spelled like a Hub repo id (``owner/name[/file.safetensors]``) and not
    like a path that climbs or doubles separators."""
    return _REPO_ID_RE.match(path) is not None and ".." not in path and "//" not in path


class OutsideLoRARootsError(InvalidRequestError):
    """A LoRA path resolves outside every allowed LoRA directory (HTTP 400)."""


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_lora_path(path: str | os.PathLike, allowed_roots: Iterable[str] | None = None) -> str:
    """Resolve a local LoRA path to its real absolute path, contained in ``allowed_roots``.

    A relative path is tried against each root in order (and against the working directory when
    no roots are given). Symlinks and ``..`` are resolved before the containment check, so a link
    pointing out of a root, ``../../etc/passwd`` or an absolute path elsewhere are all refused.

    Returns:
        The realpath of an existing file or directory.

    Raises:
        OutsideLoRARootsError (an InvalidRequestError, HTTP 400): the path resolves outside
            every allowed root.
        InvalidRequestError: the roots list is empty, or the path does not exist.
    """
    raw = os.fspath(path)
    if not raw or "\x00" in raw:
        raise InvalidRequestError("lora_path is empty or contains a NUL byte", param="lora_path")
    if allowed_roots is None:
        real = os.path.realpath(os.path.expanduser(raw))
        if not os.path.exists(real):
            raise InvalidRequestError(f"LoRA path {raw!r} does not exist", param="lora_path")
        return real
    roots = [os.path.realpath(os.path.expanduser(os.fspath(r))) for r in allowed_roots]
    if not roots:
        raise InvalidRequestError(
            "no LoRA directories are allowed on this server (--lora-dir)", param="lora_path"
        )
    expanded = os.path.expanduser(raw)
    candidates = (
        [expanded] if os.path.isabs(expanded) else [os.path.join(r, expanded) for r in roots]
    )
    outside = False
    for cand in candidates:
        real = os.path.realpath(cand)
        if not any(_within(real, r) for r in roots):
            outside = True
            continue
        if os.path.exists(real):
            return real
    if outside:
        raise OutsideLoRARootsError(
            f"LoRA path {raw!r} resolves outside the allowed LoRA directories", param="lora_path"
        )
    raise InvalidRequestError(
        f"LoRA path {raw!r} does not exist in the allowed LoRA directories", param="lora_path"
    )


def hf_hub_cache_dir() -> str:
    """The Hub cache directory, read from the environment at call time (honours ``HF_HOME``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def _snapshot_from_cache(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    cache = hf_hub_cache_dir()
    try:
        return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except Exception:  # LocalEntryNotFoundError and friends: all mean "not in the cache"
        raise InvalidRequestError(
            f"LoRA {repo_id!r} could not be found locally (not a local path, not in the Hugging "
            f"Face cache at {cache}); downloading is not possible here. Download it beforehand "
            "or pass a local path.",
            param="lora_path",
        ) from None


def _refuse_pickle(path: str) -> None:
    if path.lower().endswith(PICKLE_SUFFIXES):
        raise LoRAFormatError(
            f"refusing to load {os.path.basename(path)!r}: pickle-based checkpoints "
            f"({', '.join(PICKLE_SUFFIXES)}) can run arbitrary code; convert it to .safetensors",
            param="lora_path",
        )


def _pick_file(folder: str) -> tuple[str, str]:
    """``(weights file, kind)`` inside a LoRA folder."""
    for name, kind in ((PEFT_WEIGHTS, "peft"), (DIFFUSERS_WEIGHTS, "diffusers")):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            return p, kind
    entries = sorted(os.listdir(folder))
    st = [
        e for e in entries if e.endswith(".safetensors") and os.path.isfile(os.path.join(folder, e))
    ]
    if len(st) == 1:
        return os.path.join(folder, st[0]), "file"
    if len(st) > 1:
        raise LoRAFormatError(
            f"LoRA folder {folder!r} holds several .safetensors files ({', '.join(st[:5])}); "
            "pass the file itself",
            param="lora_path",
        )
    pickles = [e for e in entries if e.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        _refuse_pickle(os.path.join(folder, pickles[0]))
    raise LoRAFormatError(f"no .safetensors LoRA file in folder {folder!r}", param="lora_path")


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


def _open_regular(path: str) -> tuple[Any, int]:
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


def _json_kind(value: Any) -> str:
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
        raise _cannot_read(name, f"its header is {_json_kind(header)}, not a JSON object")
    meta = header.get("__metadata__")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise _cannot_read(
            name, f"its __metadata__ is {_json_kind(meta)}; it must be an object of strings"
        )
    for k, v in meta.items():
        if not isinstance(v, str):
            raise _cannot_read(
                name, f"__metadata__ entry {k!r} is {_json_kind(v)}; entries must be strings"
            )
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise _cannot_read(name, f"tensor {key!r}: its entry is {_json_kind(info)}")
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
        need = math.prod(shape) * _DTYPES[dtype][1]
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


def _read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """Read a safetensors file: ``(tensors, header metadata, content digest)``.

    The file must be a regular file; its header is read and validated (length bounded by
    :data:`MAX_HEADER_BYTES` and the file size) before any tensor is read, tensors are read
    lazily with ``safe_open``, float8 ones upcast to float32. The digest (BLAKE2b-128 of the
    file's bytes, hashed in chunks) identifies the content for the merge cache and adapter
    reuse: a file rewritten in place with the same size and mtime still gets a new one.
    """
    from safetensors import SafetensorError, safe_open

    name = os.path.basename(path)
    f, size = _open_regular(path)
    with f:
        head = f.read(64)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        if len(head) < 9 or head[8:9] not in (b"{", b" ") or n < 2:
            raise _not_safetensors(name, _what_is_it(head, size))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _not_safetensors(
                name,
                f"its header would be {n} bytes long in a file of {size} bytes "
                f"({_what_is_it(head, size)})",
            )
        f.seek(8)
        raw = f.read(n)
        try:
            header = json.loads(raw)
        except ValueError as e:
            raise _cannot_read(name, f"its header is not valid JSON ({e})") from None
        meta = _check_header(name, header, size - 8 - n)
        digest = hashlib.blake2b(digest_size=16)
        f.seek(0)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    sd: dict[str, torch.Tensor] = {}
    try:
        with safe_open(path, framework="pt", device="cpu") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = st.get_tensor(key)
                if header[key]["dtype"] in _UPCAST:
                    t = t.float()  # as diffusers' load into fp32 LoRA layers: exact
                sd[key] = t
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _cannot_read(name, str(e)) from None
    return sd, meta, digest.hexdigest()


def _read_config(path: str) -> dict:
    """``adapter_config.json``: a regular file of at most :data:`MAX_CONFIG_BYTES`, a JSON
    object."""
    name = os.path.basename(path)
    f, size = _open_regular(path)
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
        raise LoRAFormatError(f"cannot parse {name!r}: {why}", param="lora_path") from None
    if not isinstance(config, dict):
        raise LoRAFormatError(
            f"{name!r} is {_json_kind(config)}, not a JSON object", param="lora_path"
        )
    return config


def load_lora_state_dict(
    path_or_repo_id: str | os.PathLike, allowed_roots: Iterable[str] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a LoRA state dict and everything that describes it, without unpickling anything.

    Args:
        path_or_repo_id: a ``.safetensors`` file, a LoRA folder (peft / diffusers / single file), or
            a Hub repo id (``owner/name[/file.safetensors]``) present in the local Hub cache.
            Local paths are tried first.
        allowed_roots: when given, local paths must resolve (realpath) inside one of these
            directories; relative paths are taken relative to them.

    Returns:
        ``(state_dict, metadata)``: ``state_dict`` maps keys to CPU tensors in the file's dtype.
        ``metadata`` holds ``path`` (the real file path), ``kind`` (``"file"``, ``"peft"``,
        ``"diffusers"``), ``source`` (what the caller passed), ``identity``
        (``"<content digest>:<config digest>"``: equal exactly when the tensors, metadata and
        adapter config are; the merge cache and adapter reuse key on it),
        ``safetensors_metadata`` (raw header ``{str: str}``), ``lora_adapter_metadata`` (decoded
        diffusers config or ``None``) and ``adapter_config`` (``adapter_config.json`` or ``None``).

    Raises:
        LoRAFormatError: a pickle file (``.bin``/``.pt``/...), a file that is not safetensors, a
            folder without exactly one usable ``.safetensors`` file, an unreadable
            ``adapter_config.json``.
        InvalidRequestError: the path is outside ``allowed_roots``; nothing found locally or in
            the Hub cache (the message says downloading is not possible).
    """
    raw = os.fspath(path_or_repo_id)
    local: str | None = None
    try:
        local = resolve_lora_path(raw, allowed_roots)
    except InvalidRequestError as e:
        repo_match = _REPO_ID_RE.match(raw)
        if isinstance(e, OutsideLoRARootsError) or repo_match is None or ".." in raw or "//" in raw:
            raise
    from_cache = local is None
    if from_cache:
        local = _snapshot_from_cache(repo_match.group("repo"))
        if repo_match.group("file"):
            # cache files are symlinks into ../../blobs, so containment is checked on the name
            local = os.path.join(local, repo_match.group("file"))
            if not os.path.isfile(local):
                raise InvalidRequestError(
                    f"{repo_match.group('file')!r} is not in the cached snapshot of "
                    f"{repo_match.group('repo')!r}; downloading is not possible here",
                    param="lora_path",
                )
    # files picked inside a local folder must not escape the roots through a symlink either
    roots = None if from_cache or allowed_roots is None else list(allowed_roots)

    adapter_config = None
    if os.path.isdir(local):
        path, kind = _pick_file(local)
        if roots is not None:
            path = resolve_lora_path(path, roots)
        cfg_path = os.path.join(local, PEFT_CONFIG)
        if os.path.isfile(cfg_path):
            if roots is not None:
                cfg_path = resolve_lora_path(cfg_path, roots)
            adapter_config = _read_config(cfg_path)
    else:
        path, kind = local, "file"
    _refuse_pickle(path)
    sd, header, digest = _read_safetensors(path)

    lam = None
    if "lora_adapter_metadata" in header:
        try:
            lam = json.loads(header["lora_adapter_metadata"])
        except (ValueError, RecursionError) as e:
            raise LoRAFormatError(
                f"lora_adapter_metadata in the safetensors header is not valid JSON: {e}",
                param="lora_path",
            ) from None
        if lam is not None and not isinstance(lam, dict):
            raise LoRAFormatError(
                f"lora_adapter_metadata in the safetensors header is {_json_kind(lam)}, not a "
                "JSON object",
                param="lora_path",
            )
    # the config changes the deltas (alpha, rsLoRA, patterns) as much as the tensors do
    config_digest = hashlib.blake2b(
        json.dumps(adapter_config, sort_keys=True, default=str).encode(), digest_size=8
    ).hexdigest()
    metadata = {
        "source": raw,
        "path": path,
        "kind": kind,
        "identity": f"{digest}:{config_digest}",
        "safetensors_metadata": header,
        "lora_adapter_metadata": lam,
        "adapter_config": adapter_config,
    }
    return sd, metadata
