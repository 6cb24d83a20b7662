"""Lowering (final graphs, ``comms_logger`` option only): time each collective the comms logger
profiles (``runtime/comms_log.py``).

Runs on the forward, backward and inference graphs right before an inner compiler gets them, after
every pass (no pass sees the timers). For each functional collective whose kind is profiled:

- ``zerocompile::comm_timer_start(input, site)`` right before it;
- with ``blocking`` (the default), its ``wait_tensor`` nodes (and the ``getitem`` nodes a collective
  with several outputs reaches them through) move right after it, so nothing overlaps it;
- ``zerocompile::comm_timer_end(waited, site)`` right after its last wait; with ``blocking`` it
  is given every wait's result, so every reader of the collective's result runs after it.

Each timer declares that it writes the tensors it is given, so inductor keeps the start before the
collective and the end after the waits (see ``runtime/comms_log.py``); with ``blocking`` inductor
also keeps the graph's order (``compile_with_inductor``'s ``keep_graph_order``: its peak-memory
reordering would otherwise move unrelated kernels between a collective and its end). A collective
with no wait in the graph is left untimed.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from zerocompile.passes.analyses.collective_summary import COLLECTIVE_KINDS_BY_OP, collective_group_size
from zerocompile.passes.graph_utils import tag
from zerocompile.runtime import timer_ops  # noqa: F401  (registers the zerocompile::comm_timer ops)
from zerocompile.runtime import comms_log

_WAIT = torch.ops._c10d_functional.wait_tensor.default


def insert_comm_timers(graph: torch.fx.Graph, log: comms_log.CommsLog, world: int, frame: str) -> int:
    """Insert the timers into ``graph``; ``world``: the data-parallel group's size, ``frame``: the
    name the rows of ``debug`` start with. Returns how many collectives are timed."""
    position = {n: i for i, n in enumerate(graph.nodes)}      # of the graph as given: timers are not ranked
    timed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in COLLECTIVE_KINDS_BY_OP:
            continue
        kind, which = COLLECTIVE_KINDS_BY_OP[node.target]
        if not log.profiles(kind):
            continue
        followers = _waits_in_order(node, position)
        waits = [n for n in followers if n.target is _WAIT]
        if not waits:
            continue
        group_size = collective_group_size(node.target, node.args, world)
        role = tag(node).get("role", "collective")
        site = log.site(kind, group_size, f"{frame} {role}", group_size if which == "out" else 1)
        with graph.inserting_before(node):
            graph.call_function(torch.ops.zerocompile.comm_timer_start.default, (node.args[0], site))
        if log.settings.blocking:
            anchor = node
            for follower in followers:
                anchor.append(follower)
                anchor = follower
        with graph.inserting_after(waits[-1]):
            graph.call_function(torch.ops.zerocompile.comm_timer_end.default,
                                (waits if log.settings.blocking else [waits[-1]], site))
        timed += 1
    return timed


_IN_PLACE = (torch.ops.zerocompile.reduce_scatter_in_place.default, torch.ops._c10d_functional.all_reduce_.default)


def _waits_in_order(node: torch.fx.Node, position: dict) -> list[torch.fx.Node]:
    """The collective's waits in graph order, each ``getitem`` they read (a collective with a list
    of outputs) right before the first wait of it."""
    if node.target in _IN_PLACE:
        # in place: its wait reads the buffer it reduces (made before it), or what it returns
        waits = {w for u in (node, node.args[0]) for w in u.users if w.target is _WAIT and position[w] > position[node]}
        return sorted(waits, key=position.__getitem__)
    users = [u for u in node.users if u.target is operator.getitem] + [node]
    waits = sorted((w for u in users for w in u.users if w.target is _WAIT), key=position.__getitem__)
    out = []
    for wait in waits:
        source = wait.args[0]
        if source is not node and source not in out:
            out.append(source)
        out.append(wait)
    return out
