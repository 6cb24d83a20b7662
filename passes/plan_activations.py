"""Pass (joint graph): choose, per block, whether its saved activations are kept, recomputed
or offloaded, to fit ``offload_activations.budget_mb``.

The forward saves tensors for backward; three things can be done with a block's share
(``recompute.find_blocks``: one call of a numbered module such as ``layers.3``):

- **keep** it in memory: free;
- **recompute** it in backward from the block's input (the ``recompute`` pass's tags): costs
  the block's forward compute again (``CostModel.node_time`` over its nodes), frees what the
  ``SavedBytesEstimator`` says recomputing it frees;
- **offload** it (the ``offload_activations`` pass, after partitioning): costs the transfer time
  the compute around it cannot hide. For a CUDA model that is ``max(0, write - forward) +
  max(0, read - backward)`` with ``write = read = bytes / offload_gbps`` (the cost model's
  offload rate, measured with ``cost_model="probe"``), the block's forward compute as its
  forward and twice that as its backward (the write of block k overlaps the forward of block
  k+1, its read the backward of block k+1). For a CPU model it is all of ``write + read``: the
  copies and the I/O threads run on the cores the compute needs (measured on 2 cores: offloading
  a block cost what its transfers take, not what is left of them after the compute). Frees the
  block's saved tensors of at least ``min_kb``.

Starting from keeping everything, the planner takes the (block, choice) pair with the most
bytes freed per estimated second (ties: offload before recompute, then graph order, so every
rank decides the same) until the estimated saved bytes fit the budget; each block gets at most
one choice. Blocks the ``recompute`` option or the user's ``torch.utils.checkpoint`` already
recompute are left as they are. If every block's choice still leaves the saved bytes over the
budget, the saved tensors made outside every block (embeddings, head, loss) are offloaded too,
and if even that is not enough a warning gives the numbers.

``budget_mb="auto"``: the budget is ``memory_limit_mb`` minus what the simulated step holds
besides the saved activations (the joint graph's simulated peak less the saved bytes).

Recomputed blocks get the ``recompute`` pass's tags; offloaded blocks' nodes get the tag
``offload_activation``, which the ``offload_activations`` pass reads. The decision is in
``ctx.results["plan_activations"]`` (``budget_bytes``, ``estimated_saved_bytes`` before and
after, ``per_block``: each block's figures and choice) and logged at INFO.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.cost_model import CostModel
from zerocompile.passes.graph_utils import set_tag
from zerocompile.passes.liveness import simulate
from zerocompile.passes.offload_activations import why_kept
from zerocompile.passes.reshard_after_forward import GATHER_AC_GRAPH_ID
from zerocompile.passes.recompute import (
    _RECOMPUTE_POLICIES, SavedBytesEstimator, block_time, find_blocks, first_block_id, plan_tags)

_MB = 2**20
KEEP, RECOMPUTE, OFFLOAD = "keep", "recompute", "offload"


def offloadable_bytes(roots: set, block_nodes: set, root_bytes: dict, min_bytes: float) -> int:
    """Bytes of the saved storages made in a block that the offload pass would move."""
    return sum(root_bytes.get(root, 0) for root in roots if root in block_nodes and root.op != "placeholder"
               and why_kept(root.meta.get("val"), min_bytes) is None)


def exposed_transfer_seconds(nbytes: int, forward_s: float, cost: CostModel, overlap: bool = True) -> float:
    """The transfer time of offloading ``nbytes`` that the compute around it cannot hide. Without
    ``overlap`` (a model on the CPU: the copies and the I/O threads take the cores the compute
    runs on) none of it is hidden."""
    one_way = nbytes / cost.offload_bandwidth
    if not overlap:
        return 2 * one_way
    return max(0.0, one_way - forward_s) + max(0.0, one_way - 2 * forward_s)


def _rate(freed: int, seconds: float) -> float:
    if freed <= 0:
        return 0.0
    return math.inf if seconds <= 0 else freed / seconds


def choose(graph: torch.fx.Graph, budget_bytes: float, cost: CostModel, min_bytes: float,
           overlap: bool = True) -> dict:
    """The plan (see the module docstring): ``{"choices": {block order: choice}, "blocks", "per_block",
    "baseline", "estimate"}``."""
    blocks = find_blocks(graph)
    first_id = first_block_id(graph)
    estimator = SavedBytesEstimator(graph)
    roots = estimator.saved_roots({})
    baseline = sum(estimator.root_bytes.get(r, 0) for r in roots)
    figures, options = [], []
    for block in blocks:
        # recomputed already by the recompute option or the user's checkpoint (not the parameter
        # re-gathers resharding tags in every block at stage 3)
        already = any(n.meta.get("recompute") in _RECOMPUTE_POLICIES
                      and n.meta.get("ac_graph_id") != GATHER_AC_GRAPH_ID for n in block.nodes)
        seconds = block_time(block, cost)
        offload = offloadable_bytes(roots, set(block.nodes), estimator.root_bytes, min_bytes)
        recompute_freed = 0 if already else baseline - estimator.saved_bytes(plan_tags(blocks, {block.order},
                                                                                         first_id))
        figure = {"name": block.name, "forward_s": seconds, "recompute_freed_bytes": recompute_freed,
                  "recompute_s": seconds, "offload_bytes": offload,
                  "offload_exposed_s": exposed_transfer_seconds(offload, seconds, cost, overlap), "choice": KEEP,
                  "already_recomputed": already}
        figures.append(figure)
        if already:
            continue
        options.append((_rate(offload, figure["offload_exposed_s"]), 0, block.order, OFFLOAD))
        options.append((_rate(recompute_freed, seconds), 1, block.order, RECOMPUTE))
    options = [o for o in options if o[0] > 0]
    options.sort(key=lambda o: (-o[0], o[1], o[2]))
    choices: dict = {}

    def estimate() -> int:
        recomputed = {b for b, c in choices.items() if c == RECOMPUTE}
        saved = estimator.saved_bytes(plan_tags(blocks, recomputed, first_id))
        return saved - sum(figures[b]["offload_bytes"] for b, c in choices.items() if c == OFFLOAD)

    current = baseline
    for _, _, order, choice in options:
        if current <= budget_bytes:
            break
        if order in choices:
            continue
        choices[order] = choice
        figures[order]["choice"] = choice
        current = estimate()
    outside: list = []
    if current > budget_bytes:
        # every block has its choice and it is not enough: the saved tensors made outside the
        # blocks (embeddings, the head, the loss) are offloaded too
        in_blocks = {n for b in blocks for n in b.nodes}
        outside = sorted((r for r in roots if r not in in_blocks and r.op != "placeholder"
                          and offloadable_bytes({r}, {r}, estimator.root_bytes, min_bytes)), key=lambda r: r.name)
        current -= sum(estimator.root_bytes.get(r, 0) for r in outside)
    return {"choices": choices, "blocks": blocks, "first_id": first_id, "per_block": figures,
            "baseline": baseline, "estimate": current, "outside": outside}


def auto_budget(graph: torch.fx.Graph, memory_limit_mb: float) -> float:
    """``memory_limit_mb`` less what the simulated step holds besides the saved activations."""
    peak = simulate(graph).peak
    saved = SavedBytesEstimator(graph).saved_bytes({})
    return max(0.0, memory_limit_mb * _MB - max(0, peak - saved))


def plan_activations(gm: torch.fx.GraphModule, ctx: PassContext, *, settings, **_) -> torch.fx.GraphModule:
    """Choose keep / recompute / offload per block (see the module docstring); ``settings``: the
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
    recomputed = {b for b, c in plan["choices"].items() if c == RECOMPUTE}
    for node, (policy, ac_id) in plan_tags(plan["blocks"], recomputed, plan["first_id"]).items():
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = ac_id
    for block in plan["blocks"]:
        if plan["choices"].get(block.order) == OFFLOAD:
            for node in block.nodes:
                set_tag(node, offload_activation=True)
    for node in plan["outside"]:
        set_tag(node, offload_activation=True)
    if plan["estimate"] > budget:
        ctx.logger.warning(
            "[%s] plan_activations: even with every block recomputed or offloaded, an estimated %.2f MiB of saved "
            "activations stay in memory, over offload_activations.budget_mb (%.2f MiB)", ctx.frame,
            plan["estimate"] / _MB, budget / _MB)
    names = {c: [b.name for b in plan["blocks"] if plan["choices"].get(b.order) == c] for c in (RECOMPUTE, OFFLOAD)}
    ctx.results["plan_activations"] = {
        "budget_bytes": budget, "estimated_saved_bytes_before": plan["baseline"],
        "estimated_saved_bytes": plan["estimate"], "recomputed": names[RECOMPUTE], "offloaded": names[OFFLOAD],
        "offloaded_outside_blocks": [n.name for n in plan["outside"]],
        "per_block": plan["per_block"], "offload_gbps": cost.offload_bandwidth / 1e9}
    ctx.logger.info("[%s] plan_activations: budget %.2f MiB; saved activations %.2f -> %.2f MiB; recompute %s; "
                    "offload %s", ctx.frame, budget / _MB, plan["baseline"] / _MB, plan["estimate"] / _MB,
                    names[RECOMPUTE], names[OFFLOAD])
    return gm
