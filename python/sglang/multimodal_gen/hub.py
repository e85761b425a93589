"""Hub ids: models and LoRA adapters from the Hugging Face Hub, through ``huggingface_hub``.

A model (``--model-path``), a LoRA (``lora_path``) or ``--model-type`` detection may name a Hub
repo id (``owner/name``, not a local path). It is resolved by ``huggingface_hub`` itself
(``snapshot_download``: the revision endpoint, ``refs/<revision>``, the snapshot folder, the cache
layout, its progress bars), in the cache folder the library uses (:func:`hf_hub_cache_dir`), with
the library's environment: ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE`` (nothing is requested;
the cache is used), ``HF_HUB_DISABLE_PROGRESS_BARS``...

Only the files the engine reads are fetched (``allow_patterns`` / ``ignore_patterns``):

- a model (:func:`model_snapshot`): ``model_index.json``, then, for each component it names, the
  component folder's JSON configs, tokenizer files (``*.txt``, ``*.model``, ``*.jinja``) and its
  safetensors weights (``diffusion_pytorch_model`` / ``model``, single file or shards, and any
  shard its ``*.safetensors.index.json`` names); never pickle files, GGUF files, other weight
  variants, files at the repo root or folders the index does not name;
- a LoRA (:func:`lora_snapshot`): the top-level ``*.safetensors`` files and
  ``adapter_config.json`` (or the one file named ``owner/name/file.safetensors``);
- a transformer (:func:`transformer_snapshot`, ``--transformer-path`` /
  ``--transformer-weights-path``): the top-level ``*.json`` and ``*.safetensors`` files of a repo
  that is one transformer folder (or the one file named ``owner/name/file.safetensors``).

A model follows the library (the Hub is asked which commit the revision is, the cache answers when
it is offline or unreachable); a LoRA is taken from the cache when it is there (no request), and
downloaded only when the caller allows it. A failure is one line
(:class:`HubUnavailableError`, a ``FileNotFoundError``) naming the repo id, the cache folder and
the command that downloads it. Nothing here imports torch or another module of this package.
"""

from __future__ import annotations

import errno
import glob
import importlib.util
import json
import logging
import os
import re

__all__ = [
    "HubUnavailableError",
    "cached_snapshot",
    "download_command",
    "hf_hub_cache_dir",
    "is_repo_id",
    "lora_snapshot",
    "model_index_snapshot",
    "model_patterns",
    "model_snapshot",
    "transformer_snapshot",
]

logger = logging.getLogger(__name__)

MODEL_INDEX = "model_index.json"
#: never fetched: pickles (unpickling runs code), GGUF, other frameworks' weights, the transformers
#: ``.bin`` index, and anything nested below a component folder
NEVER = [
    "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle", "*.gguf", "*.msgpack", "*.h5",
    "*.onnx", "*.bin.index.json", "*/*/*",
]  # fmt: skip
#: what a component folder holds that its loader reads: configs (``config.json``,
#: ``scheduler_config.json``, ``tokenizer_config.json``, ``*.safetensors.index.json``...) and
#: tokenizer files (``merges.txt``, ``spiece.model``, ``chat_template.jinja``)
COMPONENT_FILES = ("*.json", "*.txt", "*.model", "*.jinja")
#: weight files of a component: diffusers' and transformers' names, one file or standard shards
WEIGHT_BASENAMES = ("diffusion_pytorch_model", "model")
LORA_FILES = ["*.safetensors", "adapter_config.json"]
#: a transformer repo (one diffusers component folder at its root): configs and weights
TRANSFORMER_FILES = ["*.json", "*.safetensors"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*")
_DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


class HubUnavailableError(FileNotFoundError):
    """A Hub repo is not in the local cache and could not be downloaded (or downloading is off).

    Attributes:
        repo_id, revision: what was asked for.
        cache: the cache folder searched.
        reason: why nothing could be downloaded (offline, unreachable, no such repo...).
        command: the shell command that downloads it (``hf download owner/name``).
    """

    def __init__(
        self, message: str, repo_id: str = "", cache: str = "", reason: str = "", command: str = ""
    ):
        super().__init__(message)
        self.message = message
        self.repo_id = repo_id
        self.cache = cache
        self.reason = reason
        self.command = command

    def __str__(self) -> str:
        return self.message


def hf_hub_cache_dir() -> str:
    """The Hugging Face Hub cache folder, resolved from the environment now.

    The precedence of ``huggingface_hub.constants``: ``$HF_HUB_CACHE``, else the legacy
    ``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, with ``$HF_HOME`` defaulting to
    ``$XDG_CACHE_HOME/huggingface`` (``~/.cache/huggingface``); ``~`` and ``$VARS`` expanded.
    The library computes these once, when it is imported; read here at each call, a process
    whose environment changes later (a test, an embedding application) looks where it says.
    """
    home = os.getenv(
        "HF_HOME",
        os.path.join(os.getenv("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"),
    )
    home = os.path.expandvars(os.path.expanduser(home))
    legacy = os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    return os.path.expandvars(os.path.expanduser(os.getenv("HF_HUB_CACHE", legacy)))


def is_repo_id(path: str) -> bool:
    """Whether ``path`` is spelled like a Hub model repo id, ``owner/name`` (no ``..``, no
    ``--``, at most 96 characters, as the Hub requires), and is not an existing local path."""
    return (
        isinstance(path, str)
        and _REPO_ID.fullmatch(path) is not None
        and ".." not in path
        and "--" not in path
        and len(path) <= 96
        and not os.path.exists(path)
    )


def download_command(repo_id: str, revision: str | None = None, filename: str | None = None) -> str:
    """The command of the installed ``huggingface_hub`` that downloads ``repo_id`` into the cache:
    ``hf download`` (``huggingface_hub`` >= 0.34), else ``huggingface-cli download``."""
    try:
        has_hf = importlib.util.find_spec("huggingface_hub.cli") is not None
    except (ImportError, ValueError):
        has_hf = False
    cmd = f"{'hf' if has_hf else 'huggingface-cli'} download {repo_id}"
    if filename:
        cmd += f" {filename}"
    if revision:
        cmd += f" --revision {revision}"
    return cmd


def cached_snapshot(repo_id: str) -> str:
    """The snapshot folder of ``repo_id``'s default revision in the local Hub cache.

    Args:
        repo_id: ``owner/name``.

    Returns:
        The folder (``<cache>/models--owner--name/snapshots/<commit>``).

    Raises:
        FileNotFoundError: not in the local cache (or not a valid repo id); nothing is
            downloaded. The message names the repo id and the cache folder.
    """
    from huggingface_hub import snapshot_download

    cache = hf_hub_cache_dir()
    try:
        return snapshot_download(repo_id, cache_dir=cache, local_files_only=True)
    except Exception as e:  # LocalEntryNotFoundError, an invalid id...: all mean "not cached"
        raise FileNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache at {cache} (nothing is downloaded)"
        ) from e


# ---------------------------------------------------------------------------------- snapshots
def _errors() -> dict[str, tuple[type, ...]]:
    """The library's error classes by kind (those an installed version lacks are left out)."""
    import huggingface_hub.errors as hf_errors

    def some(*names: str) -> tuple[type, ...]:
        return tuple(getattr(hf_errors, n) for n in names if hasattr(hf_errors, n))

    return {
        "offline": some("OfflineModeIsEnabled"),
        "revision": some("RevisionNotFoundError"),
        "repo": some("RepositoryNotFoundError", "GatedRepoError", "DisabledRepoError"),
        "incomplete": some("IncompleteSnapshotError"),
        "invalid": some("HFValidationError"),
        "http": some("HfHubHTTPError"),
    }


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _is_connection_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(
        names
        & {
            "ConnectError", "ConnectTimeout", "ConnectionError", "TimeoutException", "Timeout",
            "ReadTimeout", "NetworkError", "ProtocolError", "RemoteProtocolError",
        }
    ) or isinstance(e, ConnectionError | TimeoutError)  # fmt: skip


def _reason(e: BaseException, revision: str | None, partial: bool = False) -> str:
    """Why ``snapshot_download`` failed, in a few words (no traceback, no newline)."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    kinds = _errors()
    chain = _chain(e)

    def has(kind: str) -> BaseException | None:
        return next((x for x in chain if kinds[kind] and isinstance(x, kinds[kind])), None)

    if has("invalid") is not None:
        return "not a valid repo id"
    if has("revision") is not None:
        return f"the Hub at {endpoint} has no revision {revision!r} of it"
    if has("repo") is not None:
        return (
            f"the Hub at {endpoint} has no such repo, or it is private or gated and needs a "
            "token: set HF_TOKEN or run `hf auth login`"
        )
    # a snapshot cached in part (an interrupted download, another file selection) says so
    partial = partial or has("incomplete") is not None
    part = "the cached snapshot lacks some files and " if partial else ""
    if has("offline") is not None or constants.HF_HUB_OFFLINE:
        return f"{part}HF_HUB_OFFLINE is set: nothing is downloaded"
    conn = next((x for x in chain if _is_connection_error(x)), None)
    if conn is not None:
        return f"{part}the Hub at {endpoint} could not be reached: {_first_line(conn)}"
    if part:
        return f"{part}the Hub at {endpoint} could not be reached"
    http = has("http")
    if http is not None:
        status = getattr(getattr(http, "response", None), "status_code", None)
        return f"the Hub at {endpoint} answered HTTP {status}" if status else _first_line(http)
    return _first_line(e)


def _unavailable(what: str, repo_id: str, revision: str | None, reason: str, command: str):
    cache = hf_hub_cache_dir()
    rev = f" (revision {revision!r})" if revision else ""
    return HubUnavailableError(
        f"{what} {repo_id!r}{rev} is not in the local Hugging Face cache at {cache} and could "
        f"not be downloaded ({reason}); download it with `{command}`, or pass a local path",
        repo_id,
        cache,
        reason,
        command,
    )


def _snapshot(
    what: str,
    repo_id: str,
    revision: str | None,
    allow: list[str],
    ignore: list[str] | None = None,
    local_only: bool = False,
    command: str | None = None,
    shown_revision: str | None = ...,  # type: ignore[assignment]
) -> str:
    """``snapshot_download`` of the matching files into :func:`hf_hub_cache_dir`.

    Raises:
        HubUnavailableError: not cached and not downloadable (the message says why).
    """
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=hf_hub_cache_dir(),
            allow_patterns=allow,
            ignore_patterns=ignore,
            local_files_only=local_only,
        )
    except Exception as e:
        if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
            raise  # the cache folder's disk (full, read-only, not ours): not the Hub's
        partial = _cached_snapshot_dir(repo_id, revision) is not None
        reason = "downloading is off here" if local_only else _reason(e, revision, partial)
        shown = revision if shown_revision is ... else shown_revision
        raise _unavailable(
            what, repo_id, shown, reason, command or download_command(repo_id, shown)
        ) from e


def _cached_snapshot_dir(repo_id: str, revision: str | None) -> str | None:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (a commit, or a ref recorded
    in the cache), if there is one."""
    repo = os.path.join(hf_hub_cache_dir(), "models--" + repo_id.replace("/", "--"))
    commit = revision or "main"
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        try:
            with open(os.path.join(repo, "refs", commit), encoding="utf-8") as f:
                commit = f.read().strip()
        except OSError:
            return None
    folder = os.path.join(repo, "snapshots", commit)
    return folder if os.path.isdir(folder) else None


def model_patterns(components: list[str]) -> tuple[list[str], list[str]]:
    """``(allow_patterns, ignore_patterns)`` of a model's files: ``model_index.json`` and, per
    component folder, its configs, tokenizer files and safetensors weights (one file or standard
    shards). Names that are not plain folder names are left out (their loader reports them)."""
    allow = [MODEL_INDEX]
    for comp in components:
        if not _COMPONENT.fullmatch(comp) or ".." in comp:
            continue
        c = glob.escape(comp)
        allow += [f"{c}/{p}" for p in COMPONENT_FILES]
        for base in WEIGHT_BASENAMES:
            allow += [f"{c}/{base}.safetensors", f"{c}/{base}-*-of-*.safetensors"]
    return allow, list(NEVER)


def _components(snapshot: str) -> list[str]:
    """The component folders ``model_index.json`` names (``[library, class]`` entries)."""
    try:
        with open(os.path.join(snapshot, MODEL_INDEX), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return []  # the model loader reports the file
    if not isinstance(data, dict):
        return []
    return [
        k
        for k, v in data.items()
        if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v != [None, None]
    ]


def _unlisted_shards(snapshot: str, components: list[str]) -> list[str]:
    """Weight files a component's ``*.safetensors.index.json`` names that are not there yet
    (shards with other than the standard names), as repo paths."""
    out = []
    for comp in components:
        if not _COMPONENT.fullmatch(comp) or ".." in comp:
            continue
        for base in WEIGHT_BASENAMES:
            index = os.path.join(snapshot, comp, f"{base}.safetensors.index.json")
            try:
                with open(index, encoding="utf-8") as f:
                    files = set(json.load(f).get("weight_map", {}).values())
            except (OSError, ValueError, AttributeError, TypeError):
                continue
            for name in sorted(f for f in files if isinstance(f, str)):
                ok = name.endswith(".safetensors") and "/" not in name and ".." not in name
                if ok and not os.path.isfile(os.path.join(snapshot, comp, name)):
                    out.append(f"{comp}/{name}")
    return out


def model_index_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The snapshot folder of ``repo_id`` at ``revision`` holding its ``model_index.json``
    (downloaded when needed; the other files are fetched by :func:`model_snapshot`).

    Raises:
        HubUnavailableError: not cached and not downloadable.
    """
    return _snapshot("model", repo_id, revision, [MODEL_INDEX])


def model_snapshot(repo_id: str, revision: str | None = None) -> str:
    """The snapshot folder of model ``repo_id`` at ``revision`` (a branch, tag or commit; default
    the repo's default branch), downloading the files the engine reads that are missing.

    Online, the Hub says which commit ``revision`` is and only missing files are fetched; offline
    (``HF_HUB_OFFLINE=1``) or when the Hub cannot be reached, the cached snapshot is used without
    any request.

    Raises:
        HubUnavailableError: not (completely) cached and not downloadable; the message names the
            repo id, the cache folder and the command that downloads it.
    """
    snapshot = model_index_snapshot(repo_id, revision)
    commit = os.path.basename(os.path.normpath(snapshot))  # the same files for what follows
    components = _components(snapshot)
    allow, ignore = model_patterns(components)
    command = download_command(repo_id, revision)
    if not _is_complete(snapshot, components):
        logger.info("fetching %s (%s) into %s", repo_id, revision or "main", hf_hub_cache_dir())
    # the commit the revision named: the rest comes from the same files, with no second look-up
    kw = dict(command=command, shown_revision=revision)
    snapshot = _snapshot("model", repo_id, commit, allow, ignore, **kw)
    extra = _unlisted_shards(snapshot, components)
    if extra:
        _snapshot("model", repo_id, commit, [glob.escape(p) for p in extra], **kw)
    return snapshot


def _is_complete(snapshot: str, components: list[str]) -> bool:
    """Whether every component folder is there (for the log line only)."""
    return all(os.path.isdir(os.path.join(snapshot, c)) for c in components)


def lora_snapshot(repo_id: str, filename: str | None = None, download: bool = False) -> str:
    """The snapshot folder of LoRA ``repo_id`` (default branch) holding its top-level
    ``*.safetensors`` files and ``adapter_config.json``, or only ``filename``.

    The cache is used when it has them (no request); otherwise they are downloaded when
    ``download`` is true.

    Raises:
        HubUnavailableError: not cached, and ``download`` is false (``reason`` says downloading
            is off) or the download failed.
    """
    if filename is not None:
        allow, ignore = [glob.escape(filename)], None
    else:
        allow, ignore = list(LORA_FILES), ["*/*"]
    command = download_command(repo_id, filename=filename)
    try:
        snapshot = _snapshot("LoRA", repo_id, None, allow, ignore, local_only=True, command=command)
        if not download or _has_lora_files(snapshot, filename):
            return snapshot
    except HubUnavailableError:
        if not download:
            raise
    logger.info("fetching LoRA %s into %s", repo_id, hf_hub_cache_dir())
    return _snapshot("LoRA", repo_id, None, allow, ignore, command=command)


def _has_lora_files(snapshot: str, filename: str | None) -> bool:
    """Whether a cached LoRA snapshot holds ``filename``, or any top-level ``.safetensors``."""
    if filename is not None:
        return os.path.isfile(os.path.join(snapshot, filename))
    try:
        return any(n.endswith(".safetensors") for n in os.listdir(snapshot))
    except OSError:
        return False


def transformer_snapshot(
    repo_id: str, filename: str | None = None, revision: str | None = None
) -> str:
    """The snapshot folder of transformer repo ``repo_id`` at ``revision`` (default branch)
    holding its top-level ``*.json`` and ``*.safetensors`` files, or only ``filename``; fetched
    as a model is (online, the Hub says which commit the revision is and missing files are
    downloaded; offline, the cache answers).

    Raises:
        HubUnavailableError: not cached and not downloadable.
    """
    if filename is not None:
        allow, ignore = [glob.escape(filename)], list(NEVER)
    else:
        allow, ignore = list(TRANSFORMER_FILES), [*NEVER, "*/*"]
    command = download_command(repo_id, revision, filename)
    return _snapshot("transformer", repo_id, revision, allow, ignore, command=command)
