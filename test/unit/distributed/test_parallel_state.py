"""``ParallelLayout``: the rank decomposition (TP fastest, CFG slowest) and its process groups."""

from __future__ import annotations

from sglang.multimodal_gen.distributed import ParallelLayout


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
