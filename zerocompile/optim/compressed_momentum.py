"""What DeepSpeed's 1-bit Adam and 0/1 Adam share (``onebit_adam.py``, ``zero_one_adam.py``):
their constructor arguments, Adam's update, the error-feedback buffers of the compressed
all-reduce (``runtime/compressed_allreduce.py``) and the protocol by which ``ZeroOptimizer``
runs them at stage 0.

**Protocol.** A class with ``zerocompile_reduces_gradients = True`` averages gradients itself:
``ZeroOptimizer`` calls ``bind_group(group)`` with its data-parallel group when it binds, and
before each reduction asks ``takes_local_gradients()``: while that is True its gradient
all-reduce is skipped and the step reads this rank's local gradients.

**Update** (every step, both classes; torch's ``AdamW`` order of operations, so that the exact
steps are bitwise torch's single-tensor ``AdamW``)::

    p *= 1 - lr * weight_decay                      # DeepSpeed adds weight_decay * p to the update
    denom = sqrt(exp_avg_sq) / sqrt(bc2) + eps
    p -= lr / bc1 * exp_avg / denom

with ``bc1 = 1 - beta1 ** step`` and ``bc2 = 1 - beta2 ** var_updates`` (the number of times
``exp_avg_sq`` was updated: it stops at the freeze), or both 1 with ``bias_correction=False``,
which is DeepSpeed's formula (DeepSpeed accepts ``bias_correction`` and never applies it).

**Error buffers** (``worker_error``, ``server_error``) belong to one rank at one world size: the
state records both (``error_rank``, ``error_world``), and buffers loaded from another rank or
world size (a checkpoint keeps rank 0's) are reset to zero with a warning, as DeepSpeed resets
them on every load.
"""

from __future__ import annotations

import logging

import torch
from torch.optim import Optimizer

from zerocompile.runtime.comm import CommGroup, resolve_group
from zerocompile.runtime.compressed_allreduce import compressed_allreduce, padded_size
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.raw_grad import raw_grad

log = logging.getLogger("zerocompile")

DEEPSPEED_ONLY = {"cuda_aware": False, "comm_backend_name": "nccl"}
"""DeepSpeed arguments that choose its communication library; zerocompile's collectives use the
process group's backend, so they are accepted and ignored (logged)."""


class CompressedAdamBase(Optimizer):
    """The constructor checks and the pieces both algorithms use (see the module docstring).
    Subclasses implement ``step`` and ``takes_local_gradients``."""

    zerocompile_reduces_gradients = True
    """``ZeroOptimizer`` skips its gradient all-reduce while ``takes_local_gradients()``."""

    def __init__(self, params, name: str, *, lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay,
                 max_grad_norm, amsgrad, cuda_aware, comm_backend_name):
        if amsgrad:
            raise ValueError(f"{name}: amsgrad=True is not supported (DeepSpeed's {name} refuses it too)")
        if eps_inside_sqrt:
            raise ValueError(f"{name}: eps_inside_sqrt=True is not implemented (DeepSpeed's {name} accepts it and "
                             "never applies it); leave it False: eps is added to sqrt(exp_avg_sq)")
        if max_grad_norm:
            raise ValueError(f"{name}: max_grad_norm={max_grad_norm!r} is not applied by DeepSpeed's {name} either; "
                             "clip with ZeroOptimizer.clip_grad_norm_ or the gradient_clipping option (warm-up "
                             "only: see docs/onebit.md) and leave max_grad_norm=0")
        if not 0.0 <= lr:
            raise ValueError(f"{name}: invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"{name}: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{name}: invalid betas {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"{name}: invalid weight_decay {weight_decay}")
        for key, value in (("cuda_aware", cuda_aware), ("comm_backend_name", comm_backend_name)):
            if value != DEEPSPEED_ONLY[key]:
                log.info("%s: %s=%r is DeepSpeed's choice of communication library; zerocompile sends the "
                         "compressed momentum over the process group's own backend and ignores it", name, key, value)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self._name = name
        self._group: CommGroup | None = None
        self._session = None
        """The model's ``ModelSession`` (bound with the group): it counts the compressed collectives."""
        self._warned_reset = False       # the warning about error buffers of another rank, given

    # ------------------------------------------------------------------ protocol
    def bind_group(self, group: CommGroup, session=None) -> None:
        """The data-parallel group the momentum is averaged over and the model's session, which
        counts those collectives (``ZeroOptimizer`` binds them)."""
        self._group = group
        self._session = session

    def comm_group(self) -> CommGroup:
        """The bound group, else the default world group (world size 1 without torch.distributed)."""
        if self._group is None:
            self._group = resolve_group(None)
        return self._group

    def takes_local_gradients(self) -> bool:
        """The coming step reads this rank's local gradients (not averaged)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    def _params_with_grads(self):
        """``(group, p, grad, state)`` of every parameter with a gradient, state initialised. The
        gradient as autograd left it (``raw_grad``): past the warm-up it is this rank's own, which
        ``ZeroParameter.grad`` would refuse to show as the model's gradient."""
        for group in self.param_groups:
            for p in group["params"]:
                grad = raw_grad(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"{self._name} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["var_updates"] = 0
                    self._init_state(state, p)
                yield group, p, grad, state

    def _init_state(self, state: dict, p: torch.Tensor) -> None:
        """Subclass state of a parameter stepped for the first time."""

    def steps_taken(self) -> int:
        """The optimizer steps taken: the largest step count of any parameter (they step together)."""
        return max((int(st["step"].item()) for st in self.state.values() if "step" in st), default=0)

    def leader_state(self) -> dict | None:
        """The state of a parameter with the most steps (the schedule's counters are kept per
        parameter, as DeepSpeed does, and agree among those that step every time)."""
        states = [st for st in self.state.values() if "step" in st]
        return max(states, key=lambda st: int(st["step"].item())) if states else None

    def error_buffers(self, state: dict, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(worker_error, server_error)`` of ``p``: this rank's, allocated (zero) when missing or
        when the ones held belong to another rank or world size (then with a warning)."""
        group = self.comm_group()
        size = padded_size(p.numel(), group.world)
        held = state.get("worker_error")
        if held is not None and (state.get("error_rank"), state.get("error_world")) == (group.rank, group.world) \
                and held.numel() == size:
            return held, state["server_error"]
        if held is not None:
            log.log(logging.DEBUG if self._warned_reset else logging.WARNING,
                    "%s: the error-feedback buffers loaded for a parameter of shape %s (and maybe others) were saved "
                    "by rank %s of %s; this is rank %d of %d: they start again from zero (as DeepSpeed resets them on "
                    "every load)", self._name, tuple(p.shape), state.get("error_rank"), state.get("error_world"),
                    group.rank, group.world)
            self._warned_reset = True
        state["worker_error"] = torch.zeros(size, dtype=torch.float32, device=p.device)
        state["server_error"] = torch.zeros(size // group.world, dtype=torch.float32, device=p.device)
        state["error_rank"], state["error_world"] = group.rank, group.world
        return state["worker_error"], state["server_error"]

    def compressed_average(self, x: torch.Tensor, state: dict, p: torch.Tensor, group: dict) -> torch.Tensor:
        """The compressed average of ``x`` over the ranks with ``p``'s error buffers, masked by the
        param group's ``exp_avg_mask`` (DeepSpeed's option for entries that stay exactly zero)."""
        worker_error, server_error = self.error_buffers(state, p)
        out = compressed_allreduce(x, worker_error, server_error, self.comm_group(), self._session or PROCESS.outside)
        mask = group.get("exp_avg_mask")
        if mask is not None:
            out.mul_(mask.to(out.device))
        return out

    # ------------------------------------------------------------------ Adam
    @staticmethod
    def corrections(group: dict, state: dict) -> tuple[float, float]:
        """``(bc1, bc2)`` of the coming update (see the module docstring)."""
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        return 1 - beta1 ** state["step"].item(), 1 - beta2 ** state["var_updates"]

    @staticmethod
    def denominator(exp_avg_sq: torch.Tensor, group: dict, bc2: float) -> torch.Tensor:
        """``sqrt(exp_avg_sq) / sqrt(bc2) + eps``, as torch's Adam computes it."""
        return (exp_avg_sq.sqrt() / bc2 ** 0.5).add_(group["eps"])

    @staticmethod
    def adam_moments(grad: torch.Tensor, state: dict, group: dict) -> None:
        """Both moments updated from ``grad`` (torch's Adam: ``lerp`` and ``addcmul``)."""
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["var_updates"] += 1

    @classmethod
    def move(cls, p: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
        """Decoupled weight decay and the Adam step of ``p`` from its moments; returns the denominator."""
        lr, wd = group["lr"], group["weight_decay"]
        bc1, bc2 = cls.corrections(group, state)
        if wd != 0:
            p.mul_(1 - lr * wd)
        denom = cls.denominator(state["exp_avg_sq"], group, bc2)
        p.addcdiv_(state["exp_avg"], denom, value=-(lr / bc1))
        return denom
