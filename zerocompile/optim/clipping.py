"""Gradient clipping by the global norm over all ranks: ``ZeroOptimizer.clip_grad_norm_``'s
norm, the ``gradient_clipping`` option, and the clipping coefficient deferred to the fused
kernel; with the scalar all-reduces (sum, max) they and the overflow check use."""

from __future__ import annotations

import math
import weakref

import torch

from zerocompile.deepspeed_config import warn_once
from zerocompile.optim import local_gradients
from zerocompile.optim.params import target_of
from zerocompile.runtime import fused_adam
from zerocompile.runtime.comm import CommGroup, all_reduce_sum, resolve_group
from zerocompile.runtime.sharded_param import get_state
from zerocompile.runtime.zero_parameter import raw_grad


def all_reduce_scalar(x: torch.Tensor, group: CommGroup, session) -> torch.Tensor:
    """The sum of the 0-d ``x`` over ``group`` (counted and timed by ``session``, the model's)."""
    if group.world == 1:
        return x
    with session.comms.timed(x.device, "optimizer step scalars"):
        session.record("all_reduce", x.numel() * x.element_size())
        return all_reduce_sum(x.reshape(1), group.world, group.name).reshape(())


def all_reduce_max(x: torch.Tensor, group: CommGroup, session) -> torch.Tensor:
    """The maximum of the 0-d ``x`` over ``group`` (counted and timed by ``session``, the model's)."""
    if group.world == 1:
        return x
    with session.comms.timed(x.device, "optimizer step scalars"):
        session.record("all_reduce", x.numel() * x.element_size())
        out = torch.ops._c10d_functional.all_reduce(x.reshape(1).contiguous(), "max", group.name)
        return torch.ops._c10d_functional.wait_tensor(out).reshape(())


def norm(grads: list, norm_type: float, device) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``grads`` together, in float32 (one read of each: torch's
    foreach norm for float32 tensors, ``vector_norm`` computing in float32 for the others)."""
    f32 = [g for g in grads if g.dtype == torch.float32]
    norms = [torch.nn.utils.get_total_norm(f32, norm_type, foreach=True).to(device)] if f32 else []
    norms += [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device)
              for g in grads if g.dtype != torch.float32]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def configured_max_norm(states: list) -> float:
    """The ``gradient_clipping`` option (DeepSpeed's key) of the model these parameters belong to
    (``states``: their shard states, of one session, whose frames all have the model's step
    options: ``ModelSession.check_model_options``), 0.0 = off."""
    return states[0].option("step", "gradient_clipping", 0.0) if states else 0.0


class GradClipper:
    """One optimizer's clipping within a step: the bound of a ``clip_grad_norm_`` call in it,
    and a coefficient deferred to the fused kernel. ``params``: the optimizer's ``OptimizerParams``."""

    def __init__(self, params) -> None:
        self.params = params
        self.clipped_to: float | None = None
        """The max_norm of a clip_grad_norm_ call in this step, if any: the gradient_clipping
        option does not clip that step again."""
        self.deferred_scale: float | None = None
        """A clipping coefficient not yet applied to the gradients of ``self.deferred``: the
        fused kernel multiplies them by it as it reads them in the step (see ``clip``)."""
        self.deferred: dict[int, torch.Tensor] = {}    # id(target) -> target whose grad it scales
        self._hooked: set[int] = set()                  # ids of targets with the accumulate hook

    def end_step(self) -> None:
        """After a step or ``zero_grad``: no clipping call in the new step, nothing deferred."""
        self.clipped_to = None
        self.clear_deferred()

    def configured_bound(self) -> float | None:
        """The ``gradient_clipping`` bound the step clips to, None where it does not clip:
        the option is off, or ``clip_grad_norm_`` was called in this step (that call's clipping
        stands, it is not applied twice; a different bound warns once)."""
        max_norm = configured_max_norm(self.params.states())
        if max_norm > 0 and self.clipped_to is None:
            return max_norm
        if max_norm > 0 and self.clipped_to != max_norm:
            warn_once(f"ZeroOptimizer: clip_grad_norm_({self.clipped_to:g}) in a step of a model compiled with "
                      f"gradient_clipping={max_norm:g}: your call's bound is the one applied (the option clips "
                      "only the steps in which you do not clip)")
        return None

    def clip(self, max_norm: float, norm_type: float, inner) -> torch.Tensor:
        """Clip the reduced, unscaled gradients the inner optimizer reads (``inner``) to the
        global ``norm_type``-norm ``max_norm``; return that norm (before clipping)."""
        if local_gradients.reduces_gradients(inner) and inner.takes_local_gradients():
            raise local_gradients.clipping_error(inner)
        self.apply_deferred()      # clipped twice: the first coefficient goes in now
        norm_type = float(norm_type)
        owned, replicated = [], []
        group = None
        # rank-independent (every rank shards the same parameters): reduce the owned part only
        # when some parameter is sharded at all
        any_sharded = any((sp := get_state(p)) is not None and sp.rules.shards_master for p in self.params)
        for p in self.params:
            sp = get_state(p)
            target = target_of(p)
            grad = raw_grad(target)
            if grad is None:
                continue
            group = group or self.params.group_of(sp)
            (replicated if target is p else owned).append(grad)
        group = group or resolve_group(self.params.default_group)
        dev = owned[0].device if owned else (replicated[0].device if replicated else torch.device("cpu"))
        if math.isinf(norm_type):
            local = torch.maximum(norm(owned, norm_type, dev), norm(replicated, norm_type, dev))
            total = all_reduce_max(local, group, self.params.session()) if any_sharded else local
        else:
            part = norm(owned, norm_type, dev) ** norm_type
            summed = all_reduce_scalar(part, group, self.params.session()) if any_sharded else part
            rep = norm(replicated, norm_type, dev) ** norm_type
            total = (summed + rep) ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if not self._defer(coef, owned, replicated, inner):
            for g in owned + replicated:
                g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------ the deferred coefficient
    def _defer(self, coef: torch.Tensor, owned: list, replicated: list, inner) -> bool:
        """Leave the clipping coefficient for the fused kernel to apply as it reads each
        gradient in the step (one pass over the gradients fewer), where that gives the numbers
        of multiplying now, bit for bit: every gradient is a float32 shard gradient (stages
        2/3) that the fused kernel updates from; a read of ``p.grad`` in between applies it
        first (``ZeroOptimizer.read_gradients``). A backward that adds to a gradient
        before the step applies the coefficient to it first (a hook on the shard, run before
        accumulation), so the result is that of clipping in place. Returns whether it deferred."""
        if replicated or not owned or not isinstance(inner, fused_adam.FusedAdam):
            return False
        targets = []
        for p in self.params:
            sp = get_state(p)
            target = target_of(p)
            if raw_grad(target) is None:
                continue
            if sp is None or not sp.rules.reduces_in_backward or raw_grad(target).dtype != torch.float32:
                return False
            targets.append(target)
        value = float(coef.item())
        if value == 1.0:
            return True                     # nothing to scale
        for target in targets:
            if id(target) not in self._hooked:
                target.register_hook(_apply_before_accumulate(weakref.ref(self), id(target)))
                self._hooked.add(id(target))
        self.deferred = {id(t): t for t in targets}
        self.deferred_scale = value
        return True

    def apply_deferred(self, ids=None) -> None:
        """Multiply the gradients still owed the deferred coefficient (``ids``: of those
        targets only) by it now."""
        if self.deferred_scale is None:
            return
        for key in list(self.deferred) if ids is None else [i for i in ids if i in self.deferred]:
            grad = raw_grad(self.deferred.pop(key))
            if grad is not None:
                grad.mul_(torch.tensor(self.deferred_scale, dtype=grad.dtype, device=grad.device))
        if not self.deferred:
            self.deferred_scale = None

    def clear_deferred(self) -> None:
        self.deferred = {}
        self.deferred_scale = None


def _apply_before_accumulate(clipper_ref, key: int):
    """A tensor hook for a shard whose gradient may owe a deferred clipping coefficient: a
    backward about to add to that gradient applies the coefficient to it first."""
    def hook(grad):
        clipper = clipper_ref()
        if clipper is not None and key in clipper.deferred:
            clipper.apply_deferred([key])
        return None
    return hook
