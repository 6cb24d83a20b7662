"""Pass (joint graph): choose, per saved tensor, whether it is kept, recomputed or offloaded,
to fit ``offload_activations.budget_mb``.

The forward saves storages for backward (``recompute.SavedBytesEstimator``: each storage once,
graph inputs not counted). Three things can be done with them:

- **keep** a storage in memory: free;
- **recompute** a block (``recompute.find_blocks``: one call of a numbered module such as
  ``layers.3``) in backward from its input, with the ``recompute`` pass's tags: costs the
  block's forward compute again (``CostModel.node_time`` over its nodes, measured with
  ``profile=True``), frees what the ``SavedBytesEstimator`` says recomputing it frees. A block
  is recomputed whole or not at all;
- **offload** one storage (the ``offload_activations`` pass, after partitioning): costs its
  transfer time (``CostModel.offload_time``: bytes over ``offload_gbps``, or with
  ``profile=True`` the measured time of a tensor of that size through the real store) less
  what the compute around it hides. For a CUDA model a block's offloaded storages cost
  ``2 * max(0, transfer - forward)``: the writes overlap the next block's forward, the reads the
  second half of the next block's backward, about as long. A storage outside every block
  (embeddings, head, loss) hides nothing. For a CPU model nothing is hidden: the copies and the
  I/O threads run on the cores the compute needs (measured on 2 cores: offloading a block cost
  what its transfers take, not what is left of them after the compute). Frees the storage, if
  it passes the offload pass's checks (dense, at least ``min_kb``, not a graph input).

Starting from keeping everything, the planner takes the choice with the most bytes freed per
estimated second (ties: offload before recompute, larger before smaller, then graph order, so
every rank decides the same) until the estimated saved bytes fit the budget. Offloading a
storage of a block rules out recomputing that block and the other way round; a block's next
storage costs more once the compute around it is used up, so offload choices are re-priced as
they are taken. Blocks the ``recompute`` option or the user's ``torch.utils.checkpoint``
already recompute are left as they are. If every choice still leaves the saved bytes over the
budget a warning gives the numbers.

``budget_mb="auto"``: the budget is ``memory_limit_mb`` minus what the simulated step holds
besides the saved activations (the joint graph's simulated peak less the saved bytes).

Recomputed blocks get the ``recompute`` pass's tags. Every saved storage it chose among gets
the tag ``plan_saw_saved``; offloaded storages get the tag ``offload_activation``, which the
``offload_activations`` pass reads, and (unless tagged already) ``CheckpointPolicy.MUST_SAVE``:
the partitioner must save that very tensor, not recompute it from an input it would save
instead, which nothing would offload. The decision is
in ``ctx.results["plan_activations"]`` (``budget_bytes``, ``estimated_saved_bytes`` before and
after, ``recomputed`` and ``offloaded`` block names, ``offloaded_tensors``,
``offloaded_outside_blocks``, ``per_block``: each block's figures and choice, ``offload_gbps``,
``measured``: whether the transfer times were measured) and logged at INFO.
"""

from __future__ import annotations

import heapq
import math

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from zerocompile.passes.context import PassContext
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.passes.graph_utils import set_tag
from zerocompile.passes.analyses.liveness import simulate
from zerocompile.passes.offload_activations import offloadable_roots
from zerocompile.passes.analyses.profiler import ProfiledCostModel
from zerocompile.passes.reshard_after_forward import GATHER_AC_GRAPH_ID
from zerocompile.passes.recompute import (
    _RECOMPUTE_POLICIES, SavedBytesEstimator, block_time, find_blocks, first_block_id, plan_tags)

_MB = 2**20
KEEP, RECOMPUTE, OFFLOAD = "keep", "recompute", "offload"


def exposed_transfer_seconds(one_way_s: float, forward_s: float, overlap: bool = True) -> float:
    """The part of a block's transfers (``one_way_s`` to copy its offloaded tensors out, as long
    to read them back) that the compute around them cannot hide: the write overlaps the next
    block's forward (``forward_s``), the read the second half of the next block's backward
    (about as long: a backward costs twice its forward; the ``offload_activations`` pass starts
    a block's reloads there). Without ``overlap`` (a model on the CPU: the copies and the I/O
    threads take the cores the compute runs on) none of it is hidden."""
    if not overlap:
        return 2 * one_way_s
    return 2 * max(0.0, one_way_s - forward_s)


def _rate(freed: int, seconds: float) -> float:
    """Bytes freed per second, to 12 significant digits: equal rates by the model (every tensor
    at the offload rate) must tie, not differ in the last bit, for the ties to go larger first."""
    if freed <= 0:
        return 0.0
    return math.inf if seconds <= 0 else float(f"{freed / seconds:.12g}")


def choose(graph: torch.fx.Graph, budget_bytes: float, cost: CostModel, min_bytes: float,
           overlap: bool = True) -> dict:
    """The plan (see the module docstring): ``{"recomputed": block orders, "offloaded": saved roots,
    "blocks", "first_id", "per_block", "baseline", "estimate", "outside", "candidates": the saved
    roots it chose among}``."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    blocks = find_blocks(graph)
    first_id = first_block_id(graph)
    estimator = SavedBytesEstimator(graph)
    root_bytes = estimator.root_bytes
    roots = estimator.saved_roots({})
    baseline = sum(root_bytes.get(r, 0) for r in roots)
    block_of = {n: b.order for b in blocks for n in b.nodes}
    movable = offloadable_roots(roots, root_bytes, min_bytes)
    figures = []
    heap: list = []            # (-rate, offload first, larger first, graph order, choice, block or root)
    for block in blocks:
        # recomputed already by the recompute option or the user's checkpoint (not the parameter
        # re-gathers resharding tags in every block at stage 3)
        already = any(n.meta.get("recompute") in _RECOMPUTE_POLICIES
                      and n.meta.get("ac_graph_id") != GATHER_AC_GRAPH_ID for n in block.nodes)
        seconds = block_time(block, cost)
        freed = 0 if already else baseline - estimator.saved_bytes(plan_tags(blocks, {block.order}, first_id))
        figures.append({"name": block.name, "forward_s": seconds, "recompute_freed_bytes": freed,
                        "recompute_s": seconds, "offload_bytes": 0, "offloaded_bytes": 0, "offloaded_tensors": 0,
                        "offload_exposed_s": 0.0, "choice": KEEP, "already_recomputed": already})
        if not already and freed > 0:
            heapq.heappush(heap, (-_rate(freed, seconds), 1, -freed, index[block.nodes[0]], RECOMPUTE,
                                  block.order))
    sent = [0.0] * len(blocks)              # one-way seconds of each block's offloaded tensors
    for root in movable:
        b = block_of.get(root)
        if b is not None:
            figures[b]["offload_bytes"] += root_bytes[root]

    def offload_seconds(root) -> float:
        """What offloading ``root`` adds to the step, given what its block offloads already."""
        one_way = cost.offload_time(root_bytes[root])
        b = block_of.get(root)
        if b is None:
            return 2 * one_way                # nothing around a tensor outside the blocks hides it
        forward = figures[b]["forward_s"]
        return (exposed_transfer_seconds(sent[b] + one_way, forward, overlap)
                - exposed_transfer_seconds(sent[b], forward, overlap))

    for root in movable:
        heapq.heappush(heap, (-_rate(root_bytes[root], offload_seconds(root)), 0, -root_bytes[root],
                              index[root], OFFLOAD, root))
    recomputed: set = set()
    offloaded: list = []
    current = baseline
    while heap and current > budget_bytes:
        key = heapq.heappop(heap)
        choice, what = key[4], key[5]
        block = what if choice == RECOMPUTE else block_of.get(what)
        if block in recomputed or (choice == RECOMPUTE and figures[block]["offloaded_tensors"]):
            continue                          # one choice per block: recompute all of it, or offload some
        if choice == OFFLOAD:
            # its cost grows as its block sends more: take it only if it still beats the next best
            fresh = (-_rate(root_bytes[what], offload_seconds(what)),) + key[1:]
            if heap and fresh > heap[0]:
                heapq.heappush(heap, fresh)
                continue
            if fresh[0] == 0:
                break
            offloaded.append(what)
            if block is not None:
                figure = figures[block]
                figure["offload_exposed_s"] += offload_seconds(what)
                sent[block] += cost.offload_time(root_bytes[what])
                figure["offloaded_bytes"] += root_bytes[what]
                figure["offloaded_tensors"] += 1
                figure["choice"] = OFFLOAD
            current -= root_bytes[what]
        else:
            if key[0] == 0:
                break
            recomputed.add(what)
            figures[what]["choice"] = RECOMPUTE
            moved = set(offloaded)
            current = sum(root_bytes.get(r, 0) for r in estimator.saved_roots(plan_tags(blocks, recomputed, first_id))
                          if r not in moved)
    return {"recomputed": recomputed, "offloaded": offloaded, "blocks": blocks, "first_id": first_id,
            "per_block": figures, "baseline": baseline, "estimate": current,
            "outside": [r for r in offloaded if r not in block_of], "candidates": roots}


def auto_budget(graph: torch.fx.Graph, memory_limit_mb: float) -> float:
    """``memory_limit_mb`` less what the simulated step holds besides the saved activations."""
    peak = simulate(graph).peak
    saved = SavedBytesEstimator(graph).saved_bytes({})
    return max(0.0, memory_limit_mb * _MB - max(0, peak - saved))


def plan_activations(gm: torch.fx.GraphModule, ctx: PassContext, *, settings, **_) -> torch.fx.GraphModule:
    """Choose keep / recompute / offload per saved tensor (see the module docstring); ``settings``: the
    ``ActivationOffloadSettings`` (its ``budget_mb`` is set)."""
    graph = gm.graph
    if settings.device == "cpu" and (ctx.device is None or torch.device(ctx.device).type != "cuda"):
        return gm                 # nothing to offload to (the offload_activations pass says so)
    if settings.budget_mb == "auto":
        budget = auto_budget(graph, settings.memory_limit_mb)
    else:
        budget = float(settings.budget_mb) * _MB
    cost = ctx.cost_model if ctx.cost_model is not None else CostModel()
    overlap = ctx.device is not None and torch.device(ctx.device).type == "cuda"
    plan = choose(graph, budget, cost, settings.min_kb * 1024, overlap)
    for node, (policy, ac_id) in plan_tags(plan["blocks"], plan["recomputed"], plan["first_id"]).items():
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = ac_id
    for node in plan["candidates"]:
        # what the plan saw saved: kept unless chosen (what the partitioner saves in the place of
        # chosen tensors, which the plan never saw, follows them; see chosen_by_plan)
        set_tag(node, plan_saw_saved=True)
    for node in plan["offloaded"]:
        set_tag(node, offload_activation=True)
        if node.meta.get("recompute") is None:
            # the partitioner must save this very tensor, not recompute it from an input it saves
            # instead (which nothing would offload): the plan's bytes are what stays in memory
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    if plan["estimate"] > budget:
        ctx.logger.warning(
            "[%s] plan_activations: even with every block recomputed or offloaded, an estimated %.2f MiB of saved "
            "activations stay in memory, over offload_activations.budget_mb (%.2f MiB)", ctx.frame,
            plan["estimate"] / _MB, budget / _MB)
    names = {c: [f["name"] for f in plan["per_block"] if f["choice"] == c] for c in (RECOMPUTE, OFFLOAD)}
    ctx.results["plan_activations"] = {
        "budget_bytes": budget, "estimated_saved_bytes_before": plan["baseline"],
        "estimated_saved_bytes": plan["estimate"], "recomputed": names[RECOMPUTE], "offloaded": names[OFFLOAD],
        "offloaded_tensors": [n.name for n in plan["offloaded"]],
        "offloaded_outside_blocks": [n.name for n in plan["outside"]],
        "per_block": plan["per_block"], "offload_gbps": cost.offload_bandwidth / 1e9,
        "measured": isinstance(cost, ProfiledCostModel) and bool(cost.offload_seconds)}
    ctx.logger.info("[%s] plan_activations: budget %.2f MiB; saved activations %.2f -> %.2f MiB; recompute %s; "
                    "offload %d tensors (%.2f MiB) of %s and %d outside the blocks (transfer times %s)", ctx.frame,
                    budget / _MB, plan["baseline"] / _MB, plan["estimate"] / _MB, names[RECOMPUTE],
                    len(plan["offloaded"]) - len(plan["outside"]),
                    sum(f["offloaded_bytes"] for f in plan["per_block"]) / _MB, names[OFFLOAD], len(plan["outside"]),
                    "measured" if ctx.results["plan_activations"]["measured"] else "estimated")
    return gm
