"""Hub ids: models and LoRA adapters from the local Hugging Face cache, never downloaded.

A model (``--model-path``), a LoRA (``lora_path``) or ``--model-type`` detection may name a Hub
repo id (``owner/name``). It is resolved by ``huggingface_hub`` itself
(``snapshot_download(..., local_files_only=True)``: ``refs/main``, the snapshot folder, the cache
layout), in the cache folder the library uses (:func:`hf_hub_cache_dir`). Nothing here imports
torch or another module of this package.
"""

from __future__ import annotations

import os

__all__ = ["cached_snapshot", "hf_hub_cache_dir"]


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
