"""Pass (joint graph, stage 3, ``zero_hpz_partition_size = k > 1``): ZeRO++ hpZ, backward
re-gathers stay within groups of ``k`` ranks.

Stage 3 gathers every parameter twice per step over all ``N`` ranks: in forward, and again
in backward (``reshard_after_forward``). With hpZ each rank also keeps, from the forward
gather to the backward, a *secondary shard*: its ``1/k`` of the gathered parameter within
its group of ``k`` consecutive ranks (ranks ``g*k .. g*k+k-1``, the ranks of one node when
``k`` is the number of devices per node). The backward re-gathers the parameter from the
secondary shards of its group: an all-gather over ``k`` ranks, on the fast links inside a
node, instead of over all ``N``.

For each parameter all-gather the backward reads (not those ``selective_unshard`` keeps
whole), in the joint graph:

- after the forward gather's wait ``W`` (the full flat parameter): ``S = clone(W[i*L:(i+1)*L])``
  with ``L = numel(W) / k`` and ``i`` this rank's position in its group, tagged
  ``CheckpointPolicy.MUST_SAVE`` (the min-cut partitioner saves it for backward);
- a copy of the gather chain that starts from ``S``: an all-gather over the rank's
  ``k``-group, its wait, and the views after ``W``, tagged ``MUST_RECOMPUTE`` like the
  original chain, so the partitioner runs it in backward;
- the backward readers of the original chain read the copy instead.

The partitioner also copies the new chain into the forward graph, where nothing reads it (a
collective is never dead code to it); on the forward graph this pass erases those copies.
With ``recompute``, the forward ops the backward recomputes read the forward's gather, which
the partitioner then re-runs over all ranks; on the backward graph this pass points them at
the group gather of the same parameter instead (the same values) and erases the all-rank one.

The concatenation of the group's ``k`` secondary shards is ``W`` itself, so the backward
computes with exactly the forward's values (bitwise; with ``zero_quantized_weights`` the
forward's dequantized ones: the group gathers are not quantized again). Memory: each rank
holds ``1/k`` of every re-gathered parameter between forward and backward (``Ψ/k`` in the
parameter dtype over the whole model), as DeepSpeed's hpZ does; ``stats()`` and ``plan``
count it as saved activations, since it is one.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from zerocompile.errors import ZeroConfigError
from zerocompile.passes.analyses import param_identity
from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import (backward_nodes, call, is_backward_node, set_tag, stable_topological_sort,
                                            tag)
from zerocompile.passes.reshard_after_forward import (GATHER_AC_GRAPH_ID, PASS_THROUGH_OPS, gather_chain, is_op,
                                                      parameter_gathers)
from zerocompile.runtime import comm

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten


def _descendants_in_chain(wait: torch.fx.Node, chain: list) -> list:
    """The chain's nodes computed from ``wait`` (``wait`` first), in graph order."""
    members = set(chain)
    out, frontier = [], [wait]
    while frontier:
        node = frontier.pop()
        if node in out:
            continue
        out.append(node)
        frontier.extend(u for u in node.users if u in members)
    order = {n: i for i, n in enumerate(wait.graph.nodes)}
    return sorted(out, key=order.__getitem__)


def secondary_partition(graph: torch.fx.Graph, k: int, position: int, subgroup_name: str) -> dict:
    """Rewrite the graph's re-gathered parameters as described above; returns counts."""
    bw = backward_nodes(graph)
    rewritten, skipped, saved_elements = 0, 0, 0
    for gather in parameter_gathers(graph):
        if tag(gather).get("keep_gathered"):
            continue
        chain = gather_chain(gather)
        members = set(chain)
        readers = [(u, n) for n in chain for u in list(n.users) if u not in members and is_backward_node(u, bw)]
        waits = [u for u in gather.users if u.target is _c10d.wait_tensor.default]
        if not readers:
            continue
        full = waits[0].meta["val"] if len(waits) == 1 else None
        if full is None or full.dim() != 1 or full.numel() % k:
            skipped += 1           # the backward re-gathers it over every rank, as without hpZ
            continue
        wait = waits[0]
        length = full.numel() // k
        with graph.inserting_after(wait):
            part = call(graph, _aten.slice.Tensor, (wait, 0, position * length, (position + 1) * length))
        with graph.inserting_after(part):
            secondary = call(graph, _aten.clone.default, (part,))
        secondary.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        secondary.meta["ac_graph_id"] = GATHER_AC_GRAPH_ID
        set_tag(secondary, role="hpz_secondary", param=tag(gather).get("param"))
        # the chain again, from the secondary shard, over the group
        mapping = {}
        anchor = secondary
        for node in _descendants_in_chain(wait, chain):
            with graph.inserting_after(anchor):
                if node is wait:
                    regather = graph.node_copy(gather)
                    regather.args = (secondary, k, subgroup_name)
                    set_tag(regather, hpz=True)
                    anchor = regather
                    with graph.inserting_after(anchor):
                        copy = graph.node_copy(wait, lambda a: regather)
                else:
                    copy = graph.node_copy(node, lambda a: mapping.get(a, a))
            mapping[node] = copy
            anchor = copy
        for reader, source in readers:
            reader.replace_input_with(source, mapping[source])
        rewritten += 1
        saved_elements += length
    stable_topological_sort(graph)
    return {"rewritten": rewritten, "left": skipped, "k": k, "secondary_elements": saved_elements}


def drop_forward_regathers(graph: torch.fx.Graph) -> int:
    """Erase the group re-gathers the partitioner also put in the forward graph, where nothing
    reads them (they read only the secondary shard, so it counts them as forward nodes, and a
    collective is not dead code to it). Returns how many were erased."""
    erased = 0
    for gather in [n for n in graph.nodes if n.target is _c10d.all_gather_into_tensor.default and tag(n).get("hpz")]:
        chain, frontier = [], [gather]
        while frontier:
            node = frontier.pop()
            if node not in chain:
                chain.append(node)
                frontier.extend(node.users)
        members = set(chain)
        if all(u in members for n in chain for u in n.users) and \
                all(n is gather or n.target is _c10d.wait_tensor.default or _is_view_or_cast(n) for n in chain):
            order = {n: i for i, n in enumerate(graph.nodes)}
            for node in sorted(chain, key=order.__getitem__, reverse=True):
                graph.erase_node(node)
            erased += 1
    return erased


def use_group_regathers(graph: torch.fx.Graph) -> int:
    """In a backward graph, a parameter may be gathered both over its group (hpZ) and over all
    ranks: the latter where the partitioner recomputes forward ops that read the forward's
    gather (``recompute``). Both give the same full parameter, so the readers of the
    all-rank gather read the group gather instead, and the all-rank gather is erased with the
    casts and views that only fed it. Returns how many were redirected."""
    group_waits = {}
    for gather in graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        ident = param_identity.identity(gather)
        waits = [u for u in gather.users if u.target is _c10d.wait_tensor.default]
        if tag(gather).get("hpz") and ident is not None and len(waits) == 1:
            group_waits[ident.index] = waits[0]
    redirected = 0
    for gather in list(graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)):
        ident = param_identity.identity(gather)
        waits = [u for u in gather.users if u.target is _c10d.wait_tensor.default]
        if (tag(gather).get("hpz") or ident is None or ident.index not in group_waits or len(waits) != 1
                or len(gather.users) != 1):
            continue
        target = group_waits[ident.index]
        if target.meta["val"].shape != waits[0].meta["val"].shape:
            continue
        waits[0].replace_all_uses_with(target)
        source = gather.args[0]
        graph.erase_node(waits[0])
        graph.erase_node(gather)
        while source.op == "call_function" and not source.users and _is_view_or_cast(source):
            above = source.args[0]
            graph.erase_node(source)
            source = above
        redirected += 1
    stable_topological_sort(graph)
    return redirected


def _is_view_or_cast(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and is_op(node, PASS_THROUGH_OPS)


def hierarchical_partition(gm: torch.fx.GraphModule, ctx: PassContext, *, zero_hpz_partition_size: int,
                           **_) -> torch.fx.GraphModule:
    if ctx.graph_kind == "forward":
        erased = drop_forward_regathers(gm.graph)
        ctx.results.setdefault("hierarchical_partition", {})["dropped_from_forward"] = erased
        gm.recompile()
        return gm
    if ctx.graph_kind == "backward":
        redirected = use_group_regathers(gm.graph)
        ctx.results.setdefault("hierarchical_partition", {})["recomputed_gathers_redirected"] = redirected
        gm.recompile()
        return gm
    k = zero_hpz_partition_size
    group = ctx.group
    if group.world % k:
        raise ZeroConfigError(f"option 'zero_hpz_partition_size' = {k} does not divide the world size "
                              f"{group.world}; use a divisor of it (the ranks per node)")
    if k >= group.world:
        ctx.results["hierarchical_partition"] = {"rewritten": 0, "left": 0, "k": k, "secondary_elements": 0}
        ctx.logger.info("[%s] hierarchical_partition: zero_hpz_partition_size %d is the whole group of %d ranks; "
                        "backward re-gathers stay as they are", ctx.frame, k, group.world)
        return gm
    subgroup = comm.hpz_subgroup(group, k)
    report = secondary_partition(gm.graph, k, group.rank % k, subgroup.name)
    ctx.results["hierarchical_partition"] = report
    ctx.logger.debug("[%s] hierarchical_partition: %s", ctx.frame, report)
    gm.recompile()
    return gm
