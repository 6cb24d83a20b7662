"""Pass (joint graph, required): tag every parameter all-gather and gradient reduce-scatter.

Later passes (selective unsharding, resharding, bucketing, prefetch) find the
collectives they work on by these tags, never by node names. A parameter all-gather
is one whose input comes from a graph input (a shard) through casts and views only;
a gradient reduce-scatter is one whose result reaches the joint graph's output in the
position of a shard's gradient. Each gets ``node.meta["zerocompile"]``:

- the all-gather: ``{"role": "param_gather", "param": name, "params": [name]}``, its
  wait ``"param_gather_wait"``, the casts/views before it ``"gather_input"`` and the
  views/casts after its wait ``"gather_output"``;
- the reduce-scatter: ``{"role": "grad_reduce_scatter", "param": name, "params": [name]}``,
  its wait ``"grad_reduce_scatter_wait"``.

The tags survive partitioning (the partitioner copies node metadata into the forward
and backward graphs, including re-gathers it recomputes in backward).
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import set_tag
from zerocompile.passes.reshard_after_forward import PASS_THROUGH_OPS, is_op, gather_chain

_c10d = torch.ops._c10d_functional


def _source_placeholder(node: torch.fx.Node) -> torch.fx.Node | None:
    src = node.args[0]
    while src.op == "call_function" and is_op(src, PASS_THROUGH_OPS):
        src = src.args[0]
    return src if src.op == "placeholder" else None


def _output_positions(node: torch.fx.Node) -> list[int]:
    """Positions in the graph output that ``node`` reaches through single-input ops."""
    out = []
    frontier = [node]
    seen = set()
    while frontier:
        cur = frontier.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in cur.users:
            if user.op == "output":
                flat = user.args[0]
                out.extend(i for i, a in enumerate(flat) if a is cur)
            elif user.op == "call_function" and len(user.all_input_nodes) == 1:
                frontier.append(user)
    return out


def param_name_of_input(ctx: PassContext, placeholder: torch.fx.Node, placeholders: list) -> str | None:
    index = placeholders.index(placeholder)
    if index < len(ctx.primal_params) and ctx.primal_params[index] is not None:
        return ctx.primal_params[index].name
    return None


def tag_collectives(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    graph = gm.graph
    primals = [n for n in graph.find_nodes(op="placeholder") if "tangent" not in n.name]
    n_gathers = n_reduces = 0
    for ag in graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        src = _source_placeholder(ag)
        if src is None or src not in primals:
            continue  # not a parameter gather (e.g. the user's own collective): left alone
        name = param_name_of_input(ctx, src, primals) or src.name
        for node in gather_chain(ag):
            if node is ag:
                set_tag(node, role="param_gather", param=name, params=[name])
            elif node.target is _c10d.wait_tensor.default:
                set_tag(node, role="param_gather_wait", param=name)
            else:
                set_tag(node, role="gather_output" if _after(node, ag) else "gather_input", param=name)
        n_gathers += 1
    for rs in graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default):
        waits = [u for u in rs.users if u.target is _c10d.wait_tensor.default]
        if len(waits) != 1:
            continue
        positions = _output_positions(waits[0])
        grads = [p - ctx.num_fwd_outputs for p in positions if p >= ctx.num_fwd_outputs]
        if len(grads) != 1 or grads[0] >= len(primals):
            continue  # not a shard's gradient: left alone
        name = param_name_of_input(ctx, primals[grads[0]], primals) or primals[grads[0]].name
        set_tag(rs, role="grad_reduce_scatter", param=name, params=[name])
        set_tag(waits[0], role="grad_reduce_scatter_wait", param=name)
        n_reduces += 1
    ctx.results["tag_collectives"] = {"param_gathers": n_gathers, "grad_reduce_scatters": n_reduces}
    return gm


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
