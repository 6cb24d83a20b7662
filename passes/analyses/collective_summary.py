"""Analysis: the collectives of a graph, by kind, with the bytes of their full buffers."""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.graph_utils import tensor_nbytes
from zerocompile.runtime import in_place_reduction, point_to_point  # noqa: F401  (register the zerocompile:: ops)
from zerocompile.runtime.accounting import CollectiveSummary

_c10d = torch.ops._c10d_functional

# kind, and which tensor's size counts: the output of an all-gather, the input of the others
COLLECTIVE_KINDS_BY_OP = {
    _c10d.all_gather_into_tensor.default: ("all_gather", "out"),
    _c10d.all_gather_into_tensor_out.default: ("all_gather", "out"),
    _c10d.reduce_scatter_tensor.default: ("reduce_scatter", "in"),
    _c10d.all_reduce.default: ("all_reduce", "in"),
    _c10d.all_reduce_.default: ("all_reduce", "in"),
    # zerocompile issues an all-to-all only as a quantized gradient reduce-scatter (qgZ,
    # passes/quantize_gradient_reductions.py): it sends what a reduce-scatter of its input would
    _c10d.all_to_all_single.default: ("reduce_scatter", "in"),
    # point-to-point transfers (passes/point_to_point_collectives.py): the bytes of what they replace
    torch.ops.zerocompile.all_gather_point_to_point.default: ("all_gather", "out"),
    torch.ops.zerocompile.all_gather_point_to_point_unpacked.default: ("all_gather", "out"),   # its outputs together
    torch.ops.zerocompile.reduce_scatter_point_to_point.default: ("reduce_scatter", "in"),
    # a gradient bucket reduce-scattered in its own memory (passes/reduce_scatter_in_place.py)
    torch.ops.zerocompile.reduce_scatter_in_place.default: ("reduce_scatter", "in"),
}


def collective_group_size(op, args: tuple, world: int) -> int:
    """Ranks in the group of a functional collective ``op`` called with ``args`` (an
    all-reduce does not say: ``world``, the data-parallel group's, the only group zerocompile
    all-reduces over)."""
    if op in (_c10d.all_reduce.default, _c10d.all_reduce_.default):
        return world
    if op is _c10d.all_to_all_single.default:
        return len(args[1])
    if op in (_c10d.reduce_scatter_tensor.default, torch.ops.zerocompile.reduce_scatter_point_to_point.default,
              torch.ops.zerocompile.reduce_scatter_in_place.default):
        return args[2]
    return args[1]           # all-gathers: (input, group_size, group_name)


def summarize_collectives(graph: torch.fx.Graph, world: int = 1) -> CollectiveSummary:
    """Count and size every functional collective in ``graph`` (needs ``meta["val"]``);
    ``world``: the data-parallel group's size (see ``collective_group_size``)."""
    summary = CollectiveSummary()
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in COLLECTIVE_KINDS_BY_OP:
            continue
        kind, which = COLLECTIVE_KINDS_BY_OP[node.target]
        src = node if which == "out" else node.args[0]
        vals = src.meta.get("val")
        vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
        if not vals or any(v is None for v in vals):
            raise RuntimeError(f"zerocompile: collective node {node} has no shape metadata")
        summary.add(kind, sum(tensor_nbytes(v) for v in vals), dtype=str(vals[0].dtype).removeprefix("torch."),
                    group_size=collective_group_size(node.target, node.args, world))
    return summary
