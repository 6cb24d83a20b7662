"""1-bit compression with error feedback, the kernels of DeepSpeed's 1-bit Adam and 0/1 Adam.

**The scheme** (DeepSpeed's ``compressed_allreduce``): a flat float32 buffer ``x`` of ``n``
elements (``n`` a multiple of 8) is sent as its signs and one scale,
``scale = ||x||_2 / sqrt(n)``; a sign is +1 where ``x >= 0`` (zero counts as +1, as in
DeepSpeed's ``sign().add_(1).bool()``; so does NaN), else -1. What the compression lost,
``x - scale * sign``, is the *error* the caller adds to the next buffer (error feedback).
Decompressed, an element is ``scale * sign``.

**Bit layout**: the signs are packed 8 per byte, least significant bit first: bit ``k`` of
byte ``j`` is element ``8 j + k`` (1: +1). DeepSpeed packs with ``cupy.packbits`` (most
significant bit first); the two layouts carry the same information.

Two ops, each with a torch reference (the ``*_reference`` functions, which the kernels are
tested against bit for bit), the C++ kernels of ``csrc/sign_compress.cpp`` on CPU tensors
(built on first use, torch code where they cannot be, logged), and the Triton kernels of
``runtime/triton_sign.py`` on CUDA tensors where Triton imports:

- ``zerocompile::sign_pack(x, scale) -> (packed, error)``;
- ``zerocompile::sign_unpack(packed, scales, average) -> values``: ``rows`` packed rows, one
  scale each; the ``rows * m`` values, or with ``average`` their sum over rows in float32 in
  row order divided by ``rows`` (what the server of a chunk computes).
"""

from __future__ import annotations

import math

import torch

from zerocompile.runtime import cpu_extension, triton_sign

__all__ = ["scale_of", "pack_reference", "unpack_reference", "sign_pack", "sign_unpack"]

_BITS = torch.arange(8, dtype=torch.uint8)


def scale_of(x: torch.Tensor) -> torch.Tensor:
    """The 0-d float32 scale of the flat buffer ``x``: its 2-norm over ``sqrt(numel)``."""
    return torch.linalg.vector_norm(x) / math.sqrt(x.numel())


def pack_reference(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, error)`` of the flat float32 ``x`` with ``scale`` (torch ops only)."""
    positive = ~(x < 0)
    signs = torch.where(positive, 1.0, -1.0).to(torch.float32)
    error = x - scale * signs
    bits = positive.view(-1, 8).to(torch.uint8) << _BITS.to(x.device)
    packed = bits[:, 0]
    for k in range(1, 8):
        packed = packed | bits[:, k]
    return packed, error


def unpack_reference(packed: torch.Tensor, scales: torch.Tensor, average: bool) -> torch.Tensor:
    """The values of ``rows`` packed rows ``packed`` (``[rows, bytes]``) with ``scales`` (torch ops only)."""
    rows = packed.shape[0]
    bits = (packed.unsqueeze(-1) >> _BITS.to(packed.device)) & 1
    signs = torch.where(bits.reshape(rows, -1) != 0, 1.0, -1.0).to(torch.float32)
    values = signs * scales.to(torch.float32).reshape(rows, 1)
    if not average:
        return values.reshape(-1)
    acc = torch.zeros(values.shape[1], dtype=torch.float32, device=packed.device)
    for r in range(rows):                 # in row order, as the kernels sum
        acc = acc + values[r]
    return acc / torch.full_like(acc, float(rows))   # a true division, rounded once


def _check_pack(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.dim() != 1 or x.numel() % 8:
        raise ValueError(f"sign_pack: x must be a flat float32 tensor of a multiple of 8 elements, got "
                         f"{x.dtype} of shape {tuple(x.shape)}")


@torch.library.custom_op("zerocompile::sign_pack", mutates_args=())
def sign_pack(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, error)``: the signs of the flat float32 ``x`` packed 8 per byte (``uint8``,
    ``numel / 8``) and ``x - scale * sign`` (see the module docstring)."""
    _check_pack(x)
    scale = scale.to(torch.float32)
    if x.device.type == "cpu":
        module = cpu_extension.load("sign_compress")
        if module is not None:
            packed, error = module.sign_pack(x.contiguous(), scale)
            return packed, error
    elif x.device.type == "cuda" and triton_sign.available(x.device):
        return triton_sign.pack(x.contiguous(), scale.reshape(()))
    return pack_reference(x, scale)


@sign_pack.register_fake
def _sign_pack_fake(x, scale):
    _check_pack(x)
    return x.new_empty(x.numel() // 8, dtype=torch.uint8), torch.empty_like(x)


def _check_unpack(packed: torch.Tensor, scales: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 2 or scales.numel() != packed.shape[0]:
        raise ValueError(f"sign_unpack: packed must be [rows, bytes] uint8 with one scale per row, got "
                         f"{packed.dtype} {tuple(packed.shape)} and {scales.numel()} scales")


@torch.library.custom_op("zerocompile::sign_unpack", mutates_args=())
def sign_unpack(packed: torch.Tensor, scales: torch.Tensor, average: bool) -> torch.Tensor:
    """The float32 values ``scale_r * sign`` of the packed rows (``rows * 8 * bytes``), or with
    ``average`` their average over rows (``8 * bytes``), summed in row order."""
    _check_unpack(packed, scales)
    scales = scales.to(torch.float32).reshape(-1)
    if packed.device.type == "cpu":
        module = cpu_extension.load("sign_compress")
        if module is not None:
            return module.sign_unpack(packed.contiguous(), scales, average)
    elif packed.device.type == "cuda" and triton_sign.available(packed.device):
        return triton_sign.unpack(packed.contiguous(), scales.contiguous(), average)
    return unpack_reference(packed, scales, average)


@sign_unpack.register_fake
def _sign_unpack_fake(packed, scales, average):
    _check_unpack(packed, scales)
    n = 8 * packed.shape[1]
    return packed.new_empty(n if average else packed.shape[0] * n, dtype=torch.float32)
