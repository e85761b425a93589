#!/usr/bin/env python3
"""How often the demo model draws what its prompts say, through our engine.

The 40 prompts of ``demo_scenes.random_scenes(40, seed)`` run as one ``generate_batch`` (prompt
``i`` with seed ``i``, the model's own defaults: 64x64, 8 steps), and ``demo_scenes.accuracy``
reads colour, shape, background and position back. With ``--lora`` the same prompts run again
with the adapter set, scored against the scenes with object and background colours swapped (what
the demo LoRA is trained to do). docs/models.md records the numbers this prints.

Usage::

    python scripts/measure_demo_model.py [--model DIR] [--lora DIR] [--seeds 123 99 321]
"""

from __future__ import annotations

import argparse

from sglang.multimodal_gen.models import demo_scenes as ds
from sglang.multimodal_gen.models.default_model import default_model_path, demo_lora_path
from sglang.multimodal_gen.runtime import DiffusionEngine, SamplingParams


def _pictures(engine, scenes):
    reqs = [SamplingParams(prompt=s.caption, seed=i) for i, s in enumerate(scenes)]
    return [r[0] for r in engine.generate_batch(reqs, progress=False)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the packaged one)")
    ap.add_argument("--lora", default=None, help="LoRA to score (default: the packaged one)")
    ap.add_argument("--no-lora", action="store_true", help="score the base model only")
    ap.add_argument("--seeds", type=int, nargs="+", default=[123, 99, 321])
    args = ap.parse_args(argv)
    with DiffusionEngine(args.model or default_model_path(), device="cpu") as engine:
        sets = {seed: ds.random_scenes(40, seed=seed) for seed in args.seeds}
        for seed, scenes in sets.items():
            print(f"base, prompts of seed {seed}: {ds.accuracy(_pictures(engine, scenes), scenes)}")
        if args.no_lora:
            return 0
        engine.set_lora("swap", args.lora or demo_lora_path(), trusted=True)
        for seed, scenes in sets.items():
            swapped = [ds.Scene(s.background, s.shape, s.color, s.position) for s in scenes]
            acc = ds.accuracy(_pictures(engine, scenes), swapped)
            print(f"LoRA, prompts of seed {seed} (colours swapped expected): {acc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
