"""``sglang generate``'s line on the step caching its request ran with (stderr)."""

from __future__ import annotations

from PIL import Image
from sglang.cli.generate import step_cache_line
from sglang.multimodal_gen.outputs import STEP_CACHE_INFO


def test_the_counts_of_the_first_output_are_printed_only_when_caching_ran():
    image = Image.new("RGB", (8, 8))
    assert step_cache_line([image]) is None and step_cache_line([]) is None
    image.info[STEP_CACHE_INFO] = {
        "method": "fbcache",
        "steps_computed": 4,
        "steps_skipped": 2,
        "blocks_computed": 10,
        "blocks_skipped": 2,
    }
    assert step_cache_line([image]) == (
        "step cache (fbcache): 4 of 6 DiT steps computed, 2 skipped; 10 blocks computed, 2 skipped"
    )
