"""Lowering (final graphs, ``flops_profiler`` option only): mark each module boundary so the flops
profiler measures per-module latency (``runtime/module_times.py``).

Runs on the forward, backward and inference graphs right before an inner compiler gets them, after
every pass (no pass sees the marks). The graph's ops are split into segments, each a run of
consecutive ops of one module: the innermost module of the op's ``nn_module_stack`` (a backward op:
its forward op's, ``fwd_nn_module_stack``), as ``passes/analyses/flop_count.py`` attributes FLOPs; an op
without one (a view, a collective, a wait) joins the segment it is in. A
``zerocompile::module_mark(xs, site)`` goes before the first segment (``xs``: the tensors that
segment reads, made before it) and after every segment (``xs``: what the segment made that later
ops read). Each mark declares that it writes ``xs``, so inductor keeps the segment's ops on their
side of it; ops of a later segment that read none of ``xs`` may still run before it (inductor
schedules by data), and their time then counts in the segment before. A segment whose results
nothing later reads gets no end mark: its time counts in the next segment.
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.analyses.flop_count import module_path
from zerocompile.runtime import timer_ops  # noqa: F401  (registers zerocompile::module_mark)
from zerocompile.runtime import module_times

_MARK = torch.ops.zerocompile.module_mark.default


def insert_module_marks(graph: torch.fx.Graph, times: module_times.ModuleTimes) -> int:
    """Insert the marks into ``graph``; returns how many segments end with a mark."""
    kind = "backward" if any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder")) \
        else "forward"
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    segments: list[tuple[tuple, list[torch.fx.Node]]] = []      # ((path, class name), nodes)
    for node in nodes:
        if node.op != "call_function":
            continue
        module = _module_of(node)
        if module is not None and (not segments or segments[-1][0] != module):
            segments.append((module, [node]))
        elif segments:
            segments[-1][1].append(node)
    if not segments:
        return 0
    first = segments[0][1]
    inputs = _tensors({a for n in first for a in n.all_input_nodes if position[a] < position[first[0]]})
    started = bool(inputs)
    if started:
        with graph.inserting_before(first[0]):
            graph.call_function(_MARK, (inputs, times.site(kind, None)))
    ended = 0
    for (path, cls), members in segments:
        last = position[members[-1]]
        made = _tensors({n for n in members if any(position[u] > last for u in n.users)})
        if not made:
            continue
        # without a start mark, the first end mark starts the clock instead
        site = times.site(kind, path, cls) if started else times.site(kind, None)
        ended += started
        started = True
        with graph.inserting_after(members[-1]):
            graph.call_function(_MARK, (made, site))
    return ended


def _module_of(node: torch.fx.Node) -> tuple | None:
    """``(module path, class name)`` of the innermost module the op ran in."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    return module_path(path), getattr(cls, "__name__", str(cls))


def _tensors(nodes) -> list[torch.fx.Node]:
    """The nodes among ``nodes`` whose value is one dense tensor, by name (a stable order)."""
    out = [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].layout is torch.strided]
    return sorted(out, key=lambda n: n.name)
