"""A gradient bucket's reduce-scatter in the bucket's own memory (``zerocompile::reduce_scatter_in_place``).

A reduce-scatter returns a new tensor, and every way of running one on CPU ranks copies the
whole input first: gloo's ``reduce_scatter_tensor`` is an all-reduce of a clone of the input
(``ProcessGroupGloo::reduce_scatter_tensor_coalesced``: ``input.clone()``, ``allreduce``, then
this rank's chunk copied out), and zerocompile's point-to-point reduce-scatter sends from a copy
where inductor compiles the graph (``runtime/point_to_point.py``: inductor may reuse an op's input
memory as soon as the op returns). A gradient bucket (``zerocompile::pack_gradients``) is made for
its reduction and read by nothing else, so that copy is a second bucket held for nothing while the
collective runs, and a memory pass over it.

This op reduces the bucket where it is: after ``torch.ops._c10d_functional.wait_tensor(x)``, row
``rank`` of ``x`` (``world`` equal rows, flat) holds the reduction over the group's ranks of their
row ``rank``, what the reduce-scatter returns; the graph reads that row
(``passes/reduce_scatter_in_place.py``). The bucket is a tensor of the graph, which stays alive to
the wait and whose memory nothing else writes before it, so the transfers may read and write it
in place, and the memory tracker sees it for as long as it lives. ``kind``, as the frame's
``gradient_reduction`` chose (``runtime/reduction_choice.py``):

- ``"reduce_scatter"``: gloo's all-reduce of ``x`` itself: the very collective gloo's
  reduce-scatter runs on its clone, so the same sums bit for bit (the other rows hold the other
  ranks' sums, which nothing reads). Gloo only (and torch's fake process group, where nothing
  moves: ``zerocompile plan``, ``dump --world-size``); any other backend's reduce-scatter takes
  no copy, and the pass leaves it alone.
- ``"point_to_point"`` / ``"shared_memory"``: row ``r`` sent to rank ``r`` straight from ``x``
  (through the sockets, or the shared-memory segment), the rows received summed in rank order
  into row ``rank`` (``sum_in_rank_order``: the sums of ``reduce_scatter_point_to_point``).

``zerocompile.stats()`` and the collective counters count it as the reduce-scatter it replaces
(the bytes of ``x``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerocompile import _torch_compat
from zerocompile.runtime.collective_watch import REDUCE_OPS
from zerocompile.runtime.point_to_point import start_point_to_point_reduce_scatter, sum_in_rank_order
from zerocompile.runtime.session import PROCESS

KINDS = ("reduce_scatter", "point_to_point", "shared_memory")
"""The ``gradient_reduction`` choices the op carries out in place (its ``kind``)."""


@torch.library.custom_op("zerocompile::reduce_scatter_in_place", mutates_args=("x",))
def reduce_scatter_in_place(x: torch.Tensor, reduce_op: str, world: int, group_name: str, kind: str) -> None:
    """Start reducing row ``rank`` of ``x`` (``world`` equal rows, flat, contiguous) over the
    group's ranks, in ``x`` (see the module docstring); read that row after ``wait_tensor(x)``."""
    if kind not in KINDS:
        raise ValueError(f"zerocompile::reduce_scatter_in_place: kind {kind!r}; one of {KINDS}")
    if not x.is_contiguous() or x.dim() != 1 or x.numel() % world:
        raise ValueError("zerocompile::reduce_scatter_in_place: x must be flat, contiguous and of world equal rows; "
                         f"got shape {tuple(x.shape)} for world size {world}")
    group = _torch_compat.process_group_named(group_name)
    nbytes = x.numel() * x.element_size()
    if kind == "reduce_scatter":
        backend = _torch_compat.collective_backend(group_name, x.device)
        # gloo has no average (fake: torch's group of plan/dump)
        if backend not in ("gloo", "fake") or reduce_op not in REDUCE_OPS or reduce_op == "avg":
            raise ValueError(f"zerocompile::reduce_scatter_in_place: kind 'reduce_scatter' is gloo's all-reduce in "
                             f"place (sum, max, min, product); got backend {backend!r}, reduce_op {reduce_op!r}")
        work = dist.all_reduce(x, op=REDUCE_OPS[reduce_op], group=group, async_op=True)
        PROCESS.watch.register(x, [work], kind="reduce_scatter", nbytes=nbytes)
        return
    if reduce_op != "sum":
        raise ValueError(f"zerocompile::reduce_scatter_in_place: point-to-point transfers sum; got {reduce_op!r}")
    rank = dist.get_rank(group)
    works, parts = start_point_to_point_reduce_scatter(x, rank, world, group, copy_input=False,
                                                       shared_memory=kind == "shared_memory")
    mine = x.view(world, -1)[rank]

    def add_up() -> None:
        # parts[rank] is ``mine``: the sum may be written into it only once it has been read. At
        # rank 0 or 1 the first addition reads it; elsewhere the sum goes into the first received
        # row (read once, by that addition) and is copied in after.
        if rank < 2:
            sum_in_rank_order(parts, mine)
        else:
            mine.copy_(sum_in_rank_order(parts, parts[0]))

    PROCESS.watch.register(x, works, then=add_up, kind="reduce_scatter", nbytes=nbytes)


@reduce_scatter_in_place.register_fake
def _reduce_scatter_in_place_fake(x, reduce_op, world, group_name, kind):
    return None
