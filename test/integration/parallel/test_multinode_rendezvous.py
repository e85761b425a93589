"""The multi-node launch plan and the checked rendezvous, without a model.

Every "node" of a job is a thread here running :func:`checked_rendezvous` against a real
``TCPStore`` on 127.0.0.1, so the timing and the messages are the real ones; the CLI-level checks
(processes, exit codes) are in ``test_multinode.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
from sglang.multimodal_gen.configs.launch_plan import (
    fingerprint,
    parse_host_port,
    plan_launch,
    running_under_torchrun,
)
from sglang.multimodal_gen.configs.server_args import ServerArgs
from sglang.multimodal_gen.distributed.launch import find_free_port
from sglang.multimodal_gen.distributed.multinode import RendezvousTimeoutError, checked_rendezvous

TORCHRUN_ENV = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "job7",
}


def test_plan_places_ranks_per_node_and_reads_torchrun():
    plan = plan_launch(4, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000", env={})
    assert plan.ranks == (2, 3) and plan.device_indices == (0, 1)
    assert (plan.host, plan.port, plan.is_leader) == ("10.0.0.1", 5000, False)
    assert plan.node_of(1) == 0 and plan.node_of(3) == 1
    lead = plan_launch(4, nnodes=2, node_rank=0, dist_init_addr="[::1]:5000", env={})
    assert lead.ranks == (0, 1) and lead.is_leader and lead.host == "::1"
    one = plan_launch(2, env={}, free_port=1234)
    assert one.ranks == (0, 1) and (one.host, one.port) == ("127.0.0.1", 1234)

    assert running_under_torchrun(TORCHRUN_ENV) and not running_under_torchrun({})
    tr = plan_launch(4, env=TORCHRUN_ENV)
    assert tr.ranks == (3,) and tr.device_indices == (1,)  # device = LOCAL_RANK
    assert (tr.nnodes, tr.node_rank, tr.host, tr.port) == (2, 1, "10.1.2.3", 29400)
    assert tr.agent_store and "job7" in tr.store_prefix and not tr.is_leader


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), {}, r"--node-rank must be in \[0, 1\]"),
        (dict(nnodes=2, node_rank=0), {}, "--nnodes > 1 needs --dist-init-addr"),
        (dict(nnodes=3, dist_init_addr="h:1"), {}, "not divisible by --nnodes 3"),
        (dict(nnodes=2, dist_init_addr="h"), {}, "--dist-init-addr must be HOST:PORT"),
        (dict(nnodes=2, dist_init_addr="h:70000"), {}, "--dist-init-addr must be HOST:PORT"),
        (dict(timeout_s=0), {}, "--dist-timeout must be"),
        (dict(nnodes=2, dist_init_addr="h:1"), TORCHRUN_ENV, "set by torchrun"),
        (dict(), dict(TORCHRUN_ENV, WORLD_SIZE="8"), "does not match torchrun's WORLD_SIZE=8"),
    ],
)
def test_plan_refuses_bad_flags(kwargs, env, match):
    with pytest.raises(ValueError, match=match):
        plan_launch(4, env=env, free_port=1, **kwargs)


def test_server_args_check_the_flags_and_world_size():
    assert ServerArgs(tp_size=4).world_size == 4
    with pytest.raises(ValueError, match="--nnodes > 1 needs --dist-init-addr"):
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="--node-rank must be 0 without --nnodes"):
        ServerArgs(node_rank=1)
    assert parse_host_port("node0.cluster:29500") == ("node0.cluster", 29500)


def _fp(plan, **change):
    kwargs = dict(model_path=None, dtype="float32", device="cpu", dit_cpu_offload=False)
    kwargs.update(change)
    return fingerprint(plan, kwargs, "gloo")


def _join(members):
    """Run checked_rendezvous for every ``(plan, fp, rank)`` in threads;
    ``{rank: ("ok" or the exception, seconds)}``."""
    out: dict = {}
    stores: list = []  # rank 0's store serves the others: keep every store until all are done

    def run(plan, fp, rank):
        t0 = time.monotonic()
        try:
            stores.append(checked_rendezvous(plan, rank, fp))
            out[rank] = ("ok", time.monotonic() - t0)
        except Exception as e:
            # as a process that exits: a rank that fails drops its store (rank 0's is the server)
            out[rank] = (e.with_traceback(None), time.monotonic() - t0)

    threads = [threading.Thread(target=run, args=m, daemon=True) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def _plans(world, nnodes, port, timeout_s, node_ranks):
    addr = f"127.0.0.1:{port}"
    return [plan_launch(world, nnodes, n, addr, timeout_s=timeout_s, env={}) for n in node_ranks]


def test_all_nodes_agree(tiny_zimage_dir):
    plans = _plans(2, 2, find_free_port(), 20, [0, 1])
    fps = [_fp(p, model_path=tiny_zimage_dir) for p in plans]
    out = _join([(p, fp, p.ranks[0]) for p, fp in zip(plans, fps)])
    assert out[0][0] == "ok" and out[1][0] == "ok", out


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(dtype="bfloat16"), "dtype ('float32' vs 'bfloat16')"),
        (dict(model_path="OTHER"), "model_config"),
    ],
)
def test_other_settings_are_refused_on_every_node(tiny_zimage_dir, change, field):
    plans = _plans(2, 2, find_free_port(), 20, [0, 1])
    if change.get("model_path") == "OTHER":
        change = dict(model_path=f"{tiny_zimage_dir}/transformer")  # other config files
    fps = [
        _fp(plans[0], model_path=tiny_zimage_dir),
        _fp(plans[1], **{"model_path": tiny_zimage_dir, **change}),
    ]
    out = _join([(p, fp, p.ranks[0]) for p, fp in zip(plans, fps)])
    for rank in (0, 1):
        err = out[rank][0]
        assert isinstance(err, ValueError), out
        assert "node 1 was started with other settings than node 0" in str(err)
        assert field in str(err) and "\n" not in str(err)


def test_node_with_other_world_size_is_refused_not_waited_for():
    port = find_free_port()
    node0 = plan_launch(2, 2, 0, f"127.0.0.1:{port}", timeout_s=30, env={})
    node1 = plan_launch(4, 2, 1, f"127.0.0.1:{port}", timeout_s=30, env={})  # ranks 2, 3
    out = _join([(node0, _fp(node0), 0), (node0, _fp(node0), 1), (node1, _fp(node1), 2)])
    err0, took0 = out[0]
    assert isinstance(err0, ValueError) and "world_size (2 vs 4)" in str(err0), out
    assert took0 < 15  # decided as soon as node 1 posted, not at the timeout
    assert isinstance(out[2][0], ValueError)


def test_missing_node_is_a_clear_error_within_the_timeout():
    plan0 = _plans(4, 2, find_free_port(), 3, [0])[0]
    out = _join([(plan0, _fp(plan0), 0), (plan0, _fp(plan0), 1)])  # node 0: ranks 0 and 1
    err, took = out[0]
    assert isinstance(err, RendezvousTimeoutError), out
    assert "node(s) 1 (rank(s) 2, 3 of 4) did not join" in str(err)
    assert str(out[1][0]) == str(err)  # the rank that waited for the verdict: the same line
    assert 3 <= took < 10


def test_unreachable_node0_is_a_clear_error_within_the_timeout():
    plan1 = _plans(2, 2, find_free_port(), 3, [1])[0]
    out = _join([(plan1, _fp(plan1), 1)])
    err, took = out[1]
    assert isinstance(err, RendezvousTimeoutError), out
    assert "could not reach the rendezvous" in str(err) and "\n" not in str(err)
    assert 3 <= took < 10
