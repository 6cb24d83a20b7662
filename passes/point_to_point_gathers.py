"""Pass (forward, backward and inference graphs, stage 3): parameter all-gathers become
point-to-point transfers where those are faster.

Where the frame's ``ReductionChoice`` (``runtime/reduction_choice.py``, the ``parameter_gather``
option) takes ``"point_to_point"`` for a gather's size, its ``all_gather_into_tensor`` node is
replaced, in place and with the same arguments and metadata, by
``zerocompile::all_gather_point_to_point`` (``runtime/point_to_point.py``): every rank sends its
shard to every other rank and receives theirs. The result is the same tensor bit for bit (every
element copied), its ``wait_tensor`` stays where it was and waits for the transfers, so buckets,
prefetch distances and the memory the passes planned are unchanged. Only the parameter gathers
of the data-parallel group are replaced (roles ``param_gather`` / ``bucket_gather``, ZeRO++'s
quantized ones too: their int8 payload is copied as it is); an hpZ group's gathers are not.

Runs last, after ``bucketing`` and ``prefetch`` have placed every gather. The collective
summaries count the new op as the all-gather it replaces (``passes/collective_summary.py``).
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import tag, tensor_nbytes
from zerocompile.runtime import point_to_point  # noqa: F401  (registers zerocompile::all_gather_point_to_point)

_c10d = torch.ops._c10d_functional
_POINT_TO_POINT = torch.ops.zerocompile.all_gather_point_to_point.default
_ROLES = ("param_gather", "bucket_gather")


def gathers_as_point_to_point(graph: torch.fx.Graph, choice, group_name: str) -> list[int]:
    """Replace each parameter all-gather over ``group_name`` whose gathered size
    ``choice.gather_kind_for`` sends point to point; returns the gathered bytes of each one."""
    replaced = []
    for node in list(graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)):
        _, world, name = node.args
        if tag(node).get("role") not in _ROLES or name != group_name or world <= 1:
            continue
        nbytes = tensor_nbytes(node.meta["val"])
        if choice.gather_kind_for(nbytes) != "point_to_point":
            continue
        node.target = _POINT_TO_POINT
        replaced.append(nbytes)
    return replaced


def point_to_point_gathers(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    choice = ctx.gradient_reduction
    if choice is None or "point_to_point" not in choice.gather_kinds or ctx.group.world == 1:
        ctx.results.setdefault("point_to_point_gathers", {})[ctx.graph_kind] = {"replaced": 0, "bytes": 0}
        return gm
    replaced = gathers_as_point_to_point(gm.graph, choice, ctx.group.name)
    gm.recompile()
    ctx.results.setdefault("point_to_point_gathers", {})[ctx.graph_kind] = {"replaced": len(replaced),
                                                                           "bytes": sum(replaced)}
    ctx.logger.debug("[%s] point_to_point_gathers (%s): %d all-gathers (%d bytes) sent point to point",
                     ctx.frame, ctx.graph_kind, len(replaced), sum(replaced))
    return gm
