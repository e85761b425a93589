"""What a client may see of the server's file system: nothing but its own words.

Answers never carry the server's absolute paths (where the model lives, where the LoRA roots
are, the Hugging Face cache, the user the server runs as). :class:`PublicPaths` is applied where
the engine's words leave the server:

- an adapter's path in ``/v1/list_loras`` and the LoRA admin answers (:meth:`lora_path`): a path
  inside a ``--lora-dir`` root relative to that root (what a client sends to ``set_lora``), a
  relative path or a Hub id as given, any other absolute path (a startup ``--lora-path`` from
  elsewhere) by its last component only;
- every other text of those answers and every error message (:meth:`scrub`): the model's
  directory, the LoRA roots and the Hub cache are replaced, wherever they appear, by
  ``<model>``, the path relative to the root, and ``<hf-cache>``.

``/v1/models`` reports the served name (``root`` included), never ``--model-path``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["PATH_KEYS", "PublicPaths"]

#: Keys whose string values in the engine's LoRA reports are adapter paths.
PATH_KEYS = frozenset({"path", "source", "lora_path"})


def _spellings(path: str) -> set[str]:
    """The ways ``path`` may appear in a message: as given (absolute), and resolved."""
    if not path:
        return set()
    expanded = os.path.abspath(os.path.expanduser(path))
    out = {expanded.rstrip(os.sep) or os.sep, os.path.realpath(expanded).rstrip(os.sep) or os.sep}
    return {p for p in out if p != os.sep}  # "/" would replace every slash


class PublicPaths:
    """The server's directories, and how they are shown to clients.

    Args:
        lora_roots: the ``--lora-dir`` roots.
        model_path: ``--model-path`` (a directory; a Hub id is not a path and is left alone).
        hidden: more directories never shown (the Hugging Face cache), replaced by ``<name>``
            as ``{name: directory}``.
    """

    def __init__(
        self,
        lora_roots: Iterable[str] = (),
        model_path: str | None = None,
        hidden: dict[str, str] | None = None,
    ):
        self.roots = sorted(
            {s for r in lora_roots for s in _spellings(os.fspath(r))}, key=len, reverse=True
        )
        replacements: dict[str, str] = {}
        for name, folder in (hidden or {}).items():
            for s in _spellings(folder):
                replacements[s] = f"<{name}>"
        if model_path and os.path.isdir(model_path):
            for s in _spellings(model_path):
                replacements[s] = "<model>"
        for root in self.roots:
            replacements[root] = ""  # the rest of the path is what a client sends
        self._replacements = replacements
        ordered = sorted(replacements, key=len, reverse=True)  # longest first: nested folders
        # a directory, not a prefix of a longer name (/srv/lora is not in /srv/loras2)
        self._pattern = (
            re.compile("|".join(f"{re.escape(p)}(?![^/\\s'\"),;:])/?" for p in ordered))
            if ordered
            else None
        )

    def lora_path(self, path: str) -> str:
        """How an adapter's ``path`` is shown (see the module docstring)."""
        expanded = os.path.expanduser(path)
        if not os.path.isabs(expanded):
            return path  # relative, or a Hub id: the client's own words
        for candidate in (os.path.normpath(expanded), os.path.realpath(expanded)):
            for root in self.roots:
                if candidate == root:
                    return "."
                if candidate.startswith(root + os.sep):
                    return candidate[len(root) + 1 :]
        return os.path.basename(os.path.normpath(expanded)) or "."

    def scrub(self, text: str) -> str:
        """``text`` with every hidden directory replaced (see the module docstring)."""
        if self._pattern is None or not text:
            return text

        def replace(m: re.Match) -> str:
            found = m.group(0)
            base = found[:-1] if found.endswith("/") and found[:-1] in self._replacements else found
            shown = self._replacements[base]
            if shown == "":  # a LoRA root: relative to it
                return "" if found.endswith("/") else "."
            return shown + ("/" if found.endswith("/") else "")

        return self._pattern.sub(replace, text)

    def report(self, value: Any, key: str | None = None) -> Any:
        """A JSON-able engine answer (``list_loras``, an admin call's result) as a client sees
        it: adapter paths by :meth:`lora_path`, every other text by :meth:`scrub`."""
        if isinstance(value, dict):
            return {k: self.report(v, k if isinstance(k, str) else None) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.report(v, key) for v in value]
        if isinstance(value, str):
            return self.lora_path(value) if key in PATH_KEYS else self.scrub(value)
        return value
