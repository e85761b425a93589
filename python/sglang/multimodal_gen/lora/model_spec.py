"""What the LoRA format adapter needs to know about a target model.

:class:`LoRAModelSpec` lists the model's LoRA-able modules in OUR naming with the full (unsharded)
``(out, in)`` shape of each output shard, plus the model's
:class:`~sglang.multimodal_gen.models.name_map.NameMap`. From these it derives the *vocabulary*:
every module name a LoRA file may use for one of our modules (our fused name, the diffusers name,
the original-checkpoint name), each mapped to ``(our_module, shard_id)``. Kohya-style flattened
names (``layers_0_attention_to_q``) are looked up in the same vocabulary after flattening it, so
un-flattening never guesses where underscores were dots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch.nn as nn

from sglang.multimodal_gen.models.name_map import NameMap, ShardGroup, ShardId

__all__ = ["LoRAModelSpec", "shard_order_key"]

_QKV_ORDER = {"q": 0, "k": 1, "v": 2}


def _has_shards(shards: Mapping[ShardId, object], sid: ShardId | ShardGroup) -> bool:
    """Whether ``sid`` (``None``: the whole layer; a shard id; a tuple of them) names shards of a
    layer with ``shards``."""
    if sid is None:
        return True
    if isinstance(sid, tuple):
        return bool(sid) and all(s in shards for s in sid)
    return sid in shards


def shard_order_key(shard_id: ShardId) -> tuple[int, int, str]:
    """Sort key giving the row order of shards in a fused weight: None, then q,k,v, then 0,1,..."""
    if shard_id is None:
        return (0, 0, "")
    if isinstance(shard_id, int):
        return (2, shard_id, "")
    return (1, _QKV_ORDER.get(shard_id, 99), str(shard_id))


@dataclass
class LoRAModelSpec:
    """The LoRA-able surface of one model (one pipeline component).

    Attributes:
        module_shapes: ``{our_module_name: {shard_id: (out_features, in_features)}}``, full sizes.
            A plain layer has the single shard ``None``; a fused layer lists its shards in row
            order (``"q","k","v"`` for QKV, ``0,1`` for gate/up).
        name_map: resolves file/diffusers/original module names to ``(our_module, shard_id)``;
            ``None`` means file names must equal our names.
        model_name: used in error messages (``"Z-Image"``).
    """

    module_shapes: dict[str, dict[ShardId, tuple[int, int]]]
    name_map: NameMap | None = None
    model_name: str = "model"
    _extra_names: dict[str, tuple[str, ShardId]] = field(default_factory=dict, repr=False)

    @property
    def module_names(self) -> set[str]:
        return set(self.module_shapes)

    def shards(self, module: str) -> list[ShardId]:
        """The shard ids of ``module`` in row order of the fused weight."""
        return sorted(self.module_shapes[module], key=shard_order_key)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_shapes(
        cls,
        module_shapes: Mapping[str, Mapping[ShardId, tuple[int, int]]],
        name_map: NameMap | None = None,
        model_name: str = "model",
    ) -> LoRAModelSpec:
        """Build from ``{name: {shard_id: (out, in)}}`` (copied; shards sorted into row order)."""
        shapes = {
            name: {
                sid: (int(s[0]), int(s[1]))
                for sid, s in sorted(shards.items(), key=lambda kv: shard_order_key(kv[0]))
            }
            for name, shards in module_shapes.items()
        }
        return cls(module_shapes=shapes, name_map=name_map, model_name=model_name)

    @classmethod
    def from_module(
        cls,
        module: nn.Module,
        name_map: NameMap | None = None,
        model_name: str | None = None,
    ) -> LoRAModelSpec:
        """Collect the linear layers of ``module`` and map their names through ``name_map``.

        Recognized layers: ``nn.Linear`` (one shard per mapped name: a diffusers model's ``to_q``,
        ``to_k``, ``to_v`` become the ``q``/``k``/``v`` shards of our ``to_qkv``), and our
        ``ParallelLinear`` family (anything with a ``shard_map`` and ``input_size``: each
        ``ShardSpec`` gives ``(full_size, input_size)``). A LoRA wrapper (an object with a
        ``base_layer``) is described by its base layer under the wrapper's name.

        Raises:
            ValueError: two layers map to the same ``(module, shard)``, or the model has no
                linear layer.
        """
        shapes: dict[str, dict[ShardId, tuple[int, int]]] = {}
        skip_prefixes: list[str] = []
        for name, mod in module.named_modules():
            if not name or any(name.startswith(p) for p in skip_prefixes):
                continue
            base = getattr(mod, "base_layer", None)
            if isinstance(base, nn.Module):
                skip_prefixes.append(name + ".")
                mod = base
            if hasattr(mod, "shard_map") and hasattr(mod, "input_size"):
                our = name_map.resolve(name)[0] if name_map is not None else name
                entry = shapes.setdefault(our, {})
                specs = sorted(mod.shard_map, key=lambda s: s.full_offset)
                for spec in specs:
                    entry[spec.shard_id] = (int(spec.full_size), int(mod.input_size))
                continue
            if isinstance(mod, nn.Linear):
                our, sid = name_map.resolve(name) if name_map is not None else (name, None)
                entry = shapes.setdefault(our, {})
                if sid in entry:
                    raise ValueError(f"two layers map to module {our!r} shard {sid!r}")
                entry[sid] = (int(mod.out_features), int(mod.in_features))
        if not shapes:
            raise ValueError(f"{type(module).__name__} has no linear layer a LoRA could target")
        return cls.from_shapes(shapes, name_map, model_name or type(module).__name__)

    # -- vocabulary -----------------------------------------------------------------------------

    def _inverse_candidates(self, our_name: str) -> set[str]:
        """Names that might resolve to ``our_name`` by undoing name-map rules (closure, depth 3)."""
        seen = {our_name}
        if self.name_map is None:
            return seen
        frontier = [our_name]
        for _ in range(3):
            nxt = []
            for name in frontier:
                for rule in self.name_map.rules:
                    cand = rule.invert(name)
                    if cand is None:
                        continue
                    if cand not in seen:
                        seen.add(cand)
                        nxt.append(cand)
            frontier = nxt
        return seen

    @cached_property
    def vocabulary(self) -> dict[str, tuple[str, ShardId]]:
        """``{file_module_name: (our_module, shard_id)}`` for every accepted spelling.

        Includes our own names (shard ``None``: the whole, possibly fused, layer), and every name
        the name map resolves onto one of our modules with a shard this module has.
        """
        vocab: dict[str, tuple[str, ShardId]] = {}
        for our in self.module_shapes:
            vocab[our] = (our, None)
            for cand in self._inverse_candidates(our):
                if cand == our:
                    continue
                res = self.name_map.resolve(cand)
                if res[0] != our:
                    continue
                if not _has_shards(self.module_shapes[our], res[1]):
                    continue
                vocab.setdefault(cand, res)
        for k, v in self._extra_names.items():
            vocab.setdefault(k, v)
        return vocab

    @cached_property
    def flat_vocabulary(self) -> dict[str, str | None]:
        """Kohya spelling ``{name with . -> _: dotted vocabulary name}``; ``None`` marks a collision
        (two names that flatten alike but resolve to different targets)."""
        vocab = self.vocabulary
        flat: dict[str, str | None] = {}
        for name, target in vocab.items():
            key = name.replace(".", "_")
            if key not in flat:
                flat[key] = name
            elif flat[key] is not None and vocab[flat[key]] != target:
                flat[key] = None
        return flat

    def lookup(self, file_module: str) -> tuple[str, ShardId | ShardGroup] | None:
        """Resolve a dotted file module name (prefixes already removed), or None.

        The shard is ``None`` (the whole layer), one shard id, or a tuple of consecutive shard ids
        (a file module covering several sections of a fused layer)."""
        hit = self.vocabulary.get(file_module)
        if hit is not None:
            return hit
        if self.name_map is not None:
            our, sid = self.name_map.resolve(file_module)
            if our in self.module_shapes and _has_shards(self.module_shapes[our], sid):
                return our, sid
        return None

    def row_order(self, file_module: str) -> tuple[int, ...] | None:
        """How the file stores ``file_module``'s output rows when its layout differs from ours
        (``NameMap.row_order``: chunk ``i`` of ours is chunk ``order[i]`` of the file); ``None``
        when the rows are in our order."""
        return None if self.name_map is None else self.name_map.row_order(file_module)
