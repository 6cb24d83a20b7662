"""``zerocompile dump [--out DIR] [--world-size N] [--options JSON] -- SCRIPT [ARGS...]``: run
a training script with graph dumping on (``ZEROCOMPILE_DUMP=DIR``, and ``ZEROCOMPILE_OPTIONS``
for ``--options``), as a subprocess or in this process on a fake group of N ranks, and
summarise what was recorded."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zerocompile.cli.errors import CliError
from zerocompile.cli.inputs import check_options, read_dump, script_of
from zerocompile.cli.render import new_console
from zerocompile.env import DUMP_ENV, OPTIONS_ENV
from zerocompile.script_runner import ScriptRunError, run_script

logger = logging.getLogger("zerocompile")

DEFAULT_OUT = "./zerocompile_dump"


def add_parser(subparsers) -> None:
    dump = subparsers.add_parser(
        "dump", help="run a training script and dump every compiled graph",
        description="Run SCRIPT with graph dumping on (ZEROCOMPILE_DUMP=DIR). Put the script "
                    "and its arguments after --.",
        usage="zerocompile dump [--out DIR] [--world-size N] [--options JSON] -- SCRIPT [ARGS...]")
    dump.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                      help=f"dump directory (default: {DEFAULT_OUT}); a previous dump there is replaced")
    dump.add_argument("--world-size", type=int, default=None, metavar="N",
                      help="run the script in this process on a fake process group of N ranks (rank 0) "
                           "instead of as a subprocess (default: subprocess)")
    dump.add_argument("--options", default=None, metavar="JSON",
                      help="backend options as a JSON object, merged over the script's own "
                           "(sets ZEROCOMPILE_OPTIONS; default: none)")
    dump.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...]")
    dump.set_defaults(func=cmd_dump)


def _prepare_out(out: Path, console: Console) -> None:
    """Create ``out``; replace a previous dump there; refuse a file or an unrelated non-empty directory."""
    if out.exists() and not out.is_dir():
        raise CliError(f"zerocompile dump: error: --out {out} is a file, not a directory")
    if out.is_dir():
        entries = list(out.iterdir())
        if entries and not all(e.is_dir() and re.fullmatch(r"rank\d+", e.name) for e in entries):
            raise CliError(f"zerocompile dump: error: --out {out} is not empty and holds no zerocompile "
                           "dump; choose another directory")
        if entries:
            console.print(f"replacing the previous dump in {out}")
            for entry in entries:
                shutil.rmtree(entry)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"zerocompile dump: error: cannot create --out {out}: {exc}") from None


def _run_subprocess(script: Path, script_args: list, env: dict, console: Console) -> int:
    """Run ``python SCRIPT ARGS...`` with ``env``; return its exit code (128 + signal if killed)."""
    cmd = [sys.executable, str(script), *script_args]
    with console.status(f"running {script.name} (dumping graphs)"):
        proc = subprocess.Popen(cmd, env=env)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            code = proc.wait()
    return 128 - code if code < 0 else code


def _summarize(out: Path, console: Console) -> None:
    """Print where the dump is and what each rank recorded."""
    indexes = read_dump(out) if out.is_dir() else {}
    recorded = {rank: index for rank, index in indexes.items()
                if any(entry.get("graphs") for entry in index["frames"].values())}
    if not recorded:
        console.print(f"nothing was recorded in {out}: the script must compile a model with "
                      'torch.compile(model, backend="zero", ...) and run at least one step')
        return
    table = Table(title="recorded per rank", title_justify="left")
    for column in ("rank", "frames", "graphs", "steps"):
        table.add_column(column, justify="right" if column != "rank" else "left")
    for rank, index in recorded.items():
        graphs = [steps for entry in index["frames"].values() for steps in entry.get("graphs", {}).values()]
        table.add_row(str(rank), str(len(index["frames"])), str(len(graphs)), str(sum(len(s) for s in graphs)))
    console.print(table)
    console.print(f"dump written to {out}; read it with: zerocompile show {out}")


def cmd_dump(args) -> int:
    """``zerocompile dump``: run SCRIPT with dumping on; summarise the dump."""
    console, status_console = new_console(), new_console(stderr=True)
    if args.world_size is not None and args.world_size < 1:
        raise CliError(f"zerocompile dump: error: --world-size must be >= 1, got {args.world_size}")
    options = check_options(args.options)
    script, script_args = script_of(args, "dump", "[--out DIR] [--world-size N] [--options JSON]")
    out = Path(args.out).expanduser().resolve()
    _prepare_out(out, console)

    env_updates = {DUMP_ENV: str(out)}
    if options is not None:
        env_updates[OPTIONS_ENV] = json.dumps(options)
    logger.debug("zerocompile dump: running %s %s (world size %s) with %s", script, script_args,
                 args.world_size, env_updates)
    if args.world_size is None:
        code = _run_subprocess(script, script_args, {**os.environ, **env_updates}, status_console)
    else:
        console.print(f"running {script} in this process on a fake process group of "
                      f"{args.world_size} ranks (rank 0)")
        try:
            code = run_script(script.resolve(), script_args, env_updates, args.world_size)
        except ScriptRunError as exc:
            raise CliError(f"zerocompile dump: error: {exc}") from None
    if code != 0:
        console.print(f"{script} exited with code {code}")
    _summarize(out, console)
    return code
