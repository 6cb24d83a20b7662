"""Measure a real run of a training script: ``zerocompile tune --verify`` launches it with
``torchrun``-style workers (``torch.distributed.run``)::

    python -m torch.distributed.run --nproc-per-node W -m zerocompile.measure \\
        --options JSON --out FILE -- SCRIPT [ARGS...]

Each worker runs SCRIPT unmodified as ``__main__`` with the backend options ``--options``
merged over the script's own (as ``ZEROCOMPILE_OPTIONS`` does) and watches its optimizer
steps. The first step compiles. Over the second, a ``LiveStorageTracker`` (the dispatch mode the
tests and ``plan`` measure with) records the peak live bytes, starting from every tensor alive
when the step begins; the steps after it are timed without it (wall time between consecutive
step ends; the median). The script must run at least four steps. Every worker writes
``FILE.rank<r>.json``: ``{"step_ms", "peak_bytes", "steps"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time
from pathlib import Path


from zerocompile.backend import overriding_options
from zerocompile.plan import StepWatcher, track_live_tensors
from zerocompile.runtime.memory_tracker import LiveStorageTracker


def measure_script(script: Path, script_args: list, options: dict) -> dict:
    """Run ``script`` in this process (one worker of a launched job) and measure it."""
    tracker = LiveStorageTracker(track_inputs=True)
    ends: list = []
    peak = {"bytes": 0}

    def on_step(step: int) -> None:
        ends.append(time.perf_counter())
        if step == 1:
            track_live_tensors(tracker)
            tracker.__enter__()
            tracker.reset_peak()
        elif step == 2:
            tracker.__exit__(None, None, None)
            peak["bytes"] = tracker.peak

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.parent))
    try:
        with overriding_options(options), StepWatcher(on_step):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    if len(ends) < 4:
        raise RuntimeError(f"{script} ran {len(ends)} optimizer step(s); --verify needs at least 4 (the first "
                           "compiles, the second is measured for memory, the rest are timed)")
    intervals = [b - a for a, b in zip(ends[2:], ends[3:])]
    return {"step_ms": statistics.median(intervals) * 1e3, "peak_bytes": peak["bytes"], "steps": len(ends)}


def main(argv: list | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m zerocompile.measure --options JSON --out FILE -- SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m zerocompile.measure")
    parser.add_argument("--options", default="{}")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv[:cut])
    script, script_args = Path(argv[cut + 1]).resolve(), argv[cut + 2:]
    result = measure_script(script, script_args, json.loads(args.options))
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
