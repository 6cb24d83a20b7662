"""``FusedAdam``: Adam / AdamW stepping all of a group's tensors in one fused kernel call.

``ZeroOptimizer`` uses it as its inner optimizer for ``torch.optim.Adam`` and ``AdamW`` when
the hyperparameters and tensors are ones the kernels support (``unsupported_reason``):
the C++ kernel ``csrc/fused_adam.cpp`` for CPU tensors, the Triton kernel
``runtime/triton_adam.py`` for CUDA tensors. One pass over memory per element: read the
gradient, parameter and moments, write the parameter and moments.

The state is laid out exactly as torch's ``Adam`` / ``AdamW`` lay it out (``step``, a 0-dim
float32 tensor; ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype), so state dicts and
checkpoints move between this class and torch's in both directions. The arithmetic is
float32 for every dtype, in the order of torch's single-tensor ``AdamW``; results agree with
``torch.optim.AdamW`` within float32 rounding (not bit for bit: the compiler may fuse a
multiply and an add).
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from zerocompile import _torch_compat
from zerocompile.runtime import cpu_extension

SUPPORTED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay",
                   "foreach", "capturable", "differentiable", "fused")
"""The hyperparameters of torch's Adam that ``FusedAdam`` takes."""
_OFF_FLAGS = ("amsgrad", "capturable", "differentiable", "foreach", "fused")
"""Hyperparameters the kernels do not implement: each must be False or None."""


def unsupported_reason(optimizer_class: type, class_defaults: dict, groups: list[dict]) -> str | None:
    """Why ``optimizer_class`` (whose resolved defaults are ``class_defaults``) with these param
    groups (dicts of ``params``, the tensors to update, and the hyperparameters they set)
    cannot use the fused kernels, or None if it can."""
    if optimizer_class not in SUPPORTED_CLASSES:
        return f"{optimizer_class.__name__} is not torch.optim.Adam or AdamW"
    unknown = sorted(set(class_defaults) - set(HYPERPARAMETERS))
    if unknown:      # a hyperparameter a later torch added: its meaning is not implemented here
        return f"{optimizer_class.__name__} has hyperparameters the kernel does not implement: {unknown}"
    for gi, group in enumerate(groups):
        group = {**class_defaults, **group}
        for flag in _OFF_FLAGS:
            if group.get(flag):
                return f"param group {gi} sets {flag}={group[flag]!r}"
        for key in ("lr", "eps", "weight_decay"):
            value = group.get(key)
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                return f"param group {gi} has a {key} tensor of {value.numel()} elements"
        for beta in group.get("betas", ()):
            if isinstance(beta, torch.Tensor) and beta.numel() != 1:
                return f"param group {gi} has a beta tensor of {beta.numel()} elements"
        for p in group["params"]:
            if p.dtype not in SUPPORTED_DTYPES:
                return f"a parameter has dtype {p.dtype}"
            if p.device.type not in ("cpu", "cuda"):
                return f"a parameter is on {p.device.type}"
            if not p.is_contiguous():
                return f"a parameter of shape {tuple(p.shape)} is not contiguous"
    return None


def kernel_for(device_types: set[str]) -> str | None:
    """``"cpp"`` (CPU tensors) or ``"triton"`` (CUDA tensors) when that kernel can run here,
    else None. Builds the C++ extension on first use (logged once if it cannot)."""
    if device_types == {"cpu"}:
        return "cpp" if cpu_extension.load("fused_adam") is not None else None
    if device_types == {"cuda"}:
        from zerocompile.runtime import triton_adam

        return "triton" if triton_adam.available() else None
    return None


def _scalar(value) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _counts_in_float32(step) -> bool:
    """Whether ``step`` is a float32 CPU tensor, as the kernels count (the C++ kernel checks
    that it has one element)."""
    return isinstance(step, torch.Tensor) and step.dtype is torch.float32 and step.is_cpu


class FusedAdam(Optimizer):
    """Adam (``decoupled_weight_decay=False``) or AdamW (``True``) with fused kernels.

    Takes the hyperparameters torch's ``Adam`` takes (ZeroOptimizer passes the defaults
    torch's class resolved); ``unsupported_reason`` must have returned None for them."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, decoupled_weight_decay=False, foreach=None, capturable=False,
                 differentiable=False, fused=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=decoupled_weight_decay, foreach=foreach,
                        capturable=capturable, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)
        self._checked: dict[int, tuple] = {}      # id(param group) -> what _check last accepted

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0, only=None, copies: dict | None = None):
        """One update of every parameter with a gradient (``update``), after ``closure``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update(grad_scale, only, copies)
        return loss

    def update(self, grad_scale: float = 1.0, only=None, copies: dict | None = None) -> None:
        """One update of every parameter with a gradient; ``grad_scale`` multiplies each
        gradient as the kernel reads it (1.0: none). ``only``: update just these parameters
        (a collection of them; each parameter's update depends on nothing else, so stepping
        the parameters in parts gives the numbers of one step of all). ``copies``: ``{id(p):
        tensor}``, tensors of ``p``'s shape (in another dtype) that receive the updated values
        in the same pass, rounded as ``p.to(dtype)`` would (a subclass that cannot write one
        removes its entry from the dict).

        What ``ZeroOptimizer`` calls, under its own ``no_grad``: not ``step``, which torch's
        ``Optimizer`` wraps in a profiler range and its step hooks (a few hundred microseconds
        a step once the update has streamed the caches out; nobody hooks this inner
        optimizer, and ``ZeroOptimizer.step`` runs torch's step hooks itself, entering the range
        only while a profiler records: ``_torch_compat.step_with_hooks``)."""
        for group in self.param_groups:
            self._check(group)
        for group in _groups_of(self.param_groups, only):
            self._step_group(group, grad_scale, copies)

    def _step_group(self, group: dict, grad_scale: float, copies: dict | None = None) -> None:
        """Update the parameters of ``group`` (a param group dict, checked) that have gradients:
        one kernel call per device (two where only some parameters have ``copies``)."""
        # One pass over the parameters, reading each attribute once: at thousands of shards
        # this loop, not the kernel, is most of a step of small tensors.
        calls: dict[tuple, tuple] = {}
        state_of = self.state
        copies = copies or {}
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            state = state_of.get(p)
            if not state or grad.is_sparse or not _counts_in_float32(state["step"]):
                state = self._ensure_state(p, moments=True)
            copy = copies.get(id(p)) if copies else None
            # the kernel writes copies for all tensors of a call or for none
            key = (None if p.is_cpu else p.device, copy is not None)
            lists = calls.get(key)
            if lists is None:
                lists = calls[key] = ([], [], [], [], [], [])
            lists[0].append(p)
            lists[1].append(grad if grad.is_contiguous() else grad.contiguous())
            lists[2].append(state["exp_avg"])
            lists[3].append(state["exp_avg_sq"])
            lists[4].append(state["step"])
            if copy is not None:
                lists[5].append(copy)
        hyper = hyperparameters(group, grad_scale)
        for tensors in calls.values():
            _run_kernel(tensors, hyper)

    def _ensure_state(self, p: torch.Tensor, moments: bool) -> dict:
        """``p``'s state, created on its first update (with zero moments when ``moments``), its
        ``step`` brought to the 0-dim float32 CPU tensor the kernels count in (a state loaded
        from elsewhere may hold a number or a tensor of another kind)."""
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            if moments:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = state["step"]
        if not _counts_in_float32(step):
            state["step"] = torch.tensor(_scalar(step), dtype=torch.float32)
        return state

    def _check(self, group: dict) -> None:
        # per-tensor checks on every step cost as much as a small kernel: a group is checked
        # again only when its parameters or hyperparameters changed, found by what is cheap to
        # read (no Python call per parameter or value; every step asks): the parameters by
        # identity, the values but the learning rate by equality, the learning rate's kind (an LR
        # schedule moves its value every step, which the check does not look at)
        lr = group.get("lr")
        seen = (list(map(id, group["params"])), [(k, v) for k, v in group.items() if k != "params" and k != "lr"],
                ("tensor", lr.numel()) if isinstance(lr, torch.Tensor) else "number")
        try:
            if self._checked.get(id(group)) == seen:
                return
        except RuntimeError:        # a hyperparameter that is a tensor of several elements: check again
            pass
        reason = unsupported_reason(FusedAdam._as_torch_class(group), self.defaults, [group])
        if reason is not None:
            raise RuntimeError(f"{type(self).__name__}: {reason}; use torch.optim.Adam/AdamW for it")
        self._checked[id(group)] = seen

    @staticmethod
    def _as_torch_class(group: dict) -> type:
        return torch.optim.AdamW if group.get("decoupled_weight_decay") else torch.optim.Adam


def hyperparameters(group: dict, grad_scale: float) -> dict:
    """The kernel's scalar arguments for param group ``group``."""
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    return dict(lr=_scalar(group["lr"]), beta1=beta1, beta2=beta2, eps=_scalar(group["eps"]),
                weight_decay=_scalar(group["weight_decay"]), decoupled=bool(group["decoupled_weight_decay"]),
                maximize=bool(group["maximize"]), grad_scale=float(grad_scale))


def _groups_of(groups: list[dict], only) -> list[dict]:
    """``groups``, or (``only`` given) each group with just its parameters in ``only``."""
    if only is None:
        return groups
    wanted = {id(p) for p in only}
    return [{**g, "params": [p for p in g["params"] if id(p) in wanted]} for g in groups]


def _run_kernel(tensors: tuple, hyper: dict) -> None:
    """One kernel call over the lists ``tensors`` (params, grads, exp_avgs, exp_avg_sqs, steps,
    copies) with the scalars ``hyper`` (``hyperparameters``)."""
    params, grads, exp_avgs, exp_avg_sqs, steps, copies = tensors
    args = (params, grads, exp_avgs, exp_avg_sqs, steps, copies, hyper["lr"], hyper["beta1"], hyper["beta2"],
            hyper["eps"], hyper["weight_decay"], hyper["decoupled"], hyper["maximize"], hyper["grad_scale"])
    module = _direct_cpu_kernel(params)
    if module is not None:
        module.adam_step(*args, bump_versions=True)
    else:
        torch.ops.zerocompile.fused_adam_step(*args)


def _direct_cpu_kernel(params: list) -> object | None:
    """The C++ extension when a call with these ``params`` may go to it directly, else None.

    Through the ``torch.library`` op every call converts each tensor of the five lists from
    C++ to Python and back (about 3 us per parameter: 6 ms a step for 2000 shards, more than
    the update of 8M elements). Nothing is lost by skipping it for plain CPU tensors outside
    any dispatch mode and any tracing: no mode to see the call, no fake tensor, nothing to
    record; the kernel then bumps the version counters the op's wrapper would have bumped.
    The memory tracker, the communication counters, fake tensors and compiled code go
    through the op."""
    if not params or type(params[0]) not in (torch.Tensor, torch.nn.Parameter) or params[0].device.type != "cpu":
        return None
    if torch.compiler.is_compiling() or _torch_compat.active_dispatch_modes():
        return None
    return cpu_extension.load("fused_adam")


# A torch.library op rather than a bare call into the extension wherever someone may watch
# (``_direct_cpu_kernel`` says where not): dispatch modes (the memory tracker, communication
# counters) see the tensors it reads and writes, and fake tensors pass through it (no-op fake
# kernel). CUDA tensors always take it.
@torch.library.custom_op("zerocompile::fused_adam_step",
                         mutates_args=("params", "exp_avgs", "exp_avg_sqs", "steps", "copies"))
def fused_adam_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], copies: list[torch.Tensor],
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
                    maximize: bool, grad_scale: float) -> None:
    """One Adam/AdamW step of every tensor in the lists, all on one device: the C++ kernel for
    CPU tensors, the Triton kernel for CUDA tensors (arguments as ``csrc/fused_adam.cpp``'s)."""
    devices = {t.device.type for t in params}
    if devices == {"cpu"}:
        module = cpu_extension.load("fused_adam")
        if module is None:
            raise RuntimeError("zerocompile::fused_adam_step: the C++ kernel csrc/fused_adam.cpp could not be "
                               "built (see the warning logged by zerocompile); use torch.optim.Adam/AdamW")
        module.adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr, beta1, beta2, eps, weight_decay,
                         decoupled, maximize, grad_scale)
    elif devices == {"cuda"}:
        from zerocompile.runtime import triton_adam

        triton_adam.adam_step(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr=lr, beta1=beta1, beta2=beta2,
                              eps=eps, weight_decay=weight_decay, decoupled=decoupled, maximize=maximize,
                              grad_scale=grad_scale)
    elif devices:
        raise RuntimeError(f"zerocompile::fused_adam_step: tensors on {sorted(devices)}; all on one CPU or CUDA "
                           "device only")


@fused_adam_step.register_fake
def _fused_adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr, beta1, beta2, eps,
                          weight_decay, decoupled, maximize, grad_scale) -> None:
    return None
