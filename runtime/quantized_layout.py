"""The byte layout of one rank's quantized bucket (ZeRO++ qwZ and qgZ).

``n`` int8 values, zero bytes up to a multiple of 4, then the ``ceil(n / block)`` float32
scales, all as ``uint8``. The torch reference and the C++ kernels (``runtime/quantization.py``,
``csrc/quantize.cpp``) and the Triton kernels (``runtime/triton_quantize.py``) write and read
this layout; the passes size the quantized collectives with it.
"""

from __future__ import annotations

__all__ = ["BLOCK", "bucket_layout"]

BLOCK = 256
"""Elements per float32 scale. The scales add ``4 / BLOCK`` bytes per element (1.6%) to the
int8 values; DeepSpeed's qwZ uses groups of about 8,000 elements (its code says 4,000 is
best), where one outlier coarsens more weights."""


def bucket_layout(n: int, block: int = BLOCK) -> tuple[int, int, int]:
    """``(scales_offset, num_blocks, row_bytes)`` of one rank's quantized bucket of ``n``
    elements: the scales start at ``scales_offset`` (``n`` rounded up to a multiple of 4)."""
    num_blocks = -(-n // block)
    offset = -(-n // 4) * 4
    return offset, num_blocks, offset + 4 * num_blocks
