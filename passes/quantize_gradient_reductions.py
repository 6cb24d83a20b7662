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
(passes/analyses/collective_summary.py), each hop with its own group size.
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


def _hop(graph: torch.fx.Graph, rows: torch.fx.Node, ranks: int, n: int, group_name: str, dtype: torch.dtype,
         divisor: float, exchange_before: torch.fx.Node, wait: torch.fx.Node, tags: dict, names: dict,
         hop: str | None) -> torch.fx.Node:
    """One quantized exchange: the all-to-all of ``rows`` (``ranks`` rows of ``n`` elements each)
    over ``group_name``, started before ``exchange_before`` and tagged ``tags``; then, before the
    reduce-scatter's ``wait``, its own wait and the float32 sum of the rows received, as
    ``dtype`` divided by ``divisor``. Returns the sum's node."""
    extra = {"hop": hop} if hop is not None else {}
    row = quantization.bucket_layout(n, quantization.BLOCK)[2]
    with graph.inserting_before(exchange_before):
        exchanged = call(graph, _ALL_TO_ALL, (rows, [row] * ranks, [row] * ranks, group_name), quantized=True,
                         **extra, **tags)
    with graph.inserting_before(wait):
        done = call(graph, _WAIT, (exchanged,), **{**tag(wait), "quantized": True, **extra})
        return call(graph, _DEQUANTIZE_REDUCE, (done, ranks, n, quantization.BLOCK, dtype, divisor),
                    role="bucket_unpack", quantized=True, **extra, **names)


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, wait: torch.fx.Node, hops: tuple | None) -> bool:
    inp, reduce_op, world, group_name = node.args
    val = inp.meta["val"]
    if reduce_op not in ("sum", "avg") or val.dtype not in quantization.FLOAT_DTYPES or val.numel() % world:
        return False
    fused = inp.target is _PACK_GRADIENTS and len(inp.users) == 1
    grads = list(inp.args[0]) if fused else [inp]
    n = val.numel() // world
    tags = dict(tag(node))                       # the reduce-scatter's role, bucket and parameters
    names = {k: v for k, v in tags.items() if k in ("bucket", "param", "params")}
    divisor = float(world) if reduce_op == "avg" else 1.0
    if hops is not None and hops[0] != group_name:
        hops = None                  # a reduction over another group than the one hpZ splits
    if hops is None:
        with graph.inserting_before(inp if fused else node):
            rows = call(graph, _QUANTIZE_ROWS, (grads, world, quantization.BLOCK), role="bucket_pack",
                        quantized=True, **names)
        reduced = _hop(graph, rows, world, n, group_name, val.dtype, divisor, node, wait, tags, names, None)
    else:
        # hierarchical (hpZ groups of k): within the group, then across groups, with the
        # partial sum in float32 between the hops; see the module docstring
        _, k, intra, cross = hops
        groups = world // k
        with graph.inserting_before(inp if fused else node):
            rows = call(graph, _QUANTIZE_ROWS, (grads, k, quantization.BLOCK, groups), role="bucket_pack",
                        quantized=True, hop="group", **names)
        partial = _hop(graph, rows, k, groups * n, intra, torch.float32, 1.0, node, wait, tags, names, "group")
        with graph.inserting_before(wait):
            rows = call(graph, _QUANTIZE_ROWS, ([partial], groups, quantization.BLOCK), role="bucket_pack",
                        quantized=True, hop="across", **names)
        reduced = _hop(graph, rows, groups, n, cross, val.dtype, divisor, wait, wait, tags, names, "across")
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


def quantize_gradient_reductions(gm: torch.fx.GraphModule, ctx: PassContext, *, zero_hpz_partition_size: int,
                                 **_) -> torch.fx.GraphModule:
    k, group = zero_hpz_partition_size, ctx.group
    hops = None
    if 1 < k < group.world and group.world % k == 0:   # (a k that does not divide: hierarchical_partition refused it)
        hops = (group.name, k, comm.hpz_subgroup(group, k).name, comm.hpz_cross_subgroup(group, k).name)
    report = quantize_reductions(gm.graph, hops)
    ctx.results.setdefault("quantize_gradient_reductions", {})[ctx.graph_kind] = report
    ctx.logger.debug("[%s] quantize_gradient_reductions (%s): %s", ctx.frame, ctx.graph_kind, report)
    gm.recompile()
    return gm
