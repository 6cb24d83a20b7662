"""Loss scaling (float16) for one ``ZeroOptimizer``, two ways, both with one rule: the step is
skipped on every rank when any rank has a non-finite gradient (the flag is all-reduced with
MAX), and the scale moves the same way everywhere.

- ``torch.amp.GradScaler`` / FSDP's ``ShardedGradScaler``: ``scaler.step(opt)`` calls
  ``opt.step(grad_scaler=scaler)``; ``unscale_with`` divides the reduced gradients by its scale
  where the inner optimizer reads them, checks them, and records the all-reduced flag in the
  scaler's per-optimizer state, which is what ``scaler.update()`` reads.
- The ``loss_scale`` backend option (``zerocompile/loss_scale.py``): the compiled backward
  scales; the optimizer owns the scaler (``LossScaling.scaler``), and the step divides the
  gradients that stay scaled after reducing them, checks, skips and updates the scale.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from zerocompile import _torch_compat, loss_scale
from zerocompile.optim.clipping import all_reduce_max
from zerocompile.optim.params import target_of
from zerocompile.runtime.sharded_param import get_state
from zerocompile.runtime.zero_parameter import raw_grad


class LossScaling:
    """``params``: the optimizer's ``OptimizerParams``; ``scaler``: the ``loss_scale`` option's
    scaler, configured by the first frame that scales (its parameters claim it); ``clipper``:
    the optimizer's ``GradClipper`` (a coefficient still deferred is applied before checking).
    It holds no reference to the optimizer (nor to anything that holds one): an optimizer
    dropped is freed at once, and with it an offloaded state's swap file."""

    def __init__(self, params, scaler: loss_scale.LossScaler, clipper) -> None:
        self.params = params
        self.scaler = scaler
        self.clipper = clipper
        self.clipped_scaled = False     # clip_grad_norm_ ran without knowing of a GradScaler
        self.flag: torch.Tensor | None = None   # overflow flag recorded for a GradScaler

    def end_step(self) -> None:
        """After a step or ``zero_grad``: a new iteration for both kinds of scaler."""
        self.clipped_scaled = False
        self.flag = None

    # ------------------------------------------------------------------ the loss_scale option
    def loss_scaler(self) -> loss_scale.LossScaler | None:
        """The scaler of the ``loss_scale`` option, once a compiled frame that scales uses one
        of this optimizer's parameters (None before, and without the option)."""
        if self.scaler.settings is None:
            settings = self._model_settings()
            if settings is None:
                return None
            self.check_master_dtypes("the loss_scale option")
            self.scaler.configure(settings)
        return self.scaler

    def _model_settings(self) -> loss_scale.LossScaleSettings | None:
        """The model's ``loss_scale`` option (its session's, one per model:
        ``ModelSession.check_model_options``); None before a frame compiled it, or unscaled."""
        config = self.params.session().config
        return config.step.loss_scale if config is not None else None

    def current_scale(self) -> float | None:
        """The current scale of the ``loss_scale`` option, None while no frame compiled with
        the option uses this optimizer's parameters."""
        settings = self.scaler.settings or self._model_settings()
        if settings is None:
            return None
        return float(settings.initial_scale) if self.scaler.scale is None else self.scaler.scale

    def state(self) -> dict | None:
        """The scaler's state (JSON-serialisable), None where no frame uses the option."""
        if self.loss_scaler() is None and self.scaler.scale is None:
            return None
        return self.scaler.state_dict()

    def check_master_dtypes(self, what: str) -> None:
        for p in self.params:
            if p.requires_grad and p.dtype == torch.float16:
                sp = get_state(p)
                name = sp.name if sp is not None else f"of shape {tuple(p.shape)}"
                raise ValueError(
                    f"ZeroOptimizer: parameter '{name}' is float16, so its gradient, master value and "
                    f"optimizer state are float16; {what} does not unscale float16 gradients "
                    "(torch.amp.GradScaler refuses them too: 'Attempting to unscale FP16 gradients'). "
                    "Keep the model's parameters float32 and compute in float16 with the backend option "
                    "param_dtype='float16': master shards stay float32.")

    # ------------------------------------------------------------------ overflow
    def overflow(self, inv_scale: torch.Tensor | None, earlier=()) -> torch.Tensor:
        """Multiply the gradients the inner optimizer reads by ``inv_scale`` (None: leave them)
        and return 1.0 if any rank has a non-finite one (or a flag in ``earlier`` is set), else
        0.0: a float32 scalar, the same on every rank (all-reduced with MAX)."""
        self.clipper.apply_deferred()      # a clipping coefficient still pending: applied now, in place
        by_kind = defaultdict(list)
        for p in self.params:
            grad = raw_grad(target_of(p))
            if grad is not None:
                by_kind[(grad.device, grad.dtype)].append(grad)
        device = self.params.device()
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for (dev, _), grads in by_kind.items():
            found = torch.zeros((), dtype=torch.float32, device=dev)
            inv = inv_scale.to(dev) if inv_scale is not None else torch.ones((), device=dev)
            _torch_compat.unscale_and_check_(grads, found, inv)
            flag = torch.maximum(flag, found.to(device))
        for f in earlier:
            flag = torch.maximum(flag, (f.to(device) > 0).float())
        return all_reduce_max(flag, self.params.layout_group(), self.params.session())

    def unscale_with(self, grad_scaler, optimizer, reduce: Callable[[], None]) -> torch.Tensor:
        """For a ``torch.amp.GradScaler``, once per iteration: reduce the gradients (``reduce``
        brings them to where the inner optimizer reads them), divide them by its scale, and
        record the all-reduced overflow flag in its state for ``optimizer`` (which
        ``scaler.update()`` reads); return the flag."""
        ready, unscaled, _ = _torch_compat.grad_scaler_stages()
        state = _torch_compat.grad_scaler_state(grad_scaler, optimizer)
        if state["stage"] is unscaled and self.flag is not None:
            return self.flag
        self.check_master_dtypes("torch.amp.GradScaler")
        scale = _torch_compat.grad_scaler_scale(grad_scaler)
        earlier = ()
        if state["stage"] is ready:
            if self.clipped_scaled:
                raise RuntimeError(
                    "ZeroOptimizer: clip_grad_norm_ clipped gradients that a torch.amp.GradScaler had "
                    "scaled, without knowing the scale; pass the scaler to it: "
                    "opt.clip_grad_norm_(max_norm, grad_scaler=scaler) (it unscales first, as "
                    "scaler.unscale_(opt) would)")
            inv_scale = scale.double().reciprocal().float()
        else:
            # scaler.unscale_(opt) already divided what p.grad showed: the reduced gradients (its
            # first read reduced them), the shard gradients' DTensors at stages 1-3
            inv_scale = None
            earlier = tuple(state["found_inf_per_device"].values())
        reduce()
        flag = self.overflow(inv_scale, earlier)
        state["found_inf_per_device"] = {scale.device: flag.to(scale.device)}
        state["stage"] = unscaled
        self.flag = flag
        return flag


def check_one_scaler(grad_scaler, scaler) -> None:
    """A ``torch.amp.GradScaler`` and the ``loss_scale`` option's scaler (not None) both scale."""
    if grad_scaler is not None and scaler is not None:
        raise RuntimeError(
            "ZeroOptimizer: the model was compiled with the loss_scale option, which scales inside "
            "the backward, and a torch.amp.GradScaler scales the loss as well; use one of them")
