"""The ``zerocompile`` command line (also ``python -m zerocompile``).

``zerocompile dump [--out DIR] [--world-size N] [--options JSON] -- SCRIPT [ARGS...]``
    runs a training script with graph dumping on (``ZEROCOMPILE_DUMP=DIR``) and summarises
    what was recorded. With ``--world-size N`` the script runs in this process on torch's
    fake process group of N ranks (this process is rank 0), so the graphs of an N-rank job
    can be dumped on one machine.

``zerocompile show DIR [--rank R] [--frame F] [--graph G] [--after PASS] [--diff PASS]
[--svg OUT.svg] [--memory OUT.png]``
    prints, per frame and graph, a table of the pipeline's steps (nodes, collectives,
    simulated peak memory, pass time), a step's code, a diff across one pass, a graphviz
    drawing or a plot of simulated live memory.

``zerocompile consolidate CKPT_DIR OUT``
    reads a checkpoint written by ``zerocompile.save_checkpoint`` (no process group needed) and
    writes the full model state dict to one file: ``torch.save`` format, or safetensors when
    OUT ends in ``.safetensors``.

Bad arguments and paths are one-line errors on stderr with exit code 2; a missing optional
tool (graphviz, matplotlib) is a one-line error with exit code 1. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from zerocompile.dump import DUMP_ENV, GRAPH_KINDS, INDEX_FILE
from zerocompile.script_runner import ScriptRunError, run_script

logger = logging.getLogger("zerocompile")

from zerocompile.env import OPTIONS_ENV  # noqa: E402
"""Environment variable with JSON options the backend merges over the script's own options."""

DEFAULT_OUT = "./zerocompile_dump"

GRAPH_ALIASES = {"fw": "forward", "bw": "backward"}

COLLECTIVE_COLUMNS = (("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"),
                      ("all_reduce", "all-reduce"))

# fill colours of --svg drawings, by node category
NODE_COLOURS = {
    "param gather": "#8ecae6",
    "reduce-scatter": "#ffb703",
    "wait": "#d9d9d9",
    "bucket copy": "#b7e4c7",
    "other": "#ffffff",
}

# colours of the collectives marked in --memory plots
PLOT_COLOURS = {"all_gather": "tab:blue", "reduce_scatter": "tab:orange", "all_reduce": "tab:green"}


class CliError(Exception):
    """A problem the command reports as one line on stderr, exiting with ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(" ".join(str(message).split()))
        self.code = code


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (a ``CliError``), not usage + error."""

    def error(self, message):
        raise CliError(f"{self.prog}: error: {message} (see {self.prog} --help)")


# ============================================================================ helpers
def human_bytes(n) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"?"``."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _console(stderr: bool = False) -> Console:
    """A rich console that reads no markup in messages (paths may hold brackets) and does not
    wrap them (paths stay whole); when not writing to a terminal, wide enough that tables
    never wrap."""
    console = Console(stderr=stderr, highlight=False, markup=False, soft_wrap=True)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, highlight=False, markup=False, soft_wrap=True, width=200)
    return console


def _print_code(console: Console, text: str, lexer: str) -> None:
    """Syntax-highlighted on a terminal, plain text otherwise."""
    if console.is_terminal:
        console.print(Syntax(text, lexer, theme="ansi_dark", word_wrap=False))
    else:
        console.out(text, highlight=False)


def _read_json(path: Path, what: str):
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
            index = _read_json(child / INDEX_FILE, "dump index")
            if isinstance(index, dict) and isinstance(index.get("frames"), dict):
                indexes[int(match.group(1))] = index
    return dict(sorted(indexes.items()))


# ============================================================================ dump
def _check_options(text: str | None, command: str = "dump") -> dict | None:
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


def _script_of(args, command: str, usage: str) -> tuple[Path, list]:
    """The script and its arguments after ``--`` (checked to exist) of ``zerocompile COMMAND``."""
    if not args.command:
        raise CliError(f"zerocompile {command}: error: no script given; usage: zerocompile {command} {usage} "
                       "-- SCRIPT [ARGS...]")
    script, script_args = Path(args.command[0]), list(args.command[1:])
    if not script.is_file():
        raise CliError(f"zerocompile {command}: error: no such script: {script}")
    return script, script_args


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
    console, status_console = _console(), _console(stderr=True)
    if args.world_size is not None and args.world_size < 1:
        raise CliError(f"zerocompile dump: error: --world-size must be >= 1, got {args.world_size}")
    options = _check_options(args.options)
    script, script_args = _script_of(args, "dump", "[--out DIR] [--world-size N] [--options JSON]")
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


# ============================================================================ show
def _frame_label(name: str, entry: dict) -> str:
    return f"{name} ({entry.get('dir')})"


def _select(index: dict, frame: str | None, graph: str | None, rank: int) -> list:
    """``[(frame name, graph kind, steps), ...]`` matching ``--frame`` / ``--graph`` (None: all)."""
    frames = index["frames"]
    if frame is not None:
        # the name ("frame 0/0"), the directory ("frame_0_0") or the compile id ("0/0")
        matches = [name for name, entry in frames.items()
                   if frame in (name, entry.get("dir")) or name.split(" ", 1)[-1] == frame]
        if not matches:
            available = ", ".join(_frame_label(n, e) for n, e in frames.items()) or "none"
            raise CliError(f"zerocompile show: error: rank {rank} has no frame '{frame}'; available: {available}")
        frames = {name: frames[name] for name in matches[:1]}
    kind = GRAPH_ALIASES.get(graph, graph)
    selected = []
    for name, entry in frames.items():
        graphs = entry.get("graphs", {})
        order = [k for k in GRAPH_KINDS if k in graphs] + [k for k in graphs if k not in GRAPH_KINDS]
        for k in order:
            if kind is None or k == kind:
                selected.append((name, k, graphs[k]))
    if not selected and kind is not None:
        where = f"frame '{next(iter(frames))}'" if frame is not None else f"rank {rank}"
        kinds = sorted({k for entry in frames.values() for k in entry.get("graphs", {})})
        raise CliError(f"zerocompile show: error: {where} has no {kind} graph; "
                       f"available: {', '.join(kinds) or 'none'}")
    return selected


def _options_line(options) -> str:
    """The recorded options that differ from ``ZeroConfig()``'s defaults, as ``key=value``."""
    if not isinstance(options, dict):
        return "?"
    try:
        from zerocompile.config import ZeroConfig
        from zerocompile.dump import json_safe

        defaults = json_safe(ZeroConfig())
    except Exception:  # noqa: BLE001 - a dump from another version: show every option
        defaults = {}
    changed = {k: v for k, v in options.items() if k not in defaults or defaults[k] != v}
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in changed.items()) or "defaults"


def _collective_cell(collectives, kind: str) -> str:
    if collectives is None:
        return "?"
    total = collectives.get(kind, {"count": 0, "bytes": 0})
    if total["count"] == 0:
        return "0"
    # buffers that are not floating point are quantized buckets (zero_quantized_weights: int8
    # values and float32 scales, moved as uint8): name their dtype
    packed = [d for d in total.get("dtypes", []) if not d.startswith(("float", "bfloat"))]
    return f"{total['count']} / {human_bytes(total['bytes'])}" + (f" ({', '.join(packed)})" if packed else "")


def _steps_table(rank: int, frame: str, kind: str, steps: list) -> Table:
    table = Table(title=f"rank {rank} | {frame} | {kind} graph", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("pass", no_wrap=True, min_width=max((len(s["pass"]) for s in steps), default=4))
    table.add_column("nodes", justify="right")
    for _, header in COLLECTIVE_COLUMNS:
        table.add_column(header, justify="right")
    table.add_column("peak", justify="right")
    table.add_column("ms", justify="right")
    for step in steps:
        table.add_row(
            str(step["index"]), step["pass"], str(step["nodes"]),
            *(_collective_cell(step.get("collectives"), k) for k, _ in COLLECTIVE_COLUMNS),
            human_bytes(step.get("peak_bytes")), f"{1e3 * step.get('time_s', 0.0):.1f}")
    return table


def _step_after(steps: list, pass_name: str) -> dict | None:
    return next((s for s in steps if s["pass"] == pass_name), None)


def _ran_passes(selected: list) -> list:
    names = []
    for _, _, steps in selected:
        names += [s["pass"] for s in steps if s["pass"] not in names]
    return names


def _code(rank_dir: Path, step: dict) -> str:
    try:
        return (rank_dir / step["code"]).read_text()
    except OSError as exc:
        raise CliError(f"zerocompile show: error: cannot read {rank_dir / step['code']}: {exc}") from None


def _steps_with(selected: list, pass_name: str, option: str) -> list:
    """``[(frame, kind, steps, step)]`` for each selected graph where ``pass_name`` ran."""
    found = [(f, k, steps, _step_after(steps, pass_name)) for f, k, steps in selected]
    found = [item for item in found if item[3] is not None]
    if not found:
        raise CliError(f"zerocompile show: error: {option} {pass_name}: no such step in the selected graphs; "
                       f"steps recorded: {', '.join(_ran_passes(selected)) or 'none'}")
    return found


def _one_graph(selected: list, option: str) -> tuple:
    if len(selected) != 1:
        candidates = "; ".join(f"--frame '{f}' --graph {k}" for f, k, _ in selected)
        raise CliError(f"zerocompile show: error: {option} draws one graph; choose it with --frame and "
                       f"--graph ({candidates})")
    return selected[0]


def _node_category(node: dict) -> str:
    """The --svg colour category of a node dict from a dump's nodes file."""
    role = node.get("role") or ""
    target = node.get("target") or ""
    collective = node.get("collective")
    if "wait_tensor" in target:
        return "wait"
    if collective == "all_gather" or role in ("param_gather", "bucket_gather"):
        return "param gather"
    if collective == "reduce_scatter" or "reduce_scatter" in role:
        return "reduce-scatter"
    if "bucket" in role:
        return "bucket copy"
    return "other"


def _dot_quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def graph_to_dot(nodes: list, title: str) -> str:
    """A graphviz DOT description of a dumped graph, nodes filled by category, with a legend."""
    lines = [f"digraph {_dot_quote('zerocompile')} {{",
             f"  label={_dot_quote(title)}; labelloc=t; rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
    for node in nodes:
        target = node["target"] if node["op"] not in ("placeholder", "output") else node["op"]
        label = f"{node['name']}\n{target}"
        if node.get("params"):
            label += "\n" + ", ".join(node["params"])
        if node.get("bytes"):
            label += f"\n{human_bytes(node['bytes'])}"
        colour = NODE_COLOURS[_node_category(node)]
        lines.append(f"  {_dot_quote(node['name'])} [label={_dot_quote(label)}, fillcolor={_dot_quote(colour)}];")
    for node in nodes:
        for source in node.get("inputs", []):
            lines.append(f"  {_dot_quote(source)} -> {_dot_quote(node['name'])};")
    lines.append('  subgraph "cluster_legend" {')
    lines.append('    label="legend"; style=dashed;')
    for category, colour in NODE_COLOURS.items():
        lines.append(f"    {_dot_quote('legend: ' + category)} [label={_dot_quote(category)}, "
                     f"fillcolor={_dot_quote(colour)}];")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _load_nodes(rank_dir: Path, step: dict) -> list:
    data = _read_json(rank_dir / step["nodes_file"], "nodes file")
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise CliError(f"zerocompile show: error: {rank_dir / step['nodes_file']} is not a nodes file")
    return data["nodes"]


def write_svg(nodes: list, title: str, out: Path) -> Path:
    """Write ``out`` with ``.dot`` suffix, then run ``dot -Tsvg`` into ``out``; return the .dot path."""
    dot_path = out.with_suffix(".dot")
    try:
        dot_path.write_text(graph_to_dot(nodes, title))
    except OSError as exc:
        raise CliError(f"zerocompile show: error: cannot write {dot_path}: {exc}") from None
    dot = shutil.which("dot")
    if dot is None:
        raise CliError(f"zerocompile show: error: graphviz 'dot' is not on PATH; install graphviz "
                       f"(e.g. apt install graphviz / conda install graphviz); the graph was still written "
                       f"to {dot_path}", code=1)
    try:
        done = subprocess.run([dot, "-Tsvg", str(dot_path), "-o", str(out)], capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CliError(f"zerocompile show: error: running dot failed: {exc}; the graph is in {dot_path}",
                       code=1) from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[0]
        raise CliError(f"zerocompile show: error: dot failed: {reason}; the graph is in {dot_path}", code=1)
    return dot_path


def write_memory_plot(nodes: list, title: str, out: Path) -> None:
    """Plot simulated live bytes per node (Agg backend), collectives as vertical lines, peak annotated."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CliError("zerocompile show: error: --memory needs matplotlib, which is not installed "
                       "(pip install 'zerocompile[plot]', or pip install matplotlib)", code=1) from None
    live = [n.get("live") or 0 for n in nodes]
    peak = max(live, default=0)
    scale, unit = next(((s, u) for s, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if peak >= s),
                       (1, "B"))
    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(len(live)), [v / scale for v in live], color="black", linewidth=1.2, label="live")
    labelled = set()
    for i, node in enumerate(nodes):
        kind = node.get("collective")
        if kind:
            ax.axvline(i, color=PLOT_COLOURS.get(kind, "tab:gray"), alpha=0.6, linewidth=0.8,
                       label=None if kind in labelled else kind.replace("_", "-"))
            labelled.add(kind)
    if live:
        at = live.index(peak)
        ax.annotate(f"peak {human_bytes(peak)}\n{nodes[at]['name']}", xy=(at, peak / scale),
                    xytext=(0.02, 0.95), textcoords="axes fraction", va="top",
                    arrowprops={"arrowstyle": "->", "color": "tab:red"})
    ax.set_xlabel("node (graph order)")
    ax.set_ylabel(f"simulated live {unit}")
    ax.set_title(title)
    ax.set_ylim(bottom=0, top=max(peak / scale * 1.15, 1e-9))
    ax.legend(loc="upper right")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as exc:
        raise CliError(f"zerocompile show: error: cannot write {out}: {exc}", code=2) from None


def cmd_show(args) -> int:
    """``zerocompile show``: tables, code, diffs and drawings of a dump."""
    console = _console()
    root = Path(args.dir)
    if not root.exists():
        raise CliError(f"zerocompile show: error: no such directory: {root}")
    if not root.is_dir():
        raise CliError(f"zerocompile show: error: {root} is not a directory")
    indexes = read_dump(root)
    if not indexes:
        raise CliError(f"zerocompile show: error: {root} is not a zerocompile dump (no rank*/{INDEX_FILE}); "
                       "make one with zerocompile dump")
    if args.rank not in indexes:
        raise CliError(f"zerocompile show: error: rank {args.rank} is not in the dump {root}; available ranks: "
                       f"{', '.join(str(r) for r in indexes)}")
    index, rank_dir = indexes[args.rank], root / f"rank{args.rank}"
    selected = _select(index, args.frame, args.graph, args.rank)
    drawing = args.svg is not None or args.memory is not None

    if args.diff is not None:
        if args.after is not None or drawing:
            raise CliError("zerocompile show: error: --diff cannot be combined with --after, --svg or --memory")
        if args.diff == "input":
            raise CliError("zerocompile show: error: --diff input: 'input' is the graph before the pipeline, "
                           "so there is nothing to diff; use --after input to print it")
        for frame, kind, steps, step in _steps_with(selected, args.diff, "--diff"):
            before = steps[steps.index(step) - 1]
            diff = "".join(difflib.unified_diff(
                _code(rank_dir, before).splitlines(keepends=True), _code(rank_dir, step).splitlines(keepends=True),
                fromfile=f"{frame} {kind} {before['index']:02d} after {before['pass']}",
                tofile=f"{frame} {kind} {step['index']:02d} after {step['pass']}"))
            console.rule(f"{frame} | {kind} graph | --diff {args.diff}")
            if diff:
                _print_code(console, diff, "diff")
            else:
                console.print(f"({args.diff} did not change the code of this graph)")
        return 0

    if drawing:
        frame, kind, steps = _one_graph(selected, "--svg" if args.svg is not None else "--memory")
        step = steps[-1] if args.after is None else _steps_with([(frame, kind, steps)], args.after, "--after")[0][3]
        nodes = _load_nodes(rank_dir, step)
        title = f"rank {args.rank} | {frame} | {kind} graph | {step['index']:02d} after {step['pass']}"
        if args.memory is not None:
            write_memory_plot(nodes, title, Path(args.memory))
            console.print(f"wrote {args.memory} (peak {human_bytes(step.get('peak_bytes'))} at "
                          f"{step.get('peak_node')})")
        if args.svg is not None:
            dot_path = write_svg(nodes, title, Path(args.svg))
            console.print(f"wrote {args.svg} (graphviz source: {dot_path})")
        return 0

    if args.after is not None:
        for frame, kind, _, step in _steps_with(selected, args.after, "--after"):
            console.rule(f"{frame} | {kind} graph | {step['index']:02d} after {step['pass']}")
            _print_code(console, _code(rank_dir, step), "python")
        return 0

    console.print(f"zerocompile dump {root}: rank {args.rank} of {index.get('world', '?')}; "
                  f"options: {_options_line(index.get('options'))}")
    if not selected:
        console.print(f"rank {args.rank} recorded no graphs")
        return 0
    for frame, kind, steps in selected:
        console.print(_steps_table(args.rank, frame, kind, steps))
    if args.frame is not None or args.graph is not None:
        for frame, kind, steps in selected:
            step = steps[-1]
            console.rule(f"{frame} | {kind} graph | {step['index']:02d} after {step['pass']} (last step)")
            _print_code(console, _code(rank_dir, step), "python")
    return 0


# ============================================================================ consolidate
def cmd_consolidate(args) -> int:
    """``zerocompile consolidate CKPT_DIR OUT``."""
    from zerocompile.checkpoint import write_consolidated

    if os.path.isdir(args.out):
        raise CliError(f"zerocompile consolidate: error: {args.out} is a directory; OUT is the file to write")
    try:
        state = write_consolidated(args.checkpoint, args.out)
    except ImportError as err:
        raise CliError(f"zerocompile consolidate: error: {err}", code=1) from None
    except (FileNotFoundError, ValueError) as err:
        message = str(err).removeprefix("zerocompile: ")
        raise CliError(f"zerocompile consolidate: error: {message}") from None
    tensors = {id(t): t for t in state.values()}.values()
    numel = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"wrote {args.out}: {len(state)} entries, {numel:,} elements, {nbytes / 2**20:.1f} MiB")
    return 0


# ============================================================================ plan
def _hardware_names() -> list:
    from zerocompile.plan import HARDWARE

    return list(HARDWARE)


def cmd_plan(args) -> int:
    """``zerocompile plan``: run SCRIPT on fake ranks with fake tensors; report per rank."""
    from zerocompile.plan import PlanReplayError, hardware_from, plan_script

    if args.world_size < 1:
        raise CliError(f"zerocompile plan: error: --world-size must be >= 1, got {args.world_size}")
    if args.jobs < 1:
        raise CliError(f"zerocompile plan: error: --jobs must be >= 1, got {args.jobs}")
    options = _check_options(args.options, "plan") or {}
    for key in ("offload_optimizer", "offload_param"):
        if key in options:
            raise CliError(f"zerocompile plan: error: --options cannot set '{key}' yet: offloaded state "
                           "is moved with real I/O, which fake tensors cannot do; plan without it (with "
                           "--compare, plan also prints a stage-3 row with the optimizer state offloaded)")
    try:
        hardware = hardware_from(args.hardware)
    except ValueError as exc:
        raise CliError(f"zerocompile plan: error: --hardware: {exc}") from None
    script, script_args = _script_of(args, "plan", "--world-size N [--options JSON] [--hardware NAME|FILE] "
                                                    "[--json] [--compare [--jobs J]]")
    status = _console(stderr=True)
    try:
        with status.status(f"planning {script.name} on {args.world_size} fake ranks"):
            report = plan_script(script, script_args, args.world_size, options, hardware,
                                 stdout=sys.stderr if args.json else None, replay=not args.no_replay)
    except (ScriptRunError, PlanReplayError) as exc:
        raise CliError(f"zerocompile plan: error: {exc}") from None
    if report.measured_step == 0:
        ran = {0: "ran no optimizer step", 1: "ran only one optimizer step"}[report.steps_seen]
        reason = f"exited with code {report.exit_code} after {report.steps_seen} optimizer step(s)" \
            if report.exit_code != 0 else ran
        print(f"zerocompile plan: error: {script} {reason}: plan measures the second training step "
              "(forward, backward and optimizer.step()); the first compiles. Let the script run two steps",
              file=sys.stderr)
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
    _print_plan(report, script, _console())
    if args.compare:
        _print_compare(rows, _console())
    return 0


def _compare(args, options: dict, script: Path, script_args: list, status: Console) -> list:
    """Plan stages 0-3 with the same options, each in a subprocess of its own (a fresh
    process: nothing of one run's models or compiled frames is left to count in the next),
    ``args.jobs`` of them at a time."""
    def plan_stage(stage: int) -> dict:
        cmd = [sys.executable, "-m", "zerocompile", "plan", "--world-size", str(args.world_size),
               "--hardware", args.hardware, "--json", "--options", json.dumps({**options, "stage": stage}),
               "--", str(script), *script_args]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
            return {"options": {"stage": stage}, "error": tail[0]}
        return json.loads(done.stdout.strip().splitlines()[0])

    stages = (0, 1, 2, 3)
    with status.status(f"planning stages 0-3, {min(args.jobs, len(stages))} at a time"):
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            return list(pool.map(plan_stage, stages))


def _print_plan(report, script: Path, console: Console) -> None:
    r = report.as_dict()
    hw = report.hardware
    stages = ", ".join(map(str, report.stages)) or "?"
    console.print(f"plan for {script} on {report.world_size} ranks, stage{'s' * (len(report.stages) > 1)} "
                  f"{stages}, hardware {hw.name} "
                  f"({hw.description}); measured: optimizer step {report.measured_step} of the script "
                  f"({report.wall_s:.1f} s here)")
    table = Table(title=f"per rank ({r['num_params']:,} parameters in compiled frames)", title_justify="left")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    for kind, nbytes in r["model_state_bytes_by_kind"].items():
        if nbytes or not kind.startswith("offloaded"):
            table.add_row(f"model state: {kind.replace('_', ' ')}", f"{nbytes:,}", human_bytes(nbytes))
    table.add_row("model state on the device", f"{r['model_state_bytes_per_rank']:,}",
                  human_bytes(r["model_state_bytes_per_rank"]))
    table.add_row("peak live bytes in a step", f"{r['peak_bytes_per_rank']:,}", human_bytes(r["peak_bytes_per_rank"]))
    console.print(table)
    unsharded = r.get("unsharded_params") or {}
    if unsharded.get("count"):
        names = ", ".join(unsharded["names"][:6]) + (", ..." if unsharded["count"] > 6 else "")
        console.print(f"kept whole on every rank (used by no compiled frame; allow_unsharded): "
                      f"{unsharded['count']} parameter(s), {unsharded['elements']:,} elements: {names}")
    comm = Table(title="collectives per step (full buffers; wire: what each rank sends in a ring over each "
                       "collective's group)", title_justify="left")
    for column in ("kind", "count", "bytes", "size", "wire"):
        comm.add_column(column, justify="left" if column == "kind" else "right")
    for kind, v in r["comm_by_kind"].items():
        comm.add_row(kind.replace("_", "-"), str(v["count"]), f"{v['bytes']:,}", human_bytes(v["bytes"]),
                     human_bytes(v["wire_bytes"]))
    comm.add_row("total", "", f"{r['comm_bytes_per_rank_per_step']:,}", human_bytes(r["comm_bytes_per_rank_per_step"]),
                 human_bytes(r["wire_bytes_per_rank_per_step"]))
    console.print(comm)
    exposed = max(0.0, report.step_s - report.compute_s)
    console.print(f"estimated step: {report.step_s * 1e3:,.1f} ms = compute {report.compute_s * 1e3:,.1f} ms "
                  f"+ exposed communication {exposed * 1e3:,.1f} ms (communication {report.comm_s * 1e3:,.1f} ms "
                  f"in all); {hw.flops_per_s / 1e12:g} TFLOP/s, {hw.memory_gbps:g} GB/s memory, "
                  f"{hw.bandwidth_gbps:g} GB/s per rank in collectives, {hw.alpha_us:g} us latency")


def _print_compare(rows: list, console: Console) -> None:
    table = Table(title="stages side by side (per rank)", title_justify="left")
    for column in ("stage", "model state", "peak", "bytes per step", "est. step"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for r in rows:
        stage = str(r["options"]["stage"])
        if "error" in r:
            table.add_row(stage, r["error"], "", "", "")
            continue
        table.add_row(stage, human_bytes(r["model_state_bytes_per_rank"]), human_bytes(r["peak_bytes_per_rank"]),
                      human_bytes(r["comm_bytes_per_rank_per_step"]), f"{r['estimated_step_s'] * 1e3:,.1f} ms")
        if r["options"].get("stage") == 3 and r["model_state_bytes_by_kind"].get("optimizer_state"):
            opt = r["model_state_bytes_by_kind"]["optimizer_state"]
            table.add_row("3 + offload_optimizer (derived)", human_bytes(r["model_state_bytes_per_rank"] - opt),
                          human_bytes(r["peak_bytes_per_rank"] - opt), human_bytes(r["comm_bytes_per_rank_per_step"]), "")
    console.print(table)
    console.print("derived rows: the stage-3 figures less the optimizer state that offload_optimizer keeps "
                  "in host memory or on NVMe (plus its staging buffers, not counted)")


# ============================================================================ entry point
def build_parser() -> argparse.ArgumentParser:
    """The ``zerocompile`` argument parser (subcommands ``dump``, ``show``, ``consolidate``, ``plan``)."""
    from zerocompile import __version__

    parser = _Parser(prog="zerocompile", description="Debugging tools for the zerocompile torch.compile backend.")
    parser.add_argument("--version", action="version", version=f"zerocompile {__version__}")
    sub = parser.add_subparsers(dest="subcommand", metavar="{dump,show,consolidate,plan}", parser_class=_Parser)

    dump = sub.add_parser("dump", help="run a training script and dump every compiled graph",
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

    show = sub.add_parser("show", help="summarise a dump: per-pass tables, code, diffs, drawings",
                          description="Show what a zerocompile dump recorded.")
    show.add_argument("dir", metavar="DIR", help="a dump directory (from zerocompile dump or options={'dump': DIR})")
    show.add_argument("--rank", type=int, default=0, help="rank to show (default: 0)")
    show.add_argument("--frame", default=None, metavar="F",
                      help="frame: its name ('frame 0/0'), directory (frame_0_0) or compile id (0/0) "
                           "(default: all)")
    show.add_argument("--graph", default=None, choices=(*GRAPH_KINDS, *GRAPH_ALIASES),
                      help="graph kind (default: all)")
    show.add_argument("--after", default=None, metavar="PASS",
                      help="print the code after PASS ('input': before the pipeline) (default: the last "
                           "step when --frame/--graph are given)")
    show.add_argument("--diff", default=None, metavar="PASS",
                      help="unified diff of the code before and after PASS (default: none)")
    show.add_argument("--svg", default=None, metavar="OUT.svg",
                      help="draw the selected step with graphviz; OUT.dot is written next to it (default: none)")
    show.add_argument("--memory", default=None, metavar="OUT.png",
                      help="plot simulated live bytes per node of the selected step (default: none)")
    show.set_defaults(func=cmd_show)

    consolidate = sub.add_parser(
        "consolidate", help="write a checkpoint's full model state dict to one file",
        description="Read a checkpoint directory written by zerocompile.save_checkpoint (any world size, "
                    "any stage) and write the full model state dict, keys and shapes of the uncompiled "
                    "model.state_dict(), to OUT: torch.save format, or safetensors when OUT ends in "
                    ".safetensors.")
    consolidate.add_argument("checkpoint", metavar="CKPT_DIR", help="a checkpoint directory")
    consolidate.add_argument("out", metavar="OUT", help="output file (.pt, .bin, ... or .safetensors)")
    consolidate.set_defaults(func=cmd_consolidate)

    plan = sub.add_parser(
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
    return parser


def _split_script(argv: list) -> tuple:
    """For ``dump`` and ``plan``: everything after the first ``--`` is the script and its
    arguments, kept out of argparse (whose handling of ``--`` before a remainder varies
    between versions)."""
    if argv and argv[0] in ("dump", "plan") and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, None


def main(argv: list | None = None) -> int:
    """Run the command line; return the exit code (``zerocompile`` calls ``sys.exit`` with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        head, tail = _split_script(argv)
        args = parser.parse_args(head)
        if args.subcommand is None:
            parser.print_help(sys.stderr)
            return 2
        if tail is not None:
            args.command = list(args.command) + tail
        return args.func(args)
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
