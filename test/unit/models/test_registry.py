"""A family's parallel-layout check (``ModelFamily.check_parallel_layout``): any Ulysses degree is
served (heads it does not divide are split unevenly); a TP size that does not divide the heads is
refused, naming them and the TP sizes that work."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.distributed import ParallelLayout
from sglang.multimodal_gen.models.registry import get_family


def test_model_check_accepts_any_ulysses_and_names_the_tp_divisor():
    from sglang.multimodal_gen.configs.zimage import ZImageArchConfig

    fam = get_family("zimage")
    cfg = ZImageArchConfig()  # Z-Image-Turbo: 30 heads
    fam.check_parallel_layout(cfg, ParallelLayout(ulysses_degree=2, ring_degree=2))
    fam.check_parallel_layout(cfg, ParallelLayout(ring_degree=4))
    # 30 heads over Ulysses 4 or 8, 15 per TP rank over Ulysses 2: uneven head splits
    fam.check_parallel_layout(cfg, ParallelLayout(ulysses_degree=4))
    fam.check_parallel_layout(cfg, ParallelLayout(ulysses_degree=8))
    fam.check_parallel_layout(cfg, ParallelLayout(tp_size=2, ulysses_degree=2))
    with pytest.raises(ValueError, match=r"n_heads=30 is not divisible by tp_size=4.*\[1, 2, 5\]"):
        fam.check_parallel_layout(cfg, ParallelLayout(tp_size=4))


def test_list_families_does_not_depend_on_import_order():
    """A program that imports one family's declaration first (a test module building a tiny Wan,
    a plugin) registers it first; the listing (CLI help, /v1/models, docs) stays sorted by name."""
    import subprocess
    import sys

    code = (
        "import sglang.multimodal_gen.models.families.wan\n"
        "from sglang.multimodal_gen.models.registry import list_families\n"
        "print(','.join(f.name for f in list_families()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    names = out.stdout.strip().split(",")
    assert "wan" in names and names == sorted(names)
