"""The engine's command vocabulary, declared once.

Every command the engine runs is one :class:`EngineOp`: its name (the ``DiffusionEngine`` method,
the scheduler's call, the runner's ``cmd_<name>``), its HTTP route, whether it takes the admin key,
whether it needs the DiT weights on the accelerator (``--dit-cpu-offload`` moves them in only for
those), and whether it changes the LoRA state (all-or-nothing across TP ranks, written back to the
host copy under offload). The HTTP routes and auth (:mod:`~sglang.multimodal_gen.entrypoints.auth`),
the scheduler, the engine and the runner read this table; the routes are registered at the paths
and methods written here (``generate`` by ``entrypoints.images``, the admin calls by
``entrypoints.lora_admin``), so no other module spells them. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ADMIN_PATHS",
    "LORA_CHANGE_OPS",
    "OPS",
    "ROUTED_CALLS",
    "SCHEDULER_CALLS",
    "EngineOp",
    "get_op",
]


@dataclass(frozen=True)
class EngineOp:
    """One engine command.

    Attributes:
        name: method / command name.
        path: HTTP route (``None``: not an HTTP route of its own).
        method: HTTP method of ``path``.
        admin: the route takes ``--admin-api-key`` when one is configured.
        needs_weights: the command reads or writes the DiT weights on the accelerator.
        changes_lora: the command changes the LoRA state (savepoint protocol at TP > 1).
        scheduled: submitted through the scheduler as an admin call (generations have their own
            queue).
    """

    name: str
    path: str | None = None
    method: str = "POST"
    admin: bool = False
    needs_weights: bool = False
    changes_lora: bool = False
    scheduled: bool = True


_LORA_CHANGE = dict(admin=True, needs_weights=True, changes_lora=True)

OPS: dict[str, EngineOp] = {
    op.name: op
    for op in (
        EngineOp("generate", "/v1/images/generations", needs_weights=True, scheduled=False),
        # several generations in one denoising loop (the scheduler's batches); no route of its own
        EngineOp("generate_batch", needs_weights=True, scheduled=False),
        EngineOp("set_lora", "/v1/set_lora", **_LORA_CHANGE),
        EngineOp("unset_lora", "/v1/unset_lora", **_LORA_CHANGE),
        EngineOp("unload_lora", "/v1/unload_lora", **_LORA_CHANGE),
        EngineOp("merge_lora_weights", "/v1/merge_lora_weights", **_LORA_CHANGE),
        EngineOp("unmerge_lora_weights", "/v1/unmerge_lora_weights", **_LORA_CHANGE),
        EngineOp("list_loras", "/v1/list_loras", method="GET"),
        EngineOp("noop", scheduled=False),  # TP heartbeat
    )
}

#: Routes that change engine state; they take the admin key when one is configured.
ADMIN_PATHS = frozenset(op.path for op in OPS.values() if op.admin and op.path)
#: Commands that change the LoRA state (all-or-nothing across TP ranks).
LORA_CHANGE_OPS = tuple(op.name for op in OPS.values() if op.changes_lora)
#: Engine methods the scheduler queues as admin calls.
SCHEDULER_CALLS = tuple(op.name for op in OPS.values() if op.scheduled)
#: The admin calls with an HTTP route (``entrypoints.lora_admin`` registers each at its path).
ROUTED_CALLS = tuple(op for op in OPS.values() if op.scheduled and op.path)


def get_op(name: str) -> EngineOp:
    """The op named ``name``.

    Raises:
        ValueError: unknown command.
    """
    op = OPS.get(name)
    if op is None:
        raise ValueError(f"unknown engine command {name!r}")
    return op
