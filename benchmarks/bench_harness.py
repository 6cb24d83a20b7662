"""The side-by-side harness of ``run.py`` and ``stage3_vs_fsdp2.py``: several systems live in
every rank and take turns, one step each per round, and the figures both report.

- ``System``: one system under test inside one rank (model, optimizer, meters, results); a
  script's subclass adds its fields and overrides ``train_step`` or the measurement hooks;
- ``listed_passes()``: the optional passes a "no optional passes" system disables, or why
  they could not be listed;
- ``run_rounds()``: every rank's batches, a warmed-up process group, then the rounds: the
  first step, warm-up, timed steps, measurement steps (``run_round`` each);
- ``step_figures()``, ``comm_figures()``, ``max_rel_loss_diff()``, ``speed_ratios()``: the
  summary of one system over the ranks, and against the reference;
- ``add_training_options()``, ``prepare_main()``, ``result_header()``: the shared command-line
  options, the main process's logging and inductor cache, and the first keys of the result file.
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
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from common import CollectiveBytes, all_ranks_ok, optional_pass_names, quantile
from zerocompile.runtime.memory_tracker import AllocatorPeak

MEASURE_ROUNDS = 2
"""Untimed rounds under the dispatch modes at the end; the figures are the last one's, after
the first has seen every persistent storage."""
log = logging.getLogger("benchmarks.harness")


# --------------------------------------------------------------------------- systems
@dataclass
class System:
    """One system under test inside one rank: its model, optimizer, meters and results."""

    name: str
    model: object = None
    opt: object = None
    tracker: object = None
    counter: CollectiveBytes = field(default_factory=CollectiveBytes)
    error: str | None = None
    skipped: str | None = None
    first_s: float | None = None
    step_ms: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    peak_bytes: list = field(default_factory=list)
    allocator_peak_bytes: list = field(default_factory=list)
    allocator_at_peak: dict | None = None
    comm: dict | None = None

    def train_step(self, x, y, measure: bool) -> torch.Tensor:
        """One optimizer step: forward, backward, step, zero_grad. Returns the (detached) loss.
        ``measure``: the step runs under the tracker and the collective counter."""
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def before_measure(self) -> None:
        """Right before a measurement step (outside the dispatch modes)."""

    def after_measure(self) -> None:
        """Right after a measurement step and its figures (outside the dispatch modes)."""


def listed_passes() -> tuple[list[str], str | None, str | None]:
    """``(disabled, note, error)``: ``optional_pass_names()`` and no error, or no passes and
    the traceback of why they could not be listed (the zerocompile systems then fail with it)."""
    try:
        disabled, note = optional_pass_names()
        return disabled, note, None
    except Exception:  # noqa: BLE001 - the zerocompile systems will fail and say why
        return [], None, traceback.format_exc()


# --------------------------------------------------------------------------- rounds
def run_round(systems: list[System], round_index: int, phase: str, batch) -> None:
    """One step of every live system, the starting system rotated by the round number.

    ``phase``: ``first`` (timed as the first step), ``warmup`` (untimed), ``timed`` or
    ``measure`` (under the system's tracker and the collective counter, untimed)."""
    x, y = batch
    live = [s for s in systems if s.error is None and s.skipped is None]
    shift = round_index % len(live) if live else 0
    for system in live[shift:] + live[:shift]:
        error = None
        dist.barrier()
        start = time.perf_counter()
        try:
            if phase == "measure":
                system.counter.reset()
                system.before_measure()
                with system.tracker, system.counter:
                    system.tracker.track(x)      # made before the round: live in the step, before its start
                    system.tracker.track(y)
                    system.tracker.reset_peak()
                    # the allocator's view as well: it also sees the buffers inductor's code
                    # allocates without the dispatcher, which the tracker cannot
                    with AllocatorPeak(start=system.tracker.live_bytes()) as allocator:
                        loss = system.train_step(x, y, measure=True)
                system.peak_bytes.append(system.tracker.peak)
                system.allocator_peak_bytes.append(allocator.peak)
                system.allocator_at_peak = allocator.at_peak
                system.comm = {"totals": system.counter.totals, "ops": dict(system.counter.ops),
                               "unknown": dict(system.counter.unknown)}
                system.after_measure()
            else:
                loss = system.train_step(x, y, measure=False)
            value = float(loss)   # waits for the device
            elapsed = time.perf_counter() - start
            system.losses.append(value)
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


def run_rounds(systems: list[System], example, rank: int, world: int, *, vocab: int, batch: int, seq_len: int,
               warmup: int, steps: int, device: torch.device, label: str = "") -> None:
    """Every round of a run: the first step, ``warmup`` untimed rounds, ``steps`` timed ones and
    ``MEASURE_ROUNDS``, on this rank's ``batch`` sequences of the global batch of each step
    (``examples/train_gpt.py``'s data), after warming the process group up. ``label`` prefixes
    rank 0's progress lines."""
    table = example.successor_table(vocab)
    total_rounds = 1 + warmup + steps + MEASURE_ROUNDS
    batches = []
    for step in range(total_rounds):
        x, y = example.global_batch(step, batch * world, seq_len, table)
        lo, hi = rank * batch, (rank + 1) * batch
        batches.append((x[lo:hi].clone().to(device), y[lo:hi].clone().to(device)))

    # the first collectives of a process are slow: warm the process group up
    for _ in range(5):
        dist.all_reduce(torch.zeros(1024, device=device))
        dist.barrier()

    for r in range(total_rounds):
        if r == 0:
            phase = "first"
        elif r <= warmup:
            phase = "warmup"
        elif r <= warmup + steps:
            phase = "timed"
        else:
            phase = "measure"
        if rank == 0:
            log.info("%sround %d/%d (%s)", f"{label}: " if label else "", r + 1, total_rounds, phase)
        run_round(systems, r, phase, batches[r])


# --------------------------------------------------------------------------- summary
def step_figures(per_rank: list[dict]) -> dict:
    """Time and memory of one system from its ranks' figures: per timed step the slowest rank's
    time, their median, range and quartiles, the slowest first step, and the peaks of the last
    measurement round (per rank and the highest): the live tensor storages' (``peak_bytes``,
    ``LiveStorageTracker``) and the CPU allocator's (``allocator_peak_bytes``, ``AllocatorPeak``:
    the same, plus what inductor's code and kernels allocate without the dispatcher)."""
    steps = [max(p["step_ms"][i] for p in per_rank) for i in range(len(per_rank[0]["step_ms"]))]
    return dict(
        step_ms=steps, median_ms=statistics.median(steps), min_ms=min(steps), max_ms=max(steps),
        p25_ms=quantile(steps, 0.25), p75_ms=quantile(steps, 0.75),
        first_step_s=max(p["first_s"] for p in per_rank),
        peak_bytes_per_rank=[p["peak_bytes"][-1] for p in per_rank],
        peak_bytes=max(p["peak_bytes"][-1] for p in per_rank),
        allocator_peak_bytes_per_rank=[p["allocator_peak_bytes"][-1] for p in per_rank],
        allocator_peak_bytes=max(p["allocator_peak_bytes"][-1] for p in per_rank),
    )


def comm_figures(per_rank: list[dict]) -> dict:
    """The collectives rank 0 counted in the last measurement round: totals by kind, by op, and
    the ops the counter does not size."""
    comm = per_rank[0]["comm"]
    return dict(comm_by_kind=comm["totals"], comm_ops=comm["ops"], comm_unknown_ops=comm["unknown"])


def max_rel_loss_diff(losses: list[list[float]], reference: list[list[float]]) -> float:
    """The largest relative difference between a system's losses and the reference's, over the
    steps of every rank (one list per rank each)."""
    worst = 0.0
    for mine, theirs in zip(losses, reference):
        for a, b in zip(mine, theirs):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst


def speed_ratios(entry: dict, reference: dict) -> dict:
    """The ratio of the median step times to the reference's, and the median over rounds of the
    step time over the reference's in the same round."""
    return dict(ms_ratio=entry["median_ms"] / reference["median_ms"],
                ms_ratio_paired=statistics.median(a / b for a, b in zip(entry["step_ms"], reference["step_ms"])))


# --------------------------------------------------------------------------- command line and results
def add_training_options(p: argparse.ArgumentParser, reference: str, timeout_s: float, timeout_note: str = "") -> None:
    """The options of the training every system runs, and of the ranks."""
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0, help="seed every rank builds every model from")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help=f"largest relative loss difference from {reference} that is not a divergence")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=timeout_s, help=f"process-group timeout in seconds{timeout_note}")


def prepare_main() -> None:
    """The main process logs plain messages, and inductor caches its kernels in
    ``~/.cache/zerocompile/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise (the
    spawned ranks inherit it: a second run compiles from the cache)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "zerocompile" / "inductor"))


def write_results(out: Path, benchmark: str, result: dict, title: str, lines: list) -> None:
    """``out/<benchmark>.json`` (``result``) and ``out/<benchmark>.md``: ``title``, the command and
    date of ``result_header``, then the table ``lines``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{benchmark}.json").write_text(json.dumps(result, indent=1))
    header = f"# {title}\n\n`{result['command']}`, {result['date']}\n"
    (out / f"{benchmark}.md").write_text(header + "\n" + "\n".join(lines) + "\n")
    print(f"wrote {out / benchmark}.json and .md")


def git_commit() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files other than the result files
    (``benchmarks/results/``, which a run rewrites) differ from it; ``unknown`` outside a git
    checkout."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=repo,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], capture_output=True,
                               text=True, cwd=repo).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def result_header(benchmark: str, args: argparse.Namespace, argv: list | None) -> dict:
    """The first keys of a result file: which benchmark, when, the command, the machine and the
    parsed options."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "platform": platform.platform()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
