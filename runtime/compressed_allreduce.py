"""DeepSpeed's compressed all-reduce (1-bit Adam, 0/1 Adam): the average over ranks of a
float32 buffer, sent as signs and scales with error feedback, in two phases.

1. **worker**: ``buffer = x + worker_error`` (``x`` zero-padded to ``padded_size``: a
   multiple of ``8 * world``, so every rank's chunk is whole bytes); ``scale = ||buffer|| /
   sqrt(n)``; ``worker_error = buffer - scale * sign(buffer)``. The packed signs are cut into
   ``world`` chunks and exchanged with one all-to-all, each chunk carrying the worker's scale
   (4 bytes): rank ``i`` becomes the *server* of chunk ``i`` and receives it from every worker.
2. **server**: ``avg = mean_r(scale_r * sign_r) + server_error`` over the workers ``r`` (in rank
   order), compressed again: ``server_scale = ||avg|| / sqrt(chunk)``, ``server_error = avg -
   server_scale * sign(avg)``; the server signs and scale are all-gathered, and every rank
   decompresses the same ``world`` chunks: the same result on every rank, bitwise.

Per call a rank sends about ``2 * padded / 8`` bytes plus ``8 * world`` bytes of scales,
instead of the ``4 * n`` of a float32 all-reduce: 1/16 of it, plus padding and scales.
The model's session records the all-to-all as ``compressed_all_to_all`` and the all-gather as
``compressed_all_gather`` (full buffers, as for the other kinds), so ``zerocompile.stats()``
lists them. At world size 1 there is nothing to average: the buffer comes back unchanged and
the errors stay as they are (as in DeepSpeed).
"""

from __future__ import annotations

import torch

from zerocompile.runtime.comm import CommGroup, start_all_gather_flat, start_all_to_all
from zerocompile.runtime.sign_compression import scale_of, sign_pack, sign_unpack

__all__ = ["padded_size", "compressed_allreduce", "worker_compress", "server_compress", "decompress"]

_c10d = torch.ops._c10d_functional
SCALE_BYTES = 4
"""A float32 scale travels as 4 bytes at the end of each chunk's row."""


def padded_size(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of ``8 * world`` (the size of ``worker_error``;
    ``server_error`` holds ``padded_size // world``)."""
    unit = 8 * world
    return -(-numel // unit) * unit


def _rows(packed: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` uint8 rows: a chunk of ``packed`` each, then ``scale``'s 4 bytes."""
    out = torch.empty(rows, packed.numel() // rows + SCALE_BYTES, dtype=torch.uint8, device=packed.device)
    out[:, :-SCALE_BYTES] = packed.view(rows, -1)
    out[:, -SCALE_BYTES:] = scale.reshape(1).to(torch.float32).view(torch.uint8)
    return out


def _split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed signs [rows, bytes], scales [rows])`` of received rows."""
    return rows[:, :-SCALE_BYTES].contiguous(), rows[:, -SCALE_BYTES:].contiguous().view(torch.float32).reshape(-1)


def worker_compress(x: torch.Tensor, worker_error: torch.Tensor, world: int) -> torch.Tensor:
    """Phase 1 on one rank: the ``world`` rows to send (row ``i`` to rank ``i``); updates
    ``worker_error`` in place. ``x``: flat float32, at most ``worker_error.numel()`` elements."""
    buffer = torch.zeros_like(worker_error)
    buffer[: x.numel()] = x.reshape(-1)
    buffer.add_(worker_error)
    scale = scale_of(buffer)
    packed, error = sign_pack(buffer, scale)
    worker_error.copy_(error)
    return _rows(packed, scale, world)


def server_compress(received: torch.Tensor, server_error: torch.Tensor) -> torch.Tensor:
    """Phase 2 on the server of one chunk: from the ``world`` rows received (row ``r`` from
    worker ``r``), the row every rank gathers; updates ``server_error`` in place."""
    signs, scales = _split(received)
    average = sign_unpack(signs, scales, True).add_(server_error)
    scale = scale_of(average)
    packed, error = sign_pack(average, scale)
    server_error.copy_(error)
    return _rows(packed, scale, 1)[0]


def decompress(gathered: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` averaged values from the ``world`` gathered server rows."""
    signs, scales = _split(gathered)
    return sign_unpack(signs, scales, False)[:numel]


def compressed_allreduce(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                         group: CommGroup, session) -> torch.Tensor:
    """The compressed average over ``group`` of the float32 ``x`` (any shape): a new tensor of
    ``x``'s shape, the same on every rank. ``worker_error`` (``padded_size(x.numel(), world)``
    elements) and ``server_error`` (``1 / world`` of that) are this rank's error-feedback
    buffers, updated in place. ``session``: the model's ``ModelSession``, which counts the
    collectives."""
    world = group.world
    if world == 1:
        return x.clone()
    if worker_error.numel() != padded_size(x.numel(), world) or server_error.numel() * world != worker_error.numel():
        raise ValueError(f"compressed_allreduce: error buffers of {worker_error.numel()} and {server_error.numel()} "
                         f"elements for a buffer of {x.numel()} at world size {world}")
    send = worker_compress(x.to(torch.float32), worker_error, world)
    row = send.shape[1]
    session.record("compressed_all_to_all", send.numel())
    received = _c10d.wait_tensor(start_all_to_all(send.reshape(-1), [row] * world, [row] * world,
                                                  group.name)).view(world, row)
    mine = server_compress(received, server_error)
    session.record("compressed_all_gather", world * mine.numel())
    gathered = _c10d.wait_tensor(start_all_gather_flat(mine, world, group.name)).view(world, row)
    return decompress(gathered, x.numel()).view(x.shape).to(x.dtype)
