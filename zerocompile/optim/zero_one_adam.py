"""``ZeroOneAdam``: DeepSpeed's 0/1 Adam (Lu et al., 2022, arXiv:2202.06009).

Two phases, with DeepSpeed's schedule (``step`` counts from 1):

1. **Variance updates** (``step <= var_freeze_step``): step ``t`` is an exact Adam step on the
   averaged gradients when ``t % var_interval == 0``; otherwise the variance stays and the
   momentum takes the *compressed* average of the local gradients
   (``runtime/compressed_allreduce.py``). ``var_interval`` starts at 1 and doubles after every
   ``var_update_scaler`` exact steps, so the first ``var_update_scaler`` steps are all exact
   Adam (bitwise torch's single-tensor ``AdamW`` with ``bias_correction=True``).
2. **Local steps** (after ``var_freeze_step``; the error buffers start again from zero): each
   step moves the parameters from this rank's own momentum and local gradient; every
   ``local_step_interval`` steps the ranks synchronise: the parameters' move since the last
   synchronisation, scaled by the Adam denominator, is averaged compressed, and becomes both the
   momentum (``-average / sum of lr``) and the parameters' common move. ``local_step_interval``
   starts at 1 and doubles (up to ``local_step_clipper``) after every ``local_step_scaler``
   steps, so with DeepSpeed's defaults every step synchronises for 32678 steps.

Every rank holds the same parameters after each synchronising step: this class keeps the
parameters of the last synchronisation (``sync_params``, where DeepSpeed keeps its
``momentum_accumulator``, the same size) and sets ``p = sync_params + average / denom``, where
DeepSpeed subtracts its accumulated moves again (equal up to rounding, different per rank).
Between synchronisations (``local_step_interval > 1``) the ranks' parameters differ, as in the
paper. Bias correction and DeepSpeed's dummy first step: as in ``onebit_adam.py``.
"""

from __future__ import annotations

import logging

import torch

from zerocompile.optim.compressed_momentum import CompressedAdamBase

log = logging.getLogger("zerocompile")


class ZeroOneAdam(CompressedAdamBase):
    """``ZeroOneAdam(params, lr=1e-3, var_freeze_step=100000, var_update_scaler=16,
    local_step_scaler=32678, local_step_clipper=16, ...)``, DeepSpeed's arguments and defaults.
    Run it through ``ZeroOptimizer(params, optimizer_class=zerocompile.ZeroOneAdam, ...)`` at
    stage 0."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 weight_decay=0.0, max_grad_norm=0.0, var_freeze_step=100000, var_update_scaler=16,
                 local_step_scaler=32678, local_step_clipper=16, amsgrad=False, cuda_aware=False,
                 comm_backend_name="nccl"):
        for key, value, low in (("var_freeze_step", var_freeze_step, 0), ("var_update_scaler", var_update_scaler, 1),
                                ("local_step_scaler", local_step_scaler, 1),
                                ("local_step_clipper", local_step_clipper, 1)):
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"ZeroOneAdam: {key} must be an int >= {low}, got {value!r}")
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        super().__init__(params, "ZeroOneAdam", lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                         amsgrad=amsgrad, cuda_aware=cuda_aware, comm_backend_name=comm_backend_name)

    def _init_state(self, state: dict, p: torch.Tensor) -> None:
        state.update(var_interval=1, var_counter=0, local_step_interval=1, local_step_counter=0, lrs=0.0)

    def _local_phase(self, steps: int) -> bool:
        """Steps after ``steps`` are local steps (phase 2)."""
        return steps > self.var_freeze_step

    def takes_local_gradients(self) -> bool:
        """The coming step is not an exact variance-update step."""
        lead = self.leader_state()
        if lead is None:
            return False
        steps = int(lead["step"].item())
        return self._local_phase(steps) or (steps + 1) % lead["var_interval"] != 0

    @torch.no_grad()
    def step(self, closure=None):
        """One step of the phase the schedule is in (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        local = self._local_phase(self.steps_taken())
        exact = not self.takes_local_gradients()
        for group, p, grad, state in list(self._params_with_grads()):
            state["step"] += 1
            if local:
                self._local_step(group, p, grad, state)
                continue
            if exact:
                self.adam_moments(grad, state, group)
            else:
                averaged = self.compressed_average(grad, state, p, group)
                state["exp_avg"].lerp_(averaged.to(p.dtype), 1 - group["betas"][0])
            self.move(p, state, group)
            if state["step"].item() % state["var_interval"] == 0:
                state["var_counter"] += 1
                if state["var_counter"] == self.var_update_scaler:
                    state["var_counter"] = 0
                    state["var_interval"] *= 2
            if self._local_phase(int(state["step"].item())) and "worker_error" in state:
                # the errors were of gradients; from now on they are of parameter moves
                state["worker_error"].zero_()
                state["server_error"].zero_()
        return loss

    def _local_step(self, group: dict, p: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        """A phase-2 step of ``p``: a local Adam move, and every ``local_step_interval`` steps the
        compressed synchronisation."""
        if "sync_params" not in state:
            state["sync_params"] = p.detach().clone()
        state["exp_avg"].lerp_(grad, 1 - group["betas"][0])
        state["lrs"] += group["lr"]
        denom = self.move(p, state, group)
        if state["step"].item() % state["local_step_interval"] == 0:
            anchor = state["sync_params"]
            bc1, _ = self.corrections(group, state)
            moved = self.compressed_average((p - anchor) * denom, state, p, group).to(p.dtype)
            state["exp_avg"].copy_(moved * (-bc1 / state["lrs"]))
            p.copy_(anchor + moved / denom)
            anchor.copy_(p)
            state["lrs"] = 0.0
        state["local_step_counter"] += 1
        if state["local_step_counter"] == self.local_step_scaler:
            state["local_step_counter"] = 0
            state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
