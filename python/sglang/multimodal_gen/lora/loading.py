"""Reading LoRA files from disk: safetensors only, inside the allowed roots, Hub ids.

``load_lora_state_dict`` accepts:

- a ``.safetensors`` file;
- a folder written by diffusers' ``save_lora_weights`` / ``save_lora_adapter``
  (``pytorch_lora_weights.safetensors``; the adapter config sits in the file's
  ``lora_adapter_metadata`` header entry);
- a folder written by peft's ``save_pretrained`` (``adapter_model.safetensors`` +
  ``adapter_config.json``);
- a folder holding exactly one ``.safetensors`` file;
- a Hugging Face Hub repo id (``owner/name``, or ``owner/name/file.safetensors`` for one file of
  it) from the local Hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``~/.cache/huggingface/hub``; no request when it is there), downloaded into it first when the
  caller allows (``download=True``: :func:`~sglang.multimodal_gen.hub.lora_snapshot`, the
  top-level ``*.safetensors`` and ``adapter_config.json`` only). Otherwise nothing is downloaded.

Pickle-based files (``.bin``, ``.pt``, ``.pth``, ``.ckpt``, ``.pkl``) are refused without being
opened: unpickling runs arbitrary code. Local paths are resolved with ``os.path.realpath`` (so
``..`` and symlinks are followed first) and must lie inside one of ``allowed_roots`` when those are
given.

The file itself is read by :mod:`~sglang.multimodal_gen.lora.safetensors_io` (bounded, validated,
read once). Which paths a caller may read is the trust policy of :func:`read_source`; whether a
loaded adapter's file changed is answered without reading it by :func:`file_key`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import sglang.multimodal_gen.lora.safetensors_io as safetensors_io
from sglang.multimodal_gen.errors import InvalidRequestError, LoRAFormatError, SGLangError
from sglang.multimodal_gen.hub import HubUnavailableError, hf_hub_cache_dir, lora_snapshot
from sglang.multimodal_gen.lora.key_grammar import check_key_names
from sglang.multimodal_gen.lora.peft_config import check_config_depth
from sglang.multimodal_gen.lora.safetensors_io import json_kind, read_config

__all__ = [
    "LoRASource",
    "OutsideLoRARootsError",
    "fetch_hub_source",
    "file_key",
    "hf_hub_cache_dir",
    "is_hub_id",
    "load_lora_state_dict",
    "locate_lora",
    "locate_source",
    "read_source",
    "resolve_lora_path",
]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
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
    where = "" if os.path.isabs(expanded) else " (relative paths are looked up inside each of them)"
    raise InvalidRequestError(
        f"LoRA path {raw!r} does not exist in the allowed LoRA directories{where}",
        param="lora_path",
    )


def _hub_snapshot(
    repo_id: str,
    local: str = "not a local path",
    filename: str | None = None,
    download: bool = False,
) -> str:
    """The snapshot folder of ``repo_id`` in the Hub cache, downloaded first when ``download``
    and it is not there; ``local`` says why no local path matched."""
    cache = hf_hub_cache_dir()
    try:
        return lora_snapshot(repo_id, filename, download)
    except HubUnavailableError as e:
        if download:
            message = (
                f"LoRA {repo_id!r} could not be found locally ({local}; not in the Hugging Face "
                f"cache at {cache}) and could not be downloaded ({e.reason}). Download it with "
                f"`{e.command}` or pass a local path."
            )
        else:
            message = (
                f"LoRA {repo_id!r} could not be found locally ({local}; not in the Hugging "
                f"Face cache at {cache}); downloading is not possible here (a server downloads "
                "Hub LoRAs only when started with --enable-hub-lora). Download it beforehand "
                f"(`{e.command}`) or pass a local path."
            )
        raise InvalidRequestError(message, param="lora_path") from None


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


@dataclass(frozen=True)
class LoRASource:
    """Where an adapter's files are: ``weights`` (a real ``.safetensors`` path), ``kind``
    (``"file"``, ``"peft"``, ``"diffusers"``), ``config`` (``adapter_config.json`` or ``None``)
    and ``source`` (what the caller passed)."""

    source: str
    weights: str
    kind: str
    config: str | None


def locate_lora(
    path_or_repo_id: str | os.PathLike,
    allowed_roots: Iterable[str] | None = None,
    download: bool = False,
) -> LoRASource:
    """Resolve a path or Hub id to its files (see :func:`load_lora_state_dict`); nothing is read
    (``stat`` and directory listings only). ``download``: a Hub id missing from the local cache
    is downloaded into it first (the top-level ``*.safetensors`` and ``adapter_config.json``).

    Raises:
        as :func:`load_lora_state_dict` (path refused, not found, pickle, no usable file).
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
        # "owner/name" may also be a relative path the client meant: say where those are looked up
        why = "not a local path"
        if allowed_roots:
            why = "no such path inside the allowed LoRA directories, where relative paths are looked up"
        local = _hub_snapshot(repo_match.group("repo"), why, repo_match.group("file"), download)
        if repo_match.group("file"):
            # cache files are symlinks into ../../blobs, so containment is checked on the name
            local = os.path.join(local, repo_match.group("file"))
            if not os.path.isfile(local):
                where = "the Hub's" if download else "the cached"
                raise InvalidRequestError(
                    f"{repo_match.group('file')!r} is not in {where} snapshot of "
                    f"{repo_match.group('repo')!r}"
                    + ("" if download else "; downloading is not possible here"),
                    param="lora_path",
                )
    # files picked inside a local folder must not escape the roots through a symlink either
    roots = None if from_cache or allowed_roots is None else list(allowed_roots)

    cfg_found = None
    if os.path.isdir(local):
        path, kind = _pick_file(local)
        if roots is not None:
            path = resolve_lora_path(path, roots)
        cfg_path = os.path.join(local, PEFT_CONFIG)
        if os.path.isfile(cfg_path):
            if roots is not None:
                cfg_path = resolve_lora_path(cfg_path, roots)
            cfg_found = cfg_path
    else:
        path, kind = local, "file"
    _refuse_pickle(path)
    return LoRASource(raw, path, kind, cfg_found)


def file_key(src: LoRASource) -> tuple:
    """``(realpath, size, mtime_ns, ctime_ns, inode)`` of the weights file and of the config.

    Equal keys mean the files were not rewritten, so a loaded adapter can be reused without
    reading anything (the content digest is computed once, at the first read). ``ctime`` is part
    of it because ``mtime`` can be set back (``os.utime``) by a rewrite; ``ctime`` cannot.
    """

    def one(p: str | None) -> tuple:
        if p is None:
            return ()
        st = os.stat(p)
        return (os.path.realpath(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)

    return (one(src.weights), one(src.config))


def load_lora_state_dict(
    path_or_repo_id: str | os.PathLike,
    allowed_roots: Iterable[str] | None = None,
    download: bool = False,
    *,
    max_tensors: int | None = None,
    check_keys: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a LoRA state dict and everything that describes it, without unpickling anything.

    Args:
        path_or_repo_id: a ``.safetensors`` file, a LoRA folder (peft / diffusers / single file), or
            a Hub repo id (``owner/name[/file.safetensors]``) from the local Hub cache.
            Local paths are tried first.
        allowed_roots: when given, local paths must resolve (realpath) inside one of these
            directories; relative paths are taken relative to them.
        download: a Hub id missing from the local cache is downloaded into it first.
        max_tensors: most tensors the file may hold, checked in its header before anything is
            parsed (:data:`~sglang.multimodal_gen.lora.limits.MAX_TENSORS` when ``None``; the
            manager passes :func:`~sglang.multimodal_gen.lora.limits.tensor_cap` of its model).
        check_keys: refuse keys no conversion could use (unsupported features, unrecognized
            names; :func:`~sglang.multimodal_gen.lora.key_grammar.check_key_names`) from the
            header, before any tensor is read.

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
            ``adapter_config.json``; a file beyond a bound (header, metadata, tensor count:
            :mod:`~sglang.multimodal_gen.lora.limits`); with ``check_keys``, a key no
            conversion could use.
        InvalidRequestError: the path is outside ``allowed_roots``; nothing found locally or in
            the Hub cache (the message says downloading is not possible, or why it failed).
    """
    src = locate_lora(path_or_repo_id, allowed_roots, download)
    path, kind = src.weights, src.kind
    adapter_config = None if src.config is None else read_config(src.config)
    sd, header, digest = safetensors_io.read_safetensors(
        path, max_tensors, check_key_names if check_keys else None
    )

    lam = None
    if "lora_adapter_metadata" in header:
        try:
            lam = json.loads(header["lora_adapter_metadata"])
        except ValueError as e:
            raise LoRAFormatError(
                f"lora_adapter_metadata in the safetensors header is not valid JSON: {e}",
                param="lora_path",
            ) from None
        except RecursionError:
            raise LoRAFormatError(
                "lora_adapter_metadata in the safetensors header is JSON nested too deeply",
                param="lora_path",
            ) from None
        if lam is not None and not isinstance(lam, dict):
            raise LoRAFormatError(
                f"lora_adapter_metadata in the safetensors header is {json_kind(lam)}, not a "
                "JSON object",
                param="lora_path",
            )
        check_config_depth(lam, "lora_adapter_metadata in the safetensors header")
    # the config changes the deltas (alpha, rsLoRA, patterns) as much as the tensors do
    config_digest = hashlib.blake2b(
        json.dumps(adapter_config, sort_keys=True, default=str).encode(), digest_size=8
    ).hexdigest()
    metadata = {
        "source": src.source,
        "path": path,
        "kind": kind,
        "identity": f"{digest}:{config_digest}",
        "safetensors_metadata": header,
        "lora_adapter_metadata": lam,
        "adapter_config": adapter_config,
    }
    return sd, metadata


def read_source(
    path: str,
    allowed_roots: Sequence[str] | None,
    trusted: bool = False,
    download: bool = False,
    max_tensors: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read one adapter as a server's trust policy allows: the path policy of the LoRA manager.

    Args:
        allowed_roots: directories local paths must resolve into; ``None``: any local path; an
            empty sequence: no local path (Hub ids are accepted in every case).
        trusted: the path comes from the operator's command line (``--lora-path`` when a server
            starts): read it wherever it is (a relative path is looked up in the roots first,
            then in the working directory).
        download: a Hub id missing from the local cache is downloaded (the caller's policy:
            ``--enable-hub-lora``, or ``trusted``); else it is refused.
        max_tensors: most tensors the file may hold (the manager's model cap); the file's key
            names are checked before any tensor is read (``check_keys`` of
            :func:`load_lora_state_dict`).

    Returns:
        ``(state_dict, metadata)`` of :func:`load_lora_state_dict`.

    Raises:
        InvalidRequestError / LoRAFormatError (``param="lora_path"``): a refused or unreadable
            path. A local path refused by the roots gets the same message whether or not it
            exists.
    """
    return _with_policy(
        path,
        allowed_roots,
        trusted,
        functools.partial(
            load_lora_state_dict, download=download, max_tensors=max_tensors, check_keys=True
        ),
    )


def locate_source(
    path: str, allowed_roots: Sequence[str] | None, trusted: bool = False, download: bool = False
) -> LoRASource:
    """:func:`locate_lora` under the policy of :func:`read_source` (nothing is read; a Hub id
    may be downloaded, see ``download``)."""
    return _with_policy(path, allowed_roots, trusted, lambda p, r: locate_lora(p, r, download))


def fetch_hub_source(path: str, allowed_roots: Sequence[str] | None) -> None:
    """Download a ``set_lora`` path that names a Hub id missing from the local cache, under the
    policy of :func:`read_source` (a local path is left alone): the server calls this outside
    the engine, so a download does not hold up generations; the engine then finds the cache.

    Raises:
        InvalidRequestError (``param="lora_path"``): as :func:`read_source`.
    """
    if isinstance(path, str) and is_hub_id(path):
        locate_source(path, allowed_roots, trusted=False, download=True)


def _with_policy(path: str, allowed_roots: Sequence[str] | None, trusted: bool, fn):
    if not isinstance(path, str) or not path:
        raise InvalidRequestError(
            f"lora_path must be a non-empty string, got {path!r}", "lora_path"
        )
    roots = None if allowed_roots is None else list(allowed_roots)
    if trusted and roots:
        # the operator's own path: relative to the roots when it is there, else anywhere
        try:
            return fn(path, roots)
        except LoRAFormatError:
            raise
        except InvalidRequestError:
            pass
    if trusted:
        roots = None
    no_local = roots is not None and not roots
    if no_local and not is_hub_id(path):
        raise InvalidRequestError(
            f"LoRA path {path!r} refused: this server accepts local LoRA paths only inside "
            "the directories it was started with (--lora-dir DIR), and it has none. Start it "
            "with --lora-dir, or load the adapter at startup with --lora-path; Hugging Face "
            "Hub ids are accepted (from the local cache, or downloaded when the server runs "
            "with --enable-hub-lora).",
            param="lora_path",
        )
    try:
        return fn(path, roots)
    except SGLangError as e:
        if e.param is None:
            e.param = "lora_path"
        if no_local and isinstance(e, InvalidRequestError) and not isinstance(e, LoRAFormatError):
            raise type(e)(
                f"{e.message} (local LoRA paths need the server to be started with --lora-dir)",
                param=e.param,
                code=e.code,
            ) from None
        raise
