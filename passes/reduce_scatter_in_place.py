"""Pass (backward graphs, stages 2 and 3): a gradient bucket is reduce-scattered in its own memory.

On CPU ranks every reduce-scatter copies its whole input before it starts: gloo's is an
all-reduce of a clone of the input, and the point-to-point one sends from a copy where inductor
compiles the graph (``runtime/in_place_reduction.py`` says why). A gradient bucket is made for its
reduction alone (``zerocompile::pack_gradients``, whose only reader is the reduce-scatter), so the
copy is a second bucket held until the wait, at the point of the backward where gradients and
saved activations are both live, and a pass over the bucket's memory.

Each such reduce-scatter ``R = reduce_scatter(pack, "sum", world, group)`` over the data-parallel
group, with its wait ``W = wait_tensor(R)``, becomes

    reduce_scatter_in_place(pack, "sum", world, group, kind)     # where R was
    W' = wait_tensor(pack)                                       # where W was
    mine = W'[rank * chunk : (rank + 1) * chunk]                 # what W's users read

``kind`` is what the frame's ``gradient_reduction`` chose for the bucket: ``"reduce_scatter"``
(the collective, left by ``point_to_point_collectives``; over gloo only: it becomes gloo's
all-reduce of the bucket itself, the collective gloo's reduce-scatter runs on its copy), or
``"point_to_point"`` / ``"shared_memory"`` (``zerocompile::reduce_scatter_point_to_point``,
placed by ``point_to_point_collectives``; now sent straight from the bucket). The values are those
of the reduce-scatter bit for bit; the bytes counted are its bytes.

The bucket now lives to the wait's readers (the graph holds it, and the memory tracker sees it):
where every reader of ``mine`` is a division into a new tensor (``zerocompile::divide_reduced``,
the average over ranks, whether of the bucket or of each member), it is freed after them; where
some reader could keep a view of it (a gradient not divided), ``mine`` is a copy of the row
(``chunk`` elements, what gloo copies out of its all-reduce), so no reduced gradient holds the whole
bucket. Only CPU buckets over the data-parallel group, and for ``"reduce_scatter"`` only where the
group's backend is gloo (or torch's fake group of ``zerocompile plan``): NCCL's reduce-scatter
takes no copy. Runs after ``point_to_point_collectives``, so buckets, prefetch and the place of
each wait are kept.

Stage 2's buckets that ``all_reduce_gradients`` all-reduces (``gradient_reduction`` chose the
all-reduce for their size) are the same case: the functional all-reduce returns a new tensor, the
bucket's clone all-reduced; it becomes torch's in-place ``all_reduce_`` of the bucket
(``all_reduces_in_place``; any backend's all-reduce runs in place, CPU buckets only as above).

Results: ``{"replaced": n, "bytes": b, "copied": c, "all_reduce": {"replaced": n, "bytes": b}}``
per graph kind (``copied``: the rows copied out for a reader that is not a division).
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile import _torch_compat
from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import call, tag, tensor_nbytes
from zerocompile.runtime import bucket_ops, in_place_reduction, point_to_point  # noqa: F401 - register the ops below

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_PACK = torch.ops.zerocompile.pack_gradients.default
_DIVIDE = torch.ops.zerocompile.divide_reduced.default
_POINT_TO_POINT = torch.ops.zerocompile.reduce_scatter_point_to_point.default
_IN_PLACE = torch.ops.zerocompile.reduce_scatter_in_place.default
_ROLES = ("grad_reduce_scatter", "bucket_reduce_scatter")
_VIEWS = (_aten.slice.Tensor, _aten.view.default, _aten.reshape.default)


def _kind(node: torch.fx.Node, collective_backend: str | None) -> str | None:
    """The in-place op's ``kind`` for reduce-scatter ``node``, or None where it stays."""
    if node.target is _POINT_TO_POINT:
        return "shared_memory" if len(node.args) > 5 and node.args[5] else "point_to_point"
    if node.target is _c10d.reduce_scatter_tensor.default and collective_backend in ("gloo", "fake"):
        return "reduce_scatter"
    return None


def _only_divided(node: torch.fx.Node) -> bool:
    """Whether every reader of ``node`` (through slices and views) is a ``divide_reduced``:
    no reader then keeps a view of it past the divisions."""
    for user in node.users:
        if user.target is _DIVIDE and user.args[0] is node:
            continue
        if user.target in _VIEWS and user.args[0] is node and _only_divided(user):
            continue
        return False
    return bool(node.users)


def reduce_scatters_in_place(graph: torch.fx.Graph, group_name: str, rank: int,
                             collective_backend: str | None) -> dict:
    """Rewrite each gradient bucket's reduce-scatter over ``group_name`` as the module docstring
    says; ``collective_backend``: the group's backend for CPU tensors (``"gloo"``, ``"fake"``...).
    Returns ``{"replaced", "bytes", "copied"}``."""
    out = {"replaced": 0, "bytes": 0, "copied": 0}
    targets = (_c10d.reduce_scatter_tensor.default, _POINT_TO_POINT)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in targets]:
        flat, reduce_op, world, name = node.args[:4]
        if (tag(node).get("role") not in _ROLES or name != group_name or world <= 1 or reduce_op != "sum"
                or len(node.users) != 1):
            continue
        wait = next(iter(node.users))
        kind = _kind(node, collective_backend)
        val = flat.meta.get("val") if isinstance(flat, torch.fx.Node) else None
        if (kind is None or wait.target is not _c10d.wait_tensor.default or val is None
                or flat.target is not _PACK or len(flat.users) != 1 or val.device.type != "cpu"):
            continue
        chunk = val.shape[0] // world
        tags = {k: v for k, v in tag(node).items() if k in ("role", "params", "param", "bucket")}
        with graph.inserting_before(node):
            started = graph.call_function(_IN_PLACE, (flat, reduce_op, world, name, kind))
        started.meta["val"] = None
        started.meta["zerocompile"] = tags
        with graph.inserting_before(wait):
            waited = call(graph, _c10d.wait_tensor.default, (flat,), **tag(wait))
            mine = call(graph, _aten.slice.Tensor, (waited, 0, rank * chunk, (rank + 1) * chunk),
                        **{**tag(wait), "role": "grad_reduce_scatter_row"})
        wait.replace_all_uses_with(mine)
        graph.erase_node(wait)
        graph.erase_node(node)
        if not _only_divided(mine):
            with graph.inserting_after(mine):
                copy = call(graph, _aten.clone.default, (mine,), **tag(mine))
            mine.replace_all_uses_with(copy, delete_user_cb=lambda user: user is not copy)
            out["copied"] += 1
        out["replaced"] += 1
        out["bytes"] += tensor_nbytes(val)
    return out


def all_reduces_in_place(graph: torch.fx.Graph, group_name: str) -> dict:
    """Stage 2's buckets that ``all_reduce_gradients`` all-reduces (``all_reduce(pack)``, its wait,
    this rank's slice of the result): the functional all-reduce returns a new tensor, a clone of
    the bucket all-reduced, so it becomes ``all_reduce_(pack)`` in place and the slice reads the
    bucket after ``wait_tensor(pack)``. The slice was a view of the clone; it is one of the bucket,
    which lives as long as the clone did. Returns ``{"replaced", "bytes"}``."""
    out = {"replaced": 0, "bytes": 0}
    for node in list(graph.find_nodes(op="call_function", target=_c10d.all_reduce.default)):
        flat, reduce_op, name = node.args
        val = flat.meta.get("val") if isinstance(flat, torch.fx.Node) else None
        if (tag(node).get("role") != "grad_all_reduce" or name != group_name or len(node.users) != 1 or val is None
                or flat.target is not _PACK or len(flat.users) != 1 or val.device.type != "cpu"):
            continue
        wait = next(iter(node.users))
        if wait.target is not _c10d.wait_tensor.default:
            continue
        with graph.inserting_before(node):
            started = call(graph, _c10d.all_reduce_.default, (flat, reduce_op, name), **tag(node))
        with graph.inserting_before(wait):
            waited = call(graph, _c10d.wait_tensor.default, (flat,), **tag(wait))
        assert not started.users
        wait.replace_all_uses_with(waited)
        graph.erase_node(wait)
        graph.erase_node(node)
        out["replaced"] += 1
        out["bytes"] += tensor_nbytes(val)
    return out


def reduce_scatter_in_place(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    results = ctx.results.setdefault("reduce_scatter_in_place", {})
    if ctx.group.world == 1:
        results[ctx.graph_kind] = {"replaced": 0, "bytes": 0, "copied": 0, "all_reduce": {"replaced": 0, "bytes": 0}}
        return gm
    backend = _torch_compat.collective_backend(ctx.group.name, torch.device("cpu"))
    results[ctx.graph_kind] = reduce_scatters_in_place(gm.graph, ctx.group.name, ctx.group.rank, backend)
    results[ctx.graph_kind]["all_reduce"] = all_reduces_in_place(gm.graph, ctx.group.name)
    gm.recompile()
    ctx.logger.debug("[%s] reduce_scatter_in_place (%s): %s", ctx.frame, ctx.graph_kind, results[ctx.graph_kind])
    return gm
