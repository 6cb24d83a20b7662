"""Bucketed collectives the optimizer issues in eager code, once per optimizer step.

Tensors are grouped in order into buckets of at most ``bucket_bytes`` (a tensor larger
than the cap gets a bucket of its own); each bucket is one collective. Every
collective is recorded for ``zerocompile.stats()``.
"""

from __future__ import annotations

import torch

from zerocompile.runtime.accounting import ACCOUNTING
from zerocompile.runtime.comm import CommGroup, all_gather_flat, all_reduce_sum, pad_flat, reduce_scatter_flat


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
    of the world size) one bucket at a time, so the transient copy is one bucket.
    """
    world = group.world
    elem = torch.empty((), dtype=reduce_dtype).element_size()
    results: list[torch.Tensor] = [None] * len(grads)
    for bucket in _buckets([padded * elem for _, padded in grads], bucket_bytes):
        rows = torch.cat([pad_flat(grads[i][0].to(reduce_dtype), grads[i][1]).view(world, -1)
                          for i in bucket], dim=1)
        if world > 1:
            ACCOUNTING.record("reduce_scatter", rows.numel() * rows.element_size())
        mine = reduce_scatter_flat(rows.reshape(-1), world, group.name)
        if world > 1:
            mine = mine / world
        offset = 0
        for i in bucket:
            chunk = grads[i][1] // world
            results[i] = mine[offset : offset + chunk]
            offset += chunk
    return results


def all_gather_concat(shards: list[torch.Tensor], group: CommGroup, bucket_bytes: int) -> list[torch.Tensor]:
    """All-gather each shard; return the flat ``world * chunk_i`` tensors in rank order."""
    world = group.world
    results: list[torch.Tensor] = [None] * len(shards)
    sizes = [t.numel() * t.element_size() * world for t in shards]
    for bucket in _buckets(sizes, bucket_bytes):
        mine = torch.cat([shards[i].reshape(-1) for i in bucket])
        gathered = all_gather_flat(mine, world, group.name).view(world, -1)
        if world > 1:
            ACCOUNTING.record("all_gather", gathered.numel() * gathered.element_size())
        offset = 0
        for i in bucket:
            chunk = shards[i].numel()
            results[i] = gathered[:, offset : offset + chunk].reshape(-1)
            offset += chunk
    return results


def all_reduce_mean_(tensors: list[torch.Tensor], group: CommGroup, bucket_bytes: int,
                     reduce_dtype: torch.dtype) -> None:
    """Average each tensor over ranks, in place, reducing in ``reduce_dtype``."""
    world = group.world
    if world == 1:
        return
    sizes = [t.numel() * torch.empty((), dtype=reduce_dtype).element_size() for t in tensors]
    for bucket in _buckets(sizes, bucket_bytes):
        flat = torch.cat([tensors[i].reshape(-1).to(reduce_dtype) for i in bucket])
        ACCOUNTING.record("all_reduce", flat.numel() * flat.element_size())
        total = all_reduce_sum(flat, world, group.name) / world
        offset = 0
        for i in bucket:
            n = tensors[i].numel()
            tensors[i].copy_(total[offset : offset + n].view_as(tensors[i]))
            offset += n
