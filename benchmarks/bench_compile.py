"""Compiled vs eager DiT blocks per family, with LoRA: compile time, recompiles, per-call time.

For each family the tiny DiT of the compiled-block tests (``test/fixtures/compile_blocks.py``:
ours loaded from a tiny diffusers model, every linear layer wrapped for LoRA with three random
adapters) is run once to capture the inputs of the first block of each block class. Each block
is then compiled like ``--enable-torch-compile`` does (``compile_blocks``: inductor,
``fullgraph=True``) and measured:

* ``compile s``: the first compiled call (trace + inductor code generation), nothing active;
* ``graphs``: the graphs dynamo compiled for that first call, and ``recompiles``: the graphs
  it compiled during 20 LoRA changes after it (set / unset / switch, strengths, merged, per-row
  mappings: ``CHANGES`` of the fixture), from ``torch._dynamo.utils.counters["stats"]
  ["unique_graphs"]``;
* ``eager ms`` / ``compiled ms``: the median over ``--repeats`` interleaved calls of the block
  (one adapter active, unmerged), and their ratio;
* ``worst dB``: the worst PSNR of the compiled output against eager over the 20 changes.

``--resolutions`` (Z-Image): the whole DiT with compiled blocks run at three latent sizes, the
graphs compiled at each (dynamo's automatic dynamic shapes: the second size recompiles once with
dynamic sizes, later ones reuse it).

The models are tiny (dim 64): the per-call ratio shows the overhead side of compilation, not the
speed-up on production sizes. Set ``TORCHINDUCTOR_CACHE_DIR`` to reuse the compiled code of an
earlier process (inductor's FX graph cache); ``--fresh-cache`` points it at an empty folder.

Usage::

    python benchmarks/bench_compile.py [--families zimage,flux,...] [--repeats 20]
        [--resolutions] [--fresh-cache]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def bench_family(family: str, repeats: int) -> list[dict]:
    from fixtures.compile_blocks import (
        CHANGES,
        block_inputs,
        first_tensor,
        lora_model,
        mapping,
        psnr,
        set_active,
    )

    model, run, layers, ctx = lora_model(family)
    rows = []
    for name, (block, args, kwargs) in block_inputs(model, run).items():
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)
        set_active(layers, [])
        f0 = _graphs()
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(*args, **kwargs)
        compile_s = time.perf_counter() - t0
        f1 = _graphs()
        worst = float("inf")
        for pairs, merged, rws in CHANGES:
            set_active(layers, pairs, merged)
            with torch.no_grad(), ctx.rows(None if rws is None else mapping(layers, *rws)):
                got = first_tensor(compiled(*args, **kwargs))
                want = first_tensor(block(*args, **kwargs))
            worst = min(worst, psnr(got, want))
        recompiles = _graphs() - f1
        set_active(layers, [("a", 1.0)])
        times = {"eager": [], "compiled": []}
        with torch.no_grad():
            for _ in range(repeats):
                for what, fn in (("eager", block), ("compiled", compiled)):
                    t = time.perf_counter()
                    fn(*args, **kwargs)
                    times[what].append(time.perf_counter() - t)
        set_active(layers, [])
        eager, comp = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
        rows.append(
            dict(
                family=family,
                block=name,
                graphs=f1 - f0,
                compile_s=compile_s,
                recompiles=recompiles,
                eager_ms=eager,
                compiled_ms=comp,
                ratio=comp / eager,
                worst_db=worst,
            )
        )
    return rows


def bench_resolutions() -> list[tuple[str, int]]:
    """Frames compiled by the whole Z-Image DiT's compiled blocks at three latent sizes."""
    from fixtures.compile_blocks import FAMILIES
    from sglang.multimodal_gen.runtime.placement import compile_blocks

    torch._dynamo.reset()
    model, _ = FAMILIES["zimage"]()
    compile_blocks(model)
    g = torch.Generator().manual_seed(0)
    caps = [torch.randn(7, 32, generator=g) for _ in range(2)]
    out = []
    for h, w in ((8, 8), (12, 8), (16, 16)):
        x = [torch.randn(16, 1, h, w, generator=g) for _ in range(2)]
        f = _graphs()
        with torch.no_grad():
            model(x, torch.tensor([0.3, 0.8]), caps)
        out.append((f"{h}x{w} latent", _graphs() - f))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", default="zimage,flux,qwen_image,wan,hunyuan_video,ltx2")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--resolutions", action="store_true")
    p.add_argument("--fresh-cache", action="store_true")
    args = p.parse_args()
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(f"TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR', '(default)')}")
    print(
        "| family | block | graphs | compile s | recompiles (20 changes) | eager ms | "
        "compiled ms | compiled / eager | worst dB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for fam in args.families.split(","):
        for r in bench_family(fam, args.repeats):
            print(
                f"| {r['family']} | {r['block']} | {r['graphs']} | {r['compile_s']:.1f} | "
                f"{r['recompiles']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | "
                f"{r['ratio']:.2f} | {r['worst_db']:.0f} |"
            )
    if args.resolutions:
        for what, graphs in bench_resolutions():
            print(f"zimage DiT, {what}: {graphs} graph(s) compiled")


if __name__ == "__main__":
    main()
