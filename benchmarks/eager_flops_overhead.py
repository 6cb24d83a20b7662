"""What counting the FLOPs of eager code costs (``runtime/eager_flops.py``): step time with the
counting on (as shipped) against the same training with it off, on 2 gloo ranks.

    python benchmarks/eager_flops_overhead.py [--stage 3] [--layers 4] [--d-model 256]
                                              [--rounds 10] [--repeats 3] [--inner-compiler eager] [--quick]

The demo GPT (``examples/train_gpt.py``'s) with a graph break inside its block loop (the model's
forward runs eagerly around the compiled blocks: the embedding, final norm, head and loss are
eager), compiled with ``backend="zero"`` at ``--stage``, and the same GPT compiled per block
(torchtitan's ``block.compile(...)``, the root eager). Systems, each in ranks of its own:

- ``<model>``: as shipped, the eager ops counted by a dispatch mode;
- ``<model>, counting off``: the same with ``EagerRegions._count_for`` replaced by a no-op in
  that system's processes (the only way to turn the counting off: it has no option).

Reported per system: the median over timed rounds (of every repeat: the systems run in turn)
of the slowest rank's step, and the ratio of counting on to counting off. Results:
``<out>/eager_flops_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_harness import prepare_main, result_header, write_results  # noqa: E402
from common import (RESULTS, add_timed_gpt_arguments, apply_quick, break_graph_in_loop, load_example, systems_in_turn,
                    timed_gpt_steps)  # noqa: E402

SYSTEMS = ("loop break", "loop break, counting off", "per block", "per block, counting off")


def rank_main(rank: int, world: int, args, system: str) -> dict:
    import zerocompile
    from zerocompile.runtime.eager_regions import EagerRegions

    if system.endswith("counting off"):
        EagerRegions._count_for = lambda self, unit: None       # this process only
    example = load_example()
    options = {"stage": args.stage, "inner_compiler": args.inner_compiler}
    torch.manual_seed(args.seed)
    model = example.GPT(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
    if system.startswith("loop break"):
        compiled = torch.compile(break_graph_in_loop(model), backend="zero", options=options)
    else:
        for block in model.blocks:
            block.compile(backend="zero", options=options)
        compiled = model
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    step_ms, losses = timed_gpt_steps(compiled, opt, example, args, rank, world)
    return {"step_ms": step_ms, "losses": losses,
            "flops_per_step": zerocompile.stats().flops_per_step}


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timed_gpt_arguments(p)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    apply_quick(args)
    prepare_main()
    results = systems_in_turn(SYSTEMS, rank_main, args)
    lines = ["| system | step ms (median, slowest rank) | per repeat | ratio to counting off | flops_per_step |",
             "|---|---|---|---|---|"]
    for system, r in results.items():
        base = results[system.replace(", counting off", "") + ", counting off"]["step_ms"]
        r["ratio"] = r["step_ms"] / base
        repeats = ", ".join(f"{ms:.1f}" for ms in r["repeat_ms"])
        lines.append(f"| {system} | {r['step_ms']:.2f} | {repeats} | x{r['ratio']:.3f} | {r['flops_per_step']:,} |")
    print("\n".join(lines))
    result = {**result_header("eager_flops_overhead", args, argv), "systems": results}
    write_results(args.out, "eager_flops_overhead", result,
                  f"What counting eager FLOPs costs (2 gloo ranks, stage {args.stage}, GPT {args.layers} blocks of "
                  f"width {args.d_model}, {args.batch} x {args.seq_len} tokens per rank, {args.inner_compiler} inner "
                  f"compiler, {args.rounds} timed rounds)", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
