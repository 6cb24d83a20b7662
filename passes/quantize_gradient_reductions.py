"""Pass (backward graphs, stages 2 and 3, ``zero_quantized_gradients``): ZeRO++ qgZ, each
gradient reduce-scatter becomes a quantized all-to-all and a local reduction.

It runs after ``bucketing`` and before ``prefetch``, and rewrites each gradient reduce-scatter
(role ``bucket_reduce_scatter`` or ``grad_reduce_scatter``, op ``sum`` or ``avg``, a
floating-point buffer):

- the bucket's ``pack_gradients(grads, world)`` (or a lone gradient's padded flat buffer)
  becomes ``quantize_rows(grads, world, BLOCK)``: one quantized row (int8 values and float32
  block scales, runtime/quantization.py) per destination rank, row ``r`` holding what rank
  ``r`` reduces;
- the reduce-scatter becomes an ``all_to_all_single`` of the rows: each rank receives the row
  every rank quantized for it (as many bytes leave each rank as a reduce-scatter of the
  int8 buffer would send);
- its wait is followed by ``dequantize_reduce``, which sums the received rows in float32 in
  rank order (divided by the world size for ``avg``) into the dtype the reduce-scatter had.
  What read the reduce-scatter's result (the division by the world size, the slices of each
  parameter's chunk) reads this instead.

The new nodes keep the roles of those they replace, with ``quantized=True``, so ``prefetch``
moves the waits as before. Byte accounting counts the all-to-all as the reduce-scatter it
implements (passes/collective_summary.py).
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import call, stable_topological_sort, tag
from zerocompile.runtime import bucket_ops  # noqa: F401 - registers zerocompile::pack_gradients
from zerocompile.runtime import quantization

_c10d = torch.ops._c10d_functional
_REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
_ALL_TO_ALL = _c10d.all_to_all_single.default
_WAIT = _c10d.wait_tensor.default
_PACK_GRADIENTS = torch.ops.zerocompile.pack_gradients.default
_QUANTIZE_ROWS = torch.ops.zerocompile.quantize_rows.default
_DEQUANTIZE_REDUCE = torch.ops.zerocompile.dequantize_reduce.default


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, wait: torch.fx.Node) -> bool:
    inp, reduce_op, world, group_name = node.args
    val = inp.meta["val"]
    if reduce_op not in ("sum", "avg") or val.dtype not in quantization.FLOAT_DTYPES or val.numel() % world:
        return False
    fused = inp.target is _PACK_GRADIENTS and len(inp.users) == 1
    grads = list(inp.args[0]) if fused else [inp]
    n = val.numel() // world
    row = quantization.bucket_layout(n, quantization.BLOCK)[2]
    info = {k: v for k, v in tag(node).items() if k != "role"}
    names = {k: v for k, v in info.items() if k in ("bucket", "param", "params")}
    with graph.inserting_before(inp if fused else node):
        rows = call(graph, _QUANTIZE_ROWS, (grads, world, quantization.BLOCK), role="bucket_pack", quantized=True,
                    **names)
    with graph.inserting_before(node):
        exchanged = call(graph, _ALL_TO_ALL, (rows, [row] * world, [row] * world, group_name),
                         role=tag(node).get("role"), quantized=True, **info)
    with graph.inserting_before(wait):
        new_wait = call(graph, _WAIT, (exchanged,), **{**tag(wait), "quantized": True})
    with graph.inserting_after(new_wait):
        reduced = call(graph, _DEQUANTIZE_REDUCE,
                       (new_wait, world, n, quantization.BLOCK, val.dtype, float(world) if reduce_op == "avg" else 1.0),
                       role="bucket_unpack", quantized=True, **names)
    wait.replace_all_uses_with(reduced)
    graph.erase_node(wait)
    graph.erase_node(node)
    if fused:
        graph.erase_node(inp)
    return True


def quantize_reductions(graph: torch.fx.Graph) -> dict:
    """Rewrite the graph's gradient reduce-scatters; returns what was quantized and what was not."""
    quantized = left = 0
    for node in list(graph.nodes):
        if node.target is not _REDUCE_SCATTER or tag(node).get("role") not in ("bucket_reduce_scatter",
                                                                               "grad_reduce_scatter"):
            continue
        waits = list(node.users)
        done = len(waits) == 1 and waits[0].target is _WAIT and _rewrite(graph, node, waits[0])
        quantized += done
        left += not done
    stable_topological_sort(graph)
    return {"quantized": quantized, "left": left, "block": quantization.BLOCK}


def quantize_gradient_reductions(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    report = quantize_reductions(gm.graph)
    ctx.results.setdefault("quantize_gradient_reductions", {})[ctx.graph_kind] = report
    ctx.logger.debug("[%s] quantize_gradient_reductions (%s): %s", ctx.frame, ctx.graph_kind, report)
    gm.recompile()
    return gm
