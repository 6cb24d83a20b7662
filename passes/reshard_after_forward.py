"""Pass (joint graph, stage 3): gather parameters again in backward instead of saving them.

Finds every parameter all-gather (by the identity ``insert_param_collectives`` gave it,
``passes/analyses/param_identity.py``), and tags the whole chain (the cast before it, the
all-gather, its wait, and every view or cast of the gathered tensor downstream)
``CheckpointPolicy.MUST_RECOMPUTE``. The min-cut partitioner then saves only the
shard for backward and re-gathers there. Without the tags the partitioner saves the
gathered parameter (or a view of it) from forward to backward, which is not ZeRO-3.
With ``offload_param`` the fetch that reads each shard from its file is tagged as well (role
``param_fetch``: bucketing and prefetch treat it as part of the gather it feeds, not as one).
The partitioner never decides about collectives on its own: every rank sees the same
graph and the same tags, so every rank issues the same collectives.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from zerocompile.passes.analyses import param_identity
from zerocompile.runtime import param_offload  # noqa: F401  (registers zerocompile::fetch_shard)
from zerocompile.passes.context import PassContext

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_FETCH = torch.ops.zerocompile.fetch_shard.default

# A large AC region id keeps the partitioner's "save at region boundary" rule away
# from these nodes (the same value SimpleFSDP uses).
GATHER_AC_GRAPH_ID = 100000

PASS_THROUGH_OPS = {
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.t.default,
    _aten.permute.default, _aten.transpose.int, _aten.expand.default, _aten.slice.Tensor,
    _aten.alias.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims,
    _aten.squeeze.default, _aten.select.int, _aten.as_strided.default, _aten.detach.default,
    _aten._to_copy.default, _aten.clone.default,
    _aten.split.Tensor, _aten.unbind.int, _aten.chunk.default,
    torch.ops.prims.convert_element_type.default,
}


def is_op(node, ops) -> bool:
    if node.op != "call_function":
        return False
    if node.target in ops:
        return True
    import operator
    return node.target is operator.getitem and node.args and is_op(node.args[0], ops)


def parameter_gathers(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The all-gathers of parameters (by their identity, ``passes/analyses/param_identity.py``), in
    graph order."""
    return [node for node in graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)
            if param_identity.identity(node) is not None]


def gather_chain(gather: torch.fx.Node) -> list[torch.fx.Node]:
    """The all-gather, the casts/views before it, its wait and the views/casts after it."""
    chain = [gather]
    src = gather.args[0]
    while src.op == "call_function" and is_op(src, PASS_THROUGH_OPS):
        chain.append(src)
        src = src.args[0]
    frontier = list(gather.users)
    while frontier:
        node = frontier.pop()
        if node in chain:
            continue
        if node.target is _c10d.wait_tensor.default or is_op(node, PASS_THROUGH_OPS):
            chain.append(node)
            frontier.extend(node.users)
    return chain


def fetch_chain(fetch: torch.fx.Node) -> list[torch.fx.Node]:
    """An ``offload_param`` fetch (``zerocompile::fetch_shard``), the ``wait_tensor`` of its read
    and the views/casts of what it read, up to (not including) an all-gather: the whole
    parameter at world size 1."""
    chain, frontier = [], [fetch]
    while frontier:
        node = frontier.pop()
        if node in chain:
            continue
        chain.append(node)
        frontier.extend(u for u in node.users if u.target is _c10d.wait_tensor.default or is_op(u, PASS_THROUGH_OPS))
    return chain


def tag_parameter_gathers(graph: torch.fx.Graph, policy=CheckpointPolicy.MUST_RECOMPUTE) -> int:
    """Tag every parameter gather chain with ``policy``, except gathers the
    ``selective_unshard`` pass chose to keep; returns the number of gathers tagged.
    ``offload_param`` fetches are tagged too, so the backward reads the file again rather
    than keep the fetched shard (or, at world size 1, the whole parameter) alive."""
    gathers = [g for g in parameter_gathers(graph) if not g.meta.get("zerocompile", {}).get("keep_gathered")]
    chains = [(gather_chain(g), "param_gather") for g in gathers]
    # a fetch chain's own role: tagged as a gather, a fetch (which has a wait of its own)
    # would be bucketed and prefetched as an all-gather of its own
    chains += [(fetch_chain(f), "param_fetch") for f in graph.find_nodes(op="call_function", target=_FETCH)]
    for chain, role in chains:
        for node in chain:
            node.meta["recompute"] = policy
            node.meta["ac_graph_id"] = GATHER_AC_GRAPH_ID
            node.meta.setdefault("zerocompile", {"role": role})
    return len(gathers)


def reshard_after_forward(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    n = tag_parameter_gathers(gm.graph)
    ctx.results["reshard_after_forward"] = {"resharded": n}
    ctx.logger.debug("[%s] reshard_after_forward: %d parameter gathers re-gathered in backward", ctx.frame, n)
    return gm
