"""Pass (joint graph): recompute activations in backward instead of saving them.

Activation checkpointing by blocks, decided on AOTAutograd's joint forward+backward
graph before the min-cut partitioner runs. The pass talks to the partitioner only
through the node metadata ``torch.utils.checkpoint`` regions use in compiled graphs:

- ``node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE`` on every forward compute
  node of a recomputed block, and ``node.meta["ac_graph_id"]`` = the block's id. Blocks get
  distinct ids that increase in graph order, so the partitioner's clean-up rule (a node
  whose user lies in a region with a larger id is saved) saves each block's output where
  the next recomputed block reads it. The forward then keeps only the block inputs, and
  the backward recomputes each block from its input.
- Random ops (``torch.Tag.nondeterministic_seeded``) in a recomputed block get
  ``CheckpointPolicy.MUST_SAVE`` instead, and so do the tensors read out of them, so a
  recomputed block sees the same random values as the forward did.

Nodes whose ``meta["recompute"]`` is already set (the parameter all-gather chains that
``reshard_after_forward`` tags, the user's own ``torch.utils.checkpoint`` regions) are left
as they are, and so are collectives, in-place/impure ops and non-tensor values.

**Blocks.** A node's block is the outermost module on its ``meta["nn_module_stack"]``
whose path ends in a numeric index (``blocks.0``, ``model.layers.11``, ``transformer.h.5``).
Nodes outside every numbered module (embeddings, final norm, head, loss) are in no block
and never tagged. A graph without numbered modules takes each top-level child module
as a block. A module called again after another block ran (a shared module) makes a new
block (``blocks.0#2``); nodes in no block between two parts of the same block (a
parameter gather, top-level code) do not split it.

**Modes** (``ZeroConfig.recompute``):

- ``"full"``: every block is recomputed.
- ``{"memory_budget_mb": X}``: the pass estimates the bytes the forward saves for
  backward for a given set of recomputed blocks (``SavedBytesEstimator``), and each
  block's recompute time (``CostModel.node_time`` over its forward nodes). Blocks are
  recomputed in order of estimated bytes freed per second of recompute (ties: graph
  order, so every rank decides the same) until the estimate is within the budget. If
  recomputing every block still does not fit, every block is recomputed and a warning
  gives the numbers.

The decision is recorded in ``ctx.results["recompute"]`` (``mode``, ``blocks``, the
``recomputed`` blocks the pass tagged, ``estimated_saved_bytes``, ``budget_bytes`` and, in
budget mode, ``per_block`` figures) and logged at INFO on ``zerocompile.passes``.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from zerocompile.passes.context import PassContext
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.passes.graph_utils import backward_nodes, is_backward_node, tensor_nbytes
from zerocompile.passes.analyses.liveness import storage_root, tensors_of
from zerocompile.passes.reshard_after_forward import GATHER_AC_GRAPH_ID

_MB = 2**20
_RECOMPUTE_POLICIES = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
# The frame local or global a module path starts from, with any subscripts of it:
# L['self'], L['args'][0], G['model'].
_PATH_ROOT = re.compile(r"^[LG](?:\[(?:'[^']*'|\"[^\"]*\"|\d+)\])+")
# One component of a module path: a quoted key ('layers', "0") or a bare name or index.
_PATH_TOKEN = re.compile(r"'([^']*)'|\"([^\"]*)\"|([A-Za-z0-9_]+)")


@dataclass
class Block:
    """One block of the forward: a numbered module (one call of it) and its nodes."""

    name: str
    """The module path, e.g. ``blocks.0`` (``blocks.0#2`` for its second call)."""
    order: int
    """Position among the graph's blocks, in graph order."""
    nodes: list = field(default_factory=list)
    """Its forward ``call_function`` nodes, in graph order (tagged or not)."""


# --------------------------------------------------------------------- finding blocks
def module_path(path: str) -> tuple:
    """The components of an ``nn_module_stack`` path, without the frame root.

    ``"L['self'].blocks.0.ln1"``, ``"L['self'].blocks[0].ln1"``,
    ``"L['self']._modules['blocks']._modules['0'].ln1"``, ``"getattr(L['self'].blocks, '0').ln1"``,
    ``"L['args'][0].blocks.0.ln1"`` and ``"blocks.0.ln1"`` all give ``("blocks", "0", "ln1")``.
    """
    path = _PATH_ROOT.sub("", path.replace("getattr(", ""))
    tokens = [next(g for g in m.groups() if g is not None) for m in _PATH_TOKEN.finditer(path)]
    return tuple(t for t in tokens if t != "_modules")


def _stack_paths(node: torch.fx.Node) -> list:
    """The module paths on a node's ``nn_module_stack``, outermost first, root omitted."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, (tuple, list)) else value
        parts = module_path(str(path))
        if parts:
            paths.append(parts)
    return paths


def numbered_block_of(node: torch.fx.Node) -> str | None:
    """The outermost module on the node's stack whose path ends in a numeric index."""
    numbered = [p for p in _stack_paths(node) if p[-1].isdigit()]
    if not numbered:
        return None
    return ".".join(min(numbered, key=len))


def top_level_block_of(node: torch.fx.Node) -> str | None:
    """The top-level child module the node runs in (the fallback block)."""
    paths = _stack_paths(node)
    return paths[0][0] if paths else None


def _is_forward(node: torch.fx.Node, tangent_descendants: set) -> bool:
    return node.op == "call_function" and not is_backward_node(node, tangent_descendants)


def find_blocks(graph: torch.fx.Graph) -> list[Block]:
    """The blocks of a joint graph's forward, in graph order (see the module docstring)."""
    tangent_descendants = backward_nodes(graph)
    forward = [n for n in graph.nodes if _is_forward(n, tangent_descendants)]
    block_of = numbered_block_of
    if not any(numbered_block_of(n) for n in forward):
        block_of = top_level_block_of
    blocks: list[Block] = []
    calls: dict = {}
    current = None
    for node in forward:
        name = block_of(node)
        if name is None:
            continue  # not in a block (embedding, head, loss, parameter gathers): no break
        if current is None or name != current:
            calls[name] = calls.get(name, 0) + 1
            label = name if calls[name] == 1 else f"{name}#{calls[name]}"
            blocks.append(Block(name=label, order=len(blocks)))
            current = name
        blocks[-1].nodes.append(node)
    return blocks


# ------------------------------------------------------------------------- tagging
def _is_random(node: torch.fx.Node) -> bool:
    """A random op, or a tensor read out of one (``getitem`` of ``native_dropout``)."""
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        return _is_random(node.args[0])
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _is_collective(node: torch.fx.Node) -> bool:
    return getattr(node.target, "namespace", None) == "_c10d_functional"


def _taggable(node: torch.fx.Node) -> bool:
    """Whether the pass may tag this forward node: untagged, a functional op on tensors,
    not a collective."""
    if node.op != "call_function" or node.meta.get("recompute") is not None or _is_collective(node):
        return False
    if node.is_impure(impure_random=False):
        return False  # in-place / side-effecting: recomputing would apply it twice
    return bool(tensors_of(node.meta.get("val")))


def plan_tags(blocks: list[Block], chosen, first_id: int) -> dict:
    """``{node: (policy, ac_graph_id)}`` for the nodes of the ``chosen`` block indices."""
    plan = {}
    for block in blocks:
        if block.order not in chosen:
            continue
        ac_id = first_id + block.order
        for node in block.nodes:
            if _taggable(node):
                policy = CheckpointPolicy.MUST_SAVE if _is_random(node) else CheckpointPolicy.MUST_RECOMPUTE
                plan[node] = (policy, ac_id)
    return plan


def first_block_id(graph: torch.fx.Graph) -> int:
    """The id of the first block: above every region id already in the graph (the user's
    ``torch.utils.checkpoint`` regions), below the parameter gathers' id."""
    ids = [n.meta["ac_graph_id"] for n in graph.nodes
           if isinstance(n.meta.get("ac_graph_id"), int) and n.meta["ac_graph_id"] < GATHER_AC_GRAPH_ID]
    return max(ids, default=0) + 1


# ------------------------------------------------------------------------ estimate
class SavedBytesEstimator:
    """Estimates the bytes the forward saves for backward under a tagging plan.

    A forward value is saved when it is not recomputed and a backward node, or a node
    recomputed in backward, reads it. A node is recomputed when its policy is
    MUST/PREFER_RECOMPUTE, unless one of its recomputed users lies in a region with a
    larger ``ac_graph_id`` (the partitioner then saves it: a block boundary). Each
    storage counts once (views alias their base); graph inputs count zero (they exist
    anyway). For the untagged part this is an upper bound of what the min-cut partitioner
    saves, since it may shrink it by recomputing cheap ops on its own.

    What does not depend on the plan (who reads what, storages, sizes) is computed once,
    so that the budget search can try many plans.
    """

    def __init__(self, graph: torch.fx.Graph):
        tangent_descendants = backward_nodes(graph)
        self.nodes = [n for n in graph.nodes if n.op == "call_function"]
        self.forward = [n for n in self.nodes if _is_forward(n, tangent_descendants)]
        self.readers = {n: [u for u in n.users if u.op != "output"] for n in self.nodes}
        self.read_by_backward = {
            n for n in self.forward if any(is_backward_node(u, tangent_descendants) for u in self.readers[n])}
        self.root = {n: storage_root(n) for n in self.forward}
        self.root_bytes = {r: sum(tensor_nbytes(t) for t in tensors_of(r.meta.get("val")))
                           for r in set(self.root.values()) if r.op != "placeholder"}

    def saved_bytes(self, plan: dict) -> int:
        """Estimated saved bytes with ``plan`` (from ``plan_tags``) applied on top of the
        tags already in the graph."""
        return sum(self.root_bytes.get(r, 0) for r in self.saved_roots(plan))

    def saved_roots(self, plan: dict) -> set:
        """The storages (their defining nodes) saved for backward with ``plan`` applied."""

        def policy(node):
            return plan.get(node) or (node.meta.get("recompute"), node.meta.get("ac_graph_id"))

        def tagged_recompute(node):
            return policy(node)[0] in _RECOMPUTE_POLICIES

        recomputed = set()
        for node in self.nodes:
            if not tagged_recompute(node):
                continue
            my_id = policy(node)[1]
            boundary = my_id is not None and any(
                tagged_recompute(u) and policy(u)[1] is not None and policy(u)[1] > my_id
                for u in self.readers[node])
            if not boundary:
                recomputed.add(node)
        saved_roots = set()
        for node in self.forward:
            if node in recomputed:
                continue
            if node in self.read_by_backward or any(u in recomputed for u in self.readers[node]):
                saved_roots.add(self.root[node])
        return saved_roots


def block_time(block: Block, cost: CostModel) -> float:
    """Estimated seconds to recompute a block: its forward nodes' compute time."""
    return sum(cost.node_time(n) for n in block.nodes if _taggable(n))


def choose_blocks(graph: torch.fx.Graph, blocks: list[Block], budget_bytes: float, cost: CostModel,
                  first_id: int) -> tuple[set, int, list]:
    """The blocks to recompute within ``budget_bytes`` of saved activations.

    Returns (chosen block indices, estimated saved bytes, per-block figures). Blocks go
    by estimated bytes freed per second of recompute, best first, ties in graph order.
    """
    estimator = SavedBytesEstimator(graph)
    baseline = estimator.saved_bytes({})
    figures = []
    for block in blocks:
        alone = estimator.saved_bytes(plan_tags(blocks, {block.order}, first_id))
        seconds = block_time(block, cost)
        figures.append({"name": block.name, "freed_bytes": baseline - alone, "recompute_s": seconds})
    ranked = sorted(blocks, key=lambda b: (-_rate(figures[b.order]), b.order))
    chosen: set = set()
    estimate = baseline
    for block in ranked:
        if estimate <= budget_bytes:
            break
        chosen.add(block.order)
        estimate = estimator.saved_bytes(plan_tags(blocks, chosen, first_id))
    return chosen, estimate, figures


def _rate(figure: dict) -> float:
    """Bytes freed per second of recompute (a free block with a gain ranks first)."""
    if figure["recompute_s"] > 0:
        return figure["freed_bytes"] / figure["recompute_s"]
    return math.inf if figure["freed_bytes"] > 0 else 0.0


# -------------------------------------------------------------------------- the pass
def recompute(gm: torch.fx.GraphModule, ctx: PassContext, *, recompute: str, **_) -> torch.fx.GraphModule:
    """Tag the blocks to recompute in backward (see the module docstring); ``recompute`` is the
    option's value ("full", "auto", or a memory budget)."""
    mode = recompute
    graph = gm.graph
    blocks = find_blocks(graph)
    first_id = first_block_id(graph)
    budget_bytes = None
    figures: list = []
    if mode == "full":
        chosen = {b.order for b in blocks}
        estimate = SavedBytesEstimator(graph).saved_bytes(plan_tags(blocks, chosen, first_id))
    elif isinstance(mode, dict):
        budget_bytes = float(mode["memory_budget_mb"]) * _MB
        cost = ctx.cost_model if ctx.cost_model is not None else CostModel()
        chosen, estimate, figures = choose_blocks(graph, blocks, budget_bytes, cost, first_id)
        if estimate > budget_bytes:
            ctx.logger.warning(
                "[%s] recompute: even recomputing all %d blocks leaves an estimated %d bytes (%.2f MiB) of "
                "saved activations, over the budget of %d bytes (%.2f MiB, memory_budget_mb); recomputing "
                "every block", ctx.frame, len(blocks), estimate, estimate / _MB, budget_bytes, budget_bytes / _MB)
    else:
        chosen, estimate = set(), SavedBytesEstimator(graph).saved_bytes({})
    plan = plan_tags(blocks, chosen, first_id)
    for node, (policy, ac_id) in plan.items():
        node.meta["recompute"] = policy
        node.meta["ac_graph_id"] = ac_id
    # a chosen block whose nodes were all tagged already (the user's checkpoint) is not listed
    tagged = [b.name for b in blocks if any(n in plan for n in b.nodes)]
    result = {
        "mode": "budget" if isinstance(mode, dict) else mode,
        "blocks": [b.name for b in blocks],
        "recomputed": tagged,
        "estimated_saved_bytes": estimate,
        "budget_bytes": budget_bytes,
    }
    if figures:
        result["per_block"] = figures
    ctx.results["recompute"] = result
    ctx.logger.info(
        "[%s] recompute (%s): %d of %d blocks recomputed %s; estimated saved activations %.2f MiB%s",
        ctx.frame, result["mode"], len(result["recomputed"]), len(blocks), result["recomputed"],
        estimate / _MB, "" if budget_bytes is None else f" (budget {budget_bytes / _MB:.2f} MiB)")
    return gm
