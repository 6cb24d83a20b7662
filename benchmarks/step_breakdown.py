"""Where one training step's time goes: ``torch.profiler`` over the steps of each system, on rank 0.

    python benchmarks/step_breakdown.py [--workload gpt-40m] [--systems fsdp2 zero3] [--steps 3]
                                        [--top-ops 12] [--quick] [--out benchmarks/results]

Issue 10 asks, where a speed target is missed, what the profile shows. This builds the systems
of ``benchmarks/run.py`` (same workloads, seeds, optimizers and inner compiler), runs two
untimed steps of each (the first compiles), then profiles ``--steps`` steps of each, one
system after the other, on every rank (2 gloo ranks by default), and reports rank 0's:

- the step's wall time under the profiler (which slows every op; compare systems, not runs);
- self CPU time per step by op class: **compute** (matmuls, attention, pointwise and
  reductions), **copies** (copies, concatenations, splits, allocations, views: the data
  movement around the collectives), **collectives** (enqueues and waits, so the
  communication compute did not hide; for FSDP2 also the own time of its annotated
  all-gather and reduce ranges), **optimizer** (the fused Adam steps), **other** (the rest,
  mostly the own time of annotated ranges: Python);
- the ops that pack and unpack the collectives' buffers (zerocompile's ``pack_shards``,
  ``pack_gradients``, ``unpack_gathered_bucket``, which is gone where a bucket's gather lands
  straight in its parameters through shared memory; FSDP2's ``all_gather_copy_in``,
  ``split_with_sizes_copy``, ``chunk_cat``) with their time including the copies inside them;
- the ``--top-ops`` compute ops with the most self time, with their calls per step;
- the matmuls' time, and what it would be at the speed of the same calls (op and shapes) run
  with no collective alongside (``matmul_contention``; from a second profile of as many steps
  with shapes recorded; recording shapes adds its own overhead to every op, so the classes come
  from the first profile).

Self CPU time is summed over every thread the profiler saw (gloo's included), so the classes
need not add up to the wall time. Results: ``<out>/step_breakdown.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import run as bench  # noqa: E402
from common import load_example, spawn_ranks  # noqa: E402

COMM = ("wait", "gloo", "c10d", "all_gather", "allgather", "reduce_scatter", "allreduce", "all_reduce", "barrier")
OPTIMIZER = ("adam", "_foreach")
COPIES = ("copy", "cat", "split", "chunk", "narrow", "slice", "view", "reshape", "as_strided", "empty", "zero_",
          "fill", "resize", "set_", "detach", "clone", "permute", "transpose", "expand", "unsqueeze", "squeeze",
          "contiguous", "unpack", "pack", "new_", "select", "alias")
PACKING = ("zerocompile::pack_shards", "zerocompile::pack_gradients", "zerocompile::unpack_gathered_bucket",
           "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat")


def op_class(name: str) -> str:
    """The class of a profiler event by its name (see the module docstring)."""
    if name in PACKING:
        return "copies"
    n = name.lower()
    if n.startswith("fsdp::"):
        # FSDP2's annotated ranges: their own time is the Python around the ops they hold and,
        # for the collectives' ranges, the waits
        return "collectives" if "all_gather" in n or "reduce" in n else "other"
    if n.startswith("zerocompile::") and "adam" not in n:
        return "other"
    if any(k in n for k in COMM):
        return "collectives"
    if any(k in n for k in OPTIMIZER):
        return "optimizer"
    if any(k in n for k in COPIES) or n == "aten::t":
        return "copies"
    if n.startswith("aten::"):
        return "compute"
    return "other"


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def matmul_contention(events, steps: int) -> dict:
    """How much longer the matmuls took because a collective ran at the same time.

    ``events`` are the profiler's events (``name``, ``time_range.start``/``.end`` in us,
    ``input_shapes``). A matmul runs *during a collective* when its interval overlaps a gloo
    collective's (``gloo:*`` ranges, which gloo's worker thread records while it moves and
    reduces the data). Every matmul call is priced at the mean time of the calls of the same op
    and shapes that ran with no collective alongside (its *idle speed*); calls whose op and
    shapes never ran idle keep their own time. Returns ms per step of all matmuls, what they
    would take at idle speed, and the share of calls that ran during a collective."""
    busy = sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.name.startswith("gloo:") and e.name != "gloo:barrier")

    def overlaps(start, end):
        return any(a < end and b > start for a, b in busy)

    calls = collections.defaultdict(list)
    for e in events:
        if e.name in MATMULS:
            key = (e.name, str(getattr(e, "input_shapes", "")))
            calls[key].append((e.time_range.end - e.time_range.start, overlaps(e.time_range.start, e.time_range.end)))
    total = idle_speed = during = 0.0
    n = 0
    for runs in calls.values():
        idle = [us for us, hit in runs if not hit]
        mean_idle = sum(idle) / len(idle) if idle else None
        for us, hit in runs:
            total += us
            idle_speed += us if mean_idle is None else mean_idle
            during += hit
            n += 1
    return {"matmul_ms": total / 1e3 / steps, "matmul_idle_speed_ms": idle_speed / 1e3 / steps,
            "share_during_collective": during / n if n else 0.0}


def rank_main(rank: int, world: int, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    spec = bench.workload_spec(args.workload, args.quick)
    example = load_example()
    systems = [bench.build_system(name, args, spec, example, torch.device("cpu"), []) for name in args.systems]
    g = torch.Generator().manual_seed(args.seed + rank)

    def batch():
        x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]), generator=g)
        return x, x.roll(-1, 1)

    for _ in range(2):                    # the first step compiles; the second is untimed too
        x, y = batch()
        for system in systems:
            dist.barrier()
            system.train_step(x, y, measure=False)
    def profiled(system, record_shapes):
        times = []
        with profile(activities=[ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
            for _ in range(args.steps):
                x, y = batch()
                dist.barrier()
                start = time.perf_counter()
                float(system.train_step(x, y, measure=False))
                times.append(time.perf_counter() - start)
        return prof, 1e3 * sum(times) / len(times)

    out = {}
    for system in systems:
        prof, step_ms = profiled(system, record_shapes=False)
        classes = collections.Counter()
        packing = {}
        compute_ops = {}
        for event in prof.key_averages():
            classes[op_class(event.key)] += event.self_cpu_time_total / 1e3 / args.steps
            if op_class(event.key) == "compute":
                compute_ops[event.key] = {"ms": event.self_cpu_time_total / 1e3 / args.steps,
                                          "calls": event.count // args.steps}
            if event.key in PACKING:
                packing[event.key] = {"ms": event.cpu_time_total / 1e3 / args.steps, "calls": event.count // args.steps}
        top = sorted(compute_ops.items(), key=lambda kv: -kv[1]["ms"])[:args.top_ops]
        # a second profile with shapes, to price each matmul at the idle speed of its own
        # shapes; recording shapes adds its own overhead to every op, so the classes above come
        # from a profile without it
        shaped, _ = profiled(system, record_shapes=True)
        out[system.name] = {"step_ms": step_ms, "classes_ms": dict(classes), "packing": packing,
                            "compute_ops": dict(top), "contention": matmul_contention(shaped.events(), args.steps)}
    return out


def format_markdown(result: dict) -> str:
    lines = [f"# Where a step's time goes: {result['config']['workload']}, {result['config']['world_size']} gloo ranks, "
             f"rank 0 under torch.profiler", "",
             f"`python benchmarks/step_breakdown.py --workload {result['config']['workload']} --systems "
             f"{' '.join(result['config']['systems'])} --steps {result['config']['steps']}"
             f"{' --quick' if result['config']['quick'] else ''}` ({result['date']}, "
             f"torch {result['torch']}). ms per step, self CPU time by op class (every thread).", ""]
    names = list(result["systems"])
    lines += ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines.append("| step (profiled) | " + " | ".join(f"{result['systems'][n]['step_ms']:.1f}" for n in names) + " |")
    for cls in ("compute", "copies", "collectives", "optimizer", "other"):
        lines.append(f"| {cls} | " + " | ".join(f"{result['systems'][n]['classes_ms'].get(cls, 0.0):.1f}"
                                                for n in names) + " |")
    lines += ["", "Packing and unpacking the collectives' buffers (ms per step, copies inside included; calls per step):", ""]
    for n in names:
        for op, v in sorted(result["systems"][n]["packing"].items()):
            lines.append(f"- {n}: `{op}` {v['ms']:.1f} ms, {v['calls']} calls")
    lines += ["", "Matmuls (mm, addmm, bmm, baddbmm) slowed by a collective running alongside (see matmul_contention):", ""]
    for n in names:
        c = result["systems"][n]["contention"]
        lines.append(f"- {n}: {c['matmul_ms']:.1f} ms per step; {c['matmul_idle_speed_ms']:.1f} ms at the speed of the "
                     f"same calls with no collective alongside; {100 * c['share_during_collective']:.0f}% of the calls "
                     f"ran during a collective")
    ops = sorted({op for n in names for op in result["systems"][n].get("compute_ops", {})},
                 key=lambda op: -max(result["systems"][n].get("compute_ops", {}).get(op, {"ms": 0})["ms"] for n in names))
    if ops:
        lines += ["", "The compute ops with the most self time (ms per step / calls per step; - where not in a system's top list):",
                  "", "| op | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for op in ops:
            cells = []
            for n in names:
                v = result["systems"][n]["compute_ops"].get(op)
                cells.append(f"{v['ms']:.1f} / {v['calls']}" if v else "-")
            lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gpt-40m", choices=bench.WORKLOADS)
    p.add_argument("--systems", nargs="+", default=["fsdp2", "zero3"], choices=bench.SYSTEMS)
    p.add_argument("--steps", type=int, default=3, help="profiled steps per system")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--inner-compiler", default="inductor", choices=("inductor", "eager"),
                   help="for workloads that do not fix it (gpt-40m and --quick use eager)")
    p.add_argument("--quick", action="store_true", help="the tiny model of run.py --quick")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-ops", type=int, default=12, help="compute ops listed per system, by self time")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.steps < 1 or args.world_size < 1:
        p.error("--steps and --world-size must be >= 1")
    ranks = spawn_ranks(args.world_size, rank_main, (args,))
    result = {"config": {"workload": args.workload, "systems": args.systems, "steps": args.steps,
                         "world_size": args.world_size, "quick": args.quick},
              "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
              "machine": platform.machine(), "systems": ranks[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_breakdown.json").write_text(json.dumps(result, indent=1))
    md = format_markdown(result)
    (args.out / "step_breakdown.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
