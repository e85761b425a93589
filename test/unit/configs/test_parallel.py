"""The parallel layout from SGLang's flags (``configs/parallel.py``): resolved degrees,
contradictory flags as one clear error. The rank decomposition and groups:
``distributed/test_parallel_state.py``; a family's check of a layout: ``models/test_registry.py``."""

from __future__ import annotations

import argparse

import pytest
from sglang.multimodal_gen.configs.parallel import (
    add_parallel_args,
    layout_from_args,
    resolve_layout,
)


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
