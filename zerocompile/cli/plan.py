"""``zerocompile plan --world-size N [--options JSON] [--hardware NAME|FILE] [--json]
[--compare [--jobs J]] [--no-replay] -- SCRIPT [ARGS...]``: run SCRIPT on N fake ranks with
fake tensors (``zerocompile.plan``) and report per rank its memory, communication and
estimated step time; ``--compare`` plans stages 0-3 side by side."""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from zerocompile.cli.errors import CliError
from zerocompile.cli.inputs import check_options, script_of
from zerocompile.cli.render import new_console, print_compare, print_plan
from zerocompile.script_runner import ScriptRunError


def add_parser(subparsers) -> None:
    plan = subparsers.add_parser(
        "plan", help="per-rank memory, communication and step time of a script at any world size",
        description="Run SCRIPT unmodified in this process, as rank 0 of a fake process group of N ranks "
                    "with fake tensors (nothing the size of the model is allocated), and report per rank "
                    "the model-state bytes, the peak live bytes, the bytes each collective kind moves per "
                    "step and an estimated step time, measured over the script's second optimizer step. "
                    "Put the script and its arguments after --.",
        usage="zerocompile plan --world-size N [--options JSON] [--hardware NAME|FILE] [--json] [--compare [--jobs J]] [--no-replay] "
              "-- SCRIPT [ARGS...]")
    plan.add_argument("--world-size", type=int, required=True, metavar="N", help="ranks of the planned job")
    plan.add_argument("--options", default=None, metavar="JSON",
                      help="backend options as a JSON object, merged over the script's own (default: none)")
    plan.add_argument("--hardware", default="h100", metavar="NAME|FILE",
                      help="rates of the planned machine: " + ", ".join(_hardware_names())
                           + ", or a JSON file with flops_per_s, memory_gbps, bandwidth_gbps, alpha_us "
                           "(default: h100)")
    plan.add_argument("--json", action="store_true",
                      help="print the report as one JSON object on stdout (the script's output goes to stderr)")
    plan.add_argument("--compare", action="store_true",
                      help="also plan stages 0-3 (one run each, in subprocesses) and print them side by side")
    plan.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), metavar="J",
                      help="with --compare: how many of its plans run at once; each holds a fake model "
                           "and its own Python process (default: min(4, CPUs), here %(default)s)")
    plan.add_argument("--no-replay", action="store_true",
                      help="run every compiled graph instead of replaying runs identical to an earlier one "
                           "(slower; the figures are the same)")
    plan.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...]")
    plan.set_defaults(func=cmd_plan)


def _hardware_names() -> list:
    from zerocompile.plan import HARDWARE

    return list(HARDWARE)


def cmd_plan(args) -> int:
    """``zerocompile plan``: run SCRIPT on fake ranks with fake tensors; report per rank."""
    from zerocompile.plan import PlanReplayError, hardware_from, plan_script, unmeasured_reason

    if args.world_size < 1:
        raise CliError(f"zerocompile plan: error: --world-size must be >= 1, got {args.world_size}")
    if args.jobs < 1:
        raise CliError(f"zerocompile plan: error: --jobs must be >= 1, got {args.jobs}")
    options = check_options(args.options, "plan") or {}
    for key in ("offload_optimizer", "offload_param"):
        if key in options:
            raise CliError(f"zerocompile plan: error: --options cannot set '{key}' yet: offloaded state "
                           "is moved with real I/O, which fake tensors cannot do; plan without it (with "
                           "--compare, plan also prints a stage-3 row with the optimizer state offloaded)")
    try:
        hardware = hardware_from(args.hardware)
    except ValueError as exc:
        raise CliError(f"zerocompile plan: error: --hardware: {exc}") from None
    script, script_args = script_of(args, "plan", "--world-size N [--options JSON] [--hardware NAME|FILE] "
                                                    "[--json] [--compare [--jobs J]]")
    status = new_console(stderr=True)
    try:
        with status.status(f"planning {script.name} on {args.world_size} fake ranks"):
            report = plan_script(script, script_args, args.world_size, options, hardware,
                                 stdout=sys.stderr if args.json else None, replay=not args.no_replay)
    except (ScriptRunError, PlanReplayError) as exc:
        raise CliError(f"zerocompile plan: error: {exc}") from None
    if report.measured_step == 0:
        print(f"zerocompile plan: error: {unmeasured_reason(report, script)}", file=sys.stderr)
        return report.exit_code or 1
    rows = [report]
    if args.compare:
        rows = _compare(args, options, script, script_args, status)
    if args.json:
        out = report.as_dict()
        if args.compare:
            out["compare"] = [r if isinstance(r, dict) else r.as_dict() for r in rows]
        print(json.dumps(out))
        return 0
    print_plan(report, script, new_console())
    if args.compare:
        print_compare(rows, new_console())
    return 0


def plan_in_subprocess(world_size: int, hardware: str, options: dict, script: Path, script_args: list,
                       replay: bool = True) -> dict:
    """``zerocompile plan --json`` of ``script`` in a fresh Python process (nothing of an earlier
    plan's models or compiled frames is left to count); its report, or ``RuntimeError`` with the
    last line plan printed on an error."""
    cmd = [sys.executable, "-m", "zerocompile", "plan", "--world-size", str(world_size), "--hardware", hardware,
           "--json", "--options", json.dumps(options), *([] if replay else ["--no-replay"]), "--", str(script),
           *script_args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()] or [f"(no output; exit code {done.returncode})"]
        # plan's own line, and the script's last words before it when the script failed
        raise RuntimeError(lines[-1] if len(lines) == 1 or "exited with code" not in lines[-1]
                           else f"{lines[-1]} (its last line: {lines[-2].strip()})")
    return json.loads(done.stdout.strip().splitlines()[0])


def _compare(args, options: dict, script: Path, script_args: list, status: Console) -> list:
    """Plan stages 0-3 with the same options, each in a subprocess of its own (a fresh
    process: nothing of one run's models or compiled frames is left to count in the next),
    ``args.jobs`` of them at a time."""
    def plan_stage(stage: int) -> dict:
        try:
            return plan_in_subprocess(args.world_size, args.hardware, {**options, "stage": stage}, script, script_args)
        except RuntimeError as exc:
            return {"options": {"stage": stage}, "error": str(exc)}

    stages = (0, 1, 2, 3)
    with status.status(f"planning stages 0-3, {min(args.jobs, len(stages))} at a time"):
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            return list(pool.map(plan_stage, stages))
