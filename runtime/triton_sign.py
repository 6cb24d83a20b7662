"""1-bit compression (runtime/sign_compression.py) as Triton kernels, for CUDA tensors.

Two kernels, one program per ``BYTES`` packed bytes (``8 * BYTES`` elements):

- ``pack``: float32 values and a scale -> the signs packed 8 per byte, least significant bit
  first (zero and NaN count as +1), and the compression error ``x - scale * sign``;
- ``unpack``: packed rows and one scale per row -> ``scale_r * sign`` per row, or with
  ``AVERAGE`` their sum over rows in float32, in row order, divided by the row count
  (``div_rn``: IEEE rounding on a GPU too).

``scale * sign`` is exact (a sign flip), so ``x - scale * sign`` rounds once even where the GPU
fuses it into an FMA: the kernels' results are bitwise the torch reference's, which the tests
check on the CPU under ``TRITON_INTERPRET=1``. Triton is imported when a kernel is first used.
"""

from __future__ import annotations

import functools

import torch

from zerocompile import env

__all__ = ["available", "pack", "unpack"]

BYTES = 128
"""Packed bytes per program."""


def available(device: torch.device) -> bool:
    """The kernels can run for tensors on ``device``: Triton imports, and the device is CUDA
    (or the interpreter is on and the device is the CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or (device.type == "cpu" and env.triton_interpret())


@functools.cache
def _kernels():
    """The jitted kernels, defined on first use and kept (Triton caches binaries on them)."""
    import triton
    import triton.language as tl

    @triton.jit
    def pack_kernel(x_ptr, scale_ptr, packed_ptr, error_ptr, nbytes, BYTES: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BYTES
        byte = start + tl.arange(0, BYTES)
        bit = tl.arange(0, 8)
        offsets = byte[:, None] * 8 + bit[None, :]
        mask = (byte < nbytes)[:, None] & (bit < 8)[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        scale = tl.load(scale_ptr)
        positive = x >= 0.0
        positive = positive | (x != x)                       # NaN counts as +1, as in the reference
        sign = tl.where(positive, 1.0, -1.0)
        tl.store(error_ptr + offsets, x - scale * sign, mask=mask)
        bits = tl.where(positive, 1, 0).to(tl.int32) << bit[None, :]
        tl.store(packed_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte < nbytes)

    @triton.jit
    def unpack_kernel(packed_ptr, scales_ptr, out_ptr, nbytes, rows, AVERAGE: tl.constexpr, BYTES: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BYTES
        byte = start + tl.arange(0, BYTES)
        bit = tl.arange(0, 8)
        offsets = byte[:, None] * 8 + bit[None, :]
        mask = (byte < nbytes)[:, None] & (bit < 8)[None, :]
        if AVERAGE:
            acc = tl.zeros([BYTES, 8], dtype=tl.float32)
            for r in range(rows):
                b = tl.load(packed_ptr + r * nbytes + byte, mask=byte < nbytes, other=0).to(tl.int32)
                positive = ((b[:, None] >> bit[None, :]) & 1) != 0
                acc = acc + tl.load(scales_ptr + r) * tl.where(positive, 1.0, -1.0)
            tl.store(out_ptr + offsets, tl.div_rn(acc, tl.zeros([BYTES, 8], dtype=tl.float32) + rows), mask=mask)
        else:
            r = tl.program_id(1).to(tl.int64)
            b = tl.load(packed_ptr + r * nbytes + byte, mask=byte < nbytes, other=0).to(tl.int32)
            positive = ((b[:, None] >> bit[None, :]) & 1) != 0
            value = tl.load(scales_ptr + r) * tl.where(positive, 1.0, -1.0)
            tl.store(out_ptr + r * nbytes * 8 + offsets, value, mask=mask)

    return pack_kernel, unpack_kernel


def pack(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, error)`` of the contiguous float32 ``x`` (a multiple of 8 elements) and the
    0-d float32 ``scale``."""
    pack_kernel, _ = _kernels()
    nbytes = x.numel() // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    error = torch.empty_like(x)
    if nbytes:
        pack_kernel[(triton_cdiv(nbytes),)](x, scale.reshape(1), packed, error, nbytes, BYTES=BYTES)
    return packed, error


def unpack(packed: torch.Tensor, scales: torch.Tensor, average: bool) -> torch.Tensor:
    """The values of the contiguous ``[rows, bytes]`` uint8 ``packed`` with float32 ``scales``
    (one per row): ``rows * 8 * bytes`` of them, or with ``average`` the ``8 * bytes`` averages."""
    _, unpack_kernel = _kernels()
    rows, nbytes = packed.shape
    out = torch.empty(8 * nbytes if average else rows * 8 * nbytes, dtype=torch.float32, device=packed.device)
    if nbytes:
        grid = (triton_cdiv(nbytes),) if average else (triton_cdiv(nbytes), rows)
        unpack_kernel[grid](packed, scales, out, nbytes, rows, AVERAGE=average, BYTES=BYTES)
    return out


def triton_cdiv(nbytes: int) -> int:
    """Programs for ``nbytes`` packed bytes."""
    return -(-nbytes // BYTES)
