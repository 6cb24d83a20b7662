"""What monitoring costs: step time with the monitors, the comms logger and the flops profiler on,
against the same training without them, on 2 gloo ranks.

    python benchmarks/monitoring_overhead.py [--stage 3] [--layers 4] [--d-model 256]
                                             [--rounds 10] [--repeats 3] [--inner-compiler eager] [--quick]

A GPT (``examples/train_gpt.py``'s) compiled with ``backend="zero"`` at ``--stage``, trained with
``ZeroOptimizer(AdamW)``. Each system runs in ranks of its own (the comms logger's settings are
per process, so a system beside it would be timed too):

- ``plain``: no monitoring;
- ``tensorboard + csv``: DeepSpeed's ``tensorboard`` and ``csv_monitor`` keys (rank 0 writes every
  step's figures; every rank gathers them);
- ``comms_logger``: ``{"enabled": true}`` (each collective made blocking and timed);
- ``comms_logger overlapped``: ``{"enabled": true, "blocking": false}`` (the compiled schedule kept);
- ``flops_profiler``: ``profile_step: 1``: the timed steps come after the profiled one, so they
  measure what the module marks cost when they do not stamp (with inductor: the fusions they
  prevent).

Reported per system: the median over timed rounds (of every repeat: the systems run in turn
``--repeats`` times, as this machine's speed drifts by several percent over a minute) of the
slowest rank's step (forward, backward, ``opt.step()``, ``zero_grad()``, after a barrier), each
repeat's median, the ratio to ``plain``, and how far the losses are from ``plain``'s. Results:
``<out>/monitoring_overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_harness import prepare_main, result_header, write_results  # noqa: E402
from common import (RESULTS, add_timed_gpt_arguments, apply_quick, load_example, systems_in_turn,  # noqa: E402
                    timed_gpt_steps)

SYSTEMS = {
    "plain": {},
    "tensorboard + csv": {"tensorboard": {"enabled": True, "job_name": "tb"},
                          "csv_monitor": {"enabled": True, "job_name": "csv"}},
    "comms_logger": {"comms_logger": {"enabled": True}},
    "comms_logger overlapped": {"comms_logger": {"enabled": True, "blocking": False}},
    "flops_profiler": {"flops_profiler": {"enabled": True, "profile_step": 1, "output_file": "profile.txt"}},
}


def rank_main(rank: int, world: int, args, system: str) -> dict:
    with tempfile.TemporaryDirectory() as out:     # where this rank's monitors write (rank 0's do)
        return _timed(rank, world, args, system, out)


def _timed(rank: int, world: int, args, system: str, out: str) -> dict:
    import zerocompile

    example = load_example()
    options = {"zero_optimization": {"stage": args.stage}, "inner_compiler": args.inner_compiler}
    for key, value in SYSTEMS[system].items():       # the monitors' files go to a scratch folder
        value = dict(value)
        if "job_name" in value:
            value["output_path"] = out
        if "output_file" in value:
            value["output_file"] = str(Path(out) / value["output_file"])
        options[key] = value
    torch.manual_seed(args.seed)
    model = example.GPT(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
    compiled = torch.compile(model, backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    step_ms, losses = timed_gpt_steps(compiled, opt, example, args, rank, world)
    zerocompile.close_monitors()
    return {"step_ms": step_ms, "losses": losses}


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timed_gpt_arguments(p)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    apply_quick(args)
    prepare_main()
    results = systems_in_turn(SYSTEMS, rank_main, args)
    base = results["plain"]["step_ms"]
    lines = ["| system | step ms (median, slowest rank) | per repeat | ratio to plain | losses: max rel. diff to "
             "plain's |", "|---|---|---|---|---|"]
    for system, r in results.items():
        r["ratio"] = r["step_ms"] / base
        # equal with the eager inner compiler; inductor fuses differently around the profiler's marks
        r["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], results["plain"]["losses"]))
        repeats = ", ".join(f"{ms:.1f}" for ms in r["repeat_ms"])
        lines.append(f"| {system} | {r['step_ms']:.2f} | {repeats} | x{r['ratio']:.3f} | {r['max_rel_loss_diff']:.1e} |")
    print("\n".join(lines))
    result = {**result_header("monitoring_overhead", args, argv), "systems": results}
    write_results(args.out, "monitoring_overhead", result,
                  f"What monitoring costs (2 gloo ranks, stage {args.stage}, GPT {args.layers} blocks of width "
                  f"{args.d_model}, {args.batch} x {args.seq_len} tokens per rank, {args.inner_compiler} inner "
                  f"compiler, {args.rounds} timed rounds)", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
