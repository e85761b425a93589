"""From a path to a staged adapter: reading (once), reuse of an unchanged file, conversion.

Nothing here touches a layer. A file is read under the manager's path policy
(:func:`~sglang.multimodal_gen.lora.loading.read_source`); a ``set_lora`` that names the unchanged
file of a loaded adapter (same :func:`~sglang.multimodal_gen.lora.loading.file_key`) reads nothing;
a file that was rewritten is read, and reused anyway when its content digest is the same. Within
one ``set_lora`` call, a path named for several nicknames is read and converted once (each nickname
still gets its own copy on the layers).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sglang.multimodal_gen.errors import InvalidRequestError, LoRAPatternTooExpensiveError
from sglang.multimodal_gen.lora.adapters import Adapter, stage_adapter
from sglang.multimodal_gen.lora.formats import CanonicalLoRA, convert_to_canonical
from sglang.multimodal_gen.lora.limits import tensor_cap
from sglang.multimodal_gen.lora.loading import file_key, locate_source, read_source
from sglang.multimodal_gen.lora.model_spec import LoRAModelSpec
from sglang.multimodal_gen.lora.peft_config import PatternBudget

__all__ = ["UNCHANGED", "Stager"]

#: ``sources[path]`` value meaning "rank 0 checked: the file of the loaded adapter is unchanged".
UNCHANGED = "unchanged"


class Stager:
    """Reads and converts adapter files for the LoRA manager.

    Args:
        allowed_roots: directories local paths must resolve into (``None``: any; empty: none;
            see :class:`~sglang.multimodal_gen.lora.manager.LoRAManager`).
        specs: ``{target: LoRAModelSpec}``: what each target's layers accept.
        allow_hub_download: Hub ids missing from the local cache are downloaded (``trusted``
            reads download in every case).
    """

    def __init__(
        self,
        allowed_roots: Sequence[str] | None,
        specs: Mapping[str, LoRAModelSpec],
        allow_hub_download: bool = False,
    ):
        self.allowed_roots = None if allowed_roots is None else list(allowed_roots)
        self.allow_hub_download = bool(allow_hub_download)
        self.specs = dict(specs)
        self._uids = itertools.count()
        #: most tensors a file may hold for these targets (:func:`tensor_cap`)
        self.max_tensors = tensor_cap(
            len(shards) for spec in self.specs.values() for shards in spec.module_shapes.values()
        )

    def read_source(
        self, path: str, trusted: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Read one adapter as this manager's roots allow
        (:func:`~sglang.multimodal_gen.lora.loading.read_source`), holding at most
        :attr:`max_tensors` tensors; no layer is touched. TP rank 0
        reads each file once and sends the result to every rank (``set_lora(..., sources=...)``).
        The metadata gains ``file_key`` (see :meth:`unchanged`). A Hub id missing from the cache
        is downloaded first when this stager allows it (or the call is ``trusted``).
        """
        download = trusted or self.allow_hub_download
        # the key is taken before the read: a rewrite during the read makes the next call re-read
        key = file_key(locate_source(path, self.allowed_roots, trusted, download=download))
        sd, metadata = read_source(
            path, self.allowed_roots, trusted, download=download, max_tensors=self.max_tensors
        )
        metadata["file_key"] = key
        return sd, metadata

    def unchanged(self, adapter: Adapter | None, path: str, trusted: bool = False) -> bool:
        """Whether the loaded ``adapter`` was read from ``path`` and its files were not rewritten
        since (same :func:`~sglang.multimodal_gen.lora.loading.file_key`): a ``set_lora`` then
        reuses it without reading anything. Errors count as "changed" (the read reports them)."""
        if adapter is None or adapter.source != path or adapter.file_key is None:
            return False
        try:
            return file_key(locate_source(path, self.allowed_roots, trusted)) == adapter.file_key
        except Exception:
            return False

    def stage(
        self,
        nickname: str,
        path: str,
        loaded: Adapter | None,
        sources: Mapping[str, Any] | None,
        done: dict[str, tuple[dict, dict]] | None = None,
    ) -> tuple[Adapter, dict] | None:
        """Read (or take from ``sources``) and convert one file; ``None`` when ``loaded`` (the
        adapter loaded as ``nickname``, if any) is the same file, unchanged or with the same
        content. No layer is touched.

        ``done`` (``{path: (converted, metadata)}``, filled here) shares the read and the
        conversion between the nicknames of one call that name the same path."""
        given = None if sources is None else sources.get(path)
        if given == UNCHANGED or (given is None and self.unchanged(loaded, path)):
            return None
        if done is not None and path in done:
            converted, metadata = done[path]
        else:
            state_dict, metadata = given if given is not None else self.read_source(path)
            converted = self.convert(state_dict, metadata)
            if done is not None:
                done[path] = (converted, metadata)
        adapter = stage_adapter(
            nickname, f"{nickname}#{next(self._uids)}", path, converted, metadata
        )
        if loaded is not None and loaded.identity == adapter.identity:
            loaded.file_key = adapter.file_key  # same content (e.g. touched): keep the loaded one
            return None
        return adapter, converted

    # ------------------------------------------------------------------ conversion
    def convert(
        self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any]
    ) -> dict[str, CanonicalLoRA]:
        """The file converted for every target it matches (keys carry the component prefix,
        ``"transformer_2."``, or, as diffusers writes a second expert's file, the first one's).

        The adapter config's regular expressions get one time budget for all these conversions
        (:class:`~sglang.multimodal_gen.lora.peft_config.PatternBudget`).

        Raises:
            InvalidRequestError: it matches no target (the first target's reason).
            LoRAPatternTooExpensiveError: the config's patterns need more than their budget
                (raised at once: it is not a matter of the target).
        """
        converted: dict[str, CanonicalLoRA] = {}
        errors = []
        budget = PatternBudget()
        for tname, spec in self.specs.items():
            for component in dict.fromkeys((tname, "transformer")):
                try:
                    converted[tname] = convert_to_canonical(
                        state_dict, metadata, spec, component=component, pattern_budget=budget
                    )
                    break
                except LoRAPatternTooExpensiveError:
                    raise
                except InvalidRequestError as e:
                    errors.append(e)
        if not converted:
            err = errors[0]
            if err.param is None:
                err.param = "lora_path"
            raise err
        return converted
