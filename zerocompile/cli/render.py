"""What the ``zerocompile`` command draws: byte counts, rich consoles and tables (a dump's
steps, a plan's figures), highlighted code, graphviz DOT drawings and matplotlib plots of
simulated live memory."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from zerocompile.cli.errors import CliError

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


# ============================================================================ text
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


def new_console(stderr: bool = False) -> Console:
    """A rich console that reads no markup in messages (paths may hold brackets) and does not
    wrap them (paths stay whole); when not writing to a terminal, wide enough that tables
    never wrap."""
    out = Console(stderr=stderr, highlight=False, markup=False, soft_wrap=True)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, highlight=False, markup=False, soft_wrap=True, width=200)
    return out


def print_code(console: Console, text: str, lexer: str) -> None:
    """Syntax-highlighted on a terminal, plain text otherwise."""
    if console.is_terminal:
        console.print(Syntax(text, lexer, theme="ansi_dark", word_wrap=False))
    else:
        console.out(text, highlight=False)


# ============================================================================ a dump's tables
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


def steps_table(rank: int, frame: str, kind: str, steps: list) -> Table:
    """One graph's pipeline steps: nodes, collectives, simulated peak and pass time of each."""
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


def optimizer_steps_table(rank: int, data: dict) -> Table:
    """The collectives of each recorded ``ZeroOptimizer.step()`` (``optimizer_steps.json``)."""
    table = Table(title=f"rank {rank} | optimizer steps (eager collectives in opt.step())", title_justify="left")
    table.add_column("optimizer", no_wrap=True)
    table.add_column("step", justify="right")
    table.add_column("collectives (count x bytes)")
    for name, entry in (data.get("optimizers") or {}).items():
        for record in entry.get("recorded", []):
            moved = record.get("collectives") or {}
            cells = ", ".join(f"{kind.replace('_', '-')} {v['count']}x {human_bytes(v['bytes'])}"
                              for kind, v in moved.items()) or "none"
            table.add_row(name, f"{record.get('step')} of {entry.get('steps')}", cells)
    return table


# ============================================================================ graphviz
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


# ============================================================================ matplotlib
def _agg_figure(figsize: tuple, flag: str):
    """A matplotlib figure on the Agg backend (no display needed); ``flag``: the option that asked
    for it, named when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CliError(f"zerocompile show: error: {flag} needs matplotlib, which is not installed "
                       "(pip install 'zerocompile[plot]', or pip install matplotlib)", code=1) from None
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, out: Path) -> None:
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100)
    except (OSError, ValueError) as exc:
        raise CliError(f"zerocompile show: error: cannot write {out}: {exc}", code=2) from None


def write_memory_plot(nodes: list, title: str, out: Path) -> None:
    """Plot simulated live bytes per node (Agg backend), collectives as vertical lines, peak annotated."""
    fig = _agg_figure((10, 4.5), "--memory")
    live = [n.get("live") or 0 for n in nodes]
    peak = max(live, default=0)
    scale, unit = next(((s, u) for s, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if peak >= s),
                       (1, "B"))
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
    _save(fig, out)


def metrics_table(series: dict, root: Path) -> Table:
    """One row per monitored tag: points, x range, first, last, min and max."""
    table = Table(title=f"monitor figures in {root}", title_justify="left")
    table.add_column("tag", overflow="fold")          # whole, over lines on a narrow console
    for column in ("points", "x", "first", "last", "min", "max"):
        table.add_column(column, justify="right")
    for tag, points in series.items():
        values = [v for _, v in points]
        table.add_row(tag, str(len(points)), f"{points[0][0]:g}-{points[-1][0]:g}" if points else "-",
                      *(f"{v:.6g}" for v in (values[0], values[-1], min(values), max(values))) if values
                      else ["-"] * 4)
    return table


def write_metrics_plot(series: dict, title: str, out: Path) -> None:
    """One small plot per tag (Agg backend), x as the monitor wrote it (samples or steps)."""
    cols = min(3, len(series))
    rows = -(-len(series) // cols)
    fig = _agg_figure((4.2 * cols, 2.8 * rows), "--metrics")
    for i, (tag, points) in enumerate(series.items(), start=1):
        ax = fig.add_subplot(rows, cols, i)
        ax.plot([x for x, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None,
                linewidth=1.2, color="black")
        ax.set_title(tag.split("/")[-1], fontsize=9)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    _save(fig, out)


# ============================================================================ a plan's tables
def print_plan(report, script: Path, console: Console) -> None:
    """A plan's figures: model state and peak bytes, collectives and the estimated step."""
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
    from zerocompile.plan import activations_line

    line = activations_line(r.get("activations") or {}, human_bytes)
    if line is not None:
        console.print(line)
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
    if {1, 2} & set(report.stages):
        console.print(f"gradient reduction (stages 1-2): {report.gradient_reduction}")
    exposed = max(0.0, report.step_s - report.compute_s)
    console.print(f"estimated step: {report.step_s * 1e3:,.1f} ms = compute {report.compute_s * 1e3:,.1f} ms "
                  f"+ exposed communication {exposed * 1e3:,.1f} ms (communication {report.comm_s * 1e3:,.1f} ms "
                  f"in all); {hw.flops_per_s / 1e12:g} TFLOP/s, {hw.memory_gbps:g} GB/s memory, "
                  f"{hw.bandwidth_gbps:g} GB/s per rank in collectives, {hw.alpha_us:g} us latency")


def print_compare(rows: list, console: Console) -> None:
    """``plan --compare``'s stages side by side (a row per stage, or its error)."""
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
