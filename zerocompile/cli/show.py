"""``zerocompile show DIR [--rank R] [--frame F] [--graph G] [--after PASS] [--diff PASS]
[--svg OUT.svg] [--memory OUT.png]``: per frame and graph of a dump, a table of the pipeline's
steps, a step's code, a diff across one pass, a graphviz drawing or a plot of simulated live
memory; and the collectives of the recorded optimizer steps (``optimizer_steps.json``)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from zerocompile.cli.errors import CliError
from zerocompile.cli.inputs import read_dump, read_json
from zerocompile.cli.render import (human_bytes, metrics_table, new_console, optimizer_steps_table, print_code,
                                    steps_table, write_memory_plot, write_metrics_plot, write_svg)
from zerocompile.dump import GRAPH_KINDS, INDEX_FILE, OPTIMIZER_STEPS_FILE

GRAPH_ALIASES = {"fw": "forward", "bw": "backward"}


def add_parser(subparsers) -> None:
    show = subparsers.add_parser("show", help="summarise a dump: per-pass tables, code, diffs, drawings",
                                 description="Show what a zerocompile dump recorded.")
    show.add_argument("dir", metavar="DIR", nargs="?", default=None,
                      help="a dump directory (from zerocompile dump or options={'dump': DIR})")
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
    show.add_argument("--metrics", default=None, metavar="DIR",
                      help="instead of a dump: plot the figures a monitor wrote to DIR (output_path/job_name of "
                           "the csv_monitor or tensorboard option) to DIR/metrics.png (or --out), and print a "
                           "table of them")
    show.add_argument("--out", default=None, metavar="OUT.png", help="with --metrics: where the plot goes")
    show.set_defaults(func=cmd_show)


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

        defaults = json_safe(ZeroConfig().flat())
    except Exception:  # noqa: BLE001 - a dump from another version: show every option
        defaults = {}
    changed = {k: v for k, v in options.items() if k not in defaults or defaults[k] != v}
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in changed.items()) or "defaults"


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


def _load_nodes(rank_dir: Path, step: dict) -> list:
    data = read_json(rank_dir / step["nodes_file"], "nodes file")
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise CliError(f"zerocompile show: error: {rank_dir / step['nodes_file']} is not a nodes file")
    return data["nodes"]


def cmd_show(args) -> int:
    """``zerocompile show``: tables, code, diffs and drawings of a dump."""
    console = new_console()
    if args.metrics is not None:
        if args.dir is not None:
            raise CliError("zerocompile show: error: give either a dump DIR or --metrics DIR, not both")
        return _show_metrics(Path(args.metrics), Path(args.out) if args.out else None, console)
    if args.dir is None:
        raise CliError("zerocompile show: error: give a dump directory (DIR) or --metrics DIR")
    if args.out is not None:
        raise CliError("zerocompile show: error: --out goes with --metrics")
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
                print_code(console, diff, "diff")
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
            print_code(console, _code(rank_dir, step), "python")
        return 0

    console.print(f"zerocompile dump {root}: rank {args.rank} of {index.get('world', '?')}; "
                  f"options: {_options_line(index.get('options'))}")
    if not selected:
        console.print(f"rank {args.rank} recorded no graphs")
        return 0
    for frame, kind, steps in selected:
        console.print(steps_table(args.rank, frame, kind, steps))
    for frame in dict.fromkeys(f for f, _, _ in selected):
        notes = index["frames"][frame].get("notes") or {}
        reduction = notes.get("gradient_reduction")
        gather = notes.get("parameter_gather")            # stage 3's frames note only this
        if isinstance(reduction, dict):
            console.print(f"{frame}: gradient reduction: {reduction.get('description', '?')}")
            gather = reduction.get("parameter_gather", gather)
        if isinstance(gather, dict):
            console.print(f"{frame}: parameter gather: {gather.get('description', '?')}")
    if args.frame is None and args.graph is None and (rank_dir / OPTIMIZER_STEPS_FILE).exists():
        console.print(optimizer_steps_table(args.rank, read_json(rank_dir / OPTIMIZER_STEPS_FILE,
                                                                 "optimizer steps file")))
    if args.frame is not None or args.graph is not None:
        for frame, kind, steps in selected:
            step = steps[-1]
            console.rule(f"{frame} | {kind} graph | {step['index']:02d} after {step['pass']} (last step)")
            print_code(console, _code(rank_dir, step), "python")
    return 0


def _show_metrics(root: Path, out: Path | None, console) -> int:
    """``--metrics DIR``: the monitor's series (its CSV files, else TensorBoard's event files)
    as a table and a plot."""
    if not root.is_dir():
        raise CliError(f"zerocompile show: error: --metrics: no such directory: {root}")
    series = read_metrics(root)
    if not series:
        raise CliError(f"zerocompile show: error: --metrics: {root} holds no monitor files (Train_*.csv or "
                       "events.out.tfevents.*); point it at output_path/job_name of the csv_monitor or "
                       "tensorboard option")
    console.print(metrics_table(series, root))
    out = out or root / "metrics.png"
    write_metrics_plot(series, str(root), out)
    console.print(f"plot: {out}")
    return 0


def read_metrics(root: Path) -> dict:
    """``{tag: [(x, value), ...]}`` from a monitor's directory: the CSV monitor's files (one per
    tag, header ``step,<name>``), or TensorBoard's event files when there is no CSV."""
    import csv

    series = {}
    for path in sorted(root.glob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if len(rows) < 2 or len(rows[0]) != 2 or rows[0][0] != "step":
            continue
        try:
            series[path.stem.replace("_", "/", 2)] = [(float(x), float(v)) for x, v in rows[1:]]
        except ValueError:
            raise CliError(f"zerocompile show: error: --metrics: {path} has a row that is not two numbers") from None
    if series or not any(root.glob("events.out.tfevents.*")):
        return series
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise CliError("zerocompile show: error: --metrics: reading TensorBoard's event files needs the tensorboard "
                       "package (pip install 'zerocompile[monitor]'); the csv_monitor's files need nothing", code=1) \
            from None
    acc = EventAccumulator(str(root))
    acc.Reload()
    return {tag: [(float(e.step), float(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
