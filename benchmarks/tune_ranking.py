"""Does ``zerocompile tune`` rank configurations the way they run here? Five splits of the same 16
samples per rank into micro-batches and accumulation steps (16x1, 8x2, 4x4, 2x8, 1x16: neighbours
2x apart, so a miscalibrated compute or communication rate shows as a swapped pair), planned at
this machine's world size on its calibrated hardware profile, then run for real on 2 gloo ranks
by ``--verify``'s runner. At stage 3 every accumulation step gathers the parameters again, so
more, smaller micro-batches cost more communication and less arithmetic per call.

    python benchmarks/tune_ranking.py [--out benchmarks/results]

Prints estimate against measurement per split, the Kendall rank correlation of the two orders
and the pairs that disagree, and writes ``<out>/tune_ranking.json`` and ``.md``. Exit status 1
when the estimated order of the two extreme splits is the wrong way round (the estimate cannot
then be trusted to choose), 0 otherwise: adjacent pairs within the measured noise may swap,
and the report says which did.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_harness import git_commit  # noqa: E402
SPLITS = ((16, 1), (8, 2), (4, 4), (2, 8), (1, 16))

SCRIPT = REPO / "benchmarks" / "tune_train.py"
"""The training script planned and run: its micro-batch size and accumulation come from its arguments."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kendall_tau(a: list, b: list) -> float:
    """Kendall's rank correlation of two orders of the same names: 1 equal, -1 reversed."""
    pos_a, pos_b = {n: i for i, n in enumerate(a)}, {n: i for i, n in enumerate(b)}
    pairs = list(itertools.combinations(a, 2))
    agree = sum(1 if (pos_a[x] - pos_a[y]) * (pos_b[x] - pos_b[y]) > 0 else -1 for x, y in pairs)
    return agree / len(pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()

    from zerocompile.cli.plan import plan_in_subprocess
    from zerocompile.cli.tune import verify_experiments
    from zerocompile.tune import Experiment, substitute

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zerocompile-tune-ranking-") as tmp:
        tmp = Path(tmp)
        profile = tmp / "here.json"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                               str(_free_port()), str(REPO / "benchmarks" / "calibrate_hardware.py"), "--out",
                               str(profile), "--memory-gb", "4"], capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 2
        script = SCRIPT
        script_args = ["--batch", "{micro_batch}", "--accum", "{grad_accum}"]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            reports = list(pool.map(lambda split: plan_in_subprocess(
                2, str(profile), {"stage": 3}, script, substitute(script_args, *split) + ["--steps", "2"]), SPLITS))
        experiments = [Experiment(name=f"mb{mb}x{gas}", options={"stage": 3}, micro_batch=mb, grad_accum=gas,
                                  report=report) for (mb, gas), report in zip(SPLITS, reports)]
        verify_experiments(experiments, script, script_args, nproc=2)
    failed = [e.name for e in experiments if not e.measured or "error" in e.measured]
    if failed:
        print(f"runs failed: {failed}: {[e.measured for e in experiments]}", file=sys.stderr)
        return 2
    by_estimate = [e.name for e in sorted(experiments, key=lambda e: e.step_ms)]
    by_measurement = [e.name for e in sorted(experiments, key=lambda e: e.measured["step_ms"])]
    tau = kendall_tau(by_estimate, by_measurement)
    est = {e.name: e.step_ms for e in experiments}
    meas = {e.name: e.measured["step_ms"] for e in experiments}
    swapped = [(x, y) for x, y in itertools.combinations(by_estimate, 2)
               if (est[x] - est[y]) * (meas[x] - meas[y]) < 0]
    first, last = experiments[0].name, experiments[-1].name
    extremes_right = (est[first] - est[last]) * (meas[first] - meas[last]) > 0

    lines = ["# tune's estimated ranking against runs here (stage 3, 2 gloo ranks, 16 samples per rank and step)", "",
             f"`python benchmarks/tune_ranking.py` at `{git_commit()}`, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"wall {time.perf_counter() - started:.0f} s",
             "", "| split (micro-batch x accumulation) | estimated ms | measured ms | estimate / measured |",
             "|---|---:|---:|---:|"]
    for e in experiments:
        lines.append(f"| {e.name} | {est[e.name]:.1f} | {meas[e.name]:.1f} | {est[e.name] / meas[e.name]:.2f} |")
    lines += ["", f"- order by estimate: {by_estimate}", f"- order by measurement: {by_measurement}",
              f"- Kendall tau: {tau:.2f} (1 = the same order)",
              f"- pairs in the wrong order: {swapped or 'none'}",
              f"- the extremes ({first}, {last}) in the right order: {extremes_right}"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_ranking.md").write_text(text)
    (args.out / "tune_ranking.json").write_text(json.dumps(
        {"commit": git_commit(), "estimated_ms": est, "measured_ms": meas, "by_estimate": by_estimate, "by_measurement": by_measurement,
         "kendall_tau": tau, "swapped": swapped, "extremes_right": extremes_right,
         "measured": {e.name: e.measured for e in experiments}}, indent=1))
    return 0 if extremes_right else 1


if __name__ == "__main__":
    sys.exit(main())
