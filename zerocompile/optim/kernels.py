"""Which inner optimizer updates the tensors, and building it: zerocompile's fused Adam kernels
(``runtime/fused_adam.py``), torch's ``fused=True`` / ``foreach=True``, the class exactly as
configured, or (``offload_optimizer``) ``OffloadedAdam`` with the state off the device."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import torch
from torch.optim import Optimizer

from zerocompile.optim import local_gradients
from zerocompile.runtime import cpu_extension, fused_adam
from zerocompile.runtime.session import simulated_peak_bytes
from zerocompile.runtime.offload_settings import OffloadSettings
from zerocompile.runtime.offloaded_adam import OffloadedAdam

KERNEL_CHOICES = ("auto", "fused", "torch")
"""``ZeroOptimizer(kernel=...)``: ``"auto"`` = zerocompile's fused Adam kernel where it applies,
else torch's ``fused=True`` / ``foreach=True``; ``"fused"`` = zerocompile's kernel or an error;
``"torch"`` = the optimizer class exactly as you configured it."""
FUSED_KERNELS = ("cpp", "triton")
"""Kernel names of zerocompile's fused Adam (``ZeroOptimizer.kernel``)."""
log = logging.getLogger("zerocompile")


class InnerOptimizerBuilder:
    """Builds the inner optimizer of ``optimizer_class`` under the kernel choice ``choice`` (one
    of ``KERNEL_CHOICES``). ``defaults``: the hyperparameters as given (the outer optimizer's
    ``defaults``); ``resolved``: with the class's own defaults filled in."""

    def __init__(self, optimizer_class: type, choice: str, defaults: dict, resolved: dict) -> None:
        self.optimizer_class = optimizer_class
        self.choice = choice
        self.defaults = defaults
        self.resolved = resolved

    def build(self, groups: list[dict], params) -> tuple[Optimizer, str]:
        """The inner optimizer over ``groups`` (whose params are the targets) and its kernel
        name: zerocompile's fused Adam where it applies (``kernel="auto"`` or ``"fused"``),
        else the class itself, with ``fused=True`` or ``foreach=True`` under ``"auto"`` where
        it is a torch class that takes them and you set neither. ``params``: the optimizer's
        ``OptimizerParams``."""
        if local_gradients.reduces_gradients(self.optimizer_class):     # 1-bit Adam, 0/1 Adam: stage 0, torch code
            return local_gradients.build(self.optimizer_class, self.choice, groups, params, self.defaults), "torch"
        name = self.optimizer_class.__name__
        devices = {t.device.type for g in groups for t in g["params"]}
        offload = self._offload_settings(params.states(), devices)
        if offload is not None:
            return self._build_offloaded(groups, offload, params), "cpp"
        if self.choice != "torch":
            given = sorted({"fused", "foreach"} & self.defaults.keys())
            if given and self.choice == "auto":
                reason = f"you chose torch's implementation ({given[0]}={self.defaults[given[0]]!r})"
            elif self.choice == "auto" and any(t.dtype == torch.float16 for g in groups for t in g["params"]):
                # the C++ kernel converts float16 with scalar code: torch's fused kernel is ~4x faster
                reason = "float16 parameters, which torch's fused kernel steps faster"
            else:
                reason = fused_adam.unsupported_reason(self.optimizer_class, self.resolved, groups)
            kernel = None
            if reason is None:
                kernel = fused_adam.kernel_for(devices)
                if kernel is None:
                    reason = f"no fused kernel can run on {'/'.join(sorted(devices))} tensors here"
            if kernel is not None:
                log.info("ZeroOptimizer: %s steps with zerocompile's fused %s kernel", name,
                         "C++" if kernel == "cpp" else "Triton")
                return fused_adam.FusedAdam(groups, **self.resolved), kernel
            if self.choice == "fused":
                raise ValueError(f"ZeroOptimizer(kernel='fused'): {reason}; use kernel='auto' (falls back "
                                 "to torch's kernels) or kernel='torch'")
            log.debug("ZeroOptimizer: no fused zerocompile kernel for %s: %s", name, reason)
        # the defaults too: a few classes read a constructor argument rather than the group
        # (Adagrad's initial_accumulator_value)
        own_class = getattr(torch.optim, name, None) is self.optimizer_class   # not a subclass of yours
        if self.choice == "auto" and own_class and not ({"fused", "foreach"} & self.defaults.keys()):
            # torch's fused SGD with momentum fails on a parameter whose first gradient comes after
            # the first step (no momentum buffer yet: an expert no token reached at first); foreach
            # creates the buffer then, as the class itself does
            late_buffers = self.optimizer_class is torch.optim.SGD and any(
                g.get("momentum", self.defaults.get("momentum", 0)) != 0 for g in groups)
            for flag, ok in (("fused", devices <= {"cpu", "cuda"} and not late_buffers), ("foreach", True)):
                if not ok or flag not in inspect.signature(self.optimizer_class).parameters:
                    continue
                try:
                    inner = self.optimizer_class(groups, **self.defaults, **{flag: True})
                except (RuntimeError, ValueError, TypeError) as err:
                    log.debug("ZeroOptimizer: %s(%s=True) rejected: %s", name, flag, err)
                    continue
                log.info("ZeroOptimizer: %s steps with torch's %s=True kernels", name, flag)
                return inner, f"torch_{flag}"
        inner = self.optimizer_class(groups, **self.defaults)
        flag = next((f for f in ("fused", "foreach") if inner.defaults.get(f)), None)
        log.info("ZeroOptimizer: %s steps with torch's kernels as configured%s", name,
                 f" ({flag}=True)" if flag else "")
        return inner, f"torch_{flag}" if flag else "torch"

    def unaddable_reason(self, kernel: str | None, group: dict) -> str | None:
        """Why the inner optimizer of kernel ``kernel`` cannot take the param group ``group``
        (whose params are the targets), or None: zerocompile's fused kernels take only the
        groups they support."""
        if kernel not in FUSED_KERNELS:
            return None
        return fused_adam.unsupported_reason(self.optimizer_class, self.resolved, [group])

    @staticmethod
    def _offload_settings(states: list, devices: set) -> OffloadSettings | None:
        """The ``offload_optimizer`` settings of the model these parameters belong to (``states``:
        their shard states, of one session), None when nothing is to be offloaded."""
        settings = states[0].option("step", "offload_optimizer", OffloadSettings()) if states else OffloadSettings()
        if settings == OffloadSettings():
            return None
        if settings.device == "cpu" and devices <= {"cpu"}:
            log.info("ZeroOptimizer: offload_optimizer device 'cpu': the model is on the CPU, so its optimizer "
                     "state already lives in host memory; nothing to offload")
            return None
        return settings

    def _build_offloaded(self, groups: list[dict], settings: OffloadSettings, params) -> Optimizer:
        name = self.optimizer_class.__name__
        if self.choice == "torch":
            reason = "kernel='torch' was asked for"
        else:
            reason = fused_adam.unsupported_reason(self.optimizer_class, self.resolved, groups)
        if reason is None and cpu_extension.load("fused_adam") is None:
            reason = "the C++ kernel csrc/fused_adam.cpp could not be built (see the warning above)"
        if reason is not None:
            raise ValueError(f"ZeroOptimizer: offload_optimizer={settings.device!r} streams the optimizer state "
                             f"through zerocompile's fused Adam kernel, which cannot run here: {reason}. Use "
                             "torch.optim.Adam or AdamW with the defaults the kernel supports, or drop the option")
        group = params.layout_group()
        if settings.ratio == "auto":
            ratio = auto_offload_ratio(groups, settings.memory_limit_mb, params.states())
            settings = dataclasses.replace(settings, ratio=ratio)
        log.info("ZeroOptimizer: %s steps with zerocompile's fused C++ kernel, optimizer state offloaded to %s",
                 name, settings.device if settings.device == "cpu" else f"nvme ({settings.nvme_path})")
        return OffloadedAdam(groups, settings, name=f"optimizer-rank{group.rank}", **self.resolved)


def auto_offload_ratio(groups: list[dict], limit_mb: float, states: list) -> float:
    """``offload_optimizer.ratio="auto"``: the smallest fraction of the optimizer state to
    offload so that this rank's parameters and gradients, the resident rest of the state
    (AdamW: two moments per element) and the largest simulated transient peak of the
    compiled frames using these parameters (``states``: their shard states) fit in
    ``limit_mb``. The same on every rank (equal shards, the same graphs); at least a sliver,
    so the option is never a no-op."""
    targets = {id(t): t for g in groups for t in g["params"] if t.requires_grad}.values()
    weights = sum(t.numel() * t.element_size() for t in targets)
    state = 2 * weights
    transient = simulated_peak_bytes({id(sp): sp for sp in states}.values())
    # the shards (or parameters) and their gradients stay resident
    available = limit_mb * 2**20 - 2 * weights - transient
    ratio = min(1.0, max(1e-6, (state - available) / state)) if state else 1.0
    log.info("ZeroOptimizer: offload_optimizer ratio 'auto' under memory_limit_mb=%g: parameters and gradients "
             "%d B, simulated transient peak %d B, optimizer state %d B -> offloading %.1f%% of it",
             limit_mb, 2 * weights, transient, state, 100 * ratio)
    if available < 0:
        log.warning("ZeroOptimizer: memory_limit_mb=%g is below what parameters, gradients and the transient "
                    "peak need (%d B) even with all optimizer state offloaded", limit_mb, 2 * weights + transient)
    return ratio
