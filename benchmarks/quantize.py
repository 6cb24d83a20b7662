"""ZeRO++'s quantization kernels on the CPU against the best torch code for the same job.

Each of the four ops of ``runtime/quantization.py`` (the C++ kernels of ``csrc/quantize.cpp``)
is timed on one bucket against the same computation written in torch ops (the reference the
kernels are tested against), eager and compiled by inductor (``torch.compile`` of the same
function: inductor's generated C++ loop). Buckets of ``--numel`` elements as ``--params``
shards, fp32, ``--world-size`` rows for the gathered and reduced sides, one thread::

    python benchmarks/quantize.py                     # 16M elements, 64 shards, 2 ranks

It prints ms per call (median of ``--reps``) and each variant's ratio to the C++ kernel, and
writes ``results/quantize.json``. This is what decides between a hand-written C++ kernel and
an inductor-generated one for the CPU (issue 11).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402

from zerocompile.runtime import cpu_extension, quantization as Q  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    fn()                                  # warm-up (and compile, for inductor)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    module = cpu_extension.load("quantize")
    if module is None:
        raise SystemExit("the C++ kernel csrc/quantize.cpp did not build here; nothing to compare")
    g = torch.Generator().manual_seed(0)
    per = args.numel // args.params
    shards = [torch.randn(per, generator=g) for _ in range(args.params)]
    world, block = args.world_size, Q.BLOCK
    n = per * args.params
    gathered = torch.cat([Q._pack_torch([torch.randn(per, generator=g) for _ in range(args.params)], block)
                          for _ in range(world)])
    chunks = [per] * args.params
    grads = [torch.randn(world * per, generator=g) for _ in range(args.params)]
    rows = Q._rows_torch(grads, world, block)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = {name: torch.compile(fn, dynamic=False) for name, fn in (
            ("pack", Q._pack_torch), ("unpack", Q._unpack_torch), ("rows", Q._rows_torch), ("reduce", Q._reduce_torch))}
    cases = {
        "quantize_pack": (lambda: module.quantize_pack(shards, block), lambda: Q._pack_torch(shards, block),
                          lambda: compiled["pack"](shards, block)),
        "dequantize_unpack": (lambda: module.dequantize_unpack(gathered, world, chunks, block, torch.float32),
                              lambda: Q._unpack_torch(gathered, world, chunks, block, torch.float32),
                              lambda: compiled["unpack"](gathered, world, chunks, block, torch.float32)),
        "quantize_rows": (lambda: module.quantize_rows(grads, world, block), lambda: Q._rows_torch(grads, world, block),
                          lambda: compiled["rows"](grads, world, block)),
        "dequantize_reduce": (lambda: module.dequantize_reduce(rows, world, n, block, torch.float32, float(world)),
                              lambda: Q._reduce_torch(rows, world, n, block, torch.float32, float(world)),
                              lambda: compiled["reduce"](rows, world, n, block, torch.float32, float(world))),
    }
    results = {}
    for name, (cpp, eager, inductor) in cases.items():
        ms = {"cpp": _median_ms(cpp, args.reps), "torch eager": _median_ms(eager, args.reps),
              "torch inductor": _median_ms(inductor, args.reps)}
        results[name] = {"ms": ms, "ratio_to_cpp": {k: v / ms["cpp"] for k, v in ms.items()}}
    return {"config": vars(args) | {"out": str(args.out)}, "torch": torch.__version__, "results": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=16 * 2**20, help="elements per rank's bucket")
    p.add_argument("--params", type=int, default=64, help="shards (parameters) in the bucket")
    p.add_argument("--world-size", type=int, default=2, help="rows of the gathered / received buffers")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS / "quantize.json")
    args = p.parse_args(argv)
    if args.numel < args.params or args.params < 1 or args.world_size < 1 or args.reps < 1:
        p.error("need --numel >= --params >= 1, --world-size >= 1, --reps >= 1")
    result = run(args)
    print(f"{'op':<20} {'C++ ms':>9} {'torch eager':>16} {'torch inductor':>16}")
    for name, r in result["results"].items():
        ms, ratio = r["ms"], r["ratio_to_cpp"]
        print(f"{name:<20} {ms['cpp']:9.2f} {ms['torch eager']:9.2f} (x{ratio['torch eager']:4.1f}) "
              f"{ms['torch inductor']:9.2f} (x{ratio['torch inductor']:4.1f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
