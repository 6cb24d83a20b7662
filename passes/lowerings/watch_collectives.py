"""Lowering (final graphs, ``collective_timeout_s`` on): every functional collective of the graph
becomes its watched op (``runtime/watched_collectives.py``), with its site.

Runs last on the forward, backward and inference graphs right before an inner compiler gets them
(after ``lower_collectives_for_backend`` and the timers, which stay where they are: the watched
op takes the collective's place, arguments and users). The ``wait_tensor`` nodes stay: c10d's
registry sends them to the watched wait. The site (``runtime/mismatch_report.py``) names the
frame, the graph, the collective's place among the graph's collectives, its kind, the bytes of
its full buffer (as ``zerocompile.stats()`` counts them) and the parameters it carries (its
``params`` tag). It is a constant of the graph: the same on every rank and in every cache entry
of the same graph.
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.analyses.collective_summary import COLLECTIVE_KINDS_BY_OP
from zerocompile.passes.graph_utils import tag, tensor_nbytes
from zerocompile.runtime import mismatch_report, watched_collectives  # noqa: F401  (registers the ops)

_c10d = torch.ops._c10d_functional
_zc = torch.ops.zerocompile


def watch_collectives(graph: torch.fx.Graph, graph_kind: str, *, frame: str) -> int:
    """Put the watched ops in place of ``graph``'s functional collectives (``graph_kind``:
    ``forward``, ``backward`` or ``inference``). Returns how many were replaced."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in _REPLACED]
    for index, node in enumerate(nodes):
        kind, which = COLLECTIVE_KINDS_BY_OP[node.target]
        val = (node if which == "out" else node.args[0]).meta.get("val")
        nbytes = tensor_nbytes(val) if val is not None else 0
        site = mismatch_report.site(frame, graph_kind, index, len(nodes), _KIND[node.target], nbytes,
                                    tag(node).get("params") or ())
        target, args = _watched(node, site)
        with graph.inserting_before(node):
            new = graph.call_function(target, args)
        new.meta.update(node.meta)
        # the in-place all-reduce returns its input, its watched twin nothing: readers read the input
        node.replace_all_uses_with(node.args[0] if node.target is _c10d.all_reduce_.default else new)
        buffer = node.kwargs.get("out")
        graph.erase_node(node)
        if isinstance(buffer, torch.fx.Node) and not buffer.users:
            graph.erase_node(buffer)
    return len(nodes)


def _watched(node: torch.fx.Node, site: str):
    a = node.args
    if node.target in (_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default):
        return _zc.watched_all_gather.default, (a[0], a[1], a[2], site)
    if node.target is _c10d.reduce_scatter_tensor.default:
        return _zc.watched_reduce_scatter.default, (a[0], a[1], a[2], a[3], site)
    if node.target is _c10d.all_reduce.default:
        return _zc.watched_all_reduce.default, (a[0], a[1], a[2], site)
    if node.target is _c10d.all_reduce_.default:
        return _zc.watched_all_reduce_.default, (a[0], a[1], a[2], site)
    return _zc.watched_all_to_all.default, (a[0], list(a[1]), list(a[2]), a[3], site)


_KIND = {
    _c10d.all_gather_into_tensor.default: "all_gather",
    _c10d.all_gather_into_tensor_out.default: "all_gather",
    _c10d.reduce_scatter_tensor.default: "reduce_scatter",
    _c10d.all_reduce.default: "all_reduce",
    _c10d.all_reduce_.default: "all_reduce",       # a stage-2 bucket's, in place (passes/reduce_scatter_in_place.py)
    _c10d.all_to_all_single.default: "all_to_all",
}
_REPLACED = tuple(_KIND)
