"""What the collective watchdog costs (``collective_timeout_s``, ``runtime/collective_watch.py``):
step time with it on (as shipped, 60 s) against the same training with it off (``None``), on 2
gloo ranks.

    python benchmarks/watchdog_overhead.py [--layers 4] [--d-model 256] [--rounds 10]
                                           [--repeats 3] [--inner-compiler eager] [--quick]

The demo GPT (``examples/train_gpt.py``'s) compiled whole with ``backend="zero"`` at stages 3 and 2,
each with the watchdog on and off; each system runs in ranks of its own, the systems in turn,
``--repeats`` times (the machine drifts). With it on, every collective starts through
``torch.distributed`` and registers a watched ``Work``, and the responder thread looks at the
store once a second; with it off, the functional collectives run as they are. Reported per
system: the median over timed rounds of the slowest rank's step, the ratio of on to off, and
whether the losses are the same bit for bit (they must be: the watchdog moves no value). Results:
``<out>/watchdog_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_harness import prepare_main, result_header, write_results  # noqa: E402
from common import (RESULTS, add_timed_gpt_arguments, apply_quick, load_example, systems_in_turn,  # noqa: E402
                    timed_gpt_steps)

SYSTEMS = ("stage 3, watchdog on", "stage 3, watchdog off", "stage 2, watchdog on", "stage 2, watchdog off")


def rank_main(rank: int, world: int, args, system: str) -> dict:
    import zerocompile

    stage = int(system.split(",")[0].split()[1])
    timeout = 60.0 if system.endswith("on") else None
    example = load_example()
    torch.manual_seed(args.seed)
    model = example.GPT(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": args.inner_compiler,
                                                             "collective_timeout_s": timeout})
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    step_ms, losses = timed_gpt_steps(compiled, opt, example, args, rank, world)
    return {"step_ms": step_ms, "losses": losses}


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timed_gpt_arguments(p)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    apply_quick(args)
    prepare_main()
    results = systems_in_turn(SYSTEMS, rank_main, args)
    lines = ["| system | step ms (median, slowest rank) | per repeat | ratio on / off | losses equal to off |",
             "|---|---|---|---|---|"]
    for system, r in results.items():
        off = results[system.replace("watchdog on", "watchdog off")]
        r["ratio"] = r["step_ms"] / off["step_ms"]
        r["losses_equal"] = r["losses"] == off["losses"]
        repeats = ", ".join(f"{ms:.1f}" for ms in r["repeat_ms"])
        lines.append(f"| {system} | {r['step_ms']:.2f} | {repeats} | x{r['ratio']:.3f} | {r['losses_equal']} |")
    print("\n".join(lines))
    result = {**result_header("watchdog_overhead", args, argv), "systems": results}
    write_results(args.out, "watchdog_overhead", result,
                  f"What the collective watchdog costs (2 gloo ranks, GPT {args.layers} blocks of width {args.d_model}, "
                  f"{args.batch} x {args.seq_len} tokens per rank, {args.inner_compiler} inner compiler, "
                  f"{args.rounds} timed rounds x {args.repeats} repeats); the per-repeat medians show the noise",
                  lines)
    return 0 if all(r["losses_equal"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
