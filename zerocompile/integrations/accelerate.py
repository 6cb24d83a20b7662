"""``ZeroAccelerator``: HF Accelerate with a zerocompile model.

A plain ``Accelerator`` wraps every model it prepares in ``DistributedDataParallel`` when it
runs on several processes, and its ``clip_grad_norm_`` clips each rank's local gradients. With
zerocompile both are wrong: zerocompile already reduces the gradients (in its compiled
backward at stages 2-3, in ``ZeroOptimizer.step()`` at stages 0-1), and at stages 2-3 each
rank holds only a shard of each gradient, so the norm must be taken over all ranks.
``ZeroAccelerator`` changes exactly these two methods:

- ``prepare_model`` returns the model as it is (registered with the accelerator and moved to
  its device if nothing is sharded yet, never wrapped);
- ``clip_grad_norm_(parameters, max_norm)`` calls ``clip_grad_norm_`` of the prepared
  ``ZeroOptimizer`` that holds those parameters: the global norm, as one process would compute
  it on the whole batch.

Everything else (data loader sharding, gradient accumulation, ``backward``, schedulers,
``gather`` for metrics, saving RNG state) is Accelerate's own. Mixed precision is zerocompile's
(``param_dtype``, ``loss_scale``): build the accelerator with ``mixed_precision="no"``.
"""

from __future__ import annotations

import accelerate
import torch

from zerocompile.optimizer import ZeroOptimizer
from zerocompile.runtime.sharded_param import get_state

ACCELERATE_VERSIONS = (">=1.10", "<2")
"""The accelerate versions this module is written and tested for (pyproject's extra)."""


def zero_optimizer_of(optimizers, parameters) -> ZeroOptimizer | None:
    """The ``ZeroOptimizer`` among ``optimizers`` (prepared or not) that holds ``parameters``."""
    wanted = {id(p) for p in parameters}
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)        # accelerate's AcceleratedOptimizer wraps it
        if isinstance(inner, ZeroOptimizer):
            held = {id(p) for group in inner.param_groups for p in group["params"]}
            if wanted & held:
                return inner
    return None


class ZeroAccelerator(accelerate.Accelerator):
    """An ``Accelerator`` for zerocompile models (see the module docstring)."""

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        if model not in self._models:
            self._models.append(model)
        if device_placement is None:
            device_placement = self.device_placement
        if device_placement and not any(get_state(p) is not None for p in model.parameters()):
            model.to(self.device)        # before the first forward shards it; never after
        return model

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        opt = zero_optimizer_of(self._optimizers, parameters)
        if opt is None:
            raise ValueError("ZeroAccelerator.clip_grad_norm_: no prepared ZeroOptimizer holds these parameters; "
                             "prepare your zerocompile.ZeroOptimizer with accelerator.prepare(...) first")
        return opt.clip_grad_norm_(max_norm, norm_type)
