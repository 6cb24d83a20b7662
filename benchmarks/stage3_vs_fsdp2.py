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
- ``zero3-per-block``: each block compiled on its own (``block.compile(backend="zero", ...)``,
  torchtitan's regional compilation), the root module eager: its embeddings, final norm and
  head are sharded by zerocompile's per-module hooks (``runtime/eager_regions.py``);
- ``zero3-one-graph``: ``zero3`` with ``repeated_blocks="off"``: the model one graph however
  many layers it has (``zero3``'s default, ``"auto"``, compiles 8 or more identical blocks once,
  as pieces: docs/config.md);
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
  persistent storage), and by the CPU allocator (``AllocatorPeak``: the tracker's live bytes
  when the step begins plus the largest rise of the allocator's events in the step, which also
  counts the buffers inductor's generated code allocates without the dispatcher): the table's
  peak is the allocator's, exact with either inner compiler;
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
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_harness as harness  # noqa: E402
from common import MiB, RESULTS, break_graph_after, break_graph_in_loop, error_line, load_example, spawn_ranks  # noqa: E402

SYSTEMS = ("zero3", "zero3-profile", "zero3-nopass", "zero3-per-block", "zero3-one-graph", "fsdp2")
LABELS = {"zero3": "zerocompile stage 3", "zero3-profile": "zerocompile stage 3, profile=True",
          "zero3-nopass": "zerocompile stage 3, no optional passes",
          "zero3-per-block": "zerocompile stage 3, per-block compile",
          "zero3-one-graph": "zerocompile stage 3, repeated_blocks='off'",
          "fsdp2": "FSDP2 eager"}
REFERENCE = "fsdp2"
log = logging.getLogger("stage3_vs_fsdp2")


# --------------------------------------------------------------------------- presets
def preset(quick: bool) -> dict:
    """Model and run sizes: the default run (~4M parameters) or ``--quick`` (about a minute)."""
    if quick:
        return dict(vocab=256, seq_len=32, d_model=64, n_layers=2, n_heads=2, batch=2, steps=4, warmup=1)
    return dict(vocab=4096, seq_len=128, d_model=256, n_layers=4, n_heads=4, batch=4, steps=20, warmup=3)


# --------------------------------------------------------------------------- systems
@dataclass
class System(harness.System):
    """A system of this benchmark; a zerocompile one also reports ``zerocompile.stats()`` of the
    measured step, the cross-check of the collective counter."""

    uses_zero: bool = False
    zero_stats: dict | None = None

    def before_measure(self) -> None:
        import zerocompile

        if self.uses_zero:
            zerocompile.reset_stats()

    def after_measure(self) -> None:
        import zerocompile

        if self.uses_zero:
            self.zero_stats = zerocompile.stats().as_dict()


def build_system(name: str, args, example, disabled: list[str]) -> System:
    """Build one system from the seed, under its own live-storage tracker."""
    from torch.distributed.fsdp import fully_shard

    import zerocompile
    from zerocompile.runtime.memory_tracker import LiveStorageTracker, PeakAnatomy

    system = System(name, tracker=PeakAnatomy() if args.peak_anatomy else LiveStorageTracker(
        exact_peak=True, track_inputs=True), uses_zero=name != "fsdp2")
    with system.tracker:
        torch.manual_seed(args.seed)
        model = example.GPT(args.vocab, args.seq_len, args.d_model, args.n_layers, args.n_heads)
        if args.graph_break_after is not None:
            break_graph_after(model, args.graph_break_after)
        if args.graph_break_in_loop:
            break_graph_in_loop(model)
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
            if name == "zero3-one-graph":     # every layer in the one graph, even a deep model's
                options["repeated_blocks"] = "off"
            if name == "zero3-per-block":      # torchtitan's regional compilation: the root stays eager
                for block in model.blocks:
                    block.compile(backend="zero", options=options)
                system.model = model
            else:
                system.model = torch.compile(model, backend="zero", options=options)
            system.opt = zerocompile.ZeroOptimizer(system.model.parameters(), optimizer_class=torch.optim.AdamW,
                                                   lr=args.lr, weight_decay=args.weight_decay)
    return system


def rank_main(rank: int, world: int, args) -> dict:
    """Everything one rank does; returns its figures."""
    example = load_example()
    disabled, note, pass_error = harness.listed_passes()
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

    harness.run_rounds(systems, example, rank, world, vocab=args.vocab, batch=args.batch, seq_len=args.seq_len,
                       warmup=args.warmup, steps=args.steps, device=torch.device("cpu"))

    return {
        "psi": psi, "disabled_passes": disabled, "pass_note": note,
        "systems": {s.name: {"error": s.error, "first_s": s.first_s, "step_ms": s.step_ms, "losses": s.losses,
                             "peak_bytes": s.peak_bytes, "allocator_peak_bytes": s.allocator_peak_bytes,
                             "allocator_at_peak": s.allocator_at_peak, "comm": s.comm, "zero_stats": s.zero_stats,
                             "at_peak": getattr(s.tracker, "at_peak", None)}
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
        entry.update(
            **harness.step_figures(per_rank), **harness.comm_figures(per_rank),
            comm_bytes=max(sum(v["bytes"] for v in p["comm"]["totals"].values()) for p in per_rank),
            losses=[p["losses"] for p in per_rank],
        )
        # what was live at the peak, on the rank with the highest peak (--peak-anatomy)
        highest = max(per_rank, key=lambda p: p["peak_bytes"][-1])
        if highest.get("at_peak") is not None:
            entry["at_peak"] = {"op": highest["at_peak"][0], "by_op": highest["at_peak"][1]}
        # the allocator's view at its own peak (the table's figure), on the rank where it is highest
        highest = max(per_rank, key=lambda p: p["allocator_peak_bytes"][-1])
        if highest.get("allocator_at_peak"):
            entry["allocator_at_peak"] = highest["allocator_at_peak"]
        if per_rank[0]["zero_stats"] is not None:
            zs = per_rank[0]["zero_stats"]
            entry["zero_stats"] = zs
            entry["zero_stats_match"] = all(
                (p["zero_stats"][k]["count"], p["zero_stats"][k]["bytes"])
                == (p["comm"]["totals"][k]["count"], p["comm"]["totals"][k]["bytes"])
                for p in per_rank for k in ("all_gather", "reduce_scatter", "all_reduce"))
        if ref_ok:
            worst = harness.max_rel_loss_diff(entry["losses"], ref_losses)
            entry["max_rel_loss_diff"] = worst
            if not worst <= rtol:
                entry["status"] = "diverged"
        out[name] = entry
    ref = out[REFERENCE] if ref_ok else None
    for entry in out.values():
        if entry["status"] == "failed" or ref is None:
            continue
        entry.update(harness.speed_ratios(entry, ref))
        entry["peak_ratio"] = entry["allocator_peak_bytes"] / ref["allocator_peak_bytes"]
        entry["tensor_peak_ratio"] = entry["peak_bytes"] / ref["peak_bytes"]
        entry["comm_ratio"] = entry["comm_bytes"] / ref["comm_bytes"] if ref["comm_bytes"] else None
    return out


def format_anatomy(summary: dict, rows: int = 12) -> str:
    """What was live at each system's peak (``--peak-anatomy``): the ``rows`` largest groups."""
    lines = []
    for e in summary.values():
        anatomy = e.get("at_peak")
        if anatomy is None:
            continue
        lines.append(f"\n{e['label']}: peak {e['peak_bytes'] / MiB:.2f} MiB, reached at {anatomy['op']}; "
                     "live then, by the op that made it:")
        for op, (nbytes, count) in list(anatomy["by_op"].items())[:rows]:
            lines.append(f"  {nbytes / MiB:9.2f} MiB  {count:5d} storages  {op}")
        blocks = e.get("allocator_at_peak")
        if blocks:
            began = e["allocator_peak_bytes"] - sum(blocks.values())
            lines.append(f"{e['label']}: the allocator's peak {e['allocator_peak_bytes'] / MiB:.2f} MiB: "
                         f"{began / MiB:.2f} MiB live when the step began, then the blocks the step allocated "
                         "that are live at the peak, by the op that allocated them:")
            for op, nbytes in list(blocks.items())[:rows]:
                lines.append(f"  {nbytes / MiB:9.2f} MiB  {op}")
    return "\n".join(lines)


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
        mem = (f"{e['allocator_peak_bytes'] / MiB:>14.2f} {ratio(e.get('peak_ratio')):>6} "
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
    p.add_argument("--graph-break-after", type=int, default=None, metavar="K",
                   help="a Dynamo graph break after block K (0-based) in the GPT's forward: "
                        "zerocompile compiles two frames (FSDP2 runs eager either way)")
    p.add_argument("--graph-break-in-loop", action="store_true",
                   help="a Dynamo graph break inside the GPT's block loop: Dynamo runs its forward eagerly "
                        "(embeddings, final norm, head) and compiles each block as a frame")
    harness.add_training_options(p, reference="FSDP2", timeout_s=300.0,
                                 timeout_note=" (covers one rank compiling while another waits)")
    p.add_argument("--peak-anatomy", action="store_true",
                   help="also print what was live at each system's peak, by the op that made it "
                        "(zerocompile.runtime.memory_tracker.PeakAnatomy; slower, the times mean less)")
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
    harness.prepare_main()
    log.info("spawning %d gloo ranks (%s inner compiler)", args.world_size, args.inner_compiler)
    started = time.time()
    load_before = os.getloadavg()
    ranks = spawn_ranks(args.world_size, rank_main, (args,), timeout_s=args.timeout, threads=args.threads)
    summary = summarise(ranks, args.rtol)
    psi = ranks[0]["psi"]

    print(f"\nGPT: Psi = {psi} parameters ({psi / 1e6:.2f}M), vocab {args.vocab}, d_model {args.d_model}, "
          f"{args.n_layers} layers"
          + (f" (graph break after block {args.graph_break_after})" if args.graph_break_after is not None else "")
          + (" (graph break inside the block loop)" if args.graph_break_in_loop else "")
          + f", {args.n_heads} heads, seq {args.seq_len}; {args.world_size} gloo ranks x "
          f"{args.threads} thread(s), {args.batch} sequences/rank/step, fp32 AdamW; inner compiler "
          f"{args.inner_compiler}; {args.steps} timed steps after 1 + {args.warmup} warm-up; "
          f"load average before {load_before[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"optional passes disabled in 'no optional passes': {ranks[0]['disabled_passes']}"
          + (f" ({ranks[0]['pass_note']})" if ranks[0]["pass_note"] else ""))
    print(format_table(summary, args.inner_compiler))
    if args.peak_anatomy:
        print(format_anatomy(summary))
    print("ms/step: median over timed steps of the slowest rank's time (min-max); ratios are to FSDP2 eager; "
          "paired: median over rounds of the step time over FSDP2's in the same round.")
    if load_before[0] >= (os.cpu_count() or 1):
        print(f"note: the machine was busy before the run (load average {load_before[0]:.1f} on "
              f"{os.cpu_count()} CPUs): the times are noisy; trust the paired ratios more than the medians.")
    print("peak: the CPU allocator's (AllocatorPeak), inductor's own buffers included; the live tensor "
          "storages alone (LiveStorageTracker) in the JSON as 'peak_bytes'.")
    for name, e in summary.items():
        shm = (e.get("zero_stats") or {}).get("shared_memory_bytes", 0)
        if shm:
            print(f"{e['label']} also maps a {shm / 2**20:.1f} MiB shared-memory segment for its transfers "
                  f"(stats().shared_memory_bytes: one per host, shared by the {args.world_size} ranks), not in "
                  "the peak; gloo's socket buffers are not in FSDP2's either.")
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
        **harness.result_header("stage3_vs_fsdp2", args, argv),
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
