"""Bucketed collectives the optimizer issues in eager code, once per optimizer step.

Tensors are grouped in order into buckets of at most ``bucket_bytes`` (a tensor larger
than the cap gets a bucket of its own); each bucket is one collective. Every
collective is recorded for ``zerocompile.stats()``.
"""

from __future__ import annotations

from typing import Callable

import torch

from zerocompile.runtime.accounting import ACCOUNTING
from zerocompile.runtime.comm import CommGroup, pad_flat, start_all_gather_flat

_c10d = torch.ops._c10d_functional


def _buckets(sizes: list[int], cap: int) -> list[list[int]]:
    out, cur, cur_bytes = [], [], 0
    for i, size in enumerate(sizes):
        if cur and cur_bytes + size > cap:
            out.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += size
    if cur:
        out.append(cur)
    return out


def reduce_scatter_mean(grads: list[tuple[torch.Tensor, int]], group: CommGroup, bucket_bytes: int,
                        reduce_dtype: torch.dtype) -> list[torch.Tensor]:
    """Average over ranks each ``(gradient, padded_numel)``; return this rank's chunks.

    Each gradient is cast to ``reduce_dtype`` and zero-padded to ``padded_numel`` (a multiple
    of the world size) into a bucket buffer: two buffers, allocated once per call, take turns,
    so the next bucket's reduce-scatter is in flight while the previous one is averaged."""
    world = group.world
    elem = torch.empty((), dtype=reduce_dtype).element_size()
    results: list[torch.Tensor] = [None] * len(grads)
    if world == 1:
        for i, (g, padded) in enumerate(grads):
            results[i] = pad_flat(g.to(reduce_dtype), padded)
        return results
    buckets = _buckets([padded * elem for _, padded in grads], bucket_bytes)
    if not buckets:
        return results
    cap = max(sum(grads[i][1] for i in bucket) for bucket in buckets)
    device = grads[0][0].device
    slots = [torch.empty(cap, dtype=reduce_dtype, device=device) for _ in range(min(2, len(buckets)))]
    pending = None
    for k, bucket in enumerate([*buckets, None]):
        started = None
        if bucket is not None:
            n = sum(grads[i][1] for i in bucket)
            rows = slots[k % len(slots)][:n].view(world, n // world)
            offset = 0
            for i in bucket:                 # each gradient's chunk of every rank, in its column range
                chunk = grads[i][1] // world
                g = grads[i][0].reshape(-1)
                if g.numel() != world * chunk:
                    g = pad_flat(g.to(reduce_dtype), world * chunk)
                rows[:, offset : offset + chunk].copy_(g.view(world, chunk))   # casts to reduce_dtype
                offset += chunk
            ACCOUNTING.record("reduce_scatter", n * elem)
            started = (bucket, _c10d.reduce_scatter_tensor(rows.reshape(-1), "sum", world, group.name))
        if pending is not None:          # the previous bucket, while this one travels
            done, out = pending
            mine = _c10d.wait_tensor(out).div_(world)
            offset = 0
            for i in done:
                chunk = grads[i][1] // world
                results[i] = mine[offset : offset + chunk]
                offset += chunk
        pending = started
    return results


def all_gather_concat(shards: list[torch.Tensor], group: CommGroup, bucket_bytes: int,
                      write: Callable[[int, torch.Tensor], None]) -> None:
    """All-gather each shard; call ``write(i, rows)`` with shard ``i`` of every rank as a
    ``(world, numel_i)`` view, rank order (read it inside the call: the buffer is reused).

    The shards (one dtype and device) travel in buckets through two pairs of buffers allocated
    once per call: the next bucket's gather is in flight while the previous one is written
    out, and no bucket allocates memory the system must fault in afresh (on the CPU a fresh
    large allocation costs about as much as a copy of it)."""
    world = group.world
    if world == 1:
        for i, t in enumerate(shards):
            write(i, t.reshape(1, -1))
        return
    buckets = _buckets([t.numel() * t.element_size() * world for t in shards], bucket_bytes)
    if not buckets:
        return
    cap = max(sum(shards[i].numel() for i in bucket) for bucket in buckets)
    first = shards[buckets[0][0]]
    slots = [(first.new_empty(cap), first.new_empty(world * cap)) for _ in range(min(2, len(buckets)))]
    pending = None
    for k, bucket in enumerate([*buckets, None]):
        started = None
        if bucket is not None:
            mine, gathered = slots[k % len(slots)]
            n = sum(shards[i].numel() for i in bucket)
            torch.cat([shards[i].reshape(-1) for i in bucket], out=mine[:n])
            ACCOUNTING.record("all_gather", world * n * first.element_size())
            started = (bucket, n, start_all_gather_flat(mine[:n], world, group.name, out=gathered[: world * n]))
        if pending is not None:       # the previous bucket, while this one travels
            done, n, out = pending
            rows = _c10d.wait_tensor(out).view(world, n)
            offset = 0
            for i in done:
                chunk = shards[i].numel()
                write(i, rows[:, offset : offset + chunk])
                offset += chunk
        pending = started


def all_reduce_mean_(tensors: list[torch.Tensor], group: CommGroup, bucket_bytes: int,
                     reduce_dtype: torch.dtype) -> None:
    """Average each tensor over ranks, in place, reducing in ``reduce_dtype``: buckets go through
    two buffers allocated once per call, reduced in place, the next one in flight while the
    previous one is copied back."""
    world = group.world
    if world == 1:
        return
    buckets = _buckets([t.numel() * torch.empty((), dtype=reduce_dtype).element_size() for t in tensors],
                       bucket_bytes)
    if not buckets:
        return
    cap = max(sum(tensors[i].numel() for i in bucket) for bucket in buckets)
    slots = [torch.empty(cap, dtype=reduce_dtype, device=tensors[0].device) for _ in range(min(2, len(buckets)))]
    pending = None
    for k, bucket in enumerate([*buckets, None]):
        started = None
        if bucket is not None:
            n = sum(tensors[i].numel() for i in bucket)
            flat = slots[k % len(slots)][:n]
            offset = 0
            for i in bucket:
                flat[offset : offset + tensors[i].numel()].copy_(tensors[i].reshape(-1))   # casts
                offset += tensors[i].numel()
            ACCOUNTING.record("all_reduce", n * flat.element_size())
            started = (bucket, _c10d.all_reduce_(flat, "sum", group.name))
        if pending is not None:       # the previous bucket, while this one travels
            done, out = pending
            total = _c10d.wait_tensor(out).div_(world)
            offset = 0
            for i in done:
                n = tensors[i].numel()
                tensors[i].copy_(total[offset : offset + n].view_as(tensors[i]))
                offset += n
        pending = started
