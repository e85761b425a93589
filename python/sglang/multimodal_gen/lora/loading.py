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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from sglang.multimodal_gen.errors import InvalidRequestError, LoRAFormatError

__all__ = ["OutsideLoRARootsError", "hf_hub_cache_dir", "load_lora_state_dict", "resolve_lora_path"]

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
    except Exception as e:  # LocalEntryNotFoundError and friends
        raise InvalidRequestError(
            f"LoRA {repo_id!r} could not be found locally (not a local path, not in the Hugging "
            f"Face cache at {cache}); downloading is not possible here. Download it beforehand "
            f"or pass a local path. ({type(e).__name__})",
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


def _read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """Read a safetensors file once: ``(tensors, header metadata, content digest)``.

    The digest (BLAKE2b-128 of the file's bytes) identifies the content for the merge cache and
    adapter reuse: a file rewritten in place with the same size and mtime still gets a new one.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as load_bytes

    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 9 or data[8:9] != b"{":
        raise LoRAFormatError(
            f"{os.path.basename(path)!r} is not a safetensors file (a pickle/zip checkpoint "
            "renamed?); only safetensors is read",
            param="lora_path",
        )
    try:
        # safetensors layout: u64 little-endian header length, then the JSON header
        n = int.from_bytes(data[:8], "little")
        header = dict(json.loads(data[8 : 8 + n]).get("__metadata__") or {})
        sd = load_bytes(data)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAFormatError(
            f"cannot read safetensors file {os.path.basename(path)!r}: {e}", param="lora_path"
        ) from None
    return sd, header, hashlib.blake2b(data, digest_size=16).hexdigest()


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
            try:
                adapter_config = json.loads(Path(cfg_path).read_text())
            except (OSError, ValueError) as e:
                raise LoRAFormatError(
                    f"cannot parse {cfg_path!r}: {e}", param="lora_path"
                ) from None
            if not isinstance(adapter_config, dict):
                raise LoRAFormatError(f"{cfg_path!r} is not a JSON object", param="lora_path")
    else:
        path, kind = local, "file"
    _refuse_pickle(path)
    sd, header, digest = _read_safetensors(path)

    lam = None
    if "lora_adapter_metadata" in header:
        try:
            lam = json.loads(header["lora_adapter_metadata"])
        except ValueError as e:
            raise LoRAFormatError(f"lora_adapter_metadata is not valid JSON: {e}") from None
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
