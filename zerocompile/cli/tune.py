"""``zerocompile tune --world-size N [--hardware NAME|FILE] [--memory-limit-gb G] [--options JSON]
[--out DIR] [--json] [--verify K] [--jobs J] [--micro-batch M --grad-accum A] [--no-reuse] -- SCRIPT
[ARGS...]``:
search the backend options for an N-rank job with plan's simulation (``zerocompile.tune``)."""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from zerocompile.cli.errors import CliError
from zerocompile.cli.inputs import check_options, script_of
from zerocompile.cli.plan import plan_in_subprocess
from zerocompile.cli.render import new_console
from zerocompile.plan_worker import PlanWorkers


def add_parser(subparsers) -> None:
    tune = subparsers.add_parser(
        "tune", help="search backend options for an N-rank job from plan's simulation",
        description="Plan SCRIPT at N ranks (as 'zerocompile plan' does) with one configuration after another: "
                    "ZeRO stage, bucket and prefetch sizes, resharding, selective unsharding, recompute, "
                    "activation offload, hpZ, qwZ/qgZ and the micro-batch size, guided by the figures, and "
                    "report the fastest configuration whose peak fits the memory limit. Writes summary.txt, "
                    "one JSON per experiment, best_options.json, ds_config_optimal.json and cmd_optimal.txt "
                    "to --out. Put the script and its arguments after --; '{micro_batch}' and '{grad_accum}' "
                    "in them are replaced per experiment.",
        usage="zerocompile tune --world-size N [--hardware NAME|FILE] [--memory-limit-gb G] [--options JSON] "
              "[--out DIR] [--json] [--verify K] [--jobs J] [--micro-batch M] [--grad-accum A] [--tokens-per-sample T] "
              "[--no-reuse] -- SCRIPT [ARGS...]")
    tune.add_argument("--world-size", type=int, required=True, metavar="N", help="ranks of the planned job")
    tune.add_argument("--hardware", default="h100", metavar="NAME|FILE",
                      help="rates of the planned machine, as for plan (default: h100)")
    tune.add_argument("--memory-limit-gb", type=float, default=None, metavar="G",
                      help="GiB per rank a configuration's peak may reach (default: the hardware profile's "
                           "memory_gb)")
    tune.add_argument("--options", default=None, metavar="JSON",
                      help="backend options every experiment starts from, merged over the script's own")
    tune.add_argument("--out", default="zerocompile_tune", metavar="DIR", help="results directory "
                      "(default: %(default)s)")
    tune.add_argument("--json", action="store_true",
                      help="print the result as one JSON object on stdout (best, baseline, experiments)")
    tune.add_argument("--verify", type=int, default=0, metavar="K",
                      help="run the K best configurations for real on this machine (torchrun-style, "
                           "--verify-nproc ranks) and print measured step time and peak beside the estimates")
    tune.add_argument("--verify-nproc", type=int, default=2, metavar="W",
                      help="ranks of the --verify runs (default: %(default)s)")
    tune.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), metavar="J",
                      help="experiments planned at once, each in its own process (default: %(default)s)")
    tune.add_argument("--micro-batch", type=int, default=None, metavar="M",
                      help="the script's micro-batch size, put in place of '{micro_batch}' in its arguments; "
                           "the search keeps micro-batch x accumulation and tries other splits")
    tune.add_argument("--grad-accum", type=int, default=1, metavar="A",
                      help="the script's gradient accumulation steps ('{grad_accum}'; default: %(default)s)")
    tune.add_argument("--tokens-per-sample", type=int, default=None, metavar="T",
                      help="tokens in one sample (the sequence length): tokens per second beside samples "
                           "per second, with --micro-batch")
    tune.add_argument("--max-experiments", type=int, default=50, metavar="E",
                      help="stop after this many experiments (default: %(default)s)")
    tune.add_argument("--patience", type=int, default=5, metavar="P",
                      help="stop after this many experiments in a row that do not improve the best "
                           "(default: %(default)s)")
    tune.add_argument("--no-reuse", action="store_true",
                      help="plan every experiment in a fresh process, Dynamo's trace included (by default the "
                           "experiments that differ in pass options only are planned on one trace of the script)")
    tune.add_argument("--exact", action="store_true",
                      help="leave out qwZ and qgZ, which round what they move: every experiment trains the "
                           "baseline's numbers")
    tune.add_argument("--nvme-path", default="/local_nvme", metavar="DIR",
                      help="the directory a tuned activation or optimizer offload names (plan writes nothing "
                           "there; default: %(default)s)")
    tune.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...]")
    tune.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    from zerocompile.plan import hardware_from
    from zerocompile.tune import PLACEHOLDERS, Tuner, TuneSettings, ms, size, substitute, write_results

    for flag, value, low in (("--world-size", args.world_size, 1), ("--jobs", args.jobs, 1),
                             ("--verify", args.verify, 0), ("--verify-nproc", args.verify_nproc, 1),
                             ("--grad-accum", args.grad_accum, 1), ("--max-experiments", args.max_experiments, 1),
                             ("--patience", args.patience, 1)):
        if value < low:
            raise CliError(f"zerocompile tune: error: {flag} must be >= {low}, got {value}")
    options = check_options(args.options, "tune") or {}
    for key in ("offload_optimizer", "offload_param"):
        if key in options:
            raise CliError(f"zerocompile tune: error: --options cannot set '{key}': plan cannot simulate it (its "
                           "state moves with real I/O); tune derives optimizer offload rows itself when nothing fits")
    try:
        hardware = hardware_from(args.hardware)
    except ValueError as exc:
        raise CliError(f"zerocompile tune: error: --hardware: {exc}") from None
    limit_gb = args.memory_limit_gb if args.memory_limit_gb is not None else hardware.memory_gb
    if not limit_gb or limit_gb <= 0:
        raise CliError(f"zerocompile tune: error: hardware profile {hardware.name!r} gives no device memory "
                       "(memory_gb); pass --memory-limit-gb G")
    script, script_args = script_of(args, "tune", "--world-size N [--hardware NAME|FILE] [--memory-limit-gb G] "
                                                  "[--options JSON] [--out DIR] [--json] [--verify K] [--jobs J]")
    has_placeholder = any(p in a for a in script_args for p in PLACEHOLDERS)
    if has_placeholder and args.micro_batch is None:
        raise CliError("zerocompile tune: error: the script's arguments hold '{micro_batch}' or '{grad_accum}': "
                       "give the baseline with --micro-batch M (and --grad-accum A)")
    if args.micro_batch is not None and not has_placeholder:
        raise CliError("zerocompile tune: error: --micro-batch needs '{micro_batch}' in the script's arguments "
                       "(e.g. -- train.py --batch {micro_batch}) to pass each experiment's value")
    if args.tokens_per_sample is not None and (args.tokens_per_sample < 1 or args.micro_batch is None):
        raise CliError("zerocompile tune: error: --tokens-per-sample needs --micro-batch (the batch) and must be >= 1")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise CliError(f"zerocompile tune: error: --micro-batch must be >= 1, got {args.micro_batch}")
    settings = TuneSettings(world_size=args.world_size, hardware=hardware, memory_limit_bytes=limit_gb * 2**30,
                            base_options=options, micro_batch=args.micro_batch,
                            grad_accum=args.grad_accum if args.micro_batch is not None else None,
                            patience=args.patience, max_experiments=args.max_experiments, nvme_path=args.nvme_path,
                            exact=args.exact, tokens_per_sample=args.tokens_per_sample)

    workers = None if args.no_reuse else PlanWorkers(args.world_size, args.hardware, script,
                                                     max_idle=max(4, args.jobs))

    def plan_one(opts, mb, gas):
        experiment_args = substitute(script_args, mb, gas)
        if workers is None:
            return {**plan_in_subprocess(args.world_size, args.hardware, opts, script, experiment_args), "trace": "new"}
        report, reused = workers.plan(opts, experiment_args)
        return {**report, "trace": "reused" if reused else "new"}

    def plan_many(candidates):
        def one(c):
            try:
                return plan_one(*c)
            except RuntimeError as exc:
                return exc
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            return list(pool.map(one, candidates))

    console = new_console(stderr=True)
    progress = Progress(TextColumn("tune"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                        TimeElapsedColumn(), console=console, transient=True)
    with progress:
        task = progress.add_task("baseline", total=args.max_experiments)

        def on_experiment(e):
            figure = "error" if e.report is None else f"{ms(e.step_ms)}, {size(e.peak_bytes)}"
            progress.update(task, advance=1, description=f"{e.name}: {figure}")

        tuner = Tuner(settings, plan_one, plan_many, on_experiment)
        try:
            tuner.run(jobs=args.jobs)
        except RuntimeError as exc:
            raise CliError(f"zerocompile tune: error: {exc}") from None
        finally:
            if workers is not None:
                workers.close()
    traces = None if workers is None else {"made": workers.started, "reused": workers.reused,
                                           "ran_out": workers.ran_out}
    if args.verify:
        chosen = [e for e in tuner.ranked() if e.report is not None and e.derived_from is None][:args.verify]
        verify_experiments(chosen, script, script_args, args.verify_nproc, console, nvme_path=args.nvme_path)
    result = write_results(Path(args.out), tuner, settings, [str(script), *script_args], traces)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print((Path(args.out) / "summary.txt").read_text(), end="")
        print(f"results in {args.out}/: summary.txt, experiments/, best_options.json, ds_config_optimal.json, "
              "cmd_optimal.txt")
    return 0


def verify_experiments(experiments: list, script: Path, script_args: list, nproc: int, console=None,
                       nvme_path: str | None = None) -> None:
    """Run each experiment for real (``zerocompile.measure`` under ``torch.distributed.run``,
    ``nproc`` ranks) and set its ``measured``: the slowest rank's median step time and the
    largest peak, or the error the run ended with. An offload directory ``nvme_path`` in the
    options becomes a temporary one here (the tuned path is the training machines')."""
    from zerocompile.tune import substitute

    for e in experiments:
        status = console.status(f"verifying {e.name} on {nproc} ranks") if console else contextlib.nullcontext()
        with status, tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "measured"
            options = json.dumps(e.options)
            if nvme_path:
                options = options.replace(json.dumps(nvme_path), json.dumps(str(Path(tmp) / "swap")))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-port", str(_free_port()), "-m", "zerocompile.measure", "--options",
                   options, "--out", str(out), "--", str(script),
                   *substitute(script_args, e.micro_batch, e.grad_accum)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("measured.rank*.json"))]
            if done.returncode != 0 or len(ranks) != nproc:
                lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
                e.measured = {"error": (lines[-1:] or [f"exit code {done.returncode}"])[0]}
                continue
            e.measured = {"step_ms": max(r["step_ms"] for r in ranks), "peak_bytes": max(r["peak_bytes"] for r in ranks),
                          "ranks": nproc}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
