"""The all-gather as point-to-point transfers: each rank sends its shard to every other rank and
receives theirs (``torch.distributed.batch_isend_irecv``).

The same bytes cross the wire as in a ring all-gather, ``(N - 1)`` shards per rank, and every
element is copied, never combined, so the result is bit for bit the all-gather's. What differs
is the time: on gloo, whose all-gather pipelines small chunks around the ring, the transfers take
0.8x its time at 16 MiB and a third of it at 64 MiB (2 ranks on this project's machine,
``benchmarks/collectives.py``); NCCL's all-gather is the faster there. ``parameter_gather``
chooses per process group and size (``runtime/reduction_choice.py``).

The reduce-scatter the same way (``zerocompile::reduce_scatter_point_to_point``): row ``r`` of
each rank's buffer goes to rank ``r``, which sums the rows it received in rank order when the
result is waited for; half the bytes of an all-reduce, and on two ranks the one addition of a
reduce-scatter, so its result bit for bit (on more ranks the same terms in a fixed order).

Two gather ops, so that compiled graphs and the eager optimizer step use one code path and dispatch
modes see one op per gather (``zerocompile.stats()`` counts it as an all-gather):

- ``zerocompile::all_gather_point_to_point(x, world, group_name)``: a new tensor of ``world``
  rows, the graph form (``passes/point_to_point_collectives.py`` puts it in place of an
  ``all_gather_into_tensor``);
- ``zerocompile::all_gather_point_to_point_out(x, world, group_name, out)``: into ``out`` (the
  optimizer step's reused buffers).

Both only *start* the transfers; ``torch.ops._c10d_functional.wait_tensor`` of the result waits
for them, as for a functional collective (they are registered in c10d's registry of pending
work: ``_torch_compat.register_pending_works``). ``x`` must stay unchanged until then.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerocompile import _torch_compat


def start_point_to_point_gather(x: torch.Tensor, rank: int, world: int, group, out: torch.Tensor) -> list:
    """Send ``x`` to every other rank of ``group`` (this process is ``rank`` of ``world``) and
    receive row ``r`` of ``out`` (``world * x.numel()`` elements, rank order) from rank ``r``;
    this rank's row is copied here. Returns the transfers' ``Work`` handles.

    What is sent is a copy of ``x`` that only the transfers hold: a compiled graph may reuse
    ``x``'s memory for another buffer as soon as this call returns (inductor's buffer reuse
    knows nothing of transfers still reading it), which would send that buffer's values."""
    flat = x.reshape(-1).clone()
    rows = out.view(world, -1)
    transfers = []
    for peer in range(world):
        if peer != rank:
            transfers += [dist.P2POp(dist.isend, flat, group=group, group_peer=peer),
                          dist.P2POp(dist.irecv, rows[peer], group=group, group_peer=peer)]
    works = dist.batch_isend_irecv(transfers) if transfers else []
    rows[rank].copy_(flat)
    return works


def start_point_to_point_reduce_scatter(x: torch.Tensor, rank: int, world: int, group) -> tuple[list, list]:
    """Send row ``r`` of ``x`` (``world`` equal rows, flat) to rank ``r`` of ``group`` and receive
    every other rank's row ``rank``. Returns the transfers' ``Work`` handles and the rows to
    sum, in rank order (this rank's own row among them): read them after the waits. The rows
    sent and kept are a copy of ``x`` that only the transfers and the sum hold (see
    ``start_point_to_point_gather``)."""
    rows = x.reshape(world, -1).clone()
    received = x.new_empty((max(world - 1, 1), rows.shape[1]))
    transfers, parts, k = [], [], 0
    for peer in range(world):
        if peer == rank:
            parts.append(rows[rank])
            continue
        transfers += [dist.P2POp(dist.isend, rows[peer], group=group, group_peer=peer),
                      dist.P2POp(dist.irecv, received[k], group=group, group_peer=peer)]
        parts.append(received[k])
        k += 1
    works = dist.batch_isend_irecv(transfers) if transfers else []
    return works, parts


def sum_in_rank_order(parts: list, out: torch.Tensor) -> torch.Tensor:
    """``out = ((parts[0] + parts[1]) + parts[2]) + ...``: one fixed order, whatever the rank
    (on two ranks the one addition a reduce-scatter makes, so its result bit for bit)."""
    out.copy_(parts[0])
    for part in parts[1:]:
        out.add_(part)
    return out


def _start_into(x: torch.Tensor, world: int, group_name: str, out: torch.Tensor) -> None:
    group = _torch_compat.process_group_named(group_name)
    works = start_point_to_point_gather(x, dist.get_rank(group), world, group, out)
    _torch_compat.register_pending_works(out, works)


@torch.library.custom_op("zerocompile::all_gather_point_to_point", mutates_args=())
def all_gather_point_to_point(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """``all_gather_into_tensor(x, world, group_name)`` by point-to-point transfers: read the
    result after ``wait_tensor``."""
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    _start_into(x, world, group_name, out)
    return out


@all_gather_point_to_point.register_fake
def _all_gather_point_to_point_fake(x, world, group_name):
    return x.new_empty((world * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("zerocompile::all_gather_point_to_point_out", mutates_args=("out",))
def all_gather_point_to_point_out(x: torch.Tensor, world: int, group_name: str, out: torch.Tensor) -> None:
    """The same into ``out`` (``world * x.numel()`` elements): read it after ``wait_tensor(out)``."""
    _start_into(x, world, group_name, out)


@all_gather_point_to_point_out.register_fake
def _all_gather_point_to_point_out_fake(x, world, group_name, out):
    return None


@torch.library.custom_op("zerocompile::reduce_scatter_point_to_point", mutates_args=())
def reduce_scatter_point_to_point(x: torch.Tensor, reduce_op: str, world: int, group_name: str) -> torch.Tensor:
    """``reduce_scatter_tensor(x, "sum", world, group_name)`` by point-to-point transfers: row
    ``r`` of ``x`` goes to rank ``r``, and the rows received are summed in rank order when
    ``wait_tensor`` of the result returns (``sum_in_rank_order``)."""
    if reduce_op != "sum":
        raise ValueError(f"zerocompile::reduce_scatter_point_to_point sums; got reduce_op={reduce_op!r}")
    group = _torch_compat.process_group_named(group_name)
    works, parts = start_point_to_point_reduce_scatter(x, dist.get_rank(group), world, group)
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _torch_compat.register_pending_works(out, works, then=lambda: sum_in_rank_order(parts, out.view(-1)))
    return out


@reduce_scatter_point_to_point.register_fake
def _reduce_scatter_point_to_point_fake(x, reduce_op, world, group_name):
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))
