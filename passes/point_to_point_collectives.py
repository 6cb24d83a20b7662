"""Pass (forward, backward and inference graphs, stages 2 and 3): collectives become
point-to-point transfers where those are faster.

Where the frame's ``ReductionChoice`` (``runtime/reduction_choice.py``) takes
``"point_to_point"`` or ``"shared_memory"`` (the same transfers through a shared-memory segment
when every rank is on one host, ``runtime/shared_memory.py``) for a collective's size, its node is replaced in place, with the same
arguments and metadata, by the op of ``runtime/point_to_point.py`` that moves the same bytes
between pairs of ranks:

- a parameter all-gather (stage 3; roles ``param_gather`` / ``bucket_gather``, ZeRO++'s
  quantized ones too, their int8 payload copied as it is), by the ``parameter_gather`` choice:
  ``zerocompile::all_gather_point_to_point``, every rank sends its shard to every other rank.
  Every element is copied, so the result is the all-gather's bit for bit. Through shared memory a
  bucket's gather (its wait read only by ``unpack_gathered_bucket``) becomes
  ``zerocompile::all_gather_point_to_point_unpacked``, which receives each parameter's shards
  straight into that parameter's own tensor, and each member gets a ``wait_tensor`` of its own
  where the bucket's wait was: the ``[world, bucket]`` rows and the copy out of them are gone (on
  the 6-block GPT of ``benchmarks/stage3_vs_fsdp2.py`` with inductor, the step's peak went from
  103.1 to 100.1 MiB per rank). Over sockets the bucket stays one message per peer, whose latency
  the rows' copy costs less than (a transfer per parameter would pay it per parameter).
- a gradient reduce-scatter (stages 2 and 3; roles ``grad_reduce_scatter`` /
  ``bucket_reduce_scatter``), by the ``gradient_reduction`` choice:
  ``zerocompile::reduce_scatter_point_to_point``, row ``r`` of the bucket goes to rank ``r``,
  which sums the rows it received in rank order; on two ranks the reduce-scatter's one addition,
  so its result bit for bit (on more ranks the same terms in a fixed order).

The ops send a copy of their input where inductor compiles the graph (it may reuse the input's
memory as soon as the op returns); graphs run op by op (``inner_compiler="eager"``) send the
input itself, which nothing writes before the wait (``copy_input``, ``runtime/point_to_point.py``).

Each node's ``wait_tensor`` stays where it was and waits for the transfers, so buckets, prefetch
distances and the memory the passes planned are unchanged. Only collectives over the
data-parallel group are replaced (an hpZ group's are not).

Runs last, after ``bucketing``, ``prefetch`` and ``all_reduce_gradients`` have placed and chosen
every collective. The collective summaries count the new ops as the collectives they replace
(``passes/analyses/collective_summary.py``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import tag, tensor_nbytes
from zerocompile.runtime import bucket_ops, point_to_point  # noqa: F401 - register the zerocompile:: ops below

_c10d = torch.ops._c10d_functional
_GATHER = torch.ops.zerocompile.all_gather_point_to_point.default
_GATHER_UNPACKED = torch.ops.zerocompile.all_gather_point_to_point_unpacked.default
_UNPACK = torch.ops.zerocompile.unpack_gathered_bucket.default
_REDUCE = torch.ops.zerocompile.reduce_scatter_point_to_point.default
_GATHER_ROLES = ("param_gather", "bucket_gather")
_REDUCE_ROLES = ("grad_reduce_scatter", "bucket_reduce_scatter")


def collectives_as_point_to_point(graph: torch.fx.Graph, choice, group_name: str, copy_input: bool = True) -> dict:
    """Replace each parameter all-gather and gradient reduce-scatter over ``group_name`` that
    ``choice`` sends point to point (``gather_kind_for`` of the gathered bytes, ``kind_for`` of
    the reduced buffer's bytes); returns ``{"all_gather": [bytes...], "reduce_scatter": [...],
    "unpacked": n}``, ``n`` the bucket gathers received straight into their members (``_gather_unpacked``).
    ``copy_input``: the ops' argument of that name (False only for graphs run op by op). A
    ``"shared_memory"`` choice takes the same ops through the group's shared-memory segment
    (their ``shared_memory`` argument, ``runtime/shared_memory.py``)."""
    replaced = {"all_gather": [], "reduce_scatter": [], "unpacked": 0}
    for node in list(graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)):
        _, world, name = node.args
        if tag(node).get("role") not in _GATHER_ROLES or name != group_name or world <= 1:
            continue
        nbytes = tensor_nbytes(node.meta["val"])
        kind = choice.gather_kind_for(nbytes)
        if kind in point_to_point.KINDS:
            if kind == "shared_memory" and _gather_unpacked(graph, node, copy_input):
                replaced["unpacked"] += 1
            else:
                node.target = _GATHER
                node.args = (*node.args, copy_input, kind == "shared_memory")
            replaced["all_gather"].append(nbytes)
    for node in list(graph.find_nodes(op="call_function", target=_c10d.reduce_scatter_tensor.default)):
        flat, reduce_op, world, name = node.args
        if tag(node).get("role") not in _REDUCE_ROLES or name != group_name or world <= 1 or reduce_op != "sum":
            continue
        nbytes = tensor_nbytes(flat.meta["val"])
        kind = choice.kind_for(nbytes)
        if kind in point_to_point.KINDS:
            node.target = _REDUCE
            node.args = (*node.args, copy_input, kind == "shared_memory")
            replaced["reduce_scatter"].append(nbytes)
    return replaced


def _gather_unpacked(graph: torch.fx.Graph, gather: torch.fx.Node, copy_input: bool) -> bool:
    """Where ``gather`` is a bucket's (its wait read only by ``unpack_gathered_bucket``), put one
    ``zerocompile::all_gather_point_to_point_unpacked`` through shared memory in place of the
    three, each member waited for where the bucket was: the transfers land in the members, so
    neither the gathered rows nor the copy out of them exist (a bucket's size less at the
    gather, and one copy of it less). Returns whether it did."""
    waits = list(gather.users)
    if len(waits) != 1 or waits[0].target is not _c10d.wait_tensor.default:
        return False
    wait = waits[0]
    unpacks = list(wait.users)
    if len(unpacks) != 1 or unpacks[0].target is not _UNPACK or unpacks[0].args[0] is not wait:
        return False
    unpack = unpacks[0]
    members = list(unpack.users)
    x, world, name = gather.args
    chunks = unpack.args[2]
    # every member read (each gets the wait that completes it: none is left registered unwaited)
    if any(m.target is not operator.getitem for m in members) or {m.args[1] for m in members} != set(
            range(len(chunks))):
        return False
    with graph.inserting_before(gather):
        fused = graph.call_function(_GATHER_UNPACKED, (x, world, name, list(chunks), copy_input, True))
    fused.meta = {**gather.meta, "val": unpack.meta["val"]}
    for member in members:
        with graph.inserting_before(gather):
            piece = graph.call_function(operator.getitem, (fused, member.args[1]))
        piece.meta = dict(member.meta)
        with graph.inserting_before(wait):
            waited = graph.call_function(_c10d.wait_tensor.default, (piece,))
        waited.meta = {**wait.meta, "val": member.meta["val"]}
        member.replace_all_uses_with(waited)
        graph.erase_node(member)
    graph.erase_node(unpack)
    graph.erase_node(wait)
    graph.erase_node(gather)
    return True


def point_to_point_collectives(gm: torch.fx.GraphModule, ctx: PassContext, copy_input: bool = True,
                               **_) -> torch.fx.GraphModule:
    """``copy_input``: the transfers send a copy of their input (False only where the graphs run
    op by op, ``inner_compiler="eager"``)."""
    choice = ctx.gradient_reduction
    results = ctx.results.setdefault("point_to_point_collectives", {})
    if choice is None or ctx.group.world == 1 or not set(point_to_point.KINDS) & {*choice.gather_kinds, *choice.kinds}:
        results[ctx.graph_kind] = {kind: {"replaced": 0, "bytes": 0} for kind in ("all_gather", "reduce_scatter")}
        results[ctx.graph_kind]["all_gather"]["unpacked"] = 0
        return gm
    replaced = collectives_as_point_to_point(gm.graph, choice, ctx.group.name, copy_input=copy_input)
    gm.recompile()
    unpacked = replaced.pop("unpacked")
    results[ctx.graph_kind] = {kind: {"replaced": len(b), "bytes": sum(b)} for kind, b in replaced.items()}
    results[ctx.graph_kind]["all_gather"]["unpacked"] = unpacked
    ctx.logger.debug("[%s] point_to_point_collectives (%s): %s", ctx.frame, ctx.graph_kind, results[ctx.graph_kind])
    return gm
