"""Where this launcher's ranks sit in a (possibly multi-node) job: :class:`LaunchPlan`.

A job of ``world_size`` ranks is started by one *launcher* per node (``sglang serve|generate
--nnodes N --node-rank K --dist-init-addr HOST:PORT``; node ``K`` runs ranks
``K*world/N .. (K+1)*world/N - 1``) or by ``torchrun`` (one launcher per rank, read from
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``). Rank 0 (on node 0) is the
leader: it takes the commands and broadcasts them, every other rank follows.

:func:`fingerprint` lists what must agree across nodes; the rendezvous that compares it lives in
:mod:`sglang.multimodal_gen.distributed.multinode`. Nothing here imports torch, so the flags are
checked before anything heavy loads.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_DIST_TIMEOUT_S = 300.0
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

__all__ = [
    "DEFAULT_DIST_TIMEOUT_S",
    "LaunchPlan",
    "fingerprint",
    "parse_host_port",
    "plan_launch",
    "running_under_torchrun",
]


def parse_host_port(addr: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::1]:PORT"`` for IPv6) -> ``(host, port)``.

    Raises:
        ValueError: naming ``--dist-init-addr``.
    """
    host, sep, port = str(addr).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT (port 1-65535), got {addr!r}")
    return host, int(port)


def running_under_torchrun(env: Mapping[str, str] | None = None) -> bool:
    """True when ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are all set."""
    env = os.environ if env is None else env
    return all(env.get(k) for k in TORCHRUN_VARS)


@dataclass(frozen=True)
class LaunchPlan:
    """The ranks one launcher runs and how they meet the others.

    Attributes:
        world_size: ranks in the job (``ServerArgs.world_size``).
        ranks: the global ranks this launcher starts (contiguous).
        device_indices: the CUDA device index of each of ``ranks`` (its local rank).
        nnodes, node_rank: this launcher's node (under torchrun: ``GROUP_RANK`` of
            ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes).
        host, port: the rendezvous ``TCPStore``, hosted by rank 0 (by torchrun's agent under
            torchrun).
        timeout_s: seconds the rendezvous waits for every rank (``--dist-timeout``).
        agent_store: the store is torchrun's (every rank connects as a client).
        store_prefix: key namespace in the store (torchrun: per run and restart).
    """

    world_size: int
    ranks: tuple[int, ...]
    device_indices: tuple[int, ...]
    nnodes: int = 1
    node_rank: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S
    agent_store: bool = False
    store_prefix: str = "sglang"

    @property
    def is_leader(self) -> bool:
        """This launcher runs rank 0 (it takes commands and serves HTTP)."""
        return 0 in self.ranks

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.world_size // self.nnodes)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def device_index(self, rank: int) -> int:
        return self.device_indices[self.ranks.index(rank)]


def plan_launch(
    world_size: int,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str | None = None,
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    free_port: int | None = None,
) -> LaunchPlan:
    """The :class:`LaunchPlan` of this launcher, from the flags or from torchrun's environment.

    Args:
        world_size: total ranks (``--tp-size``; under torchrun it must equal ``WORLD_SIZE``).
        nnodes, node_rank, dist_init_addr: ``--nnodes``, ``--node-rank``, ``--dist-init-addr``.
        timeout_s: ``--dist-timeout`` (seconds).
        env: the environment (default ``os.environ``), read for torchrun's variables.
        free_port: the port for a single-node job without ``--dist-init-addr`` (default: a free
            one on 127.0.0.1).

    Raises:
        ValueError: naming the flag: ``--node-rank`` outside ``[0, nnodes)``, a world size not
            divisible by ``--nnodes`` (every node runs the same number of ranks), ``--nnodes > 1``
            without ``--dist-init-addr``, flags that torchrun already sets, a ``--tp-size``
            other than torchrun's ``WORLD_SIZE``.
    """
    env = os.environ if env is None else env
    world_size, nnodes, node_rank = int(world_size), int(nnodes), int(node_rank)
    if not 0 < float(timeout_s) < float("inf"):
        raise ValueError(f"--dist-timeout must be a number of seconds > 0, got {timeout_s}")
    if running_under_torchrun(env):
        if nnodes != 1 or node_rank != 0 or dist_init_addr:
            raise ValueError(
                "--nnodes/--node-rank/--dist-init-addr are set by torchrun (RANK, WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT); drop them when running under torchrun"
            )
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        if world != world_size:
            raise ValueError(
                f"the parallel size {world_size} (tp x sp x cfg) does not match torchrun's "
                f"WORLD_SIZE={world}; the number of processes must equal it"
            )
        local_world = int(env.get("LOCAL_WORLD_SIZE") or world)
        prefix = f"sglang/{env.get('TORCHELASTIC_RUN_ID', '')}/"
        prefix += env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return LaunchPlan(
            world_size=world,
            ranks=(rank,),
            device_indices=(int(env.get("LOCAL_RANK") or 0),),
            nnodes=max(1, world // local_world),
            node_rank=int(env.get("GROUP_RANK") or rank // local_world),
            host=env["MASTER_ADDR"],
            port=int(env["MASTER_PORT"]),
            timeout_s=float(timeout_s),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
            store_prefix=prefix,
        )
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, {nnodes - 1}] for --nnodes {nnodes}")
    if world_size % nnodes:
        raise ValueError(
            f"the parallel size {world_size} (tp x sp x cfg) is not divisible by --nnodes {nnodes}; "
            "every node runs the same number of ranks"
        )
    if dist_init_addr:
        host, port = parse_host_port(dist_init_addr)
    elif nnodes > 1:
        raise ValueError(
            "--nnodes > 1 needs --dist-init-addr HOST:PORT (an address of node 0 that every "
            "node can reach)"
        )
    else:
        host, port = "127.0.0.1", free_port or _free_port()
    per_node = world_size // nnodes
    first = node_rank * per_node
    return LaunchPlan(
        world_size=world_size,
        ranks=tuple(range(first, first + per_node)),
        device_indices=tuple(range(per_node)),
        nnodes=nnodes,
        node_rank=node_rank,
        host=host,
        port=port,
        timeout_s=float(timeout_s),
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- fingerprint
def _model_config_digest(model_path: str | None) -> str:
    """sha256 over the model's JSON files (``model_index.json``, ``*/config.json``, scheduler and
    tokenizer configs; not the weights): equal on two nodes that hold the same model, wherever
    it is mounted."""
    h = hashlib.sha256()
    if not model_path or not os.path.isdir(model_path):
        h.update(str(model_path).encode())
        return h.hexdigest()[:16]
    names = []
    for root, dirs, files in os.walk(model_path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        if os.path.relpath(root, model_path).count(os.sep) >= 1:
            dirs[:] = []  # model_index.json and one level of component folders
        names += [os.path.join(root, f) for f in files if f.endswith(".json")]
    for path in sorted(names):
        h.update(os.path.relpath(path, model_path).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def _checkpoint_digest(path: str | None) -> str | None:
    """sha256 over a transformer checkpoint's JSON files and safetensors headers (the 8-byte
    length and the JSON header: names, dtypes, shapes, offsets, metadata; not the tensor bytes)
    of ``path``, a file or the top level of a folder; ``None`` for no path."""
    if path is None:
        return None
    h = hashlib.sha256()
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith((".json", ".safetensors")))
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    for file in files:
        h.update(os.path.basename(file).encode() + b"\0")
        try:
            with open(file, "rb") as f:
                if file.endswith(".safetensors"):
                    head = f.read(8)
                    size = int.from_bytes(head, "little") if len(head) == 8 else 0
                    h.update(head + f.read(min(size, 100 << 20)))
                else:
                    h.update(hashlib.sha256(f.read()).digest())
        except OSError as e:  # the loader reports it; the digest only has to differ
            h.update(str(e).encode())
    return h.hexdigest()[:16]


def _weights_fingerprint(weights) -> dict | None:
    """The ``WeightOptions`` of a job as equal-on-every-node values (paths by content)."""
    if weights is None:
        return None
    return {
        "component": weights.component,
        "transformer_path": _checkpoint_digest(weights.transformer_path),
        "transformer_weights_path": _checkpoint_digest(weights.transformer_weights_path),
        "quantization": weights.quantization,
    }


def fingerprint(plan: LaunchPlan, runner_kwargs: Mapping, backend: str) -> dict:
    """The values that must be equal on every node, as a JSON-able dict.

    The model enters as the digest of its config files (its path may differ between nodes);
    ``runner_kwargs`` are those of :class:`~sglang.multimodal_gen.runtime.runner.ModelRunner`.
    """
    device = str(runner_kwargs.get("device") or "cpu").split(":")[0]
    return {
        "world_size": plan.world_size,
        "nnodes": plan.nnodes,
        "backend": backend,
        "device": device,
        "dtype": str(runner_kwargs.get("dtype") or "auto").replace("torch.", ""),
        "dit_cpu_offload": bool(runner_kwargs.get("dit_cpu_offload")),
        "generator_device": runner_kwargs.get("generator_device"),
        "model_config": _model_config_digest(runner_kwargs.get("model_path")),
        "layout": repr(runner_kwargs.get("layout")),
        "attention_backend": runner_kwargs.get("attention_backend", "auto"),
        "enable_torch_compile": bool(runner_kwargs.get("enable_torch_compile")),
        "float32_matmul_precision": runner_kwargs.get("float32_matmul_precision", "highest"),
        "cpu_gemm_backend": runner_kwargs.get("cpu_gemm_backend", "auto"),
        "weights": _weights_fingerprint(runner_kwargs.get("weights")),
    }
