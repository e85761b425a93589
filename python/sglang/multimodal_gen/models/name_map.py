"""One declarative name map per model, shared by the base-weight loader and the LoRA loader.

A checkpoint (diffusers layout, or the model's original layout) names modules differently from our
implementation, which fuses some projections (q/k/v into one ``QKVParallelLinear``, gate/up into one
``MergedColumnParallelLinear``). A :class:`NameMap` turns any known module name into
``(our_module_name, shard_id)`` where ``shard_id`` is the key of the target layer's shard map
(``None`` for the whole layer, ``"q"|"k"|"v"`` or an int for a fused section).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

ShardId = int | str | None
# several consecutive shards of one fused layer, in row order (a source module that covers e.g.
# the q, k and v sections of a fused [q | k | v | mlp] layer but not the mlp one)
ShardGroup = tuple[int | str, ...]


@dataclass(frozen=True)
class NameRule:
    """Rename one module-name segment sequence.

    ``source`` and ``target`` are dotted module-name fragments matched on segment boundaries, e.g.
    ``source="attention.to_q"``, ``target="attention.to_qkv"``, ``shard_id="q"``: the module
    ``layers.3.attention.to_q`` resolves to ``("layers.3.attention.to_qkv", "q")``.
    ``prefix_only`` rules match at the start of the name only (e.g. ``final_layer.`` ->
    ``all_final_layer.2-1.``).

    ``shard_id`` may also be a :data:`ShardGroup` (a tuple of consecutive shard ids in row order):
    the source module's output rows are those shards stacked (only LoRA files use such names).

    ``row_order``: the source layout stores the module's output rows as ``len(row_order)`` equal
    chunks in another order; chunk ``i`` of ours is chunk ``row_order[i]`` of the source (BFL's
    ``final_layer.adaLN_modulation.1`` is ``(shift, scale)`` where diffusers' ``norm_out.linear``
    is ``(scale, shift)``: ``(1, 0)``). A rename cannot do this; whoever loads output-row data of
    such a module (weight rows, bias, a LoRA ``B`` and its bias, never a LoRA ``A``) reorders it,
    reading the order from :meth:`NameMap.row_order`.
    """

    source: str
    target: str
    shard_id: ShardId | ShardGroup = None
    prefix_only: bool = False
    row_order: tuple[int, ...] | None = None

    @staticmethod
    def _rename(name: str, old: str, new: str, prefix_only: bool) -> str | None:
        """``name`` with the segment sequence ``old`` replaced by ``new``, or ``None``."""
        if prefix_only:
            if name == old or name.startswith(old + "."):
                return new + name[len(old) :]
            return None
        # match on dotted segment boundaries anywhere in the name
        m = re.search(r"(^|\.)" + re.escape(old) + r"(?=$|\.)", name)
        if m is None:
            return None
        start = m.start() + len(m.group(1))
        return name[:start] + new + name[m.end() :]

    def apply(self, name: str) -> tuple[str, ShardId] | None:
        """``(renamed, shard_id)`` if this rule matches ``name``, else ``None``."""
        out = self._rename(name, self.source, self.target, self.prefix_only)
        return None if out is None else (out, self.shard_id)

    def invert(self, name: str) -> str | None:
        """The source-side spelling of an already renamed ``name`` (``None`` if no match)."""
        return self._rename(name, self.target, self.source, self.prefix_only)


@dataclass(frozen=True)
class ParamRename:
    """Rename one whole *parameter* name, module path and leaf together, where a module
    :class:`NameRule` cannot: ``resolve_param`` renames only the module part and keeps the leaf.

    E.g. a bare block parameter (Wan's ``blocks.N.modulation`` -> ``blocks.N.scale_shift_table``)
    or a leaf of another name (BFL's ``...query_norm.scale`` -> ``...norm_q.weight``).
    ``pattern`` is a regular expression fully matched against the parameter name (wrapper
    prefixes already stripped); ``target`` is its ``re`` replacement template, the final name of
    our parameter (no rule runs after it; the shard is ``None``).
    """

    pattern: str
    target: str

    def apply(self, param_name: str) -> str | None:
        """Our parameter name if ``pattern`` matches the whole ``param_name``, else ``None``."""
        m = re.fullmatch(self.pattern, param_name)
        return None if m is None else m.expand(self.target)


class NameMap:
    """Resolver from checkpoint module names to our module names and shard ids.

    Args:
        rules: rename rules, applied in order, each to the name as the rules before it left it
            (so an original-layout rename can feed a split -> fused rule); the shard id of the
            last shard-producing rule that matched is the result's.
        strip_prefixes: leading prefixes that wrap the model's own names in checkpoints
            (``"model.diffusion_model."``, ...); removed before the rules run.
        param_renames: :class:`ParamRename` entries tried (in order) on whole parameter names
            by ``resolve_param`` before the module rules.
        unused: regular expressions (fully matched, wrapper prefix stripped) naming tensors a
            checkpoint layout carries but the model does not use (e.g. a parameter of a module
            its forward never calls); the weight loader skips them (:meth:`is_unused`).

    ``resolve(name)`` accepts module names (no ``.weight``/``.bias`` suffix); ``resolve_param``
    accepts parameter names and keeps the suffix.
    """

    def __init__(
        self,
        rules: Iterable[NameRule],
        strip_prefixes: Iterable[str] = (),
        param_renames: Iterable[ParamRename] = (),
        unused: Iterable[str] = (),
    ):
        self.rules = tuple(rules)
        self.strip_prefixes = tuple(strip_prefixes)
        self.param_renames = tuple(param_renames)
        self.unused = tuple(unused)

    def _strip(self, name: str) -> str:
        for p in self.strip_prefixes:
            if name.startswith(p):
                return name[len(p) :]
        return name

    def _walk(self, name: str) -> tuple[str, ShardId | ShardGroup, tuple[int, ...] | None]:
        name = self._strip(name)
        shard_id: ShardId | ShardGroup = None
        row_order: tuple[int, ...] | None = None
        for rule in self.rules:
            out = rule.apply(name)
            if out is None:
                continue
            name, sid = out
            if sid is not None:
                shard_id = sid
            if rule.row_order is not None:
                row_order = rule.row_order
        return name, shard_id, row_order

    def resolve(self, name: str) -> tuple[str, ShardId | ShardGroup]:
        """Map a checkpoint module name to ``(our_module_name, shard_id)``.

        Names no rule touches map to themselves with ``shard_id=None``.
        """
        name, shard_id, _ = self._walk(name)
        return name, shard_id

    def row_order(self, name: str) -> tuple[int, ...] | None:
        """The :attr:`NameRule.row_order` of the rules ``name`` resolves through (``None``: the
        source rows are in our order)."""
        return self._walk(name)[2]

    def is_unused(self, param_name: str) -> bool:
        """Whether the checkpoint tensor ``param_name`` is one the model does not use
        (an ``unused`` pattern matches it)."""
        stripped = self._strip(param_name)
        return any(re.fullmatch(p, stripped) for p in self.unused)

    def resolve_param(self, param_name: str) -> tuple[str, ShardId | ShardGroup]:
        """Like :meth:`resolve` for a parameter name ``<module>.<param>`` (``weight``, ``bias``...).

        The wrapper prefix is stripped first (so a bare top-level parameter under it,
        ``model.diffusion_model.scale_shift_table``, is not mistaken for a module); then the
        first matching :class:`ParamRename` gives the name (shard ``None``), else the module
        part goes through the rules and the leaf is kept."""
        param_name = self._strip(param_name)
        for rename in self.param_renames:
            out = rename.apply(param_name)
            if out is not None:
                return out, None
        module, _, leaf = param_name.rpartition(".")
        if not module:
            return param_name, None
        mapped, shard_id = self.resolve(module)
        return f"{mapped}.{leaf}", shard_id


@dataclass(frozen=True)
class BlockRule(NameRule):
    """A :class:`NameRule` that renames only inside the blocks of one family.

    Matches names ``<blocks>.<index>.<source>[.<rest>]`` (``source`` right after the block index)
    and rewrites them to ``<blocks>.<index>.<target>[.<rest>]``; ``prefix_only`` is implied.
    E.g. ``BlockRule("attn.to_q", "to_qkv_mlp", 0, blocks="single_transformer_blocks")`` maps
    ``single_transformer_blocks.7.attn.to_q`` to ``("single_transformer_blocks.7.to_qkv_mlp", 0)``
    and leaves ``transformer_blocks.7.attn.to_q`` alone.
    """

    blocks: str = ""

    def _in_block(self, name: str, old: str, new: str) -> str | None:
        m = re.match(re.escape(self.blocks) + r"\.\d+\.", name)
        if m is None:
            return None
        out = self._rename(name[m.end() :], old, new, True)
        return None if out is None else name[: m.end()] + out

    def apply(self, name: str) -> tuple[str, ShardId] | None:
        out = self._in_block(name, self.source, self.target)
        return None if out is None else (out, self.shard_id)

    def invert(self, name: str) -> str | None:
        return self._in_block(name, self.target, self.source)
