"""Pass (forward and backward graphs, stages 2 and 3): coalesce collectives into buckets.

One collective per parameter pays the collective's latency once per parameter. This
pass merges runs of consecutive tagged collectives of the same kind, dtype and group
into one collective on a flat bucket of at most ``bucket_mb``:

- parameter all-gathers (``param_gather``: forward, and backward re-gathers): the
  shards are concatenated (``zerocompile::pack_shards``), gathered once, and each parameter's full flat
  tensor is copied out of the ``[world, bucket]`` result by one op
  (``zerocompile::unpack_gathered_bucket``, role ``bucket_unpack``; runtime/bucket_ops.py
  says why it is not slices and clones). The
  bucket is gathered where its first member was, so later members arrive early. The
  first bucket of a graph holds at most an eighth of ``bucket_mb`` (and at least one
  parameter), so the first wait, which nothing can overlap, is short.
- gradient reduce-scatters (``grad_reduce_scatter``): each padded flat gradient is
  viewed as ``[world, chunk]``, the rows are concatenated along dim 1
  (``zerocompile::pack_gradients``), reduced once, divided by the world size once (where
  each member was; ``zerocompile::divide_reduced``, also for a reduce-scatter left alone), and
  each parameter's chunk is a slice of the result. The bucket is reduced where its
  last member's gradient is ready.

Buckets follow the model's blocks: a bucket that already holds at least ``1/16`` of
``bucket_mb`` is closed where the members pass from one numbered block to the next (a
parameter's block is its name up to its first numeric part: ``blocks.3``, ``model.layers.3``,
``transformer.h.3``). Without that, one backward bucket could gather most of a small model at
once (a 25 MiB cap holds six 3 MiB blocks), at the point where the activations peak; FSDP2
gathers one wrapped block at a time for the same reason. Small blocks still share a bucket, so
a model of many tiny layers does not pay a collective's latency per layer.

Members keep graph order (in forward that is first-use order, the same on every rank).
The values are bitwise those of the unbucketed collectives: concatenation and
slicing copy elements, and each element is reduced over the same ranks.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import call, set_tag, stable_topological_sort, tag, tensor_nbytes
from zerocompile.runtime import bucket_ops  # noqa: F401 - registers the zerocompile:: bucket ops below

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_UNPACK = torch.ops.zerocompile.unpack_gathered_bucket.default
_PACK_SHARDS = torch.ops.zerocompile.pack_shards.default
_PACK_GRADIENTS = torch.ops.zerocompile.pack_gradients.default
_DIVIDE = torch.ops.zerocompile.divide_reduced.default
_MB = 2**20
FIRST_BUCKET_FRACTION = 1 / 8
BLOCK_BUCKET_FRACTION = 1 / 16
"""A bucket holding at least this fraction of the cap is closed at a block boundary."""
_NAME_PARTS = re.compile(r"[._]")


def block_of(name: str | None) -> str | None:
    """The numbered block a parameter belongs to: its name up to and including the first
    all-digit part (``blocks.3.attn.qkv.weight`` -> ``blocks.3``); None when it has none
    (an embedding, the final norm) or no name."""
    if not name:
        return None
    parts = _NAME_PARTS.split(name)
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return None


@dataclass
class Member:
    """One per-parameter collective: the collective node, its input and its wait."""

    coll: torch.fx.Node
    inp: torch.fx.Node
    wait: torch.fx.Node
    nbytes: int
    block: str | None = None
    """The numbered block of the member's parameter (``block_of``); None: not in one."""

    @property
    def key(self) -> tuple:
        val = self.inp.meta["val"]
        return (val.dtype, *self.coll.args[1:])  # dtype, (reduce op,) world, group name


@dataclass
class Bucket:
    members: list = field(default_factory=list)
    nbytes: int = 0


def _members(graph: torch.fx.Graph, role: str) -> list[Member]:
    out = []
    for node in graph.nodes:
        if tag(node).get("role") != role:
            continue
        waits = [u for u in node.users if u.target is _c10d.wait_tensor.default]
        if len(waits) != 1 or len(node.users) != 1:
            continue
        size_of = node if role == "param_gather" else node.args[0]
        out.append(Member(node, node.args[0], waits[0], tensor_nbytes(size_of.meta["val"]),
                          block_of(tag(node).get("param"))))
    return out


def _crosses_block(bucket: Bucket, m: Member, block_min_bytes: int | None) -> bool:
    """Whether ``m`` starts a new numbered block after a bucket already large enough to close."""
    if block_min_bytes is None or m.block is None or bucket.nbytes < block_min_bytes:
        return False
    last = next((b.block for b in reversed(bucket.members) if b.block is not None), None)
    return last is not None and last != m.block


def plan_buckets(members: list[Member], cap_bytes: int, first_cap_bytes: int | None = None,
                 block_min_bytes: int | None = None) -> list[Bucket]:
    """Group consecutive members with the same key into buckets of at most ``cap_bytes``
    (the first at most ``first_cap_bytes``); a member larger than the cap is alone. With
    ``block_min_bytes``, a bucket of at least that many bytes is also closed where a member
    of another numbered block comes (``Member.block``)."""
    buckets: list[Bucket] = []
    for m in members:
        cur = buckets[-1] if buckets else None
        cap = first_cap_bytes if first_cap_bytes is not None and len(buckets) == 1 else cap_bytes
        if (cur is None or cur.members[-1].key != m.key or cur.nbytes + m.nbytes > cap
                or _crosses_block(cur, m, block_min_bytes)):
            buckets.append(Bucket())
            cur = buckets[-1]
        cur.members.append(m)
        cur.nbytes += m.nbytes
    return buckets


def _input_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and the non-placeholder nodes it is computed from (in graph order)."""
    chain, frontier = [], [node]
    while frontier:
        cur = frontier.pop()
        if cur.op == "placeholder" or cur in chain:
            continue
        chain.append(cur)
        frontier.extend(cur.all_input_nodes)
    return chain


def _bucket_gathers(graph: torch.fx.Graph, bucket: Bucket, bucket_id: str) -> None:
    members = bucket.members
    first = members[0].coll
    order = {n: i for i, n in enumerate(graph.nodes)}
    # the members' inputs are casts/views of shards: move them up to the bucket
    moved = sorted({n for m in members for n in _input_chain(m.inp)}, key=order.__getitem__)
    for node in moved:
        if order[node] > order[first]:
            first.prepend(node)
    world, group_name = first.args[1], first.args[2]
    names = [tag(m.coll).get("param") for m in members]
    with graph.inserting_before(first):
        packed = call(graph, _PACK_SHARDS, ([m.inp for m in members],), role="bucket_pack", bucket=bucket_id)
        gathered = call(graph, _c10d.all_gather_into_tensor.default, (packed, world, group_name),
                        role="bucket_gather", params=names, bucket=bucket_id)
        waited = call(graph, _c10d.wait_tensor.default, (gathered,), role="bucket_gather_wait", bucket=bucket_id)
        chunks = [m.inp.meta["val"].shape[0] for m in members]
        # one opaque op for the copies (runtime/bucket_ops.py says why not slices and clones)
        unpacked = call(graph, _UNPACK, (waited, world, chunks), role="bucket_unpack",
                        params=names, bucket=bucket_id)
        for i, (m, name) in enumerate(zip(members, names)):
            flat = call(graph, operator.getitem, (unpacked, i), role="bucket_unpack", param=name, bucket=bucket_id)
            m.wait.replace_all_uses_with(flat)
    for m in members:
        graph.erase_node(m.wait)
        graph.erase_node(m.coll)


def _common_division(members: list[Member]) -> tuple | None:
    """``(divisor, divisions)`` when every member's reduced chunk is read only by a division by
    the same number (``divisions``: those nodes, in member order), else None."""
    divisions = [_numeric_division(m.wait) for m in members]
    if None in divisions:
        return None
    divisors = {d.args[1] for d in divisions}
    return (divisors.pop(), divisions) if len(divisors) == 1 else None


def _bucket_reduce_scatters(graph: torch.fx.Graph, bucket: Bucket, bucket_id: str) -> None:
    members = bucket.members
    last = members[-1].coll
    _, reduce_op, world, group_name = last.args
    names = [tag(m.coll).get("param") for m in members]
    with graph.inserting_before(last):
        flat = call(graph, _PACK_GRADIENTS, ([m.inp for m in members], world), role="bucket_pack", bucket=bucket_id)
        reduced = call(graph, _c10d.reduce_scatter_tensor.default, (flat, reduce_op, world, group_name),
                       role="bucket_reduce_scatter", params=names, bucket=bucket_id)
        waited = call(graph, _c10d.wait_tensor.default, (reduced,), role="bucket_reduce_scatter_wait",
                      bucket=bucket_id)
        # the average over ranks: one division of the bucket rather than one per parameter
        # (a kernel with a loop per parameter), where every member is divided by the same number
        division = _common_division(members)
        if division is not None:
            waited = call(graph, _DIVIDE, (waited, float(division[0])), role="bucket_unpack", bucket=bucket_id)
        # what each member's slice replaces: its division when the bucket was divided, else its wait
        replaced = division[1] if division is not None else [m.wait for m in members]
        offset = 0
        for m, name, old in zip(members, names, replaced):
            chunk = m.inp.meta["val"].shape[0] // world
            part = call(graph, _aten.slice.Tensor, (waited, 0, offset, offset + chunk), role="bucket_unpack",
                        param=name, bucket=bucket_id)
            old.replace_all_uses_with(part)
            if division is not None:
                graph.erase_node(old)
            else:
                _divide_as_op(graph, part, bucket_id)
            offset += chunk
    for m in members:
        graph.erase_node(m.wait)
        graph.erase_node(m.coll)


def _numeric_division(node: torch.fx.Node) -> torch.fx.Node | None:
    """The only user of ``node`` when it is ``aten.div(node, number)``, else None."""
    users = list(node.users)
    if (len(users) != 1 or users[0].target is not _aten.div.Tensor or users[0].args[0] is not node
            or not isinstance(users[0].args[1], (int, float)) or users[0].kwargs):
        return None
    return users[0]


def _divide_as_op(graph: torch.fx.Graph, node: torch.fx.Node, bucket_id: str) -> None:
    """Where ``node`` (a reduced gradient) is only divided by a number, the division becomes
    ``zerocompile::divide_reduced`` (runtime/bucket_ops.py says why not ``aten.div``)."""
    old = _numeric_division(node)
    if old is None:
        return
    with graph.inserting_before(old):
        new = call(graph, _DIVIDE, (node, float(old.args[1])), **{**tag(old), "bucket": bucket_id})
    old.replace_all_uses_with(new)
    graph.erase_node(old)


def bucket_collectives(graph: torch.fx.Graph, cap_bytes: int, prefix: str) -> dict:
    """Bucket the tagged all-gathers and reduce-scatters of ``graph``; returns counts."""
    report = {}
    for role, first_fraction, rewrite, kind in (
            ("param_gather", FIRST_BUCKET_FRACTION, _bucket_gathers, "all_gather"),
            ("grad_reduce_scatter", None, _bucket_reduce_scatters, "reduce_scatter")):
        members = _members(graph, role)
        first_cap = max(1, int(cap_bytes * first_fraction)) if first_fraction else None
        buckets = plan_buckets(members, cap_bytes, first_cap, int(cap_bytes * BLOCK_BUCKET_FRACTION))
        for i, bucket in enumerate(buckets):
            bucket_id = f"{prefix}{kind}.{i}"
            if len(bucket.members) > 1:
                rewrite(graph, bucket, bucket_id)
            else:
                set_tag(bucket.members[0].coll, bucket=bucket_id)
                if kind == "reduce_scatter":
                    _divide_as_op(graph, bucket.members[0].wait, bucket_id)
        report[kind] = {"before": len(members), "after": len(buckets),
                        "bucket_bytes": [b.nbytes for b in buckets]}
    stable_topological_sort(graph)
    return report


def bucketing(gm: torch.fx.GraphModule, ctx: PassContext, *, bucket_mb: float, **_) -> torch.fx.GraphModule:
    prefix = {"forward": "fw.", "backward": "bw.", "inference": "inf."}.get(ctx.graph_kind, "")
    report = bucket_collectives(gm.graph, int(bucket_mb * _MB), prefix)
    ctx.results.setdefault("bucketing", {})[ctx.graph_kind] = report
    ctx.logger.debug("[%s] bucketing (%s): %s", ctx.frame, ctx.graph_kind, report)
    return gm
