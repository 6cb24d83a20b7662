"""Pass (joint graph, required): tag every parameter all-gather and gradient reduce-scatter.

Later passes (selective unsharding, resharding, bucketing, prefetch) find the
collectives they work on by these tags, never by node names. Which parameter a
collective belongs to is read from the identity ``insert_param_collectives`` gave the
node it inserted (``passes/analyses/param_identity.py``), which AOTAutograd carried to the
collectives traced from it, forward and backward. A collective without an identity
(e.g. the user's own) is left alone. Each gets ``node.meta["zerocompile"]``:

- the all-gather: ``{"role": "param_gather", "param": name, "params": [name]}``, its
  wait ``"param_gather_wait"``, the casts/views before it ``"gather_input"`` and the
  views/casts after its wait ``"gather_output"``;
- the reduce-scatter: ``{"role": "grad_reduce_scatter", "param": name, "params": [name]}``,
  its wait ``"grad_reduce_scatter_wait"``.

The tags survive partitioning (the partitioner copies node metadata into the forward
and backward graphs, including re-gathers it recomputes in backward).

Ensures (checked after the pass): no parameter has two all-gathers or two gradient
reduce-scatters in the joint graph, and every stage-3 parameter the graph reads is
gathered.
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.analyses import param_identity
from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import set_tag
from zerocompile.passes.reshard_after_forward import gather_chain

_c10d = torch.ops._c10d_functional


def tag_collectives(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    n_gathers = n_reduces = 0
    for nodes in param_identity.parameter_collectives(gm.graph).values():
        name = nodes.param.name
        for ag in nodes.gathers:
            for node in gather_chain(ag):
                if node is ag:
                    set_tag(node, role="param_gather", param=name, params=[name])
                elif node.target is _c10d.wait_tensor.default:
                    set_tag(node, role="param_gather_wait", param=name)
                else:
                    set_tag(node, role="gather_output" if _after(node, ag) else "gather_input", param=name)
            n_gathers += 1
        for rs in nodes.reduces:
            set_tag(rs, role="grad_reduce_scatter", param=name, params=[name])
            for wait in rs.users:
                if wait.target is _c10d.wait_tensor.default:
                    set_tag(wait, role="grad_reduce_scatter_wait", param=name)
            n_reduces += 1
    ctx.results["tag_collectives"] = {"param_gathers": n_gathers, "grad_reduce_scatters": n_reduces}
    return gm


def ensure_tagged(gm: torch.fx.GraphModule, ctx: PassContext, *, stage: int, **_) -> None:
    """At most one gather and one reduction per parameter; at stage 3, a gather for every
    parameter input the graph reads."""
    where = f"{ctx.graph_kind} ({ctx.frame})"
    if stage != 3 or ctx.group.world == 1:
        param_identity.check_at_most_one_each(gm.graph, where)
        return
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    read = {}
    indices = param_identity.number_parameters(ctx.primal_params)
    for ph, sp, index in zip(placeholders, ctx.primal_params, indices):
        if sp is not None and ph.users:
            read[index] = sp.name
    param_identity.check_gathered_where_read(gm.graph, read, where)


def _after(node: torch.fx.Node, ag: torch.fx.Node) -> bool:
    """Whether ``node`` is downstream of ``ag``."""
    frontier = list(node.all_input_nodes)
    seen = set()
    while frontier:
        cur = frontier.pop()
        if cur is ag:
            return True
        if cur in seen or cur.op == "placeholder":
            continue
        seen.add(cur)
        frontier.extend(cur.all_input_nodes)
    return False
