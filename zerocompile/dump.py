"""The graph-dump recorder: every frame's graphs, before the pass pipeline and after each pass.

When dumping is on (``options={"dump": DIR}`` or the environment variable
``ZEROCOMPILE_DUMP=DIR``), the pass manager calls ``DumpRecorder.record`` once with the
graph it is about to rewrite (pass name ``"input"``) and once after every pass. Each call
writes, for this rank::

    DIR/rank{R}/index.json                                   what was recorded, with summaries
    DIR/rank{R}/{frame_dir}/{graph_kind}/{NN}_{pass}.py      the graph's generated code
    DIR/rank{R}/{frame_dir}/{graph_kind}/{NN}_{pass}.json    its nodes (role, bytes, live bytes)

``NN`` counts the calls for one (frame, graph kind) from 00. ``index.json`` is rewritten
atomically after every record, so a dump stays readable while the program runs or after
it dies. Its layout is::

    {"rank": R, "world": N, "pid": ..., "options": {...},
     "frames": {"frame 0/0": {"dir": "frame_0_0", "options": {...},
                              "graphs": {"forward": [step, ...], ...}}}}

where a step is ``{"index", "pass", "code", "nodes_file", "nodes", "collectives",
"peak_bytes", "peak_node", "peak_breakdown", "time_s"}``; ``code`` and ``nodes_file`` are
paths relative to ``DIR/rank{R}``, and ``collectives`` is ``{kind: {"count", "bytes"}}``
for all_gather, reduce_scatter and all_reduce, or None when the graph lacks the shape
metadata to size them. ``zerocompile show DIR`` reads it (see docs/cli.md). The optimizer
steps' own collectives go to ``DIR/rank{R}/optimizer_steps.json`` (``record_optimizer_step``).

Several recorders may write to one directory in one process (for instance one per
compiled frame): each record merges its own (frame, graph kind) entries into the index
already on disk. An index written by another process (an earlier run) is replaced, not
merged. A dump never breaks a compile: a failure to write logs one warning per recorder
and the compile carries on.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import torch
import torch.fx

from zerocompile import env
from zerocompile.env import DUMP_ENV  # noqa: F401  (re-exported)
from zerocompile.passes.analyses.collective_summary import summarize_collectives
from zerocompile.passes.graph_utils import tensor_nbytes
from zerocompile.passes.analyses.liveness import simulate
from zerocompile.runtime.accounting import COLLECTIVE_KINDS

logger = logging.getLogger("zerocompile")

"""Environment variable naming the dump directory when the ``dump`` option is not given."""

GRAPH_KINDS = ("dynamo", "joint", "forward", "backward", "inference")

INDEX_FILE = "index.json"

# collective op names as ``Liveness.collectives`` reports them -> the kinds used in summaries
_COLLECTIVE_NAMES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_to_all_single": "reduce_scatter",   # the quantized gradient reduce-scatter (qgZ)
}


def safe_name(text: str, default: str = "frame") -> str:
    """A file-system-safe name for ``text``: ``"frame 0/0"`` -> ``"frame_0_0"``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("._")
    return name or default


def json_safe(value):
    """``value`` as something ``json.dump`` accepts: dtypes and other objects become strings,
    dataclasses dicts of their fields, tuples lists."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_safe(getattr(value, f.name)) for f in fields(value)}
    return repr(value)


def target_name(node: torch.fx.Node) -> str:
    """A readable name for a node's target: ``aten.mm.default``,
    ``zerocompile.runtime.param_ops.gather_param``, ``output``."""
    target = node.target
    if isinstance(target, str):
        return target
    if hasattr(target, "_schema") or hasattr(target, "overloads"):  # an ATen / c10d op (overload or packet)
        return str(target)
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if qualname is None:
        return repr(target)
    if module in (None, "builtins", "_operator", "operator"):
        return f"operator.{qualname}" if module in ("_operator", "operator") else qualname
    return f"{module}.{qualname}"


def _output_bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val", node.meta.get("example_value"))
    if isinstance(val, torch.Tensor):
        return tensor_nbytes(val)
    if isinstance(val, (list, tuple)):
        return sum(tensor_nbytes(v) for v in val if isinstance(v, torch.Tensor))
    return 0


def _params_of(tag: dict) -> list:
    params = tag.get("params")
    if params is None:
        params = [tag["param"]] if tag.get("param") is not None else []
    return [str(p) for p in params]


def describe_nodes(graph: torch.fx.Graph, liveness) -> list[dict]:
    """One JSON-safe dict per node: name, op, target, inputs, role, params, bucket, bytes,
    live (bytes live while it runs, from ``liveness``), collective (kind or None)."""
    collective_at = {index: _COLLECTIVE_NAMES.get(kind, kind) for index, kind in liveness.collectives}
    out = []
    for index, node in enumerate(graph.nodes):
        tag = node.meta.get("zerocompile", {})
        out.append({
            "name": node.name,
            "op": node.op,
            "target": target_name(node),
            "inputs": [n.name for n in node.all_input_nodes],
            "role": tag.get("role"),
            "params": _params_of(tag),
            "bucket": json_safe(tag.get("bucket")),
            "bytes": _output_bytes(node),
            "live": liveness.live[index] if index < len(liveness.live) else None,
            "collective": collective_at.get(index),
        })
    return out


def collective_totals(graph: torch.fx.Graph) -> dict | None:
    """``{kind: {"count", "bytes", "dtypes"}}`` from ``summarize_collectives`` (``dtypes``: the
    sorted dtype names of the buffers moved), or None when a collective lacks the shape
    metadata to size it."""
    try:
        summary = summarize_collectives(graph)
    except RuntimeError:
        return None
    return {kind: {"count": summary.totals[kind].count, "bytes": summary.totals[kind].bytes,
                   "dtypes": sorted({dtype for k, dtype, _ in summary.sequence if k == kind and dtype})}
            for kind in COLLECTIVE_KINDS}


class DumpRecorder:
    """Writes one rank's graphs and per-pass summaries under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, rank: int, world: int, options: dict | None = None):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"zerocompile dump: rank must be an int >= 0, got {rank!r}")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1 or rank >= world:
            raise ValueError(f"zerocompile dump: world must be an int > rank ({rank}), got {world!r}")
        self.root = Path(root)
        self.rank = rank
        self.world = world
        self.options = json_safe(options or {})
        self.rank_dir = self.root / f"rank{rank}"
        self._frames: dict = {}
        """The (frame -> {"dir", "options", "graphs": {kind: [step, ...]}}) entries this recorder wrote."""
        self._warned = False

    # ------------------------------------------------------------------ recording
    def record(self, frame: str, graph_kind: str, pass_name: str, gm: torch.fx.GraphModule,
               time_s: float) -> None:
        """Write ``gm`` as it is after ``pass_name`` (``"input"``: before the pipeline) and
        update the index. Never raises: a failure logs one warning per recorder."""
        try:
            self._record(str(frame), str(graph_kind), str(pass_name), gm, float(time_s))
        except Exception as exc:  # noqa: BLE001 - a dump must never break a user's compile
            if not self._warned:
                self._warned = True
                logger.warning("zerocompile: could not write the graph dump under %s (%s: %s); "
                               "carrying on without it", self.root, type(exc).__name__, exc)
            else:
                logger.debug("zerocompile: dump write failed again: %s", exc)

    def note(self, frame: str, key: str, value) -> None:
        """Record ``value`` (JSON) as ``key`` of ``frame``'s index entry, under ``"notes"``
        (``zerocompile show`` prints them: e.g. the gradient reduction chosen). Never raises."""
        try:
            index = self._load_index()
            self._entry(str(frame), index).setdefault("notes", {})[str(key)] = json_safe(value)
            self._write_index(index)
        except Exception as exc:  # noqa: BLE001 - a dump must never break a user's compile
            logger.debug("zerocompile: dump note failed: %s", exc)

    def _entry(self, frame: str, index: dict) -> dict:
        """This recorder's entry for ``frame`` (made on first use)."""
        entry = self._frames.get(frame)
        if entry is None:
            entry = {"dir": self._frame_dir(frame, index), "options": self.options, "graphs": {}}
            self._frames[frame] = entry
        return entry

    def _record(self, frame: str, graph_kind: str, pass_name: str, gm: torch.fx.GraphModule,
                time_s: float) -> None:
        index = self._load_index()
        entry = self._entry(frame, index)
        steps = entry["graphs"].setdefault(graph_kind, [])
        number = len(steps)
        stem = f"{number:02d}_{safe_name(pass_name, 'pass')}"
        rel_dir = Path(entry["dir"]) / safe_name(graph_kind, "graph")
        out_dir = self.rank_dir / rel_dir
        out_dir.mkdir(parents=True, exist_ok=True)

        graph = gm.graph
        liveness = simulate(graph, count_inputs=(graph_kind == "backward"))
        nodes = describe_nodes(graph, liveness)
        (out_dir / f"{stem}.py").write_text(gm.code)
        _write_text_atomic(out_dir / f"{stem}.json", nodes_json(
            {"frame": frame, "graph": graph_kind, "index": number, "pass": pass_name}, nodes))
        steps.append({
            "index": number,
            "pass": pass_name,
            "code": (rel_dir / f"{stem}.py").as_posix(),
            "nodes_file": (rel_dir / f"{stem}.json").as_posix(),
            "nodes": len(nodes),
            "collectives": collective_totals(graph),
            "peak_bytes": liveness.peak,
            "peak_node": liveness.peak_node,
            "peak_breakdown": json_safe(liveness.peak_breakdown),
            "time_s": time_s,
        })
        self._write_index(index)

    # ------------------------------------------------------------------ index
    def _load_index(self) -> dict:
        """The index on disk if this process wrote it (another recorder of this run), else a new one."""
        path = self.rank_dir / INDEX_FILE
        try:
            with open(path) as f:
                index = json.load(f)
        except (OSError, ValueError):
            index = None
        if not isinstance(index, dict) or index.get("pid") != os.getpid() or index.get("world") != self.world:
            index = {"frames": {}}
        index.update(rank=self.rank, world=self.world, pid=os.getpid(), options=self.options)
        if not isinstance(index.get("frames"), dict):
            index["frames"] = {}
        return index

    def _frame_dir(self, frame: str, index: dict) -> str:
        """The directory ``frame`` already has in the index, else a name no other frame uses."""
        existing = index["frames"].get(frame)
        if isinstance(existing, dict) and isinstance(existing.get("dir"), str):
            return existing["dir"]
        taken = {entry.get("dir") for name, entry in index["frames"].items()
                 if name != frame and isinstance(entry, dict)}
        taken |= {entry["dir"] for name, entry in self._frames.items() if name != frame}
        base = safe_name(frame)
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        return name

    def _write_index(self, index: dict) -> None:
        for frame, mine in self._frames.items():
            entry = index["frames"].get(frame)
            if not isinstance(entry, dict) or entry.get("dir") != mine["dir"]:
                entry = {"dir": mine["dir"], "options": mine["options"], "graphs": {}}
            entry["graphs"] = {**entry.get("graphs", {}), **mine["graphs"]}
            if mine.get("notes"):
                entry["notes"] = {**entry.get("notes", {}), **mine["notes"]}
            index["frames"][frame] = entry
        _write_text_atomic(self.rank_dir / INDEX_FILE, json.dumps(index, indent=1) + "\n")


def nodes_json(header: dict, nodes: list) -> str:
    """A nodes file: ``header``'s keys plus ``"nodes"``, one node per line (valid JSON that
    stays readable and greppable for graphs of thousands of nodes)."""
    head = json.dumps(header)[:-1]
    body = ",\n".join(json.dumps(node) for node in nodes)
    return f'{head}, "nodes": [\n{body}\n]}}\n'


def _write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


OPTIMIZER_STEPS_FILE = "optimizer_steps.json"
"""``DIR/rank{R}/optimizer_steps.json``: the collectives of each ``ZeroOptimizer.step()`` (see
``record_optimizer_step``)."""

KEPT_STEPS = 3
"""``record_optimizer_step`` keeps the first steps of each optimizer and the last one."""


def record_optimizer_step(root, rank: int, world: int, optimizer: str, collectives: dict) -> None:
    """Add one step of ``optimizer`` (a name) to ``DIR/rank{R}/optimizer_steps.json``:
    ``{"pid", "rank", "world", "optimizers": {name: {"steps": n, "recorded": [{"step", "collectives":
    {kind: {"count", "bytes"}}}, ...]}}}``, the first ``KEPT_STEPS`` steps and the last. The
    collectives of an optimizer step are eager (the gradient reduction done in the step, the
    replicas' all-gather, a whole-parameter optimizer's all-to-alls, 1-bit Adam's compressed
    momentum), not part of any graph, so the dump records them here. Never raises."""
    path = Path(root) / f"rank{rank}" / OPTIMIZER_STEPS_FILE
    try:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
        if not isinstance(data, dict) or data.get("pid") != os.getpid():
            data = {"pid": os.getpid(), "rank": rank, "world": world, "optimizers": {}}
        entry = data["optimizers"].setdefault(optimizer, {"steps": 0, "recorded": []})
        entry["steps"] += 1
        record = {"step": entry["steps"], "collectives": collectives}
        if len(entry["recorded"]) > KEPT_STEPS:
            entry["recorded"].pop()            # the previous last step
        entry["recorded"].append(record)
        _write_text_atomic(path, json.dumps(data, indent=1) + "\n")
    except Exception as exc:  # noqa: BLE001 - a dump must never break a training step
        logger.debug("zerocompile: could not record the optimizer step under %s: %s", root, exc)


def recorder_for(config, group) -> DumpRecorder | None:
    """The recorder for a compile under ``config`` (a ``ZeroConfig``) on ``group`` (a
    ``CommGroup``): dumps go to its ``dump`` option, else to ``$ZEROCOMPILE_DUMP``; None when
    neither is set. The dump records the options flat, by the names users give."""
    root = config.observability.dump or env.dump_dir()
    if root is None:
        return None
    return DumpRecorder(root, group.rank, group.world, options=json_safe(config.flat()))
