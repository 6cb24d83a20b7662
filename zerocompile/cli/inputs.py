"""The command line's inputs, read and checked: ``--options`` JSON, the script after ``--``,
and a dump directory's per-rank indexes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from zerocompile.cli.errors import CliError
from zerocompile.dump import INDEX_FILE


def read_json(path: Path, what: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CliError(f"zerocompile show: error: cannot read {what} {path}: {exc}") from None


def read_dump(root: Path) -> dict:
    """``{rank: index}`` of every ``rank*/index.json`` under ``root`` (empty if none)."""
    indexes = {}
    if not root.is_dir():
        return indexes
    for child in root.iterdir():
        match = re.fullmatch(r"rank(\d+)", child.name)
        if match and (child / INDEX_FILE).is_file():
            index = read_json(child / INDEX_FILE, "dump index")
            if isinstance(index, dict) and isinstance(index.get("frames"), dict):
                indexes[int(match.group(1))] = index
    return dict(sorted(indexes.items()))


def check_options(text: str | None, command: str = "dump") -> dict | None:
    """Parse ``--options`` of ``zerocompile COMMAND`` and validate it with
    ``ZeroConfig.from_options``; ``None`` when it was not given."""
    if text is None:
        return None
    where = f"zerocompile {command}: error: --options"
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise CliError(f"{where} is not valid JSON ({exc}): {text}") from None
    if not isinstance(options, dict):
        raise CliError(f"{where} must be a JSON object such as '{{\"stage\": 3}}', got {text}")
    if "process_group" in options:
        raise CliError(f"{where} cannot set 'process_group' (a process group is not JSON); the script's "
                       "default group is used")
    if "dump" in options:
        raise CliError(f"{where} cannot set 'dump'; " + ("give the directory with --out" if command == "dump"
                                                         else "use zerocompile dump to write graphs"))
    from zerocompile.config import ZeroConfig, ZeroConfigError

    try:
        ZeroConfig.from_options(options)
    except ZeroConfigError as exc:
        raise CliError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - report, as one line, whatever validation raised
        raise CliError(f"{where} could not be checked: {type(exc).__name__}: {exc}") from None
    return options


def script_of(args, command: str, usage: str) -> tuple[Path, list]:
    """The script and its arguments after ``--`` (checked to exist) of ``zerocompile COMMAND``."""
    if not args.command:
        raise CliError(f"zerocompile {command}: error: no script given; usage: zerocompile {command} {usage} "
                       "-- SCRIPT [ARGS...]")
    script, script_args = Path(args.command[0]), list(args.command[1:])
    if not script.is_file():
        raise CliError(f"zerocompile {command}: error: no such script: {script}")
    return script, script_args
