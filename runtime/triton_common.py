"""The Triton helper the kernels of ``runtime/triton_adam.py`` and ``runtime/triton_quantize.py``
share: storing float32 values in an output's dtype, rounded to nearest even.

This module imports Triton (it comes with torch's CUDA builds), so the kernel modules import it
only when they build their kernels. ``triton.language`` is a global here on purpose: Triton's
interpreter (``TRITON_INTERPRET=1``) looks for it among the globals of a jitted function's
module. A kernel defined in a function cannot see the helper as a global and Triton does not
resolve closures, so the kernels take it as a ``tl.constexpr`` argument.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rounding_store"]


def rounding_store():
    """A jitted ``store(ptr, offsets, x, mask)``, defined afresh on each call: each caller makes
    it with its kernels and keeps it with them (``functools.cache``), so that clearing a
    kernel's cache (the tests' switch to ``TRITON_INTERPRET=1``, read when Triton jits a
    function) rebuilds its helper under the same setting."""
    @triton.jit
    def store(ptr, offsets, x, mask):
        """Store float32 ``x`` in ``ptr``'s dtype, rounding to nearest even. bfloat16 is rounded
        with integer operations: the same bits on a GPU and in Triton's interpreter (whose
        float32 -> bfloat16 cast truncates)."""
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(x != x, 0x7FC0, rounded)          # NaN stays NaN
            tl.store(ptr + offsets, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=mask)

    return store
