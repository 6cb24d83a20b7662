"""Bucketed collectives the optimizer issues in eager code, once per optimizer step.

Tensors are grouped in order into buckets of at most ``bucket_bytes`` (a tensor larger
than the cap gets a bucket of its own); each bucket is one collective. Every
collective is recorded for ``zerocompile.stats()`` in the ``session`` given (the model's
``ModelSession``, ``runtime/session.py``), and timed by its comms logger.
"""

from __future__ import annotations

from typing import Callable

import torch

from zerocompile.runtime import point_to_point  # registers the zerocompile:: point-to-point ops
from zerocompile.runtime import comm
from zerocompile.runtime.comm import CommGroup, pad_flat, start_all_gather_flat, start_reduce_scatter, watched

_c10d = torch.ops._c10d_functional


def bucket_indices(sizes: list[int], cap: int, breaks: list[bool] | None = None) -> list[list[int]]:
    """Indices of items of ``sizes`` bytes in order, in buckets of at most ``cap`` bytes (an item
    larger than that gets a bucket of its own); ``breaks[i]``: item ``i`` starts a new bucket."""
    out, cur, cur_bytes = [], [], 0
    for i, size in enumerate(sizes):
        if cur and (cur_bytes + size > cap or (breaks is not None and breaks[i])):
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += size
    if cur:
        out.append(cur)
    return out


def _two_in_flight(buckets: list[list[int]], start: Callable, finish: Callable, device: torch.device,
                   session, label: str = "optimizer step") -> None:
    """For each bucket ``k``, ``start(k, bucket)`` (fill buffer ``k % 2``, issue the collective,
    return a handle), then ``finish(handle)`` of the bucket before it: the next bucket travels
    while the previous one is read out, and a buffer is refilled only after its bucket finished.

    The handle's last item is the tensor ``finish`` waits for. With the comms logger on
    (``runtime/comms_log.py``), each collective ``start`` counts is timed until that wait returns;
    with its ``blocking`` setting, each bucket finishes before the next one starts."""
    comms = session.comms
    blocking = comms.settings is not None and comms.settings.blocking
    pending = None
    for k, bucket in enumerate([*buckets, None]):
        started = None
        if bucket is not None:
            with comms.capturing(device) as issued:      # nothing without the comms logger
                started = (start(k, bucket), issued)
        if blocking and started is not None:
            pending, started = started, None
        if pending is not None:
            handle, issued = pending
            if issued:
                _c10d.wait_tensor(handle[-1])    # finish's own wait then returns at once
                comms.done(issued, label)
            finish(*handle)
        pending = started


def _slots(count: int, numel: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Bucket buffers allocated once per call: two, or one for a single bucket."""
    return [torch.empty(numel, dtype=dtype or like.dtype, device=like.device) for _ in range(min(2, count))]


def reduce_scatter_mean(grads: list[tuple[torch.Tensor, int]], group: CommGroup, bucket_bytes: int,
                        reduce_dtype: torch.dtype, choose: Callable[[int], str] | None = None,
                        label: str = "optimizer step", *, session) -> list[torch.Tensor]:
    """Average over ranks each ``(gradient, padded_numel)``; return this rank's chunks
    (``label``: the comms logger's call site; ``session``: the model's, which counts them).

    Each gradient is cast to ``reduce_dtype`` and zero-padded to ``padded_numel`` (a multiple
    of the world size) into a bucket buffer: two buffers, allocated once per call, take turns,
    so the next bucket's reduce-scatter is in flight while the previous one is averaged.
    ``choose(bucket bytes)``: ``"all_reduce"`` to all-reduce the bucket in its buffer and keep
    this rank's row instead, ``"point_to_point"`` (or ``"shared_memory"``, the same transfers
    through the group's shared-memory segment) to send each row to its rank and sum what
    arrives (the same sums: ``runtime/reduction_choice.py``; a bucket whose gradients need no
    cast and no padding is sent from their own memory, ``reduce_scatter_point_to_point_into``,
    with no bucket buffer); None: reduce-scatter."""
    if group.world == 1:
        return [pad_flat(g.to(reduce_dtype), padded) for g, padded in grads]
    elem = torch.empty((), dtype=reduce_dtype).element_size()
    buckets = bucket_indices([padded * elem for _, padded in grads], bucket_bytes)
    reduction = BucketReduction(grads, group, reduce_dtype, choose, session, slots=min(2, len(buckets)),
                                slot_numel=max((sum(grads[i][1] for i in b) for b in buckets), default=0))
    if buckets:
        _two_in_flight(buckets, reduction.start, reduction.finish, grads[0][0].device, session, label)
    return reduction.results


class BucketReduction:
    """The buckets of ``reduce_scatter_mean``, started and finished one at a time:
    ``start(k, bucket)`` packs bucket ``k`` (indices into ``grads``, read when it starts: an
    entry may be filled in just before) into buffer ``k % slots`` and issues its collective;
    ``finish(*handle)`` waits for it and puts each gradient's averaged chunk in ``results``.
    A buffer is reused only after the bucket that filled it finished (the caller's order).
    ``grads``: ``(gradient, padded_numel)`` per item; ``slot_numel``: the elements of each
    buffer (the largest bucket's); the others as ``reduce_scatter_mean``'s."""

    def __init__(self, grads: list, group: CommGroup, reduce_dtype: torch.dtype, choose, session,
                 slots: int = 2, slot_numel: int = 0) -> None:
        self.grads = grads
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.choose = choose
        self.session = session
        self.slot_count = max(1, slots)
        self.slot_numel = slot_numel
        self.elem = torch.empty((), dtype=reduce_dtype).element_size()
        self.slots: dict[int, torch.Tensor] = {}  # slot -> bucket buffer, allocated by the first bucket that packs
        self.results: list[torch.Tensor | None] = [None] * len(grads)

    def start(self, k: int, bucket: list[int]) -> tuple:
        grads, world, session = self.grads, self.group.world, self.session
        n = sum(grads[i][1] for i in bucket)
        kind = "reduce_scatter" if self.choose is None else self.choose(n * self.elem)
        shared_memory = kind == "shared_memory"
        if kind in point_to_point.KINDS and all(_sendable(*grads[i], self.reduce_dtype) for i in bucket):
            # each gradient's rows sent from its own memory, summed into its own chunk
            session.record("reduce_scatter", n * self.elem)
            outs = [grads[i][0].new_empty(grads[i][1] // world) for i in bucket]
            torch.ops.zerocompile.reduce_scatter_point_to_point_into([grads[i][0].reshape(-1) for i in bucket], outs,
                                                                     world, self.group.name, shared_memory)
            return bucket, outs, outs[0]
        slot = k % self.slot_count
        if slot not in self.slots or self.slots[slot].numel() < n:
            self.slots[slot] = torch.empty(max(n, self.slot_numel), dtype=self.reduce_dtype,
                                           device=grads[bucket[0]][0].device)
        rows = self.slots[slot][:n].view(world, n // world)
        offset = 0
        for i in bucket:                 # each gradient's chunk of every rank, in its column range
            chunk = grads[i][1] // world
            g = grads[i][0].reshape(-1)
            if g.numel() != world * chunk:
                g = pad_flat(g.to(self.reduce_dtype), world * chunk)
            rows[:, offset : offset + chunk].copy_(g.view(world, chunk))   # casts to reduce_dtype
            offset += chunk
        if kind == "all_reduce":
            session.record("all_reduce", n * self.elem)
            started = watched("all_reduce", rows, self.group.name, reduce_op="sum", out=rows)
            return bucket, rows, started if started is not None else _c10d.all_reduce_(rows, "sum", self.group.name)
        session.record("reduce_scatter", n * self.elem)
        if kind in point_to_point.KINDS:
            # the buffer stays as it is until the wait: sent without a copy
            return bucket, None, torch.ops.zerocompile.reduce_scatter_point_to_point(
                rows.reshape(-1), "sum", world, self.group.name, copy_input=False, shared_memory=shared_memory)
        return bucket, None, start_reduce_scatter(rows.reshape(-1), "sum", world, self.group.name)

    def finish(self, bucket: list[int], rows, out) -> None:
        world = self.group.world
        if isinstance(rows, list):     # sent in place: ``rows`` are the bucket's chunks, ``out`` the first
            _c10d.wait_tensor(out)
            for i, chunk in zip(bucket, rows):
                self.results[i] = chunk.div_(world)
            return
        if rows is not None:       # all-reduced in the buffer, which the bucket after next reuses: copied out
            mine = _c10d.wait_tensor(out)[self.group.rank].div(world)
        else:
            mine = _c10d.wait_tensor(out).div_(world)
        offset = 0
        for i in bucket:
            chunk = self.grads[i][1] // world
            self.results[i] = mine[offset : offset + chunk]
            offset += chunk


def _sendable(grad: torch.Tensor, padded: int, reduce_dtype: torch.dtype) -> bool:
    """A gradient that travels point to point from its own memory: already in the reduction's
    dtype, contiguous, with no padding to add."""
    return grad.dtype == reduce_dtype and grad.is_contiguous() and grad.numel() == padded


def all_gather_concat(shards: list[torch.Tensor], group: CommGroup, bucket_bytes: int,
                      write: Callable[[int, torch.Tensor], None],
                      prepare: Callable[[list[int]], None] | None = None,
                      choose: Callable[[int], str] | None = None,
                      places: list[torch.Tensor | None] | None = None, *, session) -> None:
    """All-gather each shard; call ``write(i, rows)`` with shard ``i`` of every rank as a
    ``(world, numel_i)`` view, rank order (read it inside the call: the buffer is reused).
    ``prepare(indices)``, called for each bucket right before its shards are read, may still
    change their values in place (the optimizer step of that bucket, done while the previous
    bucket's gather is in flight).

    The shards (one dtype and device) travel in buckets through two pairs of buffers allocated
    once per call: the next bucket's gather is in flight while the previous one is written
    out, and no bucket allocates memory the system must fault in afresh (on the CPU a fresh
    large allocation costs about as much as a copy of it). ``choose(gathered bytes)``:
    ``"point_to_point"`` (or ``"shared_memory"``) to send the bucket to each rank and receive theirs instead of the
    all-gather collective (``runtime/point_to_point.py``: the same bytes and values);
    None: the all-gather. ``places[i]``: where shard ``i`` of every rank ends up (``world *
    numel_i`` elements, this rank's row possibly ``shards[i]`` itself: a stage 1-2 replica); a
    bucket whose shards all have one travels point to point straight into them, and ``write``
    gets a view of its place."""
    world = group.world
    if world == 1:
        for i, t in enumerate(shards):
            if prepare is not None:
                prepare([i])
            write(i, t.reshape(1, -1))
        return
    buckets = bucket_indices([t.numel() * t.element_size() * world for t in shards], bucket_bytes)
    if not buckets:
        return
    cap = max(sum(shards[i].numel() for i in b) for b in buckets)
    first = shards[buckets[0][0]]
    mines, gathers = [], []     # allocated after the first bucket's prepare: not alive during it

    def start(k, bucket):
        if prepare is not None:
            prepare(bucket)
        nbytes = world * sum(shards[i].numel() for i in bucket) * first.element_size()
        kind = "all_gather" if choose is None else choose(nbytes)
        if places is not None and all(places[i] is not None for i in bucket) and kind in point_to_point.KINDS:
            session.record("all_gather", nbytes)
            outs = [places[i] for i in bucket]
            torch.ops.zerocompile.all_gather_point_to_point_into([shards[i] for i in bucket], outs, world, group.name,
                                                                 kind == "shared_memory")
            return bucket, None, outs[0]
        if not mines:
            mines.extend(_slots(len(buckets), cap, first))
            gathers.extend(_slots(len(buckets), world * cap, first))
        n = sum(shards[i].numel() for i in bucket)
        mine = torch.cat([shards[i].reshape(-1) for i in bucket], out=mines[k % len(mines)][:n])
        session.record("all_gather", nbytes)
        out = gathers[k % len(gathers)][: world * n]
        if kind in point_to_point.KINDS:
            torch.ops.zerocompile.all_gather_point_to_point_out(mine, world, group.name, out, copy_input=False,
                                                                shared_memory=kind == "shared_memory")
            return bucket, n, out
        return bucket, n, start_all_gather_flat(mine, world, group.name, out=out)

    def finish(bucket, n, out):
        if n is None:               # received in place
            _c10d.wait_tensor(out)
            for i in bucket:
                write(i, places[i].view(world, -1))
            return
        rows = _c10d.wait_tensor(out).view(world, n)
        offset = 0
        for i in bucket:
            chunk = shards[i].numel()
            write(i, rows[:, offset : offset + chunk])
            offset += chunk

    _two_in_flight(buckets, start, finish, first.device, session)


def all_reduce_mean_(tensors: list[torch.Tensor], group: CommGroup, bucket_bytes: int,
                     reduce_dtype: torch.dtype, *, session) -> None:
    """Average each tensor over ranks, in place, reducing in ``reduce_dtype``: buckets go through
    two buffers allocated once per call, reduced in place, the next one in flight while the
    previous one is copied back."""
    world = group.world
    if world == 1:
        return
    buckets = bucket_indices([t.numel() * torch.empty((), dtype=reduce_dtype).element_size() for t in tensors],
                       bucket_bytes)
    if not buckets:
        return
    slots = _slots(len(buckets), max(sum(tensors[i].numel() for i in b) for b in buckets), tensors[0], reduce_dtype)

    def start(k, bucket):
        n = sum(tensors[i].numel() for i in bucket)
        flat = slots[k % len(slots)][:n]
        offset = 0
        for i in bucket:
            flat[offset : offset + tensors[i].numel()].copy_(tensors[i].reshape(-1))   # casts
            offset += tensors[i].numel()
        session.record("all_reduce", n * flat.element_size())
        return bucket, _c10d.all_reduce_(flat, "sum", group.name)

    def finish(bucket, out):
        total = _c10d.wait_tensor(out).div_(world)
        offset = 0
        for i in bucket:
            n = tensors[i].numel()
            tensors[i].copy_(total[offset : offset + n].view_as(tensors[i]))
            offset += n

    _two_in_flight(buckets, start, finish, tensors[0].device, session)


def start_all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                     group: CommGroup, *, session) -> torch.Tensor:
    """Start an all-to-all of the flat ``send``: ``send_counts[r]`` elements to rank ``r`` (in
    rank order), ``recv_counts[r]`` from it; returns the received flat tensor, to be read after
    ``finish_all_to_all``. Recorded as the bytes this rank sends to the other ranks."""
    if group.world == 1:
        return send
    elem = send.element_size()
    comms = session.comms
    with comms.capturing(send.device) as issued:         # nothing without the comms logger
        session.record("all_to_all", (sum(send_counts) - send_counts[group.rank]) * elem)
        received = comm.start_all_to_all(send, list(recv_counts), list(send_counts), group.name)
    if issued and comms.settings.blocking:     # waited for here: finish_all_to_all's wait returns at once
        _c10d.wait_tensor(received)
        comms.done(issued, "optimizer step")
    else:
        comms.hold(received, issued)           # timed until finish_all_to_all's wait
    return received


def finish_all_to_all(received: torch.Tensor, *, session) -> torch.Tensor:
    """Wait for an all-to-all ``start_all_to_all`` started (with the same ``session``); return
    the received tensor."""
    out = _c10d.wait_tensor(received)
    session.comms.done(session.comms.unhold(received), "optimizer step")
    return out
