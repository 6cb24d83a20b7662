"""Pass (joint graph, stage 3): keep some gathered parameters from forward to backward.

ZeRO-3 gathers every parameter twice per step: in forward, and again in backward
(``reshard_after_forward``). Keeping a gathered parameter alive from forward to backward
saves the backward all-gather at the price of its full bytes of memory for that
interval. This pass chooses which to keep, within ``unshard_budget_mb`` per rank:

- candidates are the parameter gathers whose value the backward uses (a bias whose
  gradient does not need the bias is never re-gathered, so keeping it saves nothing);
- each is scored by the time its backward all-gather would take (cost model:
  ``alpha + wire bytes / bandwidth``) per byte kept; the latency term makes small
  parameters the best buys;
- candidates are taken in score order (ties: graph order) while they fit the budget.

``unshard_budget_mb="auto"`` sets the budget to ``memory_limit_mb`` minus the simulated
peak of the graph without any kept parameter (the joint graph's liveness with gathered
parameters counted as transient: the largest one once). An unlimited budget keeps every
candidate, which moves as few bytes as stage 2.

Kept gathers are tagged ``keep_gathered``; ``reshard_after_forward`` tags the others.
Every input to the decision (graph, config, cost model) is identical on every rank.
"""

from __future__ import annotations

import math

import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.passes.graph_utils import backward_nodes, is_backward_node, set_tag, tag, tensor_nbytes
from zerocompile.passes.analyses.liveness import simulate
from zerocompile.passes.reshard_after_forward import gather_chain

_MB = 2**20


def unshard_candidates(graph: torch.fx.Graph) -> list[tuple[torch.fx.Node, list[torch.fx.Node]]]:
    """(all-gather, its chain) of each tagged parameter gather whose value backward reads."""
    bw = backward_nodes(graph)
    out = []
    for node in graph.nodes:
        if tag(node).get("role") != "param_gather":
            continue
        chain = gather_chain(node)
        members = set(chain)
        if any(is_backward_node(u, bw) for n in chain for u in n.users if u not in members):
            out.append((node, chain))
    return out


def choose_kept(candidates, budget_bytes: float, cost: CostModel, world: int) -> list[torch.fx.Node]:
    """The gathers to keep: best backward time saved per byte first, while they fit."""
    scored = []
    for order, (ag, _) in enumerate(candidates):
        nbytes = tensor_nbytes(ag.meta["val"])
        saved = cost.collective_time("all_gather", nbytes, world)
        scored.append((-saved / max(nbytes, 1), order, ag, nbytes))
    scored.sort(key=lambda s: (s[0], s[1]))
    kept, used = [], 0
    for _, _, ag, nbytes in scored:
        if used + nbytes <= budget_bytes:
            kept.append(ag)
            used += nbytes
    return kept


def auto_budget(graph: torch.fx.Graph, memory_limit_mb: float) -> tuple[float, int]:
    """Bytes left under ``memory_limit_mb`` by the simulated peak without kept parameters."""
    gathered = set()
    largest = 0
    for node in graph.nodes:
        if tag(node).get("role") == "param_gather":
            gathered.update(gather_chain(node))
            largest = max(largest, tensor_nbytes(node.meta["val"]))
    peak = simulate(graph, zero_nodes=gathered).peak + largest
    return max(0.0, memory_limit_mb * _MB - peak), peak


def selective_unshard(gm: torch.fx.GraphModule, ctx: PassContext, *, unshard_budget_mb, memory_limit_mb: float | None,
                      **_) -> torch.fx.GraphModule:
    candidates = unshard_candidates(gm.graph)
    base_peak = None
    if unshard_budget_mb == "auto":
        budget, base_peak = auto_budget(gm.graph, memory_limit_mb)
    else:
        budget = math.inf if math.isinf(unshard_budget_mb) else unshard_budget_mb * _MB
    cost = ctx.cost_model or CostModel()
    kept = choose_kept(candidates, budget, cost, ctx.group.world)
    for ag in kept:
        set_tag(ag, keep_gathered=True)
    kept_bytes = sum(tensor_nbytes(ag.meta["val"]) for ag in kept)
    ctx.results["selective_unshard"] = {
        "budget_bytes": budget, "candidates": len(candidates), "kept": [tag(ag)["param"] for ag in kept],
        "kept_bytes": kept_bytes, "simulated_peak_without_kept": base_peak,
        "backward_gather_seconds_saved": sum(
            cost.collective_time("all_gather", tensor_nbytes(ag.meta["val"]), ctx.group.world) for ag in kept),
    }
    ctx.logger.info("[%s] selective_unshard: keeping %d of %d re-gathered parameters gathered (%.2f MiB, "
                    "budget %s MiB)", ctx.frame, len(kept), len(candidates), kept_bytes / _MB,
                    "unlimited" if math.isinf(budget) else f"{budget / _MB:.2f}")
    return gm
