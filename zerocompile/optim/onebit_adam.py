"""``OneBitAdam``: DeepSpeed's 1-bit Adam (Tang et al., 2021, arXiv:2102.02888).

Steps ``1 .. freeze_step`` (the warm-up) are exact Adam on the averaged gradients: with
``bias_correction=True`` (the default) they are bitwise torch's single-tensor ``AdamW``, with
``weight_decay`` decoupled as DeepSpeed applies it. After the warm-up the variance
``exp_avg_sq`` is frozen; each step updates the momentum from this rank's *local* gradient and
replaces it by its compressed average over the ranks (``runtime/compressed_allreduce.py``: signs
and scales with worker and server error feedback), the same on every rank, and steps from it
with the frozen variance (its bias correction frozen with it). The gradients are then never
all-reduced: ``takes_local_gradients()`` tells ``ZeroOptimizer`` to skip that.

Differences from DeepSpeed's ``OnebitAdam``, on purpose: DeepSpeed's first ``step()`` only
sets up its communication buffers and moves nothing (it counts as step 1); here every step is a
real one. DeepSpeed never applies ``bias_correction``; here it is applied (``False`` gives
DeepSpeed's formula). See ``compressed_momentum.py`` for the update and the error buffers.
"""

from __future__ import annotations

import torch

from zerocompile.optim.compressed_momentum import CompressedAdamBase


class OneBitAdam(CompressedAdamBase):
    """``OneBitAdam(params, lr=1e-3, freeze_step=100000, ...)``, DeepSpeed's arguments and
    defaults. Run it through ``ZeroOptimizer(params, optimizer_class=zerocompile.OneBitAdam,
    freeze_step=...)`` at stage 0."""

    def __init__(self, params, lr=1e-3, freeze_step=100000, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0, amsgrad=False, cuda_aware=False,
                 comm_backend_name="nccl"):
        if not (isinstance(freeze_step, int) and freeze_step >= 1):
            raise ValueError(f"OneBitAdam: freeze_step must be an int >= 1 (the exact Adam steps before the "
                             f"compression starts; the variance is frozen after them), got {freeze_step!r}")
        self.freeze_step = freeze_step
        super().__init__(params, "OneBitAdam", lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                         amsgrad=amsgrad, cuda_aware=cuda_aware, comm_backend_name=comm_backend_name)

    def takes_local_gradients(self) -> bool:
        """The warm-up is over: the coming step averages the momentum, not the gradients."""
        return self.steps_taken() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        """One step: exact Adam during the warm-up, compressed momentum after it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.takes_local_gradients()
        for group, p, grad, state in list(self._params_with_grads()):
            state["step"] += 1
            if not compressing:
                self.adam_moments(grad, state, group)
            else:
                exp_avg = state["exp_avg"]
                exp_avg.lerp_(grad, 1 - group["betas"][0])
                exp_avg.copy_(self.compressed_average(exp_avg, state, p, group))
            self.move(p, state, group)
        return loss
