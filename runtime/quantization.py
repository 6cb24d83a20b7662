"""Blockwise int8 quantization of the weights an all-gather moves (ZeRO++ qwZ).

With ``zero_quantized_weights`` the ``quantize_weight_gathers`` pass (passes/) replaces every
parameter all-gather of a compiled graph by an all-gather of a *quantized bucket*: each rank
quantizes its shards into one ``uint8`` buffer, the buffers are gathered with one collective,
and every rank dequantizes the gathered rows into the parameters' dtype.

**The scheme** (symmetric, one scale per block, as DeepSpeed's qwZ):

- a rank's shards are concatenated (``n`` elements) and cut into blocks of ``BLOCK``
  consecutive elements (the last may be shorter);
- per block, ``amax`` = the largest absolute value, in float32; the stored scale is
  ``amax / 127`` (float32); each value becomes ``round(x * (127 / amax))`` (round half to
  even), an int8 in [-127, 127], or 0 where ``amax`` is 0;
- dequantized, a value is ``q * scale`` in float32, then cast to the parameter dtype. Its
  error is at most ``amax / 254`` (half a step), plus float32 rounding.

A NaN or infinite value makes its block's scale NaN or infinite, so the whole block
dequantizes to NaN: a broken weight stays visible in the loss.

**The quantized bucket of one rank** (``bucket_layout`` of ``runtime/quantized_layout.py``):
``n`` int8 values, zero bytes up to a multiple of 4, then the ``ceil(n / BLOCK)`` float32
scales, all as ``uint8``. The all-gather returns ``world`` such rows. Values and scales travel
in one collective, so the prefetch pass moves them as one, and every rank dequantizes the same
bytes into the same parameters.

**Gradients (ZeRO++ qgZ, ``zero_quantized_gradients``).** A reduce-scatter bucket becomes
``quantize_rows`` (one quantized row per destination rank, same scheme and layout), an
all-to-all of the rows, and ``dequantize_reduce`` (each rank sums the ``world`` rows it
received, dequantized, in float32 and in rank order). Each rank's contribution is rounded once,
by at most half a step of its block; the sum is in full precision. DeepSpeed's qgZ uses int4
values (twice the step); int8 halves that error for twice its bytes.

On CUDA tensors the ops run the Triton kernels of ``runtime/triton_quantize.py`` where Triton
imports, else the torch code below. The ops (``zerocompile::quantize_pack``,
``dequantize_unpack``, ``quantize_rows``, ``dequantize_reduce``) run the C++
kernels of ``csrc/quantize.cpp`` on CPU tensors where they build, else the torch code below
(the reference the kernels are tested against), which also serves other devices.
"""

from __future__ import annotations

import torch

from zerocompile.runtime import cpu_extension, triton_quantize
from zerocompile.runtime.quantized_layout import BLOCK, bucket_layout

__all__ = ["BLOCK", "bucket_layout", "quantize_reference", "dequantize_reference", "quantize_pack",
           "dequantize_unpack", "quantize_rows", "dequantize_reduce"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize_reference(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: the int8 values and float32 scales of the flat ``x`` (torch ops only)."""
    n = x.numel()
    num_blocks = -(-n // block)
    padded = torch.zeros(num_blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    blocks = padded.view(num_blocks, block)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    # tensor by tensor: a true division, rounded once (``127.0 / amax`` is a reciprocal and a
    # product, and a division by a Python scalar may be a product too, each rounded twice)
    levels = torch.full_like(amax, 127.0)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    inv = torch.where(torch.isnan(amax), amax, inv)    # 0 * NaN stays NaN: the block shows it
    y = torch.round(blocks * inv)
    q = torch.where(torch.isfinite(y), y, torch.zeros_like(y)).to(torch.int8)
    return q.view(-1)[:n], (amax / levels).view(-1)


def dequantize_reference(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """The flat values of ``q`` and its ``scales`` in ``dtype`` (torch ops only)."""
    n = q.numel()
    expanded = scales.repeat_interleave(block)[:n]
    return (q.to(torch.float32) * expanded).to(dtype)


def _pack_torch(shards: list[torch.Tensor], block: int) -> torch.Tensor:
    flat = torch.cat([s.reshape(-1) for s in shards])
    q, scales = quantize_reference(flat, block)
    offset, num_blocks, row = bucket_layout(flat.numel(), block)
    out = torch.zeros(row, dtype=torch.uint8, device=flat.device)
    out[:flat.numel()] = q.view(torch.uint8)
    out[offset:] = scales.view(torch.uint8)
    return out


def _unpack_torch(gathered: torch.Tensor, world: int, chunks: list[int], block: int,
                  dtype: torch.dtype) -> list[torch.Tensor]:
    n = sum(chunks)
    offset, num_blocks, row = bucket_layout(n, block)
    rows = gathered.view(world, row)
    values = torch.stack([
        dequantize_reference(r[:n].view(torch.int8), r[offset:].view(torch.float32), dtype, block) for r in rows])
    outs = [torch.empty(world * c, dtype=dtype, device=gathered.device) for c in chunks]
    torch.split_with_sizes_copy(values, chunks, dim=1, out=[o.view(world, c) for o, c in zip(outs, chunks)])
    return outs


# the Triton path (CUDA; on the CPU under TRITON_INTERPRET=1 for the tests): the copies into
# and out of a contiguous buffer are torch ops, the quantization the kernels of
# runtime/triton_quantize.py
def _pack_triton(shards: list[torch.Tensor], block: int) -> torch.Tensor:
    flat = torch.cat([s.reshape(-1) for s in shards])
    return triton_quantize.quantize_rows_into(flat.view(1, -1), block)


def _unpack_triton(gathered: torch.Tensor, world: int, chunks: list[int], block: int,
                   dtype: torch.dtype) -> list[torch.Tensor]:
    values = triton_quantize.dequantize_rows(gathered, world, sum(chunks), block, dtype)
    outs = [torch.empty(world * c, dtype=dtype, device=gathered.device) for c in chunks]
    torch.split_with_sizes_copy(values, chunks, dim=1, out=[o.view(world, c) for o, c in zip(outs, chunks)])
    return outs


def _rows_triton(grads: list[torch.Tensor], world: int, block: int) -> torch.Tensor:
    rows = torch.cat([g.reshape(world, -1) for g in grads], dim=1)
    return triton_quantize.quantize_rows_into(rows, block)


def _reduce_triton(received: torch.Tensor, world: int, n: int, block: int, dtype: torch.dtype,
                   divisor: float) -> torch.Tensor:
    return triton_quantize.dequantize_rows(received, world, n, block, dtype, reduce=True, divisor=divisor)


def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" and triton_quantize.available(device)


def _check_shards(shards: list[torch.Tensor], block: int) -> None:
    if not shards:
        raise ValueError("quantize_pack: no shards to pack")
    dtypes = {s.dtype for s in shards}
    if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_DTYPES:
        raise ValueError(f"quantize_pack: the shards must share one of {FLOAT_DTYPES}; got {sorted(map(str, dtypes))}")
    if block < 1:
        raise ValueError(f"quantize_pack: block must be >= 1, got {block}")


@torch.library.custom_op("zerocompile::quantize_pack", mutates_args=())
def quantize_pack(shards: list[torch.Tensor], block: int) -> torch.Tensor:
    """One rank's quantized bucket (``uint8``, ``bucket_layout``) of the concatenated flat
    ``shards`` (float32, bfloat16 or float16, one dtype)."""
    _check_shards(shards, block)
    if all(s.device.type == "cpu" for s in shards):
        module = cpu_extension.load("quantize")
        if module is not None:
            return module.quantize_pack([s.reshape(-1).contiguous() for s in shards], block)
    elif _use_triton(shards[0].device):
        return _pack_triton(shards, block)
    return _pack_torch(shards, block)


@quantize_pack.register_fake
def _quantize_pack_fake(shards, block):
    n = sum(s.numel() for s in shards)
    return shards[0].new_empty(bucket_layout(n, block)[2], dtype=torch.uint8)


@torch.library.custom_op("zerocompile::dequantize_unpack", mutates_args=())
def dequantize_unpack(gathered: torch.Tensor, world: int, chunks: list[int], block: int,
                      dtype: torch.dtype) -> list[torch.Tensor]:
    """The flat ``world * chunks[i]`` parameters (``dtype``) in the all-gathered quantized
    buckets ``gathered`` (``world`` rows of ``bucket_layout(sum(chunks))``), each a new
    contiguous tensor in rank order, as ``unpack_gathered_bucket`` returns them unquantized."""
    if gathered.dtype != torch.uint8:
        raise ValueError(f"dequantize_unpack: the gathered buckets must be uint8, got {gathered.dtype}")
    if gathered.numel() != world * bucket_layout(sum(chunks), block)[2]:
        raise ValueError(f"dequantize_unpack: {gathered.numel()} bytes are not {world} quantized buckets of "
                         f"{sum(chunks)} elements")
    if gathered.device.type == "cpu":
        module = cpu_extension.load("quantize")
        if module is not None:
            return module.dequantize_unpack(gathered.contiguous(), world, list(chunks), block, dtype)
    elif _use_triton(gathered.device):
        return _unpack_triton(gathered.contiguous(), world, list(chunks), block, dtype)
    return _unpack_torch(gathered, world, chunks, block, dtype)


@dequantize_unpack.register_fake
def _dequantize_unpack_fake(gathered, world, chunks, block, dtype):
    return [gathered.new_empty(world * c, dtype=dtype) for c in chunks]


# --------------------------------------------------------------- qgZ: gradient reduction
def _rows_torch(grads: list[torch.Tensor], world: int, block: int) -> torch.Tensor:
    rows = [g.reshape(world, -1) for g in grads]
    return torch.cat([_pack_torch([r[i] for r in rows], block) for i in range(world)])


def _reduce_torch(received: torch.Tensor, world: int, n: int, block: int, dtype: torch.dtype,
                  divisor: float) -> torch.Tensor:
    offset, _, row = bucket_layout(n, block)
    rows = received.view(world, row)
    acc = torch.zeros(n, dtype=torch.float32, device=received.device)
    for r in rows:             # in rank order, as every rank sums its own chunk
        acc += dequantize_reference(r[:n].view(torch.int8), r[offset:].view(torch.float32), torch.float32, block)
    if divisor != 1.0:
        acc = acc / torch.full_like(acc, divisor)
    return acc.to(dtype)


@torch.library.custom_op("zerocompile::quantize_rows", mutates_args=())
def quantize_rows(grads: list[torch.Tensor], world: int, block: int, groups: int = 1) -> torch.Tensor:
    """The ``world`` quantized rows (``uint8``, each ``bucket_layout(sum(chunks) * groups)``) of a
    reduce-scatter bucket: gradient ``i`` is viewed as ``[groups, world, chunks[i]]``, and row
    ``r`` is the quantized concatenation, for each ``h < groups`` in turn, of chunk ``(h, r)`` of
    every gradient. With ``groups = 1`` row ``r`` is what rank ``r`` reduces. With ``groups = G``
    it is the first hop of a hierarchical reduction over ``G`` groups of ``world`` ranks: row
    ``r`` goes to the ``r``-th rank of this rank's group and holds the chunks of the ranks
    ``h * world + r``, ordered by ``h``, so that the sum it receives is, viewed as
    ``[G, sum(chunks)]``, the input of the second hop (``quantize_rows([sum], G, block)``)."""
    _check_shards(grads, block)
    if groups < 1 or any(g.numel() % (world * groups) for g in grads):
        raise ValueError(f"quantize_rows: every gradient must have a multiple of world={world} x groups={groups} "
                         f"elements")
    if groups > 1:   # views, no copy: row r's part of group h of gradient i is slice h's chunk r
        grads = [g.reshape(groups, -1)[h] for h in range(groups) for g in grads]
    if all(g.device.type == "cpu" for g in grads):
        module = cpu_extension.load("quantize")
        if module is not None:
            return module.quantize_rows([g.reshape(-1).contiguous() for g in grads], world, block)
    elif _use_triton(grads[0].device):
        return _rows_triton(grads, world, block)
    return _rows_torch(grads, world, block)


@quantize_rows.register_fake
def _quantize_rows_fake(grads, world, block, groups=1):
    n = sum(g.numel() for g in grads) // world
    return grads[0].new_empty(world * bucket_layout(n, block)[2], dtype=torch.uint8)


@torch.library.custom_op("zerocompile::dequantize_reduce", mutates_args=())
def dequantize_reduce(received: torch.Tensor, world: int, n: int, block: int, dtype: torch.dtype,
                      divisor: float) -> torch.Tensor:
    """This rank's ``n`` reduced elements (``dtype``) from the ``world`` quantized rows the
    all-to-all delivered (row ``s`` from rank ``s``): dequantized and summed in float32 in rank
    order, divided by ``divisor`` (the world size for an average, else 1)."""
    if received.dtype != torch.uint8:
        raise ValueError(f"dequantize_reduce: the received rows must be uint8, got {received.dtype}")
    if received.numel() != world * bucket_layout(n, block)[2]:
        raise ValueError(f"dequantize_reduce: {received.numel()} bytes are not {world} quantized rows of {n} elements")
    if received.device.type == "cpu":
        module = cpu_extension.load("quantize")
        if module is not None:
            return module.dequantize_reduce(received.contiguous(), world, n, block, dtype, float(divisor))
    elif _use_triton(received.device):
        return _reduce_triton(received.contiguous(), world, n, block, dtype, float(divisor))
    return _reduce_torch(received, world, n, block, dtype, float(divisor))


@dequantize_reduce.register_fake
def _dequantize_reduce_fake(received, world, n, block, dtype, divisor):
    return received.new_empty(n, dtype=dtype)
