"""The parallel layout: rank decomposition, groups, SGLang's flags, and the model checks."""

from __future__ import annotations

import argparse

import pytest
from sglang.multimodal_gen.configs.parallel import (
    add_parallel_args,
    layout_from_args,
    resolve_layout,
)
from sglang.multimodal_gen.distributed import ParallelLayout
from sglang.multimodal_gen.models.registry import get_family


def test_rank_decomposition_tp_fastest_cfg_slowest():
    lay = ParallelLayout(tp_size=2, ulysses_degree=2, ring_degree=2, cfg_degree=2)
    assert lay.world_size == 16 and lay.sp_degree == 4
    for r in range(16):
        c = lay.coords(r)
        assert lay.rank_of(**c) == r
    assert lay.coords(0) == dict(tp=0, ulysses=0, ring=0, cfg=0)
    assert lay.coords(1)["tp"] == 1 and lay.coords(2)["ulysses"] == 1
    assert lay.coords(4)["ring"] == 1 and lay.coords(8)["cfg"] == 1
    assert lay.groups("tp")[0] == [0, 1]
    assert lay.groups("ulysses")[0] == [0, 2]
    assert lay.groups("ring")[0] == [0, 4]
    assert lay.groups("sp")[0] == [0, 2, 4, 6]  # SP rank = ring * ulysses_degree + ulysses
    assert lay.groups("cfg")[0] == [0, 8]
    for dim, size in (("tp", 2), ("ulysses", 2), ("ring", 2), ("sp", 4), ("cfg", 2)):
        groups = lay.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(16))  # a partition
        assert all(len(g) == size for g in groups)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (dict(), (1, 1, 1, 1)),
        (dict(num_gpus=4), (4, 1, 1, 1)),  # --num-gpus alone: the TP size (historic)
        (dict(sp_degree=4), (1, 4, 1, 1)),
        (dict(sp_degree=4, heads=30), (1, 2, 2, 1)),  # Z-Image-Turbo: 30 heads
        (dict(sp_degree=4, tp_size=2, heads=30), (2, 1, 4, 1)),  # 15 heads per TP rank
        (dict(ulysses_degree=2, ring_degree=2), (1, 2, 2, 1)),
        (dict(sp_degree=4, ring_degree=4), (1, 1, 4, 1)),
        (dict(num_gpus=8, tp_size=2, enable_cfg_parallel=True), (2, 2, 1, 2)),
        (dict(num_gpus=8, sp_degree=4), (2, 4, 1, 1)),
        (dict(num_gpus=4, enable_cfg_parallel=True), (1, 2, 1, 2)),
        (dict(num_gpus=2, enable_cfg_parallel=True), (1, 1, 1, 2)),
    ],
)
def test_resolve_layout(flags, expected):
    lay = resolve_layout(**flags)
    assert (lay.tp_size, lay.ulysses_degree, lay.ring_degree, lay.cfg_degree) == expected


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(sp_degree=4, ulysses_degree=2, ring_degree=3), "--sp-degree 4 must equal"),
        (dict(sp_degree=4, ulysses_degree=3), "--ulysses-degree 3 does not divide --sp-degree 4"),
        (dict(num_gpus=6, tp_size=4), "--num-gpus 6 is not divisible by tp x cfg = 4"),
        (dict(num_gpus=4, tp_size=2, sp_degree=4), "--num-gpus 4 must equal tp 2 x sp 4"),
        (dict(num_gpus=3, enable_cfg_parallel=True), "--num-gpus 3 is not divisible"),
        (dict(ring_degree=0), "--ring-degree must be >= 1"),
    ],
)
def test_contradictory_flags_are_one_clear_error(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        resolve_layout(**flags)


def test_cli_flags_as_sglang_names_them():
    parser = argparse.ArgumentParser()
    add_parallel_args(parser)
    args = parser.parse_args(
        ["--tp-size", "2", "--ulysses-degree", "2", "--ring-degree", "2", "--enable-cfg-parallel"]
    )
    assert layout_from_args(args).world_size == 16


def test_model_check_names_heads_and_a_working_degree():
    from sglang.multimodal_gen.configs.zimage import ZImageArchConfig

    fam = get_family("zimage")
    cfg = ZImageArchConfig()  # Z-Image-Turbo: 30 heads
    fam.check_parallel_layout(cfg, ParallelLayout(ulysses_degree=2, ring_degree=2))
    fam.check_parallel_layout(cfg, ParallelLayout(ring_degree=4))
    with pytest.raises(ValueError, match=r"30 attention heads.*not divisible by ulysses_degree=4"):
        fam.check_parallel_layout(cfg, ParallelLayout(ulysses_degree=4))
    with pytest.raises(ValueError, match=r"not divisible by tp_size=4"):
        fam.check_parallel_layout(cfg, ParallelLayout(tp_size=4))
