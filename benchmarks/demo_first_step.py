"""How long `make demo`'s first step takes, cold and on a restart: runs `examples/train_gpt.py
--stage 3` (2 gloo ranks, inductor) twice with a fresh inductor cache directory, the first run
cold and the second on what the first left, and writes what the demo printed and its step times
to ``<out>/demo_first_step.md`` and ``.json``. The README's figure comes from here.

    python benchmarks/demo_first_step.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_harness import git_commit
from first_step import bytecode_cache_on, bytecode_note

REPO = Path(__file__).resolve().parent.parent


def run_demo(cache_dir: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "examples" / "train_gpt.py"), "--stage", "3"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    output = done.stdout + done.stderr
    steps = [float(ms) / 1e3 for ms in re.findall(r"^step +\d+ \|.*\| (\d+) ms$", done.stdout, re.M)]
    frames = re.findall(r"^zerocompile: compiled .*$", done.stderr, re.M)
    return {"wall_s": wall, "first_step_s": steps[0], "later_step_s": sorted(steps[1:])[len(steps[1:]) // 2],
            "frames": frames, "output": output}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    bytecode = bytecode_note()
    if bytecode_cache_on():
        # one untimed run fills Python's bytecode cache (first_step.prepare_bytecode says why)
        with tempfile.TemporaryDirectory(prefix="zerocompile-bytecode-") as cache:
            run_demo(cache)
        bytecode += ", filled by one untimed run first"
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="zerocompile-demo-cache-") as cache:
        cold = run_demo(cache)
        warm = run_demo(cache)
    commit = git_commit()
    lines = ["# `make demo`'s first step, cold and on a restart", "",
             f"`python benchmarks/demo_first_step.py` at `{commit}`, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{os.cpu_count()} CPUs, load average before {load:.1f}; {bytecode}", "",
             "| run | first step s | later steps s (median) | whole demo s |", "|---|---:|---:|---:|"]
    for name, r in (("cold inductor cache", cold), ("restart (warm cache)", warm)):
        lines.append(f"| {name} | {r['first_step_s']:.1f} | {r['later_step_s']:.2f} | {r['wall_s']:.1f} |")
    lines += ["", "What the cold run printed about its compile (stderr, not a terminal):", "", "```",
              *cold["frames"], "```", ""]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo_first_step.md").write_text(text)
    (args.out / "demo_first_step.json").write_text(json.dumps(
        {"commit": commit, "load_before": load, "bytecode": bytecode, "cold": cold, "warm": warm}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
