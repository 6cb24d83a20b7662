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

The ops come in several forms, so that compiled graphs and the eager optimizer step use one code
path and dispatch modes see one op per collective (``zerocompile.stats()`` counts each as the
collective it replaces):

- ``zerocompile::all_gather_point_to_point(x, world, group_name)``: a new tensor of ``world``
  rows, the graph form (``passes/point_to_point_collectives.py`` puts it in place of an
  ``all_gather_into_tensor``);
- ``zerocompile::all_gather_point_to_point_unpacked(x, world, group_name, chunks)``: a bucket's
  gather straight into its members, one new tensor each, the graph form where the transfers go
  through shared memory (no buffer of gathered rows, and no copy out of it);
- ``zerocompile::all_gather_point_to_point_out(x, world, group_name, out)``: into ``out`` (the
  optimizer step's reused buffers);
- ``zerocompile::all_gather_point_to_point_into(xs, outs, world, group_name)``: many tensors
  at once, each straight into its own ``out`` (the optimizer step's refresh of the stage 1-2
  replicas, whose receive buffers are the replicas themselves: no bucket buffer, no copy out);
- ``zerocompile::reduce_scatter_point_to_point(x, "sum", world, group_name)``: the graph form
  of the reduce-scatter;
- ``zerocompile::reduce_scatter_point_to_point_into(xs, outs, world, group_name)``: the
  reduce-scatter of many tensors at once, each sent from its own memory and summed into its
  own ``out`` (the stage 1 optimizer step's reduction of the full gradients).

Every op takes a last argument ``shared_memory`` (default False): True sends the same bytes
through the process group's shared-memory segment instead of its sockets, where every rank is
on one host (``runtime/shared_memory.py``, the ``"shared_memory"`` choice); the results are
the same bit for bit.

All of them only *start* the transfers; ``torch.ops._c10d_functional.wait_tensor`` of the result waits
for them, as for a functional collective (they are registered in c10d's registry of pending
work: ``_torch_compat.register_pending_works``). ``x`` must stay unchanged until then.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerocompile import _torch_compat
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.shared_memory import channel_of

KINDS = ("point_to_point", "shared_memory")
"""The choices (``runtime/reduction_choice.py``) these ops carry out: through the process group's
sockets, or through its shared-memory segment (their ``shared_memory`` argument)."""


def _exchange(pairs: list, rank: int, world: int, group, shared_memory: bool = False,
              copy_input: bool = False) -> list:
    """Start, with every other rank ``peer`` of ``group`` and for each ``(send, receive)`` of
    ``pairs``, the send of ``send(peer)`` and the receive into ``receive(peer)``: in one
    ``batch_isend_irecv`` (gloo's or NCCL's sockets), or through the group's shared-memory
    segment (``shared_memory``: ``runtime/shared_memory.py``, which sends from a copy of what
    it could not write at once where ``copy_input``). Returns what to ``wait()`` for."""
    if shared_memory:
        return channel_of(group).exchange(pairs, copy_input)
    transfers = []
    for peer in range(world):
        if peer != rank:
            for send, receive in pairs:
                transfers += [dist.P2POp(dist.isend, send(peer), group=group, group_peer=peer),
                              dist.P2POp(dist.irecv, receive(peer), group=group, group_peer=peer)]
    return dist.batch_isend_irecv(transfers) if transfers else []


def start_point_to_point_gather(x: torch.Tensor, rank: int, world: int, group, out: torch.Tensor,
                                copy_input: bool = True, shared_memory: bool = False) -> list:
    """Send ``x`` to every other rank of ``group`` (this process is ``rank`` of ``world``) and
    receive row ``r`` of ``out`` (``world * x.numel()`` elements, rank order) from rank ``r``;
    this rank's row is copied here. Returns the transfers' ``Work`` handles.

    What is sent is a copy of ``x`` that only the transfers hold (``copy_input``): a compiled
    graph may reuse ``x``'s memory for another buffer as soon as this call returns (inductor's
    buffer reuse knows nothing of transfers still reading it), which would send that buffer's
    values. Without the copy, ``x`` itself is sent: only where its memory stays as it is until
    the wait (graphs run op by op, ``passes/point_to_point_collectives.py``; the eager step;
    the transfers hold a reference, so ``x`` is not freed before). Through shared memory
    (``shared_memory``) ``x`` is copied into the segment when the transfer starts, and only
    what does not fit yet is copied aside (``SharedMemoryChannel.exchange``)."""
    return start_point_to_point_gather_unpacked(x, [x.numel()], rank, world, group, [out], copy_input, shared_memory)


def start_point_to_point_reduce_scatter(x: torch.Tensor, rank: int, world: int, group,
                                        copy_input: bool = True, shared_memory: bool = False) -> tuple[list, list]:
    """Send row ``r`` of ``x`` (``world`` equal rows, flat) to rank ``r`` of ``group`` and receive
    every other rank's row ``rank``. Returns the transfers' ``Work`` handles and the rows to
    sum, in rank order (this rank's own row among them): read them after the waits. The rows
    sent and kept are a copy of ``x`` that only the transfers and the sum hold where
    ``copy_input`` (see ``start_point_to_point_gather``; through shared memory only this rank's
    own row is copied, and what does not fit the segment yet)."""
    rows = x.reshape(world, -1).clone() if copy_input and not shared_memory else x.reshape(world, -1)
    received = x.new_empty((max(world - 1, 1), rows.shape[1]))     # one row per other rank, in rank order
    own = rows[rank].clone() if copy_input and shared_memory else rows[rank]
    parts = [own if peer == rank else received[peer - (peer > rank)] for peer in range(world)]
    works = _exchange([(lambda peer: rows[peer], lambda peer: parts[peer])], rank, world, group, shared_memory,
                      copy_input)
    return works, parts


def sum_in_rank_order(parts: list, out: torch.Tensor) -> torch.Tensor:
    """``out = ((parts[0] + parts[1]) + parts[2]) + ...``: one fixed order, whatever the rank
    (on two ranks the one addition a reduce-scatter makes, so its result bit for bit)."""
    if len(parts) == 1:
        return out.copy_(parts[0])
    torch.add(parts[0], parts[1], out=out)        # one pass, the same rounding as a copy and add_
    for part in parts[2:]:
        out.add_(part)
    return out


def _start_into(x: torch.Tensor, world: int, group_name: str, out: torch.Tensor, copy_input: bool = True,
                shared_memory: bool = False) -> None:
    group = _torch_compat.process_group_named(group_name)
    works = start_point_to_point_gather(x, dist.get_rank(group), world, group, out, copy_input, shared_memory)
    PROCESS.watch.register(out, works, nbytes=out.numel() * out.element_size())


@torch.library.custom_op("zerocompile::all_gather_point_to_point", mutates_args=())
def all_gather_point_to_point(x: torch.Tensor, world: int, group_name: str, copy_input: bool = True,
                              shared_memory: bool = False) -> torch.Tensor:
    """``all_gather_into_tensor(x, world, group_name)`` by point-to-point transfers: read the
    result after ``wait_tensor``. ``copy_input``: see ``start_point_to_point_gather``;
    ``shared_memory``: through the group's shared-memory segment, not the sockets."""
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    _start_into(x, world, group_name, out, copy_input, shared_memory)
    return out


@all_gather_point_to_point.register_fake
def _all_gather_point_to_point_fake(x, world, group_name, copy_input=True, shared_memory=False):
    return x.new_empty((world * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("zerocompile::all_gather_point_to_point_out", mutates_args=("out",))
def all_gather_point_to_point_out(x: torch.Tensor, world: int, group_name: str, out: torch.Tensor,
                                  copy_input: bool = True, shared_memory: bool = False) -> None:
    """The same into ``out`` (``world * x.numel()`` elements): read it after ``wait_tensor(out)``."""
    _start_into(x, world, group_name, out, copy_input, shared_memory)


@all_gather_point_to_point_out.register_fake
def _all_gather_point_to_point_out_fake(x, world, group_name, out, copy_input=True, shared_memory=False):
    return None


def start_point_to_point_gather_unpacked(x: torch.Tensor, chunks: list, rank: int, world: int, group, outs: list,
                                         copy_input: bool = True, shared_memory: bool = False) -> list:
    """A bucket's all-gather received straight into its members: ``x`` is this rank's shards of the
    bucket's parameters, concatenated (``chunks[i]`` elements each); ``outs[i]`` (``world *
    chunks[i]`` elements) receives every rank's shard of parameter ``i``, in rank order, this rank's
    copied here. One transfer per parameter and peer, so no buffer of the gathered rows exists and
    nothing is copied out of one (``unpack_gathered_bucket``): what shared memory is for, where a
    transfer costs no message of its own. ``copy_input`` as ``start_point_to_point_gather``.
    Returns the transfers' ``Work`` handles."""
    flat = x.reshape(-1).clone() if copy_input and not shared_memory else x.reshape(-1)
    offsets = [sum(chunks[:i]) for i in range(len(chunks))]
    pieces = [flat[a : a + c] for a, c in zip(offsets, chunks)]
    rows = [out.view(world, -1) for out in outs]
    pairs = [(lambda peer, piece=piece: piece, lambda peer, row=row: row[peer]) for piece, row in zip(pieces, rows)]
    works = _exchange(pairs, rank, world, group, shared_memory, copy_input)
    for piece, row in zip(pieces, rows):
        row[rank].copy_(piece)
    return works


@torch.library.custom_op("zerocompile::all_gather_point_to_point_unpacked", mutates_args=())
def all_gather_point_to_point_unpacked(x: torch.Tensor, world: int, group_name: str, chunks: list[int],
                                       copy_input: bool = True, shared_memory: bool = False) -> list[torch.Tensor]:
    """``unpack_gathered_bucket(all_gather_into_tensor(x, world, group_name), world, chunks)`` in one
    op, by point-to-point transfers straight into the members (``start_point_to_point_gather_unpacked``):
    read each result after its own ``wait_tensor`` (every one waits for all the transfers)."""
    group = _torch_compat.process_group_named(group_name)
    outs = [x.new_empty(world * chunk) for chunk in chunks]
    works = start_point_to_point_gather_unpacked(x, chunks, dist.get_rank(group), world, group, outs, copy_input,
                                                 shared_memory)
    PROCESS.watch.register(outs, works, nbytes=sum(o.numel() * o.element_size() for o in outs))
    return outs


@all_gather_point_to_point_unpacked.register_fake
def _all_gather_point_to_point_unpacked_fake(x, world, group_name, chunks, copy_input=True, shared_memory=False):
    return [x.new_empty(world * chunk) for chunk in chunks]


@torch.library.custom_op("zerocompile::reduce_scatter_point_to_point", mutates_args=())
def reduce_scatter_point_to_point(x: torch.Tensor, reduce_op: str, world: int, group_name: str,
                                  copy_input: bool = True, shared_memory: bool = False) -> torch.Tensor:
    """``reduce_scatter_tensor(x, "sum", world, group_name)`` by point-to-point transfers: row
    ``r`` of ``x`` goes to rank ``r``, and the rows received are summed in rank order when
    ``wait_tensor`` of the result returns (``sum_in_rank_order``). ``copy_input``: see
    ``start_point_to_point_gather``; ``shared_memory``: through the group's shared-memory segment."""
    if reduce_op != "sum":
        raise ValueError(f"zerocompile::reduce_scatter_point_to_point sums; got reduce_op={reduce_op!r}")
    group = _torch_compat.process_group_named(group_name)
    works, parts = start_point_to_point_reduce_scatter(x, dist.get_rank(group), world, group, copy_input,
                                                       shared_memory)
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    PROCESS.watch.register(out, works, then=lambda: sum_in_rank_order(parts, out.view(-1)), kind="reduce_scatter",
                              nbytes=x.numel() * x.element_size())
    return out


@reduce_scatter_point_to_point.register_fake
def _reduce_scatter_point_to_point_fake(x, reduce_op, world, group_name, copy_input=True, shared_memory=False):
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))


PACK_BELOW = 64 * 1024
"""``all_gather_point_to_point_into``: tensors of fewer bytes than this travel packed into one
message per peer (a transfer costs tens of microseconds however small, on gloo over TCP about
as long as copying this many bytes twice); larger ones travel from and into their own memory."""


def _by_size(xs: list) -> tuple[list[int], list[int]]:
    """The indices of ``xs`` under ``PACK_BELOW`` bytes (packed together) and the others."""
    small = [x.numel() * x.element_size() < PACK_BELOW for x in xs]
    return [i for i, s in enumerate(small) if s], [i for i, s in enumerate(small) if not s]


def start_point_to_point_gather_into(xs: list, outs: list, rank: int, world: int, group,
                                     shared_memory: bool = False) -> tuple[list, object]:
    """Send each ``xs[i]`` to every other rank of ``group`` and receive rank ``r``'s into row ``r``
    of ``outs[i]`` (``world * xs[i].numel()`` elements, rank order); this rank's row is copied
    from ``xs[i]`` unless ``xs[i]`` is that row. Tensors under ``PACK_BELOW`` bytes travel packed
    together. Returns the transfers' ``Work`` handles and what to call after they are done (it
    unpacks the packed rows). Nothing is copied for the larger tensors: the caller keeps
    ``xs`` unchanged until the waits (the eager optimizer step, which owns them)."""
    rows = [out.view(world, -1) for out in outs]
    for x, row in zip(xs, rows):
        if x.data_ptr() != row[rank].data_ptr():
            row[rank].copy_(x.reshape(-1))
    small, large = _by_size(xs)
    pairs = [(lambda peer, x=xs[i].reshape(-1): x, lambda peer, row=rows[i]: row[peer]) for i in large]
    packed = received = None
    if small and world > 1:
        packed = torch.cat([xs[i].reshape(-1) for i in small])
        received = packed.new_empty((world, packed.numel()))
        pairs.append((lambda peer: packed, lambda peer: received[peer]))
    works = _exchange(pairs, rank, world, group, shared_memory)

    def unpack() -> None:
        if received is None:
            return
        offset = 0
        for i in small:
            n = xs[i].numel()
            for peer in range(world):
                if peer != rank:
                    rows[i][peer].copy_(received[peer, offset : offset + n])
            offset += n

    return works, unpack


def _start_many(start, xs: list, outs: list, world: int, group_name: str, shared_memory: bool) -> None:
    """``start(xs, outs, rank, world, group, shared_memory)`` (one of the ``start_..._into``),
    its transfers and what completes them registered on ``outs[0]``, which ``wait_tensor``
    waits for."""
    group = _torch_compat.process_group_named(group_name)
    works, then = start(xs, outs, dist.get_rank(group), world, group, shared_memory)
    if outs:
        gathers = start is start_point_to_point_gather_into
        PROCESS.watch.register(outs[0], works, then=then, kind="all_gather" if gathers else "reduce_scatter",
                                  nbytes=sum(t.numel() * t.element_size() for t in (outs if gathers else xs)))


@torch.library.custom_op("zerocompile::all_gather_point_to_point_into", mutates_args=("outs",))
def all_gather_point_to_point_into(xs: list[torch.Tensor], outs: list[torch.Tensor], world: int,
                                   group_name: str, shared_memory: bool = False) -> None:
    """``outs[i]`` = the all-gather of ``xs[i]`` for every ``i``, by point-to-point transfers
    straight into ``outs`` (``start_point_to_point_gather_into``): read them after
    ``wait_tensor(outs[0])``. Eager use only (``xs`` are sent from their own memory).
    ``shared_memory``: through the group's shared-memory segment."""
    _start_many(start_point_to_point_gather_into, xs, outs, world, group_name, shared_memory)


@all_gather_point_to_point_into.register_fake
def _all_gather_point_to_point_into_fake(xs, outs, world, group_name, shared_memory=False):
    return None


def start_point_to_point_reduce_scatter_into(xs: list, outs: list, rank: int, world: int, group,
                                             shared_memory: bool = False) -> tuple[list, object]:
    """Send row ``r`` of each ``xs[i]`` (``world`` equal rows, flat) to rank ``r`` of ``group``
    and receive every other rank's row ``rank`` of it; returns the transfers' ``Work`` handles and
    what to call after they are done: it writes into ``outs[i]`` the sum of the rows in rank
    order (``sum_in_rank_order``, the sums of ``reduce_scatter_point_to_point``). Tensors
    under ``PACK_BELOW`` bytes travel packed together. Nothing is copied for the larger ones:
    the caller keeps ``xs`` unchanged until the waits (the eager optimizer step)."""
    rows = [x.reshape(world, -1) for x in xs]
    small, large = _by_size(xs)
    received = {i: xs[i].new_empty((world, rows[i].shape[1])) for i in large}
    pairs = [(lambda peer, row=rows[i]: row[peer], lambda peer, got=received[i]: got[peer]) for i in large]
    packed = packed_in = None
    if small and world > 1:
        packed = torch.cat([rows[i] for i in small], dim=1)     # (world, total): row r goes to rank r
        packed_in = packed.new_empty(packed.shape)
        pairs.append((lambda peer: packed[peer], lambda peer: packed_in[peer]))
    works = _exchange(pairs, rank, world, group, shared_memory)

    def add_up() -> None:
        for i in large:
            parts = [rows[i][r] if r == rank else received[i][r] for r in range(world)]
            sum_in_rank_order(parts, outs[i].view(-1))
        offset = 0
        for i in small:
            n = rows[i].shape[1]
            parts = [rows[i][r] if r == rank or packed_in is None else packed_in[r, offset : offset + n]
                     for r in range(world)]
            sum_in_rank_order(parts, outs[i].view(-1))
            offset += n

    return works, add_up


@torch.library.custom_op("zerocompile::reduce_scatter_point_to_point_into", mutates_args=("outs",))
def reduce_scatter_point_to_point_into(xs: list[torch.Tensor], outs: list[torch.Tensor], world: int,
                                       group_name: str, shared_memory: bool = False) -> None:
    """``outs[i]`` = the reduce-scatter (sum) of ``xs[i]`` for every ``i``, by point-to-point
    transfers sent from ``xs``' own memory (``start_point_to_point_reduce_scatter_into``): read
    them after ``wait_tensor(outs[0])``. Eager use only. ``shared_memory``: through the
    group's shared-memory segment."""
    _start_many(start_point_to_point_reduce_scatter_into, xs, outs, world, group_name, shared_memory)


@reduce_scatter_point_to_point_into.register_fake
def _reduce_scatter_point_to_point_into_fake(xs, outs, world, group_name, shared_memory=False):
    return None
