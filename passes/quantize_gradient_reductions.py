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

With hpZ (``zero_hpz_partition_size = k``, ``1 < k < N``, ``G = N / k`` groups of ``k``
consecutive ranks), a reduction over the default group runs in two hops, as ZeRO++'s
hierarchical all-to-all, so that only ``1/k`` of the bytes cross between groups (nodes):

- hop 1, within the group: ``quantize_rows(grads, k, BLOCK, groups=G)`` makes ``k`` rows, row
  ``i`` holding the chunks of ranks ``h*k + i`` for every group ``h`` (``[G, n]``); an
  all-to-all over hpZ's group (runtime/comm.hpz_subgroup); ``dequantize_reduce`` sums the
  ``k`` rows received into float32: the group's partial sum of those chunks;
- hop 2, across the groups: ``quantize_rows([partial], G, BLOCK)``, row ``h`` for the rank at
  this rank's position in group ``h``; an all-to-all over those ranks (``hpz_cross_subgroup``);
  ``dequantize_reduce`` into the reduce-scatter's dtype, divided by ``N`` for ``avg``.

The new nodes keep the roles of those they replace, with ``quantized=True`` (and ``hop``
``"group"`` / ``"across"`` for the two hops), so ``prefetch`` moves the waits as before.
Byte accounting counts the all-to-all as the reduce-scatter it implements
(passes/collective_summary.py), each hop with its own group size.
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import call, stable_topological_sort, tag
from zerocompile.runtime import bucket_ops  # noqa: F401 - registers zerocompile::pack_gradients
from zerocompile.runtime import comm, quantization

_c10d = torch.ops._c10d_functional
_REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
_ALL_TO_ALL = _c10d.all_to_all_single.default
_WAIT = _c10d.wait_tensor.default
_PACK_GRADIENTS = torch.ops.zerocompile.pack_gradients.default
_QUANTIZE_ROWS = torch.ops.zerocompile.quantize_rows.default
_DEQUANTIZE_REDUCE = torch.ops.zerocompile.dequantize_reduce.default


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, wait: torch.fx.Node, hops: tuple | None) -> bool:
    inp, reduce_op, world, group_name = node.args
    val = inp.meta["val"]
    if reduce_op not in ("sum", "avg") or val.dtype not in quantization.FLOAT_DTYPES or val.numel() % world:
        return False
    fused = inp.target is _PACK_GRADIENTS and len(inp.users) == 1
    grads = list(inp.args[0]) if fused else [inp]
    n = val.numel() // world
    info = {k: v for k, v in tag(node).items() if k != "role"}
    names = {k: v for k, v in info.items() if k in ("bucket", "param", "params")}
    role = tag(node).get("role")
    divisor = float(world) if reduce_op == "avg" else 1.0
    if hops is not None and hops[0] != group_name:
        hops = None                  # a reduction over another group than the one hpZ splits
    if hops is None:
        row = quantization.bucket_layout(n, quantization.BLOCK)[2]
        with graph.inserting_before(inp if fused else node):
            rows = call(graph, _QUANTIZE_ROWS, (grads, world, quantization.BLOCK), role="bucket_pack",
                        quantized=True, **names)
        with graph.inserting_before(node):
            exchanged = call(graph, _ALL_TO_ALL, (rows, [row] * world, [row] * world, group_name),
                             role=role, quantized=True, **info)
        with graph.inserting_before(wait):
            new_wait = call(graph, _WAIT, (exchanged,), **{**tag(wait), "quantized": True})
        with graph.inserting_after(new_wait):
            reduced = call(graph, _DEQUANTIZE_REDUCE, (new_wait, world, n, quantization.BLOCK, val.dtype, divisor),
                           role="bucket_unpack", quantized=True, **names)
    else:
        # hierarchical (hpZ groups of k): within the group, then across groups, with the
        # partial sum in float32 between the hops; see the module docstring
        _, k, intra, cross = hops
        groups = world // k
        row1 = quantization.bucket_layout(groups * n, quantization.BLOCK)[2]
        row2 = quantization.bucket_layout(n, quantization.BLOCK)[2]
        with graph.inserting_before(inp if fused else node):
            rows = call(graph, _QUANTIZE_ROWS, (grads, k, quantization.BLOCK, groups), role="bucket_pack",
                        quantized=True, hop="group", **names)
        with graph.inserting_before(node):
            first = call(graph, _ALL_TO_ALL, (rows, [row1] * k, [row1] * k, intra), role=role, quantized=True,
                         hop="group", **info)
        with graph.inserting_before(wait):
            first_wait = call(graph, _WAIT, (first,), **{**tag(wait), "quantized": True, "hop": "group"})
            partial = call(graph, _DEQUANTIZE_REDUCE,
                           (first_wait, k, groups * n, quantization.BLOCK, torch.float32, 1.0),
                           role="bucket_unpack", quantized=True, hop="group", **names)
            rows2 = call(graph, _QUANTIZE_ROWS, ([partial], groups, quantization.BLOCK), role="bucket_pack",
                         quantized=True, hop="across", **names)
            second = call(graph, _ALL_TO_ALL, (rows2, [row2] * groups, [row2] * groups, cross), role=role,
                          quantized=True, hop="across", **info)
            new_wait = call(graph, _WAIT, (second,), **{**tag(wait), "quantized": True, "hop": "across"})
            reduced = call(graph, _DEQUANTIZE_REDUCE, (new_wait, groups, n, quantization.BLOCK, val.dtype, divisor),
                           role="bucket_unpack", quantized=True, hop="across", **names)
    wait.replace_all_uses_with(reduced)
    graph.erase_node(wait)
    graph.erase_node(node)
    if fused:
        graph.erase_node(inp)
    return True


def quantize_reductions(graph: torch.fx.Graph, hops: tuple | None = None) -> dict:
    """Rewrite the graph's gradient reduce-scatters; returns what was quantized and what was not.
    ``hops``: ``(group_name, k, intra_name, cross_name)`` to reduce the reduce-scatters over
    ``group_name`` in two hops (hpZ groups of ``k`` ranks), None for one."""
    quantized = left = 0
    for node in list(graph.nodes):
        if node.target is not _REDUCE_SCATTER or tag(node).get("role") not in ("bucket_reduce_scatter",
                                                                               "grad_reduce_scatter"):
            continue
        waits = list(node.users)
        done = len(waits) == 1 and waits[0].target is _WAIT and _rewrite(graph, node, waits[0], hops)
        quantized += done
        left += not done
    stable_topological_sort(graph)
    report = {"quantized": quantized, "left": left, "block": quantization.BLOCK}
    if hops is not None:
        report["hierarchical_k"] = hops[1]
    return report


def quantize_gradient_reductions(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    k, group = ctx.config.zero_hpz_partition_size, ctx.group
    hops = None
    if 1 < k < group.world and group.world % k == 0:   # (a k that does not divide: hierarchical_partition refused it)
        hops = (group.name, k, comm.hpz_subgroup(group, k).name, comm.hpz_cross_subgroup(group, k).name)
    report = quantize_reductions(gm.graph, hops)
    ctx.results.setdefault("quantize_gradient_reductions", {})[ctx.graph_kind] = report
    ctx.logger.debug("[%s] quantize_gradient_reductions (%s): %s", ctx.frame, ctx.graph_kind, report)
    gm.recompile()
    return gm
