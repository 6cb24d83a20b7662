"""What each collective costs on this machine's process group, for one gradient-sized buffer.

ZeRO stages 1 and 2 replace DDP's all-reduce of the gradients by a reduce-scatter (before the
optimizer step) and an all-gather of the updated parameters (after it). With ring algorithms the
two move the same bytes as the one all-reduce, so where the backend implements them as rings
(NCCL) the stages cost DDP's communication. This script measures whether the backend at hand
does: each collective on the same number of gradient elements, in buckets of ``--bucket-mb``
(as zerocompile's optimizer step issues them, into buffers allocated once), timed from a
barrier, median of ``--reps``::

    python benchmarks/collectives.py                  # 2 gloo ranks, 42M fp32 elements
    python benchmarks/collectives.py --numel 4200000 --world-size 4

It also times the point-to-point transfers zerocompile can run in their place
(``gradient_reduction`` / ``parameter_gather="point_to_point"``, ``runtime/point_to_point.py``):
as compiled graphs run them (each sends a copy of its input) and as the stage 1-2 optimizer step
runs them, in place (the gather receives straight into the buffer that holds this rank's shard,
the reduce-scatter sends the rows from the buffer itself); and the same four through the ranks'
shared-memory segment instead of gloo's sockets (``"shared_memory"``, ``runtime/shared_memory.py``).
It prints ms per collective kind and the ratio to the all-reduce, and writes
``results/collectives.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, spawn_ranks, two_in_flight  # noqa: E402


def rank_main(rank: int, world: int, args) -> dict:
    per_bucket = max(world, args.bucket_mb * 2**20 // 4 // world * world)
    buckets = [torch.randn(min(per_bucket, args.numel - start)) for start in range(0, args.numel, per_bucket)]
    buckets = [b[: b.numel() // world * world] for b in buckets if b.numel() >= world]
    shards = [b.new_empty(b.numel() // world) for b in buckets]

    def all_reduce():
        for b in buckets:
            dist.all_reduce(b)

    def reduce_scatter():
        for b, s in zip(buckets, shards):
            dist.reduce_scatter_single(s, b)

    def all_gather():
        for b, s in zip(buckets, shards):
            dist.all_gather_single(b, s)

    from zerocompile.runtime import point_to_point  # noqa: F401  (registers the op)

    group_name = dist.group.WORLD.group_name

    p2p = torch.ops.zerocompile

    def point_to_point_gather(shm):       # parameter_gather="point_to_point", as compiled graphs send it
        for b, s in zip(buckets, shards):
            p2p.all_gather_point_to_point_out(s, world, group_name, b, True, shm)
            yield b

    def point_to_point_reduce_scatter(shm):   # gradient_reduction="point_to_point", as compiled graphs send it
        for b in buckets:
            yield p2p.reduce_scatter_point_to_point(b, "sum", world, group_name, True, shm)

    def point_to_point_gather_in_place(shm):      # the step's form: the replica receives into itself
        for b in buckets:
            p2p.all_gather_point_to_point_into([b.view(world, -1)[rank]], [b], world, group_name, shm)
            yield b

    def point_to_point_reduce_scatter_in_place(shm):   # the stage 1 step's form: rows sent from the gradient
        for b, s in zip(buckets, shards):
            p2p.reduce_scatter_point_to_point_into([b], [s], world, group_name, shm)
            yield s

    kinds = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather}
    # the transfers through the sockets, then through the ranks' shared-memory segment ("shared_memory")
    for prefix, shm in (("point_to_point", False), ("shared_memory", True)):
        for form, started in (("reduce_scatter", point_to_point_reduce_scatter), ("gather", point_to_point_gather),
                              ("reduce_scatter_in_place", point_to_point_reduce_scatter_in_place),
                              ("gather_in_place", point_to_point_gather_in_place)):
            kinds[f"{prefix}_{form}"] = lambda started=started, shm=shm: two_in_flight(started(shm))
    times = {k: [] for k in kinds}
    for rep in range(args.reps + 1):                  # the first round warms up
        for name, fn in kinds.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if rep:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn")
    p.add_argument("--numel", type=int, default=42_090_000, help="fp32 gradient elements (the 42M bench GPT)")
    p.add_argument("--bucket-mb", type=int, default=25, help="bucket size, zerocompile's default bucket_mb")
    p.add_argument("--reps", type=int, default=4, help="timed rounds (median)")
    p.add_argument("--out", type=Path, default=RESULTS / "collectives.json")
    args = p.parse_args(argv)
    per_rank = spawn_ranks(args.world_size, rank_main, (args,))
    slowest = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    ratio = {k: v / slowest["all_reduce"] for k, v in slowest.items()}
    mib = args.numel * 4 / 2**20
    print(f"{args.world_size} gloo ranks, {args.numel:,} fp32 elements ({mib:.0f} MiB) in {args.bucket_mb} MiB "
          f"buckets, median of {args.reps}, slowest rank; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print("| collective | ms | × all-reduce |\n|---|---|---|")
    for k in slowest:
        print(f"| {k.replace('_', '-')} | {slowest[k]:.1f} | ×{ratio[k]:.2f} |")
    stages = slowest["reduce_scatter"] + slowest["all_gather"]
    print(f"ZeRO stages 1-2 (reduce-scatter + all-gather): {stages:.1f} ms = ×{stages / slowest['all_reduce']:.2f} "
          "DDP's all-reduce (a ring implementation of both: ×1.00)")
    p2p = slowest["point_to_point_reduce_scatter"] + slowest["point_to_point_gather"]
    print(f"the same point to point (gradient_reduction / parameter_gather='point_to_point'): {p2p:.1f} ms = "
          f"×{p2p / slowest['all_reduce']:.2f} DDP's all-reduce; the transfers take "
          f"×{slowest['point_to_point_reduce_scatter'] / slowest['reduce_scatter']:.2f} the reduce-scatter's time and "
          f"×{slowest['point_to_point_gather'] / slowest['all_gather']:.2f} the all-gather's")
    in_place = slowest["point_to_point_reduce_scatter_in_place"] + slowest["point_to_point_gather_in_place"]
    print(f"in place, as the stage 1-2 optimizer step runs them: {in_place:.1f} ms = "
          f"×{in_place / slowest['all_reduce']:.2f} DDP's all-reduce")
    shm = slowest["shared_memory_reduce_scatter"] + slowest["shared_memory_gather"]
    shm_in_place = slowest["shared_memory_reduce_scatter_in_place"] + slowest["shared_memory_gather_in_place"]
    print(f"through shared memory (gradient_reduction / parameter_gather='shared_memory'): {shm:.1f} ms = "
          f"×{shm / slowest['all_reduce']:.2f} DDP's all-reduce (×{shm / p2p:.2f} the sockets' transfers); in place "
          f"{shm_in_place:.1f} ms = ×{shm_in_place / slowest['all_reduce']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                    "torch": torch.__version__, "cpu_count": os.cpu_count(),
                                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "ms": slowest, "x_all_reduce": ratio, "stages_1_2_x_all_reduce":
                                    stages / slowest["all_reduce"]}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
