"""The runner's LoRA plumbing: the manager over a pipeline's denoisers, and naming a request's
adapter as the cause of NaN/Inf output."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch

from sglang.multimodal_gen.errors import NonFiniteOutputError
from sglang.multimodal_gen.lora.manager import LoRAManager
from sglang.multimodal_gen.lora.per_request import LoRASelection
from sglang.multimodal_gen.models.registry import ModelFamily, resolve_object
from sglang.multimodal_gen.runtime.placement import merge_cache_device

__all__ = ["LARGE_LORA_SCALE", "blame_lora", "build_lora_manager", "field_selections"]


def build_lora_manager(
    denoisers: dict[str, torch.nn.Module],
    family: ModelFamily,
    lora_dirs: Sequence[str] | None = None,
    cpu_offload: bool = False,
    merge_cache_gb: float | None = None,
    max_loaded_gb: float | None = None,
    allow_hub_download: bool = False,
) -> LoRAManager:
    """The LoRA manager over the denoisers' LoRA-able layers.

    Args:
        denoisers: ``{component: module}`` of the pipeline (``transformer``, ``transformer_2``).
        family: their family (LoRA target names, name map, display name).
        lora_dirs: allowed roots for local LoRA paths; ``None``: any local path; empty: none
            (see :class:`LoRAManager`'s ``allowed_roots``).
        cpu_offload: the DiT weights live in host memory between commands (``--dit-cpu-offload``
            on CUDA): pre-merge snapshots and cached merges are kept in host memory too, so the
            accelerator holds one copy of the model.
        merge_cache_gb: bound of the merge cache in GiB (``--lora-merge-cache-gb``; default 1).
            It is kept in host memory when the accelerator could not hold it next to what is
            free now (:func:`merge_cache_device`).
        max_loaded_gb: bound of the loaded adapters in GiB (``--max-loaded-lora-gb``; default 8).
        allow_hub_download: Hub LoRA ids missing from the local cache are downloaded
            (``--enable-hub-lora``; see :class:`LoRAManager`).
    """
    cache_bytes = int((1.0 if merge_cache_gb is None else merge_cache_gb) * 2**30)
    kw: dict = dict(merge_cache_bytes=cache_bytes)
    if max_loaded_gb is not None:
        kw["max_loaded_bytes"] = int(max_loaded_gb * 2**30)
    if cpu_offload:
        kw.update(snapshot_device="cpu", merge_cache_device="cpu")
    else:
        weight = next(iter(denoisers.values())).parameters().__next__()
        kw["merge_cache_device"] = merge_cache_device(weight.device, cache_bytes)
    targets = {family.denoiser(c).lora_target: m for c, m in denoisers.items()}
    return LoRAManager(
        targets,
        resolve_object(family.denoisers[0].name_map),
        allowed_roots=None if lora_dirs is None else list(lora_dirs),
        model_name=family.display_name,
        allow_hub_download=allow_hub_download,
        **kw,
    )


def field_selections(manager: LoRAManager, params) -> dict[str, LoRASelection]:
    """``{field: selection}`` of the request's adapter fields other than ``lora`` (fields of
    kind ``lora`` a family declares, e.g. LTX-2's ``stage_2_lora``) that are set; ``{}`` when
    none is. The family's pipeline takes them as ``lora_fields``.

    Raises:
        NotFoundError / InvalidRequestError: an unknown adapter or a bad entry (``param``
            names the field; :meth:`LoRAManager.selection`).
    """
    out = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name != "lora" and f.metadata.get("kind") == "lora" and value is not None:
            out[f.name] = manager.selection(value, f.name)
    return out


#: A per-request adapter scale this large is named as the likely cause of NaN/Inf output.
LARGE_LORA_SCALE = 100.0


@contextlib.contextmanager
def blame_lora(lora) -> Iterator[None]:
    """A :class:`NonFiniteOutputError` that names no field names ``lora`` when the request's
    own composition has an extreme scale (the pipeline checks guidance values only)."""
    try:
        yield
    except NonFiniteOutputError as e:
        big = [(n, s) for n, s in (lora or ()) if abs(s) >= LARGE_LORA_SCALE]
        if e.param is None and big:
            e.param = "lora"
            e.message += f" (adapter {big[0][0]!r} at scale {big[0][1]:g} is the likely cause)"
            e.args = (e.message,)
        raise
