"""Pass (forward and backward graphs, stages 2 and 3): all-gathers early, waits late.

A functional collective is asynchronous: its node starts it and its ``wait_tensor``
blocks. Right after the bucketing pass, each all-gather starts just before its first
use, so nothing overlaps it. This pass moves each all-gather's start (with the casts,
views and ``cat`` that build its input, which read only graph inputs) earlier:

- far enough back that the compute in between (cost model) covers its communication
  time, but no further, so it holds memory no longer than useful;
- never before the previous all-gather's start (the order of collectives is kept);
- never so far that more than ``prefetch_mb`` of gathered bytes are in flight (started,
  their wait not yet returned) at any point (so an all-gather larger than ``prefetch_mb`` is not
  moved at all); with ``memory_limit_mb`` set, never so far that the liveness
  simulation's peak exceeds that limit (or, where the graph already peaks above it
  without prefetching, exceeds that peak).

In backward, re-gathers are prefetched the same way (the backward graph already runs
in reverse layer order), and each gradient reduce-scatter's wait moves down to just
before the next reduce-scatter starts (or the end), so reduction overlaps the next
layer's gradient computation with one reduction in flight (a two-hop qgZ reduction: see
``delay_reduce_waits``).

With ``offload_param`` each bucket's file reads (``zerocompile::fetch_shard``, which starts a
read on a thread and returns what ``wait_tensor`` waits for) then start one bucket ahead: before
the previous bucket's reads are waited for (``prefetch_fetches``).

Every input to these decisions is the same on every rank, so every rank issues the
same collectives in the same order.
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.passes.graph_utils import stable_topological_sort, tag, tensor_nbytes
from zerocompile.passes.analyses.liveness import simulate
from zerocompile.runtime import param_offload  # noqa: F401  (registers zerocompile::fetch_shard)

_c10d = torch.ops._c10d_functional
_FETCH = torch.ops.zerocompile.fetch_shard.default
_MB = 2**20
_GATHER_ROLES = ("param_gather", "bucket_gather")
_REDUCE_ROLES = ("grad_reduce_scatter", "bucket_reduce_scatter")


def _wait_of(node: torch.fx.Node) -> torch.fx.Node | None:
    waits = [u for u in node.users if u.target is _c10d.wait_tensor.default]
    return waits[0] if len(waits) == 1 else None


def _start_group(coll: torch.fx.Node) -> list[torch.fx.Node]:
    """The collective and the nodes computing its input from graph inputs, if all of them
    are used only on the way to this collective (so they can move with it)."""
    group, frontier = [coll], list(coll.all_input_nodes)
    while frontier:
        cur = frontier.pop()
        if cur.op == "placeholder" or cur in group:
            continue
        if any(u not in group for u in cur.users):
            return []
        group.append(cur)
        frontier.extend(cur.all_input_nodes)
    return group


def prefetch_gathers(graph: torch.fx.Graph, cost: CostModel, world: int, inflight_cap: int,
                     memory_cap: int | None = None, count_inputs: bool = False) -> list[dict]:
    """Move all-gather starts earlier (see the module docstring); returns one record per
    all-gather: its parameters, how many nodes earlier it now starts, and its bytes.

    Linear in the distance moved: bookkeeping is per node, walking ``node.prev``."""
    nodes = list(graph.nodes)
    time_of = {n: cost.node_time(n) for n in nodes}
    gathers = [n for n in nodes if tag(n).get("role") in _GATHER_ROLES and _wait_of(n) is not None]
    # gathered bytes in flight while each node runs: a gather is in flight from its start
    # through its wait (until the wait returns), so a gather placed before another's wait
    # overlaps it
    inflight = dict.fromkeys(nodes, 0)
    for g in gathers:
        node, end, nbytes = g, _wait_of(g).next, tensor_nbytes(g.meta["val"])
        while node is not end:
            inflight[node] += nbytes
            node = node.next
    floor = None  # the node after the previous gather: nothing moves above it
    baseline_peak = simulate(graph, count_inputs=count_inputs).peak if memory_cap is not None else None
    records = []
    for g in gathers:
        group = _start_group(g)
        nbytes = tensor_nbytes(g.meta["val"])
        steps = 0
        if group:
            members = set(group)
            ordered, node = [], g
            while len(ordered) < len(group):  # the group in graph order (all of it precedes g)
                if node in members:
                    ordered.append(node)
                node = node.prev
            ordered.reverse()
            for n in ordered[:-1]:  # gather the group right before its collective first
                g.prepend(n)
            blockers = {i for n in group for i in n.all_input_nodes if i not in members and i.op != "placeholder"}
            need = cost.collective_time("all_gather", nbytes, world)
            cursor, covered = ordered[0], 0.0
            while cursor is not floor and covered < need:
                prev = cursor.prev
                if (prev.op in ("placeholder", "root") or prev in blockers
                        or inflight[prev] + nbytes > inflight_cap):
                    break
                cursor, covered, steps = prev, covered + time_of[prev], steps + 1
            if steps:
                back = ordered[-1].next  # where the group goes back to if the move is refused
                for n in ordered:
                    cursor.prepend(n)
                if memory_cap is not None and simulate(graph, count_inputs=count_inputs).peak > max(
                        memory_cap, baseline_peak):
                    for n in ordered:
                        back.prepend(n)
                    steps = 0
                else:
                    node = cursor
                    while node is not back:
                        if node not in members:
                            inflight[node] += nbytes
                        node = node.next
        floor = g.next  # the next gather starts after this one
        records.append({"params": tag(g).get("params", []), "bytes": nbytes, "moved_up": steps})
    return records


def delay_reduce_waits(graph: torch.fx.Graph) -> int:
    """Move each reduce-scatter's wait to just before the next reduce-scatter (the last
    one's to the end of the graph); returns how many waits moved.

    A reduction in two hops (qgZ with hpZ, passes/quantize_gradient_reductions.py: its second
    all-to-all is tagged ``hop="across"``) counts as one reduce-scatter, its first hop, for the
    rule above; the second hop's wait moves to just before the next first hop's wait, so each
    hop overlaps the gradient computation of one bucket."""
    reduces = [n for n in graph.nodes if tag(n).get("role") in _REDUCE_ROLES and _wait_of(n) is not None]
    firsts = [n for n in reduces if tag(n).get("hop") != "across"]
    output = next(iter(graph.find_nodes(op="output")))
    position = {n: i for i, n in enumerate(graph.nodes)}
    moves = []
    for cur, nxt in zip(firsts, firsts[1:] + [None]):
        moves.append((_wait_of(cur), nxt if nxt is not None else output))
    for cur in reduces:
        if tag(cur).get("hop") == "across":
            nxt = next((f for f in firsts if position[f] > position[cur]), None)
            moves.append((_wait_of(cur), _wait_of(nxt) if nxt is not None else output))
    moved = 0
    for wait, anchor in moves:
        if wait.next is anchor:
            continue
        anchor.prepend(wait)
        moved += 1
    if moved:
        stable_topological_sort(graph)  # the wait's users follow it down
    return moved


def _fetch_units(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The ``offload_param`` file reads (``zerocompile::fetch_shard`` nodes), grouped by what
    consumes them together (the all-gather, bucketed or not, that their waits feed; at world
    size 1, where nothing gathers, each read alone), in the order their first wait runs."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    units: dict[object, list] = {}
    for fetch in graph.find_nodes(op="call_function", target=_FETCH):
        wait = _wait_of(fetch)
        if wait is None:
            continue
        consumer, frontier, seen = None, [wait], set()
        while frontier and consumer is None:           # the first gather downstream of the wait
            node = frontier.pop()
            for user in node.users:
                if tag(user).get("role") in _GATHER_ROLES or user.target is _c10d.all_gather_into_tensor.default:
                    consumer = user
                elif user not in seen and (user.target is torch.ops.aten.cat.default or _passes_through(user)
                                           or tag(user).get("role") == "bucket_pack"):
                    seen.add(user)
                    frontier.append(user)
        units.setdefault(consumer if consumer is not None else fetch, []).append(fetch)
    return sorted(units.values(), key=lambda fetches: min(position[_wait_of(f)] for f in fetches))


def _passes_through(node: torch.fx.Node) -> bool:
    """A node that only reshapes or casts what it reads on the way to an all-gather."""
    return node.op == "call_function" and not node.is_impure() and len(node.all_input_nodes) == 1 and \
        node.target is not _c10d.all_gather_into_tensor.default


def prefetch_fetches(graph: torch.fx.Graph) -> int:
    """``offload_param``: issue the file reads of each bucket one bucket ahead (DeepSpeed's
    ``stage3_prefetch_bucket_size``): the reads of unit k+1 (``_fetch_units``) start right
    before the first wait of unit k, so they run on their threads while unit k is waited
    for, all-gathered and computed with. A read depends on graph inputs only, so moving it up
    is always legal; its wait stays where it was. Holds one more unit's shards at a time.
    Returns how many reads moved."""
    units = _fetch_units(graph)
    position = {n: i for i, n in enumerate(graph.nodes)}     # the waits never move
    moved = 0
    for previous, unit in zip(units, units[1:]):
        anchor = min((_wait_of(f) for f in previous), key=position.__getitem__)
        for fetch in unit:
            if position[fetch] > position[anchor]:       # only ever earlier
                anchor.prepend(fetch)
                moved += 1
    return moved


def prefetch(gm: torch.fx.GraphModule, ctx: PassContext, *, prefetch_mb: float, memory_limit_mb: float | None,
             **_) -> torch.fx.GraphModule:
    cost = ctx.cost_model or CostModel()
    memory_cap = int(memory_limit_mb * _MB) if memory_limit_mb is not None else None
    records = prefetch_gathers(gm.graph, cost, ctx.group.world, int(prefetch_mb * _MB), memory_cap,
                               count_inputs=ctx.graph_kind == "backward")
    delayed = delay_reduce_waits(gm.graph) if ctx.graph_kind == "backward" else 0
    fetches = prefetch_fetches(gm.graph)
    ctx.results.setdefault("prefetch", {})[ctx.graph_kind] = {
        "gathers": len(records), "prefetched": sum(r["moved_up"] > 0 for r in records),
        "reduce_waits_delayed": delayed, "file_reads_ahead": fetches}
    return gm
