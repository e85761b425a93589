"""A family's parallel-layout check (``ModelFamily.check_parallel_layout``): names the heads and a
degree that works."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.distributed import ParallelLayout
from sglang.multimodal_gen.models.registry import get_family


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
