"""Benchmark zerocompile ZeRO-3 against PyTorch FSDP2 on the same model, data and seed.

Run on this machine's CPUs (the script spawns ``--world-size`` gloo ranks itself)::

    python benchmarks/stage3_vs_fsdp2.py                          # inductor, 2 ranks
    python benchmarks/stage3_vs_fsdp2.py --inner-compiler eager
    python benchmarks/stage3_vs_fsdp2.py --quick                   # small model, ~1 minute

Three systems train the GPT of ``examples/train_gpt.py`` (fp32, AdamW) side by side in
every rank:

- ``zero3``: ``torch.compile(model, backend="zero", options={"stage": 3, ...})`` with the
  default pass pipeline, optimizer wrapped in ``zerocompile.ZeroOptimizer``;
- ``zero3-profile``: the same with ``profile=True`` (the passes decide from times measured
  on the frame's graph at compile time instead of the estimates);
- ``zero3-nopass``: the same with every optional pass disabled (the list is read from the
  pass registry, minus ``cast_forward_inputs``, which fp32 does not run anyway);
- ``fsdp2``: ``fully_shard`` on each block and then on the root module, eager, no compile,
  with ``torch.optim.AdamW(fused=True)`` (torch's fastest AdamW, as zerocompile steps with
  its own fused kernel).

Each rank builds every model from the same seed and feeds every system the same batch at
the same step. The systems take turns inside each rank, one step each per round (the
starting system rotates every round), so drift in the machine's speed hits all alike.
Round 0 is the first step (for the zerocompile systems, the compile); then ``--warmup``
untimed rounds; then ``--steps`` timed rounds, each step timed from a barrier; then two
measurement rounds under dispatch modes (not timed: the modes slow every op down):

- peak live bytes during the step, by ``zerocompile.runtime.memory_tracker.LiveStorageTracker``
  (one per system, active while that system's model was built, so its parameters count; the
  peak of the second measurement round is reported, after the first has recorded every
  persistent storage);
- bytes communicated per step by a dispatch mode that counts both functional collectives
  (``torch.ops._c10d_functional``, what zerocompile's graphs issue) and the c10d ops that
  ``torch.distributed`` calls (``torch.ops.c10d``, what FSDP2 issues), with the bytes of the
  full buffer: all-gather output, reduce-scatter input, all-reduce tensor; and, for the
  zerocompile systems, ``zerocompile.stats()`` of the same step as a cross-check.

The losses of every step are compared with FSDP2's; a system whose loss differs by more
than ``--rtol`` (relative) at any step on any rank is reported as diverged, without speed
figures. Results go to a table on stdout and to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (MiB, RESULTS, CollectiveBytes, all_ranks_ok, error_line,  # noqa: E402
                    load_example, optional_pass_names, quantile, spawn_ranks)

SYSTEMS = ("zero3", "zero3-profile", "zero3-nopass", "fsdp2")
LABELS = {"zero3": "zerocompile stage 3", "zero3-profile": "zerocompile stage 3, profile=True",
          "zero3-nopass": "zerocompile stage 3, no optional passes",
          "fsdp2": "FSDP2 eager"}
REFERENCE = "fsdp2"
MEASURE_ROUNDS = 2
log = logging.getLogger("stage3_vs_fsdp2")


# --------------------------------------------------------------------------- presets
def preset(quick: bool) -> dict:
    """Model and run sizes: the default run (~4M parameters) or ``--quick`` (about a minute)."""
    if quick:
        return dict(vocab=256, seq_len=32, d_model=64, n_layers=2, n_heads=2, batch=2, steps=4, warmup=1)
    return dict(vocab=4096, seq_len=128, d_model=256, n_layers=4, n_heads=4, batch=4, steps=20, warmup=3)


# --------------------------------------------------------------------------- systems
@dataclass
class System:
    """One system under test inside one rank: its model, optimizer, meters and results."""

    name: str
    model: object = None
    opt: object = None
    tracker: object = None
    counter: CollectiveBytes = field(default_factory=CollectiveBytes)
    uses_zero: bool = False
    error: str | None = None
    first_s: float | None = None
    step_ms: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    peak_bytes: list = field(default_factory=list)
    comm: dict | None = None
    zero_stats: dict | None = None


def build_system(name: str, args, example, disabled: list[str]) -> System:
    """Build one system from the seed, under its own live-storage tracker."""
    from torch.distributed.fsdp import fully_shard

    import zerocompile
    from zerocompile.runtime.memory_tracker import LiveStorageTracker

    system = System(name, tracker=LiveStorageTracker(exact_peak=True, track_inputs=True),
                    uses_zero=name != "fsdp2")
    with system.tracker:
        torch.manual_seed(args.seed)
        model = example.GPT(args.vocab, args.seq_len, args.d_model, args.n_layers, args.n_heads)
        if name == "fsdp2":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            system.model = model
            # torch's fused AdamW: the fair peer of zerocompile's fused kernel (the CPU default is a for-loop)
            system.opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=True)
        else:
            options = {"stage": 3, "inner_compiler": args.inner_compiler}
            if name == "zero3-nopass":
                options["passes"] = {"disable": list(disabled)}
            if name == "zero3-profile":
                options["profile"] = True
            system.model = torch.compile(model, backend="zero", options=options)
            system.opt = zerocompile.ZeroOptimizer(system.model.parameters(), optimizer_class=torch.optim.AdamW,
                                                   lr=args.lr, weight_decay=args.weight_decay)
    return system


def train_step(system: System, x, y) -> torch.Tensor:
    """One optimizer step: forward, backward, step, zero_grad. Returns the (detached) loss."""
    loss = system.model(x, y)
    loss.backward()
    system.opt.step()
    system.opt.zero_grad()
    return loss.detach()


def run_round(systems: list[System], round_index: int, phase: str, batch) -> None:
    """One step of every live system, starting system rotated by the round number.

    ``phase``: ``first`` (time the step as the first-step time), ``warmup`` (untimed),
    ``timed`` (time it) or ``measure`` (under the tracker and collective counter)."""
    import zerocompile

    x, y = batch
    live = [s for s in systems if s.error is None]
    shift = round_index % len(live) if live else 0
    for system in live[shift:] + live[:shift]:
        error = None
        dist.barrier()
        start = time.perf_counter()
        try:
            if phase == "measure":
                system.counter.reset()
                if system.uses_zero:
                    zerocompile.reset_stats()
                with system.tracker, system.counter:
                    system.tracker.reset_peak()
                    loss = train_step(system, x, y)
                system.peak_bytes.append(system.tracker.peak)
                system.comm = {"totals": system.counter.totals, "ops": dict(system.counter.ops),
                               "unknown": dict(system.counter.unknown)}
                if system.uses_zero:
                    system.zero_stats = zerocompile.stats().as_dict()
            else:
                loss = train_step(system, x, y)
            elapsed = time.perf_counter() - start
            system.losses.append(float(loss))
            del loss
        except Exception:  # noqa: BLE001 - a system that fails is reported, the others go on
            error = traceback.format_exc()
            log.error("rank %d: %s failed in its %s step:\n%s", dist.get_rank(), system.name, phase, error)
        if not all_ranks_ok(error is None):
            system.error = error or "failed on another rank"
            continue
        if phase == "first":
            system.first_s = elapsed
        elif phase == "timed":
            system.step_ms.append(elapsed * 1e3)


def rank_main(rank: int, world: int, args) -> dict:
    """Everything one rank does; returns its figures."""
    example = load_example()
    try:
        disabled, note = optional_pass_names()
        pass_error = None
    except Exception:  # noqa: BLE001 - the zerocompile systems will fail and say why
        disabled, note, pass_error = [], None, traceback.format_exc()
    torch.manual_seed(args.seed)
    psi = sum(p.numel() for p in example.GPT(args.vocab, args.seq_len, args.d_model,
                                            args.n_layers, args.n_heads).parameters())

    systems = []
    for name in args.systems:
        try:
            systems.append(build_system(name, args, example, disabled))
        except Exception:  # noqa: BLE001
            systems.append(System(name, error=traceback.format_exc()))
    if pass_error is not None:
        for s in systems:
            if s.uses_zero and s.error is None:
                s.error = "could not list the optional passes:\n" + pass_error

    table = example.successor_table(args.vocab)
    total_rounds = 1 + args.warmup + args.steps + MEASURE_ROUNDS
    batches = []
    for step in range(total_rounds):
        x, y = example.global_batch(step, args.batch * world, args.seq_len, table)
        lo, hi = rank * args.batch, (rank + 1) * args.batch
        batches.append((x[lo:hi].clone(), y[lo:hi].clone()))

    # the first collectives of a process are slow: warm the process group up
    for _ in range(5):
        dist.all_reduce(torch.zeros(1024))
        dist.barrier()

    for r in range(total_rounds):
        if r == 0:
            phase = "first"
        elif r <= args.warmup:
            phase = "warmup"
        elif r <= args.warmup + args.steps:
            phase = "timed"
        else:
            phase = "measure"
        if rank == 0:
            log.info("round %d/%d (%s)", r + 1, total_rounds, phase)
        run_round(systems, r, phase, batches[r])

    return {
        "psi": psi, "disabled_passes": disabled, "pass_note": note,
        "systems": {s.name: {"error": s.error, "first_s": s.first_s, "step_ms": s.step_ms, "losses": s.losses,
                             "peak_bytes": s.peak_bytes, "comm": s.comm, "zero_stats": s.zero_stats}
                    for s in systems},
    }


# --------------------------------------------------------------------------- report
def summarise(ranks: list[dict], rtol: float) -> dict:
    """Combine the ranks' figures: per step the slowest rank's time, peaks and comm the max
    over ranks, and each system's largest relative loss difference from FSDP2."""
    out = {}
    names = list(ranks[0]["systems"])
    ref_ok = REFERENCE in names and all(r["systems"][REFERENCE]["error"] is None for r in ranks)
    ref_losses = [r["systems"][REFERENCE]["losses"] for r in ranks] if ref_ok else None
    for name in names:
        per_rank = [r["systems"][name] for r in ranks]
        errors = [p["error"] for p in per_rank if p["error"]]
        entry = {"label": LABELS[name], "status": "ok", "error": errors[0] if errors else None}
        if errors:
            entry["status"] = "failed"
            out[name] = entry
            continue
        steps = [max(p["step_ms"][i] for p in per_rank) for i in range(len(per_rank[0]["step_ms"]))]
        entry.update(
            step_ms=steps,
            median_ms=statistics.median(steps),
            min_ms=min(steps), max_ms=max(steps),
            p25_ms=quantile(steps, 0.25), p75_ms=quantile(steps, 0.75),
            first_step_s=max(p["first_s"] for p in per_rank),
            peak_bytes_per_rank=[p["peak_bytes"][-1] for p in per_rank],
            peak_bytes=max(p["peak_bytes"][-1] for p in per_rank),
            comm_by_kind=per_rank[0]["comm"]["totals"],
            comm_ops=per_rank[0]["comm"]["ops"],
            comm_unknown_ops=per_rank[0]["comm"]["unknown"],
            comm_bytes=max(sum(v["bytes"] for v in p["comm"]["totals"].values()) for p in per_rank),
            losses=[p["losses"] for p in per_rank],
        )
        if per_rank[0]["zero_stats"] is not None:
            zs = per_rank[0]["zero_stats"]
            entry["zero_stats"] = zs
            entry["zero_stats_match"] = all(
                (p["zero_stats"][k]["count"], p["zero_stats"][k]["bytes"])
                == (p["comm"]["totals"][k]["count"], p["comm"]["totals"][k]["bytes"])
                for p in per_rank for k in ("all_gather", "reduce_scatter", "all_reduce"))
        if ref_ok:
            worst = 0.0
            for mine, ref in zip((p["losses"] for p in per_rank), ref_losses):
                for a, b in zip(mine, ref):
                    worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
            entry["max_rel_loss_diff"] = worst
            if not worst <= rtol:
                entry["status"] = "diverged"
        out[name] = entry
    ref = out[REFERENCE] if ref_ok else None
    for entry in out.values():
        if entry["status"] == "failed" or ref is None:
            continue
        entry["ms_ratio"] = entry["median_ms"] / ref["median_ms"]
        entry["ms_ratio_paired"] = statistics.median(
            mine / theirs for mine, theirs in zip(entry["step_ms"], ref["step_ms"]))
        entry["peak_ratio"] = entry["peak_bytes"] / ref["peak_bytes"]
        entry["comm_ratio"] = entry["comm_bytes"] / ref["comm_bytes"] if ref["comm_bytes"] else None
    return out


def format_table(summary: dict, inner_compiler: str) -> str:
    """The printed table (see benchmarks/README.md for how to read it)."""
    def ratio(value):
        return "-" if value is None else f"x{value:.2f}"

    head = (f"{'system':40} {'ms/step (min-max)':>22} {'first s':>8} {'ms':>6} {'paired':>6} "
            f"{'peak MiB/rank':>14} {'peak':>6} {'comm MiB/step':>14} {'comm':>6}")
    lines = [head, "-" * len(head)]
    for name, e in summary.items():
        if e["status"] == "failed":
            lines.append(f"{e['label']:40} FAILED: {error_line(e['error'])[:120]}")
            continue
        bound = "≥" if inner_compiler == "inductor" and name != "fsdp2" else " "
        mem = (f"{bound}{e['peak_bytes'] / MiB:>13.2f} {ratio(e.get('peak_ratio')):>6} "
               f"{e['comm_bytes'] / MiB:>14.2f} {ratio(e.get('comm_ratio')):>6}")
        if e["status"] == "diverged":
            lines.append(f"{e['label']:40} {'DIVERGED (loss rel diff ' + format(e['max_rel_loss_diff'], '.1e') + ')':>46} "
                         f"{'':>6} {mem}")
            continue
        speed = f"{e['median_ms']:.1f} ({e['min_ms']:.1f}-{e['max_ms']:.1f})"
        lines.append(f"{e['label']:40} {speed:>22} {e['first_step_s']:>8.2f} {ratio(e.get('ms_ratio')):>6} "
                     f"{ratio(e.get('ms_ratio_paired')):>6} {mem}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn")
    p.add_argument("--inner-compiler", default="inductor", choices=("inductor", "eager"),
                   help="what compiles zerocompile's sharded graphs")
    p.add_argument("--quick", action="store_true",
                   help="small model and few steps (about a minute); sizes given explicitly still apply")
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 20, quick 4)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed rounds after the first (compile) step (default 3, quick 1)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank and step (default 4, quick 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128, quick 32)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 4096, quick 256)")
    p.add_argument("--d-model", type=int, default=None, help="embedding width (default 256, quick 64)")
    p.add_argument("--n-layers", type=int, default=None, help="transformer blocks (default 4, quick 2)")
    p.add_argument("--n-heads", type=int, default=None, help="attention heads (default 4, quick 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0, help="seed every rank builds every model from")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="largest relative loss difference from FSDP2 that is not a divergence")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="process-group timeout in seconds (covers one rank compiling while another waits)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                   help="systems to run (ratios and the divergence check need fsdp2)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file to write (default: benchmarks/results/stage3_vs_fsdp2.json, with "
                        "'-eager' and/or '-quick' before '.json' for those runs, so they do not overwrite it)")
    args = p.parse_args(argv)
    for key, value in preset(args.quick).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        suffix = ("-eager" if args.inner_compiler == "eager" else "") + ("-quick" if args.quick else "")
        args.out = RESULTS / f"stage3_vs_fsdp2{suffix}.json"
    if args.d_model % args.n_heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --n-heads {args.n_heads}")
    if args.world_size < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--world-size and --steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "zerocompile" / "inductor"))
    log.info("spawning %d gloo ranks (%s inner compiler)", args.world_size, args.inner_compiler)
    started = time.time()
    load_before = os.getloadavg()
    ranks = spawn_ranks(args.world_size, rank_main, (args,), timeout_s=args.timeout, threads=args.threads)
    summary = summarise(ranks, args.rtol)
    psi = ranks[0]["psi"]

    print(f"\nGPT: Psi = {psi} parameters ({psi / 1e6:.2f}M), vocab {args.vocab}, d_model {args.d_model}, "
          f"{args.n_layers} layers, {args.n_heads} heads, seq {args.seq_len}; {args.world_size} gloo ranks x "
          f"{args.threads} thread(s), {args.batch} sequences/rank/step, fp32 AdamW; inner compiler "
          f"{args.inner_compiler}; {args.steps} timed steps after 1 + {args.warmup} warm-up; "
          f"load average before {load_before[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"optional passes disabled in 'no optional passes': {ranks[0]['disabled_passes']}"
          + (f" ({ranks[0]['pass_note']})" if ranks[0]["pass_note"] else ""))
    print(format_table(summary, args.inner_compiler))
    print("ms/step: median over timed steps of the slowest rank's time (min-max); ratios are to FSDP2 eager; "
          "paired: median over rounds of the step time over FSDP2's in the same round.")
    if load_before[0] >= (os.cpu_count() or 1):
        print(f"note: the machine was busy before the run (load average {load_before[0]:.1f} on "
              f"{os.cpu_count()} CPUs): the times are noisy; trust the paired ratios more than the medians.")
    if args.inner_compiler == "inductor":
        print("≥: with inductor the peak is a lower bound: buffers inductor allocates and frees inside a "
              "compiled graph bypass the dispatcher, so the tracker does not see them.")
    for name, e in summary.items():
        if e.get("zero_stats_match") is False:
            print(f"note: zerocompile.stats() disagrees with the dispatch-mode count for {name}: "
                  f"{e['zero_stats']} vs {e['comm_by_kind']}")
        if e.get("comm_unknown_ops"):
            print(f"note: {name} ran collectives the counter does not size: {e['comm_unknown_ops']}")
        if e["status"] == "diverged":
            print(f"{e['label']}: DIVERGED from FSDP2 (largest relative loss difference "
                  f"{e['max_rel_loss_diff']:.2e} > {args.rtol:g}); no speed figures")
        if e["status"] == "failed":
            print(f"{e['label']} failed: {error_line(e['error'])} (traceback in {args.out})")

    result = {
        "benchmark": "stage3_vs_fsdp2",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "platform": platform.platform()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "psi": psi,
        "disabled_passes": ranks[0]["disabled_passes"],
        "pass_note": ranks[0]["pass_note"],
        "wall_s": time.time() - started,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "systems": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
