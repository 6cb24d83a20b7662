"""ZeRO++'s quantization (runtime/quantization.py) as Triton kernels, for CUDA tensors.

Two kernels, each one program per block of ``BLOCK`` elements of a row (the grid's second
axis is the row):

- ``quantize``: float rows (float32, bfloat16 or float16) -> int8 values and float32 scales,
  written straight into the quantized buckets' ``uint8`` rows (values at the row's start,
  scales at ``bucket_layout``'s offset);
- ``dequantize``: quantized rows -> either one float row per input row (the all-gathered
  weights) or, with ``REDUCE``, their sum over rows in float32 in row order, divided by a
  divisor (the gradient reduction).

The arithmetic is the torch reference's: ``amax`` per block, ``127 / amax`` and ``amax / 127``
as IEEE-rounded divisions (``div_rn``), round half to even (written with ``floor``, exact for
every finite value), bfloat16 rounded to nearest even with integer operations (the same bits on
a GPU and in Triton's interpreter, whose float cast truncates; ``runtime/triton_common.py``).
Under ``TRITON_INTERPRET=1`` the kernels run on the CPU and the tests compare them bit for bit
with the reference; on a GPU the reduction's multiply-add may be fused into an FMA (one
rounding fewer), so the reduced gradients agree with the reference within float32 rounding.

The callers (``quantize_pack`` and friends in runtime/quantization.py) copy the shards into
one contiguous float buffer first (``torch.cat``) and the gathered weights out of the dense
rows after (``split_with_sizes_copy``); the C++ kernels do those copies inside their loops.
Triton is imported only when a kernel is first used; it comes with torch's CUDA builds.
"""

from __future__ import annotations

import functools

import torch

from zerocompile import env
from zerocompile.runtime.quantized_layout import bucket_layout

__all__ = ["available", "quantize_rows_into", "dequantize_rows"]


def available(device: torch.device) -> bool:
    """The kernels can run for tensors on ``device``: Triton imports, and the device is CUDA
    (or the interpreter is on and the device is the CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and env.triton_interpret()


@functools.cache
def _kernels():
    """The jitted kernels, defined on first use and kept (Triton caches binaries on them)."""
    import triton
    import triton.language as tl

    from zerocompile.runtime import triton_common

    @triton.jit
    def round_half_even(y):
        r = tl.floor(y)
        d = y - r                                         # exact: y and floor(y) are close
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(d > 0.5, r + 1.0, tl.where(d < 0.5, r, tl.where(odd, r + 1.0, r)))

    @triton.jit
    def quantize_kernel(x_ptr, out_ptr, n, x_row_stride, row_bytes, scales_offset, round_half_even: tl.constexpr,
                        BLOCK: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        block = tl.program_id(0).to(tl.int64)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + row * x_row_stride + offsets, mask=mask, other=0.0).to(tl.float32)
        nans = tl.sum((x != x).to(tl.int32), axis=0)
        amax = tl.max(tl.abs(x), axis=0)
        amax = tl.where(nans > 0, float("nan"), amax)
        inv = tl.where(amax > 0.0, tl.div_rn(127.0, amax), 0.0)
        inv = tl.where(nans > 0, float("nan"), inv)
        y = round_half_even(x * inv)
        finite = (y == y) & (tl.abs(y) < float("inf"))
        q = tl.where(finite, y, 0.0).to(tl.int8)
        base = out_ptr + row * row_bytes
        tl.store(base.to(tl.pointer_type(tl.int8)) + offsets, q, mask=mask)
        scale_ptr = (base + scales_offset).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr + block, tl.div_rn(amax, 127.0))

    @triton.jit
    def dequantize_kernel(in_ptr, out_ptr, n, rows, row_bytes, scales_offset, out_row_stride, divisor,
                          store_float: tl.constexpr, REDUCE: tl.constexpr, DIVIDE: tl.constexpr,
                          BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        if REDUCE:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in range(rows):
                base = in_ptr + r * row_bytes
                q = tl.load(base.to(tl.pointer_type(tl.int8)) + offsets, mask=mask, other=0).to(tl.float32)
                scale = tl.load((base + scales_offset).to(tl.pointer_type(tl.float32)) + block)
                acc = acc + q * scale
            if DIVIDE:
                acc = tl.div_rn(acc, divisor)
            store_float(out_ptr, offsets, acc, mask)
        else:
            r = tl.program_id(1).to(tl.int64)
            base = in_ptr + r * row_bytes
            q = tl.load(base.to(tl.pointer_type(tl.int8)) + offsets, mask=mask, other=0).to(tl.float32)
            scale = tl.load((base + scales_offset).to(tl.pointer_type(tl.float32)) + block)
            store_float(out_ptr + r * out_row_stride, offsets, q * scale, mask)

    # the helpers go in as constexpr arguments: a kernel defined in a function cannot see them
    # as globals, and Triton does not resolve closures (as in triton_adam.py); the rounding
    # store is runtime/triton_common.py's
    return (functools.partial(_launch, quantize_kernel, {"round_half_even": round_half_even}),
            functools.partial(_launch, dequantize_kernel, {"store_float": triton_common.rounding_store()}))


def _launch(kernel, helpers, grid, *args, **meta):
    kernel[grid](*args, **helpers, **meta)


def quantize_rows_into(x: torch.Tensor, block: int) -> torch.Tensor:
    """The quantized buckets (``uint8``, ``rows * bucket_layout(n)[2]`` bytes) of the rows of
    the contiguous float ``x`` of shape ``[rows, n]``."""
    quantize_kernel, _ = _kernels()
    rows, n = x.shape
    offset, num_blocks, row = bucket_layout(n, block)
    out = torch.zeros(rows * row, dtype=torch.uint8, device=x.device)
    if n:
        quantize_kernel((num_blocks, rows), x, out, n, x.stride(0), row, offset, BLOCK=block)
    return out


def dequantize_rows(buckets: torch.Tensor, rows: int, n: int, block: int, dtype: torch.dtype,
                    reduce: bool = False, divisor: float = 1.0) -> torch.Tensor:
    """The ``[rows, n]`` values (``dtype``) of ``rows`` quantized buckets, or with ``reduce``
    their ``[n]`` sum over rows in float32, in row order, divided by ``divisor``."""
    _, dequantize_kernel = _kernels()
    offset, num_blocks, row = bucket_layout(n, block)
    out = torch.empty((n,) if reduce else (rows, n), dtype=dtype, device=buckets.device)
    if n:
        grid = (num_blocks,) if reduce else (num_blocks, rows)
        dequantize_kernel(grid, buckets, out, n, rows, row, offset, n, float(divisor), REDUCE=reduce,
                          DIVIDE=(divisor != 1.0), BLOCK=block)
    return out
