"""The all-gather as point-to-point transfers: each rank sends its shard to every other rank and
receives theirs (``torch.distributed.batch_isend_irecv``).

The same bytes cross the wire as in a ring all-gather, ``(N - 1)`` shards per rank, and every
element is copied, never combined, so the result is bit for bit the all-gather's. What differs
is the time: on gloo, whose all-gather pipelines small chunks around the ring, the transfers take
0.8x its time at 16 MiB and a third of it at 64 MiB (2 ranks on this project's machine,
``benchmarks/collectives.py``); NCCL's all-gather is the faster there. ``parameter_gather``
chooses per process group and size (``runtime/reduction_choice.py``).

Two ops, so that compiled graphs and the eager optimizer step use one code path and dispatch
modes see one op per gather (``zerocompile.stats()`` counts it as an all-gather):

- ``zerocompile::all_gather_point_to_point(x, world, group_name)``: a new tensor of ``world``
  rows, the graph form (``passes/point_to_point_gathers.py`` puts it in place of an
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
    this rank's row is copied here. Returns the transfers' ``Work`` handles."""
    flat = x.contiguous().view(-1)
    rows = out.view(world, -1)
    transfers = []
    for peer in range(world):
        if peer != rank:
            transfers += [dist.P2POp(dist.isend, flat, group=group, group_peer=peer),
                          dist.P2POp(dist.irecv, rows[peer], group=group, group_peer=peer)]
    works = dist.batch_isend_irecv(transfers) if transfers else []
    rows[rank].copy_(flat)
    return works


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
