"""``torch.amp.GradScaler``: what ``ZeroOptimizer`` reads and records in it when it unscales its
own gradients.

Part of ``zerocompile._torch_compat`` (see its docstring): each function says why it needs a
private API, and ``tests/test_torch_compat.py`` exercises it."""

from __future__ import annotations

import torch


# torch.amp.GradScaler. Why private: GradScaler passes itself as ``grad_scaler=`` to an
# optimizer with ``_step_supports_amp_scaling`` (the contract torch's own fused optimizers
# were built on) and leaves the unscaling to it; the optimizer then has to record in the
# scaler's per-optimizer state what it found, which is what ``update()`` reads. ZeroOptimizer
# must unscale itself: its gradients live in flat shards that GradScaler cannot see.
def grad_scaler_state(scaler, optimizer) -> dict:
    """The scaler's record for ``optimizer`` this iteration: ``{"stage": OptState, "found_inf_per_device": {device: tensor}}``."""
    return scaler._per_optimizer_states[id(optimizer)]


def grad_scaler_scale(scaler) -> torch.Tensor:
    """The scaler's current scale (a one-element float32 tensor on its device)."""
    scale = scaler._scale
    if scale is None:
        raise RuntimeError("GradScaler: no scale yet; call scaler.scale(loss) before the step")
    return scale


def grad_scaler_stages():
    """``(READY, UNSCALED, STEPPED)`` of ``torch.amp.grad_scaler.OptState``."""
    from torch.amp.grad_scaler import OptState

    return OptState.READY, OptState.UNSCALED, OptState.STEPPED


def unscale_and_check_(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply ``grads`` (one device and dtype) by ``inv_scale`` in place and set
    ``found_inf`` to 1 if any is not finite (what GradScaler.unscale_ runs).

    Why private: ``torch._amp_foreach_non_finite_check_and_unscale_`` is GradScaler's own fused
    kernel (one launch per device and dtype on GPUs)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
