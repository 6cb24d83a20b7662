"""What CPython's stack-chunk thrashing costs a compile, and what ``zerocompile/deep_stack.py``
wins back, in fresh processes taking turns.

    python benchmarks/deep_stack.py [--rounds 2] [--layers 4] [--depths 0 6 12 18] [--quick]

On Python 3.11 and 3.12 a call whose frame crosses the end of a 16 KiB stack chunk maps a new
chunk and unmaps it on return (CPython issue gh-142183); a loop that does so on every call spends
most of its time in the kernel. Whether a given loop does depends on how deep the stack already is,
so each process first calls down ``depth`` extra frames (as a user's code sits some frames deep:
HF's ``Trainer.train`` is five frames above the model call), then does what
``compile_collection.py`` does: an HF Llama of ``--layers`` layers compiled whole at stage 3 (rank
0 of torch's fake process group of 2 ranks), 3 steps, twice (Dynamo reset between; the first run
pays the lazy imports). Systems:

- ``plain call``: the backend's compile called as a plain function (the deep stack replaced in
  that process);
- ``backend deep`` (as shipped): each ``backend="zero"`` compile runs from ``on_a_deep_stack``;
- ``loop deep``: as shipped, and the whole loop run with ``on_a_deep_stack(loop)``, as the
  docs suggest for a training script (Dynamo's tracing then runs on the deep stack too).

Reported: per system and run, the median wall time over rounds and depths, the minor page faults
(``getrusage``: each chunk mapped anew faults at least once) and the ratio to ``plain call``, paired
by round and depth; the losses must be bit for bit the same in every system. Results:
``<out>/deep_stack.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_harness import prepare_main, result_header, write_results  # noqa: E402
from common import RESULTS  # noqa: E402
from compile_collection import RUNS, run_child, train_llama_whole  # noqa: E402

SYSTEMS = ("plain call", "backend deep", "loop deep")


def _down(depth: int, fn):
    """``fn()``, called ``depth`` frames further down the stack."""
    return fn() if depth <= 0 else _down(depth - 1, fn)


def child(system: str, layers: int, inner: str, depth: int) -> dict:
    """In a fresh process: each run's wall time, minor page faults and losses."""
    import resource
    import time

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerocompile import backend
    from zerocompile.deep_stack import on_a_deep_stack

    if system == "plain call":
        backend.on_a_deep_stack = lambda fn, *args, **kwargs: fn(*args, **kwargs)
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def one_run():
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        losses = train_llama_whole(layers, inner)
        return {"wall_s": time.perf_counter() - started, "losses": losses,
                "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}

    out = {}
    for run in RUNS:
        torch.compiler.reset()
        out[run] = _down(depth, (lambda: on_a_deep_stack(one_run)) if system == "loop deep" else one_run)
    dist.destroy_process_group()
    return out


def measure(system: str, depth: int, args) -> dict:
    return run_child(__file__, system, args, "--depths", str(depth))


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="processes per system and depth, the systems in turn")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--depths", type=int, nargs="+", default=[0, 6, 12, 18],
                   help="extra frames on the stack under the training loop")
    p.add_argument("--inner-compiler", choices=("eager", "inductor"), default="eager")
    p.add_argument("--quick", action="store_true", help="one round, one depth, 2 layers")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.inner_compiler, args.depths[0])))
        return 0
    if args.quick:
        args.rounds, args.layers, args.depths = 1, 2, args.depths[:1]
    prepare_main()
    samples = []        # one per round and depth: {system: child's result}
    for r in range(args.rounds):
        for depth in args.depths:
            order = SYSTEMS if (r + depth) % 2 == 0 else SYSTEMS[::-1]
            samples.append({"round": r, "depth": depth, **{system: measure(system, depth, args) for system in order}})
    same = all(s[system][run]["losses"] == s["plain call"][run]["losses"]
               for s in samples for system in SYSTEMS for run in RUNS)
    lines = ["| run | system | wall s (median) | minor page faults (median) | / plain call (paired median) | range |",
             "|---|---|---:|---:|---:|---|"]
    table = {}
    for run in RUNS:
        for system in SYSTEMS:
            walls = [s[system][run]["wall_s"] for s in samples]
            ratios = [s[system][run]["wall_s"] / s["plain call"][run]["wall_s"] for s in samples]
            entry = {"wall_s": statistics.median(walls), "faults": statistics.median(s[system][run]["faults"]
                                                                                    for s in samples),
                     "paired_ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
            table.setdefault(run, {})[system] = entry
            ratio = "" if system == "plain call" else f"x{entry['paired_ratio']:.3f}"
            span = "" if system == "plain call" else f"x{entry['ratio_min']:.2f}-{entry['ratio_max']:.2f}"
            lines.append(f"| {run} | {system} | {entry['wall_s']:.2f} | {entry['faults']:.0f} | {ratio} | {span} |")
    lines += ["", f"- losses of the three systems bit for bit the same in every process: {same}",
              f"- Python {sys.version.split()[0]}; depths {args.depths}, {args.rounds} round(s)"]
    print("\n".join(lines))
    result = {**result_header("deep_stack", args, argv), "table": table, "samples": samples, "losses_equal": same}
    write_results(args.out, "deep_stack", result,
                  f"CPython's stack-chunk thrashing in a compile: HF Llama of {args.layers} layers compiled whole "
                  f"at stage 3 ({args.inner_compiler} inner compiler, rank 0 of 2, fake process group), 3 steps, "
                  f"twice per process; the loop {args.depths} frames deep; fresh processes in turn", lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
