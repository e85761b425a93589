"""Process groups of the parallel layout: tensor (TP), sequence (Ulysses x ring) and CFG.

Usage (every rank)::

    torch.distributed.init_process_group("gloo" or "nccl", ...)
    initialize_model_parallel(tensor_parallel_size=2, ulysses_degree=2)

The world is ``cfg x ring x ulysses x tp`` ranks. TP varies fastest, so the ranks of one TP group
are neighbours (on a GPU node: the best-connected devices, since TP all-reduces twice per block);
CFG varies slowest (one all-gather per step). A global rank decomposes as::

    rank = ((cfg_rank * ring_degree + ring_rank) * ulysses_degree + ulysses_rank) * tp_size + tp_rank

as in xDiT / SGLang's diffusion runtime. The sequence-parallel (SP) group is the ``ulysses x
ring`` ranks that share ``(cfg_rank, tp_rank)``; within it the SP rank is
``ring_rank * ulysses_degree + ulysses_rank``.

Without :func:`initialize_model_parallel` everything behaves as a single process: every getter
returns rank 0 of size 1 and the collectives are identities. This lets a single-process program
(and tests that build a layer "as rank r of n") use the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions (``world_size = tp * ulysses * ring * cfg``).

    Raises:
        ValueError: a size below 1 or a CFG degree other than 1 or 2.
    """

    tp_size: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_degree: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "ulysses_degree", "ring_degree", "cfg_degree"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cfg_degree not in (1, 2):
            raise ValueError(f"cfg_degree must be 1 or 2, got {self.cfg_degree}")

    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def world_size(self) -> int:
        return self.tp_size * self.sp_degree * self.cfg_degree

    def coords(self, rank: int) -> dict[str, int]:
        """``{"tp", "ulysses", "ring", "cfg"}`` ranks of global ``rank``."""
        tp = rank % self.tp_size
        rest = rank // self.tp_size
        uly = rest % self.ulysses_degree
        rest //= self.ulysses_degree
        ring = rest % self.ring_degree
        return {"tp": tp, "ulysses": uly, "ring": ring, "cfg": rest // self.ring_degree}

    def rank_of(self, tp: int, ulysses: int, ring: int, cfg: int) -> int:
        return ((cfg * self.ring_degree + ring) * self.ulysses_degree + ulysses) * self.tp_size + tp

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of dimension ``dim`` (``tp``, ``ulysses``, ``ring``, ``sp``, ``cfg``) as
        sorted global ranks, in a fixed order (every rank must create groups in the same order)."""
        sizes = {
            "tp": self.tp_size,
            "ulysses": self.ulysses_degree,
            "ring": self.ring_degree,
            "cfg": self.cfg_degree,
        }
        free = {"sp": ("ulysses", "ring")}.get(dim, (dim,))
        by_key: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(v for k, v in sorted(c.items()) if k not in free)
            by_key.setdefault(key, []).append(r)
        if any(len(g) != _prod(sizes[f] for f in free) for g in by_key.values()):
            raise AssertionError("inconsistent group sizes")  # a bug in coords()
        return [sorted(g) for _, g in sorted(by_key.items())]


def _prod(it) -> int:
    out = 1
    for v in it:
        out *= int(v)
    return out


_LAYOUT: ParallelLayout | None = None
_GROUPS: dict[str, dist.ProcessGroup | None] = {}
# Control messages (commands, LoRA payloads, broadcast conditioning) travel on a gloo group over
# the whole world, as vLLM's ``cpu_group``: pickled objects on NCCL would be staged through a GPU.
_CPU_GROUP: dist.ProcessGroup | None = None


def initialize_model_parallel(
    tensor_parallel_size: int = 1,
    ulysses_degree: int = 1,
    ring_degree: int = 1,
    cfg_degree: int = 1,
) -> None:
    """Create the TP, Ulysses, ring, SP and CFG groups over the default process group.

    Args:
        tensor_parallel_size: ranks that shard each layer's weights (heads / FFN units).
        ulysses_degree: ranks that exchange heads for sequence by all-to-all around attention.
        ring_degree: ranks that pass key/value blocks around a ring inside attention.
        cfg_degree: 2 to run the conditional and unconditional CFG branches on different ranks.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized, or the groups exist already.
        ValueError: the product of the sizes is not the world size.
    """
    global _LAYOUT, _CPU_GROUP
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel() needs torch.distributed.init_process_group() first"
        )
    if _LAYOUT is not None:
        raise RuntimeError("the model-parallel groups are already initialized")
    layout = ParallelLayout(tensor_parallel_size, ulysses_degree, ring_degree, cfg_degree)
    world = dist.get_world_size()
    if layout.world_size != world:
        raise ValueError(
            f"tp_size={layout.tp_size} x ulysses_degree={layout.ulysses_degree} x "
            f"ring_degree={layout.ring_degree} x cfg_degree={layout.cfg_degree} = "
            f"{layout.world_size} must equal the world size {world}"
        )
    me = dist.get_rank()
    for dim in ("tp", "ulysses", "ring", "sp", "cfg"):
        mine = None
        for ranks in layout.groups(dim):
            if len(ranks) == world:
                # the default group already spans these ranks; a new_group would only add a
                # second communicator (and a second NCCL init) for the same set
                group = dist.group.WORLD
            elif len(ranks) == 1:
                group = None  # size 1: collectives are identities, no communicator needed
            else:
                group = dist.new_group(ranks)  # collective: every rank creates every group
            if me in ranks:
                mine = group
        _GROUPS[dim] = mine
    _CPU_GROUP = (
        dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    )
    _LAYOUT = layout


def destroy_model_parallel() -> None:
    """Forget the groups (the default process group is left to the caller)."""
    global _LAYOUT, _CPU_GROUP
    _LAYOUT = None
    _CPU_GROUP = None
    _GROUPS.clear()


def model_parallel_is_initialized() -> bool:
    return _LAYOUT is not None


def get_parallel_layout() -> ParallelLayout:
    """The layout in use (all sizes 1 without initialization)."""
    return _LAYOUT or ParallelLayout()


def _group(dim: str) -> dist.ProcessGroup | None:
    return _GROUPS.get(dim)


def _rank(dim: str) -> int:
    g = _GROUPS.get(dim)
    return dist.get_rank(g) if g is not None else 0


def _size(dim: str) -> int:
    g = _GROUPS.get(dim)
    return dist.get_world_size(g) if g is not None else 1


def get_tp_group() -> dist.ProcessGroup | None:
    """The TP process group, or ``None`` at TP size 1."""
    return _group("tp")


def get_tp_rank() -> int:
    """This process's rank in the TP group (0 without initialization)."""
    return _rank("tp")


def get_tp_world_size() -> int:
    """The TP group size (1 without initialization)."""
    return _size("tp")


def get_sp_group() -> dist.ProcessGroup | None:
    """The sequence-parallel group (Ulysses x ring), ``None`` at SP degree 1."""
    return _group("sp")


def get_sp_rank() -> int:
    """This rank's SP rank, ``ring_rank * ulysses_degree + ulysses_rank`` (the index of the
    sequence shard it holds)."""
    return _rank("sp")


def get_sp_world_size() -> int:
    return _size("sp")


def get_ulysses_group() -> dist.ProcessGroup | None:
    return _group("ulysses")


def get_ulysses_rank() -> int:
    return _rank("ulysses")


def get_ulysses_world_size() -> int:
    return _size("ulysses")


def get_ring_group() -> dist.ProcessGroup | None:
    return _group("ring")


def get_ring_rank() -> int:
    return _rank("ring")


def get_ring_world_size() -> int:
    return _size("ring")


def get_cfg_group() -> dist.ProcessGroup | None:
    """The CFG-parallel group (2 ranks that hold the two CFG branches), ``None`` without CFG
    parallelism."""
    return _group("cfg")


def get_cfg_rank() -> int:
    return _rank("cfg")


def get_cfg_world_size() -> int:
    return _size("cfg")


def get_world_cpu_group() -> dist.ProcessGroup | None:
    """The gloo group over every rank for control messages (``None`` without initialization)."""
    return _CPU_GROUP


def get_world_size() -> int:
    """Ranks in the layout (1 without initialization)."""
    return get_parallel_layout().world_size if _LAYOUT is not None else 1


# The control group was TP-only before sequence/CFG parallelism; the old name stays an alias.
get_tp_cpu_group = get_world_cpu_group
