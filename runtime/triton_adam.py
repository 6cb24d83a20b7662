"""The fused Adam / AdamW step as a Triton kernel, for CUDA tensors.

The same update as ``csrc/fused_adam.cpp``, element for element (float32 arithmetic,
IEEE-rounded square root and division, the operation order of torch's single-tensor
``AdamW``), one program per ``BLOCK`` elements, one launch per tensor. ``FusedAdam``
(``runtime/fused_adam.py``) calls ``adam_step`` for the CUDA tensors of a param group.

Tested on the CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter runs the kernel on CPU
tensors) against the C++ kernel and ``torch.optim.AdamW``; ``make gpu-check`` runs it on a GPU.
Triton is imported only when this module is used; it comes with torch's CUDA builds.
"""

from __future__ import annotations

import functools
import math

import torch

from zerocompile import env

BLOCK = 1024


def available() -> bool:
    """Triton can run the kernel here: it imports, and a CUDA device (or the interpreter) is there."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or env.triton_interpret()


@functools.cache
def _kernel():
    """The jitted kernel, defined on first use (importing this module needs no Triton) and
    kept: Triton caches its compiled binaries on the function object."""
    import triton
    import triton.language as tl

    from zerocompile.runtime import triton_common

    @triton.jit
    def adam_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, n, grad_scale, lr_decay, l2,
                    one_minus_b1, beta2, one_minus_b2, bc2_sqrt, eps, neg_step_size,
                    store: tl.constexpr, HAS_L2: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        p = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
        g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32) * grad_scale
        if HAS_L2:
            g = tl.fma(l2, p, g)
        p = p * lr_decay
        m = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        m = tl.fma(one_minus_b1, g - m, m)
        v = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32) * beta2
        v = tl.fma(one_minus_b2 * g, g, v)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p + tl.div_rn(neg_step_size * m, denom)
        store(param_ptr, offsets, p, mask)
        store(exp_avg_ptr, offsets, m, mask)
        store(exp_avg_sq_ptr, offsets, v, mask)
        if HAS_COPY:
            store(copy_ptr, offsets, p, mask)

    return functools.partial(_launch, adam_kernel, triton_common.rounding_store())


def _launch(kernel, store, grid, *args, **meta):
    # the store helper (runtime/triton_common.py) is passed as a constexpr argument: a kernel
    # defined in a function cannot see the helper as a global, and Triton does not resolve closures
    kernel[grid](*args, store=store, **meta)


def adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies=None, *, lr: float, beta1: float,
              beta2: float, eps: float, weight_decay: float, decoupled: bool, maximize: bool,
              grad_scale: float = 1.0) -> None:
    """One Adam/AdamW step of every tensor in the lists (contiguous, one dtype per index);
    ``steps`` are 0-dim float32 CPU tensors, incremented here; ``copies`` (optional) receive
    the updated parameters in their own dtype. The arguments of ``csrc/fused_adam.cpp``'s
    ``adam_step``."""
    kernel = _kernel()
    copies = copies or []
    if copies and len(copies) != len(params):
        raise ValueError("triton_adam.adam_step: copies must be empty or one per parameter")
    scale = -grad_scale if maximize else grad_scale
    for i, p in enumerate(params):
        for name, t in (("grads", grads[i]), ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i])):
            if t.numel() != p.numel() or not t.is_contiguous() or t.dtype != p.dtype:
                raise ValueError(f"triton_adam.adam_step: {name}[{i}] must be contiguous with the "
                                 "parameter's numel and dtype")
        if not p.is_contiguous():
            raise ValueError(f"triton_adam.adam_step: params[{i}] is not contiguous")
        steps[i] += 1
        step = float(steps[i])
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        n = p.numel()
        if n == 0:
            continue
        copy = copies[i] if copies else p
        kernel((math.ceil(n / BLOCK),),
            p, grads[i], exp_avgs[i], exp_avg_sqs[i], copy, n, scale,
            1.0 - lr * weight_decay if decoupled else 1.0, 0.0 if decoupled else weight_decay,
            1.0 - beta1, beta2, 1.0 - beta2, math.sqrt(bc2), eps, -lr / bc1,
            HAS_L2=(not decoupled and weight_decay != 0), HAS_COPY=bool(copies), BLOCK=BLOCK)
