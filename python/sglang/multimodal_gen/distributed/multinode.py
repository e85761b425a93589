"""The checked start-up rendezvous of a multi-node (or torchrun) job.

:func:`checked_rendezvous` replaces a bare ``init_process_group`` rendezvous so that start-up
failures are one clear line on every node within ``plan.timeout_s`` instead of a hang: every rank
posts its *fingerprint* (:func:`~sglang.multimodal_gen.configs.launch_plan.fingerprint`: the
arguments that must agree across nodes and a digest of the model's config files) to a
``TCPStore`` at the rendezvous address; rank 0 waits for all of them, compares them with its own
and posts a verdict that every other rank waits for. ``init_process_group(store=...)`` then runs
over the same store, as torch's own ``tcp://``/``env://`` rendezvous does.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from datetime import timedelta

from sglang.multimodal_gen.configs.launch_plan import LaunchPlan

__all__ = ["RendezvousTimeoutError", "checked_rendezvous"]

VERDICT_GRACE_S = 5.0


class RendezvousTimeoutError(TimeoutError):
    """A node (or rank) did not arrive at the rendezvous, or node 0 could not be reached."""


def _differences(mine: Mapping, theirs: Mapping) -> list[str]:
    keys = sorted(set(mine) | set(theirs))
    return [
        f"{k} ({mine.get(k)!r} vs {theirs.get(k)!r})" for k in keys if mine.get(k) != theirs.get(k)
    ]


# ---------------------------------------------------------------------- rendezvous
def checked_rendezvous(plan: LaunchPlan, rank: int, fp: Mapping):
    """Meet every rank at ``plan.host:plan.port``, check that all fingerprints equal rank 0's.

    Returns:
        A ``torch.distributed.Store`` for ``init_process_group(store=..., rank, world_size)``.

    Raises:
        RendezvousTimeoutError: node 0 unreachable, or ranks missing after ``plan.timeout_s``
            (rank 0 names the missing nodes and ranks; the ranks present get the same line).
        ValueError: a node's fingerprint differs from node 0's (names the node and the fields).
    """
    import torch.distributed as dist

    where = f"{plan.host}:{plan.port}"
    deadline = time.monotonic() + plan.timeout_s
    master = rank == 0 and not plan.agent_store
    try:
        if not master:  # wait here: the store's own connect retries log C++ errors meanwhile
            _wait_listening(plan.host, plan.port, deadline)
        store = dist.TCPStore(
            plan.host,
            plan.port,
            world_size=None,
            is_master=master,
            timeout=timedelta(seconds=plan.timeout_s),
            wait_for_workers=False,
            multi_tenant=True,
        )
    except Exception as e:  # DistNetworkError, DistStoreError: one line, no C++ trace
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RendezvousTimeoutError(
            f"multi-node start-up: rank {rank} (node {plan.node_of(rank)}) could not reach the "
            f"rendezvous at {where} within {plan.timeout_s:g} s ({first}); is node 0 started "
            "with the same --dist-init-addr?"
        ) from None
    store = dist.PrefixStore(plan.store_prefix + "/", store)
    posted = json.dumps(dict(fp), sort_keys=True)
    store.set(f"fp/{rank}", posted)
    # per node too: a node started with another --tp-size/--nnodes runs other rank numbers, and
    # rank 0 must still tell it apart from a node that is missing
    store.set(f"node/{plan.node_rank}", posted)
    store.add("joined", 1)  # every rank that posted, whatever world size it was started with
    if rank == 0:
        verdict = _leader_verdict(store, plan, dict(fp), deadline, where)
        store.set("verdict", verdict)
        if verdict:
            # rank 0 hosts the store: leaving at once would reset the connections of the ranks
            # still reading the verdict, and they would report that instead of the verdict
            _wait_read(store)
        _raise_verdict(verdict)
        return store
    try:
        # rank 0 decides at the deadline at the latest; a grace period to hear its verdict
        left = deadline + VERDICT_GRACE_S - time.monotonic()
        store.wait(["verdict"], timedelta(seconds=max(0.1, left)))
    except Exception:
        raise RendezvousTimeoutError(
            f"multi-node start-up: node 0 did not finish the rendezvous at {where} within "
            f"{plan.timeout_s:g} s (rank {rank} waited); are all nodes started?"
        ) from None
    verdict = store.get("verdict").decode()
    if verdict:
        store.add("verdict_read", 1)
    _raise_verdict(verdict)
    return store


def _wait_read(store) -> None:
    """Rank 0: wait (``VERDICT_GRACE_S`` at most) until every other rank that joined, a node
    started with another world size included, read the verdict."""
    until = time.monotonic() + VERDICT_GRACE_S
    while store.add("verdict_read", 0) < store.add("joined", 0) - 1:
        if time.monotonic() >= until:
            return
        time.sleep(0.02)


def _wait_listening(host: str, port: int, deadline: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; ``TimeoutError`` at ``deadline``."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"nothing listens at {host}:{port} ({e.strerror or e})"
                ) from None
            time.sleep(0.2)


def _leader_verdict(store, plan: LaunchPlan, mine: dict, deadline: float, where: str) -> str:
    """Rank 0: wait for every rank's fingerprint; ``""`` when all agree, else the error line."""
    waiting = set(range(1, plan.world_size))
    nodes_seen: set[int] = set()
    # every node's record too, not only every rank's: a node started with other flags may post
    # rank numbers that happen to complete the set before its node record is read
    while (waiting or len(nodes_seen) < plan.nnodes - 1) and time.monotonic() < deadline:
        for n in set(range(1, plan.nnodes)) - nodes_seen:
            if store.check([f"node/{n}"]):
                nodes_seen.add(n)
                diff = _differences(mine, json.loads(store.get(f"node/{n}")))
                if diff:
                    return _mismatch(n, diff)
        waiting = {r for r in waiting if not store.check([f"fp/{r}"])}
        if waiting or len(nodes_seen) < plan.nnodes - 1:
            time.sleep(0.05)
    if waiting or len(nodes_seen) < plan.nnodes - 1:
        unseen = set(range(1, plan.nnodes)) - nodes_seen
        nodes = sorted({plan.node_of(r) for r in waiting} | unseen)
        return "timeout:" + (
            f"multi-node start-up: node(s) {', '.join(map(str, nodes))} (rank(s) "
            f"{', '.join(map(str, sorted(waiting)))} of {plan.world_size}) did not join the "
            f"rendezvous at {where} within {plan.timeout_s:g} s; start them with the same "
            "command and their --node-rank"
        )
    for r in range(1, plan.world_size):
        diff = _differences(mine, json.loads(store.get(f"fp/{r}")))
        if diff:
            return _mismatch(plan.node_of(r), diff)
    return ""


def _mismatch(node: int, diff: list[str]) -> str:
    return "mismatch:" + (
        f"multi-node start-up: node {node} was started with other settings than node 0: "
        f"{'; '.join(diff)} (node 0 vs node {node}); every node must run the same model and flags"
    )


def _raise_verdict(verdict: str) -> None:
    if not verdict:
        return
    kind, _, message = verdict.partition(":")
    raise (RendezvousTimeoutError if kind == "timeout" else ValueError)(message)
