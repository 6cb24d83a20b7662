"""Pass (backward graphs, stage 2): gradient reduce-scatters become all-reduces where faster.

Where the frame's ``ReductionChoice`` (``runtime/reduction_choice.py``, the
``gradient_reduction`` option) takes an all-reduce for a bucket's size, the bucket's
reduce-scatter (role ``bucket_reduce_scatter``, or ``grad_reduce_scatter`` unbucketed) is
replaced by an all-reduce of the same flat buffer, and the wait's users read this rank's
slice of the result instead: rows ``[rank * chunk, (rank + 1) * chunk)`` of the buffer, the
very elements the reduce-scatter returns, summed over the same ranks (on two ranks the same
one addition: bitwise equal). The all-reduce's full result lives from its wait to the slice's
last use, a transient of the backward like the gradient itself; the shard gradient and the
model state between steps are those of the reduce-scatter.

Runs after bucketing and prefetch, so buckets and the place of each wait are kept: the
all-reduce starts where the reduce-scatter started and is waited for where it was waited for.
Nodes get the roles ``grad_all_reduce``, ``grad_all_reduce_wait`` and
``grad_all_reduce_slice``, with the reduce-scatter's ``params`` and ``bucket``.
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import call, tag, tensor_nbytes

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_ROLES = ("grad_reduce_scatter", "bucket_reduce_scatter")


def reduce_scatters_as_all_reduces(graph: torch.fx.Graph, choice, rank: int) -> list[int]:
    """Replace each tagged gradient reduce-scatter whose buffer ``choice.kind_for`` all-reduces;
    returns the bytes of each one replaced."""
    replaced = []
    for node in list(graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default)):
        if tag(node).get("role") not in _ROLES or len(node.users) != 1:
            continue
        wait = next(iter(node.users))
        if wait.target is not _c10d.wait_tensor.default:
            continue
        flat, reduce_op, world, group_name = node.args
        nbytes = tensor_nbytes(flat.meta["val"])
        if world <= 1 or choice.kind_for(nbytes) != "all_reduce":
            continue
        chunk = flat.meta["val"].shape[0] // world
        tags = {k: v for k, v in tag(node).items() if k in ("params", "param", "bucket")}
        with graph.inserting_before(node):
            reduced = call(graph, _c10d.all_reduce.default, (flat, reduce_op, group_name), role="grad_all_reduce",
                           **tags)
        with graph.inserting_before(wait):
            waited = call(graph, _c10d.wait_tensor.default, (reduced,), role="grad_all_reduce_wait", **tags)
            mine = call(graph, _aten.slice.Tensor, (waited, 0, rank * chunk, (rank + 1) * chunk),
                        role="grad_all_reduce_slice", **tags)
        wait.replace_all_uses_with(mine)
        graph.erase_node(wait)
        graph.erase_node(node)
        replaced.append(nbytes)
    return replaced


def all_reduce_gradients(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    choice = ctx.gradient_reduction
    if choice is None or not choice.uses_all_reduce() or ctx.group.world == 1:
        ctx.results["all_reduce_gradients"] = {"replaced": 0, "bytes": 0}
        return gm
    replaced = reduce_scatters_as_all_reduces(gm.graph, choice, ctx.group.rank)
    ctx.results["all_reduce_gradients"] = {"replaced": len(replaced), "bytes": sum(replaced)}
    ctx.logger.debug("[%s] all_reduce_gradients: %d reduce-scatters (%d bytes) became all-reduces", ctx.frame,
                     len(replaced), sum(replaced))
    return gm
