"""``ZeroOptimizer``: any element-wise torch optimizer on this rank's shards.

Modelled on ``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class,
**defaults)``. It is a ``torch.optim.Optimizer`` whose ``param_groups`` hold the
user's parameters (so LR schedulers and ``add_param_group`` work as usual); an inner
``optimizer_class`` instance holds the real state and updates the shards. It binds
lazily: it may be built before the first forward, when no parameter is sharded yet.

Per optimizer step, by stage:

- stage 0 (and parameters no compiled frame has used): full gradients, all-reduced
  (averaged) once per step; the inner optimizer updates full parameters.
- stage 1: full gradients accumulated locally are reduce-scattered into the shards;
  the shards are updated and all-gathered into the replicas; the shard gradients are
  dropped (the full gradients stay until ``zero_grad``).
- stage 2: shard gradients come reduce-scattered from the backward graph; the shards
  are updated and all-gathered into the replicas.
- stage 3: shard gradients come from the backward graph; the shards are updated; the
  next forward gathers them.

Loss scaling (float16), two ways, both with one rule: the step is skipped on every rank when
any rank has a non-finite gradient (the flag is all-reduced with MAX), and the scale moves
the same way everywhere.

- ``torch.amp.GradScaler`` / FSDP's ``ShardedGradScaler``, unchanged: ``ZeroOptimizer`` has
  ``_step_supports_amp_scaling``, so ``scaler.step(opt)`` calls ``opt.step(grad_scaler=scaler)``
  and leaves the unscaling to it. The step reduces the gradients, divides them by the scale
  where the inner optimizer reads them (the shard gradients at stages 1-3, the averaged full
  gradients at stage 0), checks them, and records the all-reduced flag in the scaler's
  per-optimizer state, which is what ``scaler.update()`` reads.
- The ``loss_scale`` backend option (``zerocompile/loss_scale.py``): the compiled backward
  scales; the optimizer owns the scaler (``opt.loss_scale``), divides the gradients that
  stay scaled (those in shards and 16-bit replicas) after reducing them, checks, skips and
  updates the scale.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import logging
import math
import warnings
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.optim import Optimizer

from zerocompile import _torch_compat, loss_scale, optimizer_state_dict
from zerocompile.deepspeed_config import warn_once
from zerocompile.errors import UnshardedParametersError
from zerocompile.optimizer_rules import check_elementwise
from zerocompile.runtime import cpu_extension, fused_adam
from zerocompile.runtime.offload_settings import OffloadSettings
from zerocompile.runtime.offloaded_adam import OffloadedAdam
from zerocompile.runtime.param_offload import resident_shards
from zerocompile.runtime.accounting import ACCOUNTING
from zerocompile.runtime.comm import CommGroup, all_reduce_sum, resolve_group
from zerocompile.runtime.grad_participation import (Holder, compare_holders, fill_missing, layout_differences,
                                                    participation_error)
from zerocompile.runtime.leaf_modules import leaf_of
from zerocompile.runtime.sharded_param import get_state
from zerocompile.runtime.step_collectives import all_gather_concat, all_reduce_mean_, reduce_scatter_mean
from zerocompile.runtime.zero_parameter import raw_grad, set_gradient_reducer, set_raw_grad

_DEFAULT_BUCKET_MB = 25.0
KERNEL_CHOICES = ("auto", "fused", "torch")
"""``ZeroOptimizer(kernel=...)``: ``"auto"`` = zerocompile's fused Adam kernel where it applies,
else torch's ``fused=True`` / ``foreach=True``; ``"fused"`` = zerocompile's kernel or an error;
``"torch"`` = the optimizer class exactly as you configured it."""
log = logging.getLogger("zerocompile")

# torch.amp.GradScaler.step warns, each time it passes itself to an optimizer's step, that it
# will stop doing so. The warning is addressed to the optimizer's authors (tests/test_torch_compat.py
# fails when the contract changes), not to the person training, who could do nothing about it.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


class ZeroOptimizer(Optimizer):
    """``ZeroOptimizer(params, optimizer_class=torch.optim.AdamW, lr=..., ...)``.

    ``optimizer_class`` must be element-wise (see ``zerocompile.optimizer_rules``): one of the
    allow-listed torch classes, or any class with ``assume_elementwise=True``, your promise that
    it updates every element from that element's value, gradient and state alone and never
    depends on a parameter's shape."""

    _step_supports_amp_scaling = True
    """``torch.amp.GradScaler.step`` passes itself to ``step(grad_scaler=...)``, which unscales
    the gradients where they live (see the module docstring)."""

    def __init__(self, params, optimizer_class=torch.optim.AdamW, process_group=None, *,
                 assume_elementwise: bool = False, kernel: str = "auto", **defaults):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                f"ZeroOptimizer: optimizer_class must be a torch.optim.Optimizer subclass "
                f"(e.g. torch.optim.AdamW), got {optimizer_class!r}")
        check_elementwise(optimizer_class, assume_elementwise)
        if kernel not in KERNEL_CHOICES:
            raise ValueError(f"ZeroOptimizer: kernel={kernel!r} is invalid; allowed: "
                             f"{', '.join(repr(k) for k in KERNEL_CHOICES)}")
        self.optimizer_class = optimizer_class
        self._kernel_choice = kernel
        self.kernel: str | None = None
        """How the inner optimizer updates the tensors, chosen when it binds (None before):
        ``"cpp"`` / ``"triton"`` (zerocompile's fused Adam kernels, ``runtime/fused_adam.py``),
        ``"torch_fused"`` / ``"torch_foreach"`` (the class's own ``fused=True`` /
        ``foreach=True``), or ``"torch"`` (the class as configured)."""
        self._inner: Optimizer | None = None
        self._bound: list[list] = []          # per group: the tensor the inner optimizer updates
        self._pending_state: dict | None = None
        self._grads_reduced = False
        self._default_group = process_group
        self._warned_unsharded = False   # the warning about parameters no compiled frame used, given
        self._scaler = loss_scale.LossScaler()   # the loss_scale option's, configured by the first frame
        self._clipped_scaled = False     # clip_grad_norm_ ran without knowing of a GradScaler
        self._clipped_to: float | None = None
        """The max_norm of a clip_grad_norm_ call in this step, if any: the gradient_clipping
        option does not clip that step again."""
        self._deferred_scale: float | None = None
        """A clipping coefficient not yet applied to the gradients of ``self._deferred``: the
        fused kernel multiplies them by it as it reads them in the step (see clip_grad_norm_)."""
        self._deferred: dict[int, torch.Tensor] = {}    # id(target) -> target whose grad it scales
        self._step_copies: dict[int, torch.Tensor] = {}
        """During a step: id(shard) -> the updated shard in the compute dtype, written by the kernel."""
        self._hooked: set[int] = set()                  # ids of targets with the accumulate hook
        self._scaler_flag: torch.Tensor | None = None   # overflow flag recorded for a GradScaler
        self.skipped_steps = 0
        """Optimizer steps skipped because some rank's gradients were not finite."""
        self._collected_through = 0      # compile order of the newest frame whose garbage was collected
        super().__init__(params, defaults)
        # a meta parameter zerocompile has not sharded has no values (sharded ones are fine: a
        # model run on meta inputs end to end, as a plan does)
        meta = [tuple(p.shape) for g in self.param_groups for p in g["params"] if p.is_meta and get_state(p) is None]
        if meta:
            raise ValueError(f"ZeroOptimizer: {len(meta)} parameters are on the meta device (the first has shape "
                             f"{meta[0]}), so the model was built under torch.device('meta') and has no values yet. "
                             "Give it values first: zerocompile.materialize(model) (its own init, shard by shard) or "
                             "zerocompile.load_pretrained(model, path), before compiling and training it")
        try:  # fail now, not at the first step, on a bad hyperparameter
            probe = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        except (TypeError, ValueError) as err:
            raise type(err)(f"ZeroOptimizer: {optimizer_class.__name__} rejects {defaults}: {err}") from err
        self._resolved_defaults = dict(probe.defaults)   # with the class's own defaults filled in
        ACCOUNTING.optimizers.add(self)

    # ------------------------------------------------------------------ binding
    def _target(self, p: torch.Tensor) -> torch.Tensor:
        sp = get_state(p)
        return p if sp is None else sp.rules.optimizer_target(sp)

    def _check_one_group(self) -> None:
        names = {sp.group.name for p in self._params() if (sp := get_state(p)) is not None}
        if len(names) > 1:
            raise ValueError(
                f"ZeroOptimizer: its parameters are sharded over different process groups "
                f"({sorted(names)}); use one ZeroOptimizer per data-parallel group")

    def _bind(self) -> None:
        if self._inner is None:
            self._check_one_group()
            groups = []
            self._bound = []
            for group in self.param_groups:
                targets = [self._target(p) for p in group["params"]]
                self._bound.append(targets)
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": targets})
            self._inner, self.kernel = self._make_inner(groups)
            if self._pending_state is not None:
                self._load_inner(self._pending_state)
                self._pending_state = None
            return
        # a parameter first sharded after binding: swap it in while it has no state
        moved = [(gi, pi) for gi, group in enumerate(self.param_groups)
                 for pi, p in enumerate(group["params"]) if self._target(p) is not self._bound[gi][pi]]
        if not moved:
            return
        self._check_one_group()
        if any(self._inner.state.get(self._bound[gi][pi]) for gi, pi in moved):
            self._rebind_with_state()
            return
        for gi, pi in moved:
            target = self._target(self.param_groups[gi]["params"][pi])
            self._bound[gi][pi] = target
            self._inner.param_groups[gi]["params"][pi] = target

    def _rebind_with_state(self) -> None:
        """Some parameters that hold optimizer state were sharded since the inner optimizer
        bound (``state_dict()`` or a checkpoint loaded before the first forward bound it to the
        whole parameters): build the inner optimizer again over the current targets, with the
        kernel and offload settings their frames ask for, and cut each whole state into this
        rank's shard. Exact: element-wise state is the same on every rank (whole parameters
        step from averaged gradients), so each rank's chunk of it is its shard's state."""
        states = {}
        for group, targets in zip(self.param_groups, self._bound):
            for p, target in zip(group["params"], targets):
                values = self._target_state(target)
                if values:
                    states[p] = ParamState(dict(values), sharded=target is not p)
        log.info("ZeroOptimizer: %d parameters with optimizer state were sharded after the optimizer bound "
                 "to them whole; their state is cut into this rank's shards", len(states))
        self._inner = None
        self._pending_state = {_PARAM_STATES: states}
        self._bind()

    def _make_inner(self, groups: list[dict]) -> tuple[Optimizer, str]:
        """The inner optimizer over ``groups`` (whose params are the targets) and its kernel
        name: zerocompile's fused Adam where it applies (``kernel="auto"`` or ``"fused"``),
        else the class itself, with ``fused=True`` or ``foreach=True`` under ``"auto"`` where
        it is a torch class that takes them and you set neither."""
        name = self.optimizer_class.__name__
        devices = {t.device.type for g in groups for t in g["params"]}
        offload = self._offload_settings(devices)
        if offload is not None:
            return self._make_offloaded(groups, offload), "cpp"
        if self._kernel_choice != "torch":
            given = sorted({"fused", "foreach"} & self.defaults.keys())
            if given and self._kernel_choice == "auto":
                reason = f"you chose torch's implementation ({given[0]}={self.defaults[given[0]]!r})"
            elif self._kernel_choice == "auto" and any(t.dtype == torch.float16 for g in groups for t in g["params"]):
                # the C++ kernel converts float16 with scalar code: torch's fused kernel is ~4x faster
                reason = "float16 parameters, which torch's fused kernel steps faster"
            else:
                reason = fused_adam.unsupported_reason(self.optimizer_class, self._resolved_defaults, groups)
            kernel = None
            if reason is None:
                kernel = fused_adam.kernel_for(devices)
                if kernel is None:
                    reason = f"no fused kernel can run on {'/'.join(sorted(devices))} tensors here"
            if kernel is not None:
                log.info("ZeroOptimizer: %s steps with zerocompile's fused %s kernel", name,
                         "C++" if kernel == "cpp" else "Triton")
                return fused_adam.FusedAdam(groups, **self._resolved_defaults), kernel
            if self._kernel_choice == "fused":
                raise ValueError(f"ZeroOptimizer(kernel='fused'): {reason}; use kernel='auto' (falls back "
                                 "to torch's kernels) or kernel='torch'")
            log.debug("ZeroOptimizer: no fused zerocompile kernel for %s: %s", name, reason)
        # the defaults too: a few classes read a constructor argument rather than the group
        # (Adagrad's initial_accumulator_value)
        own_class = getattr(torch.optim, name, None) is self.optimizer_class   # not a subclass of yours
        if self._kernel_choice == "auto" and own_class and not ({"fused", "foreach"} & self.defaults.keys()):
            for flag, ok in (("fused", devices <= {"cpu", "cuda"}), ("foreach", True)):
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

    def _offload_settings(self, devices: set) -> OffloadSettings | None:
        """The ``offload_optimizer`` settings of the compiled frames that use these parameters,
        None when nothing is to be offloaded."""
        found = {sp.offload_optimizer for p in self._params() if (sp := get_state(p)) is not None}
        found.discard(OffloadSettings())
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"ZeroOptimizer: its parameters come from frames compiled with different "
                             f"offload_optimizer options ({'; '.join(sorted(map(str, found)))}); compile them with one")
        settings = found.pop()
        if settings.device == "cpu" and devices <= {"cpu"}:
            log.info("ZeroOptimizer: offload_optimizer device 'cpu': the model is on the CPU, so its optimizer "
                     "state already lives in host memory; nothing to offload")
            return None
        return settings

    def _make_offloaded(self, groups: list[dict], settings: OffloadSettings) -> Optimizer:
        name = self.optimizer_class.__name__
        if self._kernel_choice == "torch":
            reason = "kernel='torch' was asked for"
        else:
            reason = fused_adam.unsupported_reason(self.optimizer_class, self._resolved_defaults, groups)
        if reason is None and cpu_extension.load("fused_adam") is None:
            reason = "the C++ kernel csrc/fused_adam.cpp could not be built (see the warning above)"
        if reason is not None:
            raise ValueError(f"ZeroOptimizer: offload_optimizer={settings.device!r} streams the optimizer state "
                             f"through zerocompile's fused Adam kernel, which cannot run here: {reason}. Use "
                             "torch.optim.Adam or AdamW with the defaults the kernel supports, or drop the option")
        group = self._layout_group()
        if settings.ratio == "auto":
            settings = dataclasses.replace(settings, ratio=self._auto_offload_ratio(groups, settings.memory_limit_mb))
        log.info("ZeroOptimizer: %s steps with zerocompile's fused C++ kernel, optimizer state offloaded to %s",
                 name, settings.device if settings.device == "cpu" else f"nvme ({settings.nvme_path})")
        return OffloadedAdam(groups, settings, name=f"optimizer-rank{group.rank}", **self._resolved_defaults)

    def _auto_offload_ratio(self, groups: list[dict], limit_mb: float) -> float:
        """``offload_optimizer.ratio="auto"``: the smallest fraction of the optimizer state to
        offload so that this rank's parameters and gradients, the resident rest of the state
        (AdamW: two moments per element) and the largest simulated transient peak of the
        compiled frames using these parameters fit in ``limit_mb``. The same on every rank
        (equal shards, the same graphs); at least a sliver, so the option is never a no-op."""
        targets = {id(t): t for g in groups for t in g["params"] if t.requires_grad}.values()
        weights = sum(t.numel() * t.element_size() for t in targets)
        state = 2 * weights
        params = {id(sp): sp for p in self._params() if (sp := get_state(p)) is not None}
        frames = [r for r in list(ACCOUNTING.frames) if any(id(sp) in params for sp in r.plans if sp is not None)]
        transient = max((r.partitioner.ctx.results.get("simulated_peak_bytes", 0) for r in frames), default=0)
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

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if getattr(self, "_scaler", None) is not None:    # the frames using them read its scale
            for p in self.param_groups[-1]["params"]:
                loss_scale.claim(p, self._scaler)
                set_gradient_reducer(p, weakref.WeakMethod(self._gradients_for_reading))
        if getattr(self, "_inner", None) is not None:
            group = self.param_groups[-1]
            targets = [self._target(p) for p in group["params"]]
            if self.kernel in ("cpp", "triton"):
                reason = fused_adam.unsupported_reason(self.optimizer_class, self._resolved_defaults,
                                                       [{**group, "params": targets}])
                if reason is not None:
                    self.param_groups.pop()
                    raise ValueError(f"ZeroOptimizer.add_param_group: the fused Adam kernel this optimizer "
                                     f"uses cannot update this group ({reason}); build the ZeroOptimizer "
                                     "with kernel='torch' to add such groups")
            self._bound.append(targets)
            self._inner.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                         "params": targets})

    # ------------------------------------------------------------------ gradients
    def _params(self):
        seen = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def _bucket_bytes(self, states) -> int:
        mbs = {s.bucket_mb for s in states if getattr(s, "bucket_mb", None) is not None}
        return int((min(mbs) if mbs else _DEFAULT_BUCKET_MB) * 2**20)  # 0: one tensor per collective

    def _group_of(self, sp) -> CommGroup:
        return sp.group if sp is not None else resolve_group(self._default_group)

    def _reduce_gradients(self) -> None:
        """Bring every gradient to where the inner optimizer reads it, averaged over ranks and,
        with the ``loss_scale`` option, divided by the scale where the backward left it scaled.

        Called by the step, by ``clip_grad_norm_`` and by the first read of a ``p.grad`` after a
        backward (``runtime/zero_parameter.py``). A compiled forward after that (more
        micro-batches before the step) makes its parameters' gradients stale
        (``ShardedParam.grad_reduced``), and the next call reduces them again: at stage 0 the
        all-reduce of what was averaged plus the new local part (averaging values equal on
        every rank leaves them as they are), at stage 1 the whole local gradient into the
        shard, at stages 2 and 3 nothing (the backward reduced the new part)."""
        states = [sp for p in self._params() if (sp := get_state(p)) is not None]
        if self._grads_reduced and all(sp.grad_reduced for sp in states):
            return
        again = self._grads_reduced     # some gradients were reduced before the last backward
        self._agree_on_gradients()
        scaler = self._loss_scaler()
        scale = scaler.scale if scaler is not None else None
        full = defaultdict(list)        # (group, reduce dtype) -> replicated grads to all-reduce
        # (group, reduce dtype) -> (state, full grad, accumulate?, scale it carries or None)
        to_scatter = defaultdict(list)
        for p in self._params():
            sp = get_state(p)
            own = raw_grad(p)
            if sp is None or not sp.rules.shards_master:
                if own is not None and (sp is None or not again or not sp.grad_synced):
                    group = self._group_of(sp)
                    rd = sp.reduce_dtype if sp is not None else torch.float32
                    full[(group, rd)].append((sp, own))
                continue
            key = (sp.group, sp.reduce_dtype)
            scaled = scale if scale is not None and loss_scale.holds_scaled_gradient(sp) else None
            if sp.rules.reduces_in_step:
                if again and sp.grad_reduced and own is None:
                    continue
                self._check_unchanged_since_reduced(sp)
                grad = raw_grad(sp.replica)
                eager = None
                if p is not sp.replica and own is not None:   # eager use of a freed parameter
                    set_raw_grad(p, None)
                    if scaled is None:
                        grad = own.to(sp.compute_dtype) if grad is None else grad.add_(own)
                    else:   # not scaled, unlike the replica's: reduced apart, added once that is unscaled
                        eager = own
                if grad is not None:
                    to_scatter[key].append((sp, grad, False, scaled))
                if eager is not None:
                    to_scatter[key].append((sp, eager, grad is not None, None))
                continue
            if scaled is not None and sp.shard.grad is not None:
                if not sp.grad_unscaled:
                    sp.shard.grad.div_(scaled)
                    sp.grad_unscaled = True
                elif not sp.grad_reduced:
                    raise RuntimeError(
                        f"ZeroOptimizer: a backward added loss-scaled gradients to parameter '{sp.name}', "
                        "whose gradient had already been unscaled (read through p.grad, clipped, or stepped "
                        "without zero_grad() after it). With the loss_scale option, read and clip gradients "
                        "after the last micro-batch's backward, and call opt.zero_grad() after each step")
            if own is not None:      # stages 2/3: a gradient from eager use of the parameter
                to_scatter[key].append((sp, own, True, None))
                set_raw_grad(p, None)
        self._warn_unsharded(full)
        for (group, rd), items in full.items():
            all_reduce_mean_([g for _, g in items], group, self._bucket_bytes([s for s, _ in items]), rd)
            for sp, _ in items:
                if sp is not None:
                    sp.grad_synced = True    # p.grad is now the averaged gradient: readable
        for (group, rd), items in to_scatter.items():
            shards = reduce_scatter_mean([(item[1], item[0].padded_numel) for item in items], group,
                                         self._bucket_bytes([item[0] for item in items]), rd)
            for (sp, _, accumulate, scaled), shard_grad in zip(items, shards):
                shard_grad = shard_grad.to(sp.dtype)
                if scaled is not None:
                    shard_grad = shard_grad / scaled        # in the master dtype
                if accumulate and sp.shard.grad is not None:
                    sp.shard.grad.add_(shard_grad)
                else:
                    sp.shard.grad = shard_grad if scaled is not None else shard_grad.clone()
        for sp in states:
            sp.grad_reduced = True
            if sp.rules.reduces_in_step and sp.shard.grad is not None:
                sp.reduced_grad_version = sp.shard.grad._version
        self._grads_reduced = True

    def _gradients_for_reading(self) -> None:
        """What a read of ``p.grad`` calls first (``runtime/zero_parameter.py``): the gradients
        reduced, and a clipping coefficient still deferred applied, so the reader sees the
        values the step would use."""
        self._reduce_gradients()
        self._apply_deferred()

    @staticmethod
    def _check_unchanged_since_reduced(sp) -> None:
        """Stage 1 reduces the whole local gradient into the shard again after more micro-batches;
        that replaces the shard gradient, so it must still be what the last reduction left."""
        grad = sp.shard.grad
        if grad is not None and sp.reduced_grad_version is not None and grad._version != sp.reduced_grad_version:
            raise RuntimeError(
                f"ZeroOptimizer: at stage 1 the averaged gradient of parameter '{sp.name}' was changed in place "
                "(through p.grad: clipped or scaled) and then a backward added local gradients to it before the "
                "step; the two cannot be combined exactly. Change or clip gradients after the last micro-batch's "
                "backward, or use stage 0 or 2")

    def _agree_on_gradients(self) -> None:
        """Make every rank hold the same set of gradients to reduce: a zero gradient where
        another rank has one and this rank's data did not reach the parameter; at stage 3,
        outside leaf modules, and wherever ranks shard a parameter differently, an error on
        every rank instead (runtime/grad_participation.py)."""
        group = self._layout_group()
        if group.world == 1:
            return
        holders = []
        for p in self._params():
            if not p.requires_grad:
                continue
            sp = get_state(p)
            # what decides how it is reduced: whole (stage 0, or no state) or into its stage's shards
            layout = 0 if sp is None or not sp.rules.shards_master else 1 + sp.stage
            replica = sp.replica if sp is not None and sp.rules.reduces_in_step and sp.replica is not p else None
            holders += [Holder(p, p, layout), Holder(p, replica, 0)]
        rows = compare_holders(holders, group, self._device())
        if rows is None:
            return
        roots = {id(m): m for frame in list(ACCOUNTING.frames) for m in getattr(frame, "_hook_roots", ())}
        roots = sorted(roots.values(), key=lambda m: -sum(1 for _ in m.parameters()))   # the model first
        split = layout_differences(holders, rows)
        if split:
            raise participation_error([_param_name(h.param, roots) for h, _ in split], [d for _, d in split], roots,
                                      "are sharded on some ranks only, by a compiled frame that ran on those ranks "
                                      "only")
        partial = fill_missing(holders, rows)
        stage = max((sp.stage for p in self._params() if (sp := get_state(p)) is not None), default=0)
        refused = [(h, ranks) for h, ranks in partial if leaf_of(h.param) is None
                   and (sp.stage if (sp := get_state(h.param)) is not None else stage) == 3]
        if refused:
            raise participation_error([_param_name(h.param, roots) for h, _ in refused],
                                      [f"ranks {ranks}" for _, ranks in refused], roots,
                                      "got a gradient on some ranks only at stage 3")

    # ------------------------------------------------------------------ loss scaling
    def _loss_scaler(self) -> loss_scale.LossScaler | None:
        """The scaler of the ``loss_scale`` option, once a compiled frame that scales uses one
        of this optimizer's parameters (None before, and without the option)."""
        found = {s for p in self._params() if (s := loss_scale.settings_of(p)) is not None}
        if self._scaler.settings is not None:
            found.add(self._scaler.settings)
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"ZeroOptimizer: its parameters come from frames compiled with different "
                             f"loss_scale options ({'; '.join(sorted(map(repr, found)))}); compile them with one")
        if self._scaler.settings is None:
            self._check_master_dtypes("the loss_scale option")
            self._scaler.configure(found.pop())
        return self._scaler

    @property
    def loss_scale(self) -> float | None:
        """The current scale of the ``loss_scale`` backend option: what the compiled backward
        multiplies gradients by. None while no frame compiled with the option uses this
        optimizer's parameters."""
        settings = self._scaler.settings or next(
            (s for p in self._params() if (s := loss_scale.settings_of(p)) is not None), None)
        if settings is None:
            return None
        return float(settings.initial_scale) if self._scaler.scale is None else self._scaler.scale

    def loss_scaler_state(self) -> dict | None:
        """The ``loss_scale`` option's scaler state (scale, iteration, last overflow, hysteresis
        left; JSON-serialisable), or None where no frame compiled with the option uses this
        optimizer's parameters. ``state_dict`` and ``zerocompile.save_checkpoint`` include it."""
        if self._loss_scaler() is None and self._scaler.scale is None:
            return None
        return self._scaler.state_dict()

    def load_loss_scaler_state(self, state: dict) -> None:
        """Restore what ``loss_scaler_state`` returned (at once: the next backward uses it)."""
        self._scaler.load_state_dict(state)

    def _check_master_dtypes(self, what: str) -> None:
        for p in self._params():
            if p.requires_grad and p.dtype == torch.float16:
                sp = get_state(p)
                name = sp.name if sp is not None else f"of shape {tuple(p.shape)}"
                raise ValueError(
                    f"ZeroOptimizer: parameter '{name}' is float16, so its gradient, master value and "
                    f"optimizer state are float16; {what} does not unscale float16 gradients "
                    "(torch.amp.GradScaler refuses them too: 'Attempting to unscale FP16 gradients'). "
                    "Keep the model's parameters float32 and compute in float16 with the backend option "
                    "param_dtype='float16': master shards stay float32.")

    def _device(self) -> torch.device:
        return next((self._target(p).device for p in self._params()), torch.device("cpu"))

    def _overflow(self, inv_scale: torch.Tensor | None, earlier=()) -> torch.Tensor:
        """Multiply the gradients the inner optimizer reads by ``inv_scale`` (None: leave them)
        and return 1.0 if any rank has a non-finite one (or a flag in ``earlier`` is set), else
        0.0: a float32 scalar, the same on every rank (all-reduced with MAX)."""
        self._apply_deferred()      # a clipping coefficient still pending: applied now, in place
        by_kind = defaultdict(list)
        for p in self._params():
            grad = raw_grad(self._target(p))
            if grad is not None:
                by_kind[(grad.device, grad.dtype)].append(grad)
        device = self._device()
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for (dev, _), grads in by_kind.items():
            found = torch.zeros((), dtype=torch.float32, device=dev)
            inv = inv_scale.to(dev) if inv_scale is not None else torch.ones((), device=dev)
            _torch_compat.unscale_and_check_(grads, found, inv)
            flag = torch.maximum(flag, found.to(device))
        for f in earlier:
            flag = torch.maximum(flag, (f.to(device) > 0).float())
        return _all_reduce_max(flag, self._layout_group())

    def _unscale_with(self, grad_scaler) -> torch.Tensor:
        """For a ``torch.amp.GradScaler``, once per iteration: reduce the gradients, divide them
        by its scale, and record the all-reduced overflow flag in its state for this optimizer
        (which ``scaler.update()`` reads); return the flag."""
        ready, unscaled, _ = _torch_compat.grad_scaler_stages()
        state = _torch_compat.grad_scaler_state(grad_scaler, self)
        if state["stage"] is unscaled and self._scaler_flag is not None:
            return self._scaler_flag
        self._check_master_dtypes("torch.amp.GradScaler")
        scale = _torch_compat.grad_scaler_scale(grad_scaler)
        earlier = ()
        if state["stage"] is ready:
            if self._clipped_scaled:
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
        self._reduce_gradients()
        flag = self._overflow(inv_scale, earlier)
        state["found_inf_per_device"] = {scale.device: flag.to(scale.device)}
        state["stage"] = unscaled
        self._scaler_flag = flag
        return flag

    def _skip_step(self) -> None:
        """The update is skipped: shards, replicas and optimizer state stay as they are."""
        self.skipped_steps += 1
        log.info("ZeroOptimizer: step skipped, non-finite gradients on some rank")
        for p in self._params():
            sp = get_state(p)
            if sp is not None and sp.rules.reduces_in_step:
                sp.shard.grad = None     # as after a step: the full gradients stay until zero_grad()
                sp.forget_reduction()

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Reduce gradients, update this rank's shards, refresh replicas (stages 1/2).

        With loss scaling (``grad_scaler``, which ``torch.amp.GradScaler.step(opt)`` passes, or
        the ``loss_scale`` backend option) the gradients are unscaled first, and the update is
        skipped on every rank when any rank's gradients are not finite."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._bind()
        self._sync_hyperparameters()
        scaler = self._loss_scaler()
        if grad_scaler is not None and scaler is not None:
            raise RuntimeError(
                "ZeroOptimizer: the model was compiled with the loss_scale option, which scales inside "
                "the backward, and a torch.amp.GradScaler scales the loss as well; use one of them")
        if grad_scaler is not None:
            overflow = bool(self._unscale_with(grad_scaler).item())
        elif scaler is not None:
            self._reduce_gradients()
            overflow = bool(self._overflow(None).item())
        else:
            self._reduce_gradients()
            overflow = False
        if overflow:
            self._apply_deferred()      # the gradients stay as clipping left them
            self._skip_step()
        else:
            try:
                self._clip_as_configured()
                self._step_inner()
                self._after_step()
            finally:
                self._step_copies = {}
        if scaler is not None:
            scaler.update(overflow)
        self._grads_reduced = False
        self._clipped_scaled = False
        self._clipped_to = None
        self._scaler_flag = None
        self._clear_deferred()
        self._collect_compile_garbage()
        return loss

    def _collect_compile_garbage(self) -> None:
        """After a step in which frames were compiled, run Python's cyclic garbage collector
        once. Dynamo's tracing leaves reference cycles that hold each compiled frame's example
        inputs (that step's activations: a decoder layer's hidden states, its position ids);
        uncollected, they stay alive until the interpreter's next full collection, at a point
        of its choosing, and every step's peak until then counts them. Collected here, the
        memory of later steps is the program's own, the same in a real run and in ``plan``."""
        newest = max((runner.order for runner in list(ACCOUNTING.frames)), default=0)
        if newest > self._collected_through:
            self._collected_through = newest
            gc.collect()

    def _clip_as_configured(self) -> None:
        """The ``gradient_clipping`` option of the frames that use these parameters (DeepSpeed's
        key): clip the reduced, unscaled gradients' global norm to it, unless ``clip_grad_norm_``
        was called in this step (that call's clipping stands, it is not applied twice)."""
        found = {sp.gradient_clipping for p in self._params() if (sp := get_state(p)) is not None}
        if len(found) > 1:
            raise ValueError(f"ZeroOptimizer: its parameters come from frames compiled with different "
                             f"gradient_clipping options ({', '.join(map(str, sorted(found)))}); compile them "
                             "with one")
        max_norm = found.pop() if found else 0.0
        if max_norm > 0 and self._clipped_to is None:
            self.clip_grad_norm_(max_norm)
        elif max_norm > 0 and self._clipped_to != max_norm:
            warn_once(f"ZeroOptimizer: clip_grad_norm_({self._clipped_to:g}) in a step of a model compiled with "
                      f"gradient_clipping={max_norm:g}: your call's bound is the one applied (the option clips "
                      "only the steps in which you do not clip)")

    def _step_inner(self) -> None:
        """The inner optimizer's update. Shards kept in files (``offload_param``) are read back
        for it and written again: with zerocompile's fused kernels part by part, at most
        ``buffer_count * buffer_size`` elements of them at a time (each parameter's update
        depends on nothing else, so the numbers are those of one step of all); torch's
        optimizers update every tensor in one call, so all of them at once."""
        states = {id(self._target(p)): sp for p in self._params() if (sp := get_state(p)) is not None}
        offloaded = [sp for sp in states.values() if sp.shard_file is not None]
        if not isinstance(self._inner, fused_adam.FusedAdam):
            with resident_shards(offloaded, write=True, threads=max((sp.offload_param.threads for sp in offloaded),
                                                                     default=1)):
                self._inner.step()
            return
        in_files = {id(sp.shard) for sp in offloaded}
        self._fused_step([t for g in self._inner.param_groups for t in g["params"] if id(t) not in in_files], states)
        if not offloaded:
            return
        settings = offloaded[0].offload_param
        limit = settings.buffer_count * settings.buffer_size
        part, size = [], 0
        for sp in offloaded + [None]:
            if part and (sp is None or size + sp.chunk > limit):
                with resident_shards(part, write=True, threads=settings.threads):
                    self._fused_step([s.shard for s in part], states)
                part, size = [], 0
            if sp is not None:
                part.append(sp)
                size += sp.chunk

    def _fused_step(self, targets: list, states: dict) -> None:
        """The fused inner optimizer's update of ``targets``, the gradients still owed a deferred
        clipping coefficient multiplied by it inside the kernel, and (stages 1/2 with a
        ``param_dtype``) the shard's copy in the compute dtype, which the replica's all-gather
        sends, written in the same pass (``self._step_copies``). ``states`` maps ``id`` of each
        target to its parameter's shard state."""
        copies = {}
        for t in targets:
            sp = states.get(id(t))
            if (t.grad is not None and sp is not None and sp.rules.keeps_replica and sp.requires_grad
                    and sp.compute_dtype != sp.dtype):
                copies[id(t)] = torch.empty(t.shape, dtype=sp.compute_dtype, device=t.device)
        scale = self._deferred_scale
        scaled = [t for t in targets if scale is not None and id(t) in self._deferred]
        rest = [t for t in targets if scale is None or id(t) not in self._deferred]
        if scaled:
            self._inner.step(only=scaled, grad_scale=scale, copies=copies)
        if rest:
            self._inner.step(only=rest, copies=copies)
        # the inner optimizer removed the copies it did not write (parameters whose optimizer
        # state streams from a swap file): the after-step casts those shards itself
        self._step_copies.update(copies)

    def _after_step(self) -> None:
        replicas = defaultdict(list)
        for p in self._params():
            sp = get_state(p)
            if sp is None or not sp.rules.shards_master:
                continue
            if sp.rules.keeps_replica and sp.requires_grad:
                replicas[(sp.group, sp.compute_dtype)].append((sp, sp.refresh_replica))
            if sp.separate_full_param and sp.requires_grad:
                replicas[(sp.group, sp.dtype)].append((sp, sp.refresh_param))
            if sp.rules.reduces_in_step:
                sp.shard.grad = None     # the full gradients stay until zero_grad()
                sp.forget_reduction()
            sp.release()                 # eager-gathered copies are stale now
        for (group, dtype), items in replicas.items():
            with resident_shards([sp for sp, _ in items]):     # offload_param: shards read back
                shards = [self._step_copies.get(id(sp.shard)) if dtype == sp.compute_dtype else None
                          for sp, _ in items]
                shards = [c if c is not None else sp.shard.detach().to(dtype) for c, (sp, _) in zip(shards, items)]
                all_gather_concat(shards, group, self._bucket_bytes([sp for sp, _ in items]),
                                  lambda i, rows: items[i][1](rows))

    def unsharded_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of each trainable parameter no compiled frame has used (kept
        whole on every rank, with its gradient and optimizer state); ``zerocompile plan``
        reports them."""
        params = [p for p in self._params() if get_state(p) is None and p.requires_grad]
        return list(zip(_parameter_names(params), params))

    def _warn_unsharded(self, full: dict) -> None:
        """Parameters that no compiled frame has used (no ``ShardedParam``) and that get
        gradients on several ranks are kept whole everywhere, as DDP keeps them (exact, but not
        sharded). At stage 3 that is refused (``UnshardedParametersError``) unless the frames
        were compiled with ``allow_unsharded``; otherwise a warning, once. ``full``: the
        gradients to all-reduce whole, by (group, reduce dtype)."""
        if self._warned_unsharded or all(group.world <= 1 for group, _ in full):
            return
        grads = [g for items in full.values() for sp, g in items if sp is None]
        if not grads or not any(bool(g.any()) for g in grads):
            return      # none, or all zero: torch's _init_optim_state stepping before the first forward
        unsharded = [p for p in self._params() if get_state(p) is None and raw_grad(p) is not None]
        names = _parameter_names(unsharded)
        listed = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        elements = f"{sum(g.numel() for g in grads):,}"
        stage3 = [sp for p in self._params() if (sp := get_state(p)) is not None and sp.stage == 3]
        if stage3 and not all(sp.allow_unsharded for sp in stage3):
            raise UnshardedParametersError(
                f"ZeroOptimizer: {len(grads)} parameter(s) ({elements} elements: {listed}) were used by no frame "
                "compiled with backend='zero', so at stage 3 every rank would keep them whole, with whole "
                "gradients and optimizer state. Dynamo ran the code that uses them eagerly: a graph break it "
                "could not resume from (e.g. inside a torch.utils.checkpoint region, or in a loop), a "
                "torch.compiler.disable'd function, or a torch.nn module compiled on its own (Dynamo does not "
                "compile the forward of nn.Linear, nn.Embedding... as a frame: compile the module that calls it). "
                "See why with TORCH_LOGS=graph_breaks and run that code inside a compiled frame, or keep them "
                "whole on purpose with options={'allow_unsharded': True}")
        self._warned_unsharded = True
        shapes = ", ".join(str(list(g.shape)) for g in grads[:4]) + (", ..." if len(grads) > 4 else "")
        log.warning(
            "ZeroOptimizer: %d parameter(s) (%s elements; shapes %s; %s) were used by no frame compiled with "
            "backend='zero', so every rank keeps them whole, with whole gradients (all-reduced) and optimizer "
            "state. Run the code that uses them inside a compiled frame; note that Dynamo does not compile the "
            "forward of a torch.nn module (nn.Linear, nn.Embedding...) as a frame of its own: compile the module "
            "that calls it", len(grads), elements, shapes, listed)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients wherever zerocompile keeps them (parameters, replicas, shards)."""
        self._grads_reduced = False
        self._clipped_scaled = False
        self._clipped_to = None
        self._scaler_flag = None
        self._clear_deferred()
        for p in self._params():
            sp = get_state(p)
            holders = [p] if sp is None else {id(t): t for t in (p, sp.replica, sp.shard) if t is not None}.values()
            if sp is not None:
                sp.forget_reduction()
            for t in holders:
                grad = raw_grad(t)
                if grad is None:
                    continue
                if set_to_none:
                    set_raw_grad(t, None)
                else:
                    grad.detach_()
                    grad.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, grad_scaler=None) -> torch.Tensor:
        """Clip gradients by their global norm over all ranks; return that norm (before clipping).

        With a ``torch.amp.GradScaler``, pass it as ``grad_scaler``: the gradients are unscaled
        first, as ``scaler.unscale_(opt)`` would (which cannot reach gradients kept in shards),
        and ``scaler.step(opt)`` then does not unscale again. With the ``loss_scale`` option the
        gradients are unscaled here by themselves. A model compiled with the ``gradient_clipping``
        option is not clipped again by the step that follows."""
        self._bind()
        self._clipped_to = float(max_norm)
        if grad_scaler is not None and grad_scaler.is_enabled():
            self._sync_hyperparameters()
            if self._loss_scaler() is not None:
                raise RuntimeError(
                    "ZeroOptimizer: the model was compiled with the loss_scale option, which scales "
                    "inside the backward, and a torch.amp.GradScaler scales the loss as well; use one of them")
            self._unscale_with(grad_scaler)
        else:
            self._clipped_scaled = True
        self._reduce_gradients()
        self._apply_deferred()      # clipped twice: the first coefficient goes in now
        norm_type = float(norm_type)
        owned, replicated = [], []
        group = None
        # rank-independent (every rank shards the same parameters): reduce the owned part only
        # when some parameter is sharded at all
        any_sharded = any((sp := get_state(p)) is not None and sp.rules.shards_master for p in self._params())
        for p in self._params():
            sp = get_state(p)
            target = self._target(p)
            grad = raw_grad(target)
            if grad is None:
                continue
            group = group or self._group_of(sp)
            (replicated if target is p else owned).append(grad)
        group = group or resolve_group(self._default_group)
        dev = owned[0].device if owned else (replicated[0].device if replicated else torch.device("cpu"))
        if math.isinf(norm_type):
            local = torch.maximum(_norm(owned, norm_type, dev), _norm(replicated, norm_type, dev))
            total = _all_reduce_max(local, group) if any_sharded else local
        else:
            part = _norm(owned, norm_type, dev) ** norm_type
            summed = _all_reduce_scalar(part, group) if any_sharded else part
            rep = _norm(replicated, norm_type, dev) ** norm_type
            total = (summed + rep) ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if not self._defer_clip(coef, owned, replicated):
            for g in owned + replicated:
                g.mul_(coef.to(g.dtype))
        return total

    # ------------------------------------------------------------------ the deferred coefficient
    def _defer_clip(self, coef: torch.Tensor, owned: list, replicated: list) -> bool:
        """Leave the clipping coefficient for the fused kernel to apply as it reads each
        gradient in the step (one pass over the gradients fewer), where that gives the numbers
        of multiplying now, bit for bit: every gradient is a float32 shard gradient (stages
        2/3) that the fused kernel updates from; a read of ``p.grad`` in between applies it
        first (``_gradients_for_reading``). A backward that adds to a gradient before the step applies
        the coefficient to it first (a hook on the shard, run before accumulation), so the
        result is that of clipping in place. Returns whether it deferred."""
        if replicated or not owned or not isinstance(self._inner, fused_adam.FusedAdam):
            return False
        targets = []
        for p in self._params():
            sp = get_state(p)
            target = self._target(p)
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
        self._deferred = {id(t): t for t in targets}
        self._deferred_scale = value
        return True

    def _apply_deferred(self, ids=None) -> None:
        """Multiply the gradients still owed the deferred coefficient (``ids``: of those
        targets only) by it now."""
        if self._deferred_scale is None:
            return
        for key in list(self._deferred) if ids is None else [i for i in ids if i in self._deferred]:
            grad = raw_grad(self._deferred.pop(key))
            if grad is not None:
                grad.mul_(torch.tensor(self._deferred_scale, dtype=grad.dtype, device=grad.device))
        if not self._deferred:
            self._deferred_scale = None

    def _clear_deferred(self) -> None:
        self._deferred = {}
        self._deferred_scale = None

    def state_dict(self) -> dict:
        """torch's layout (``state`` keyed by each parameter's position in the param groups,
        ``param_groups`` with those positions as ``params``), sharded state as DTensors (see
        ``zerocompile.optimizer_state_dict``), plus a ``"zerocompile"`` entry (optimizer class,
        rank, world size, the ``loss_scale`` option's scaler state). No communication.

        Before the optimizer binds (no step yet, nothing loaded: what ``accelerate.prepare``
        reads) it holds no state: the param groups' hyperparameters only (``"shapes": None`` in
        the ``"zerocompile"`` entry), and reading it binds nothing, so the first forward still
        decides what each parameter's shard is."""
        if self._inner is None and self._pending_state is None:
            return self._unbound_state_dict()
        self._bind()
        self._sync_hyperparameters()
        state, groups, index = {}, [], 0
        for group, targets in zip(self.param_groups, self._bound):
            ids = []
            for p, target in zip(group["params"], targets):
                values = self._target_state(target)
                if values:
                    state[index] = {k: optimizer_state_dict.exported(p, target, v) for k, v in values.items()}
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        layout = self._layout_group()
        meta = {"rank": layout.rank, "world_size": layout.world, "optimizer_class": self.optimizer_class.__name__}
        scaler_state = self.loss_scaler_state()
        if scaler_state is not None:
            meta["loss_scaler"] = scaler_state
        return {"state": state, "param_groups": groups, "zerocompile": meta}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict in torch's layout: what ``state_dict()`` gave (on this rank, or
        filled by ``dcp.load``), or what torch's ``set_optimizer_state_dict`` passes. Saved
        parameters map to yours by position in the param groups, as in torch."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("ZeroOptimizer.load_state_dict: not an optimizer state dict (it needs 'state' and "
                             "'param_groups'); it must come from ZeroOptimizer.state_dict() or torch's "
                             "get_optimizer_state_dict")
        meta = state_dict.get("zerocompile") or {}
        if meta.get("optimizer_class", self.optimizer_class.__name__) != self.optimizer_class.__name__:
            raise ValueError(f"ZeroOptimizer.load_state_dict: state of {meta['optimizer_class']}, "
                             f"but this optimizer wraps {self.optimizer_class.__name__}")
        if "shapes" in meta:            # the per-rank layout of earlier versions: flat shards
            self._load_per_rank(state_dict, meta)
            return
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError(
                "ZeroOptimizer.load_state_dict: the state dict's param groups (sizes "
                f"{[len(s['params']) for s in saved_groups]}) do not match this optimizer's "
                f"({[len(g['params']) for g in self.param_groups]})")
        positions = {}
        for saved, group in zip(saved_groups, self.param_groups):
            positions.update(zip(saved["params"], group["params"]))
        group = self._layout_group()
        if "rank" in meta and (meta["rank"], meta["world_size"]) != (group.rank, group.world) and any(
                optimizer_state_dict.is_sharded_value(v) for st in state_dict["state"].values() for v in st.values()):
            raise ValueError(
                f"ZeroOptimizer.load_state_dict: this state was saved by rank {meta['rank']} of "
                f"{meta['world_size']}, but this is rank {group.rank} of {group.world}; load each "
                "rank's own file with the same world size, or save and load with torch.distributed.checkpoint, "
                "which reshards")
        unknown = [key for key in state_dict["state"] if key not in positions]
        if unknown:
            raise ValueError(f"ZeroOptimizer.load_state_dict: state for parameters {unknown[:4]} that no param "
                             "group of the state dict lists")
        if "loss_scaler" in meta:       # at once: the next backward already uses this scale
            self.load_loss_scaler_state(meta["loss_scaler"])
        if self._inner is None and any(get_state(positions[key]) is None and optimizer_state_dict.is_sharded_value(v)
                                       for key, st in state_dict["state"].items() for v in st.values()):
            # shards of parameters not sharded yet (a forward shards them): read when binding
            self._pending_state = {_TORCH_LAYOUT: state_dict}
            return
        states = {}
        for key, values in state_dict["state"].items():
            p = positions[key]
            values, sharded = optimizer_state_dict.imported(p, repr(key), values)
            states[p] = ParamState(values, sharded=sharded)
        self.load_checkpoint_state(states, [{k: v for k, v in g.items() if k != "params"} for g in saved_groups])

    def _load_per_rank(self, state_dict: dict, meta: dict) -> None:
        group = self._layout_group()
        if (meta["rank"], meta["world_size"]) != (group.rank, group.world):
            raise ValueError(
                f"ZeroOptimizer.load_state_dict: this state was saved by rank {meta['rank']} of "
                f"{meta['world_size']}, but this is rank {group.rank} of {group.world}; load each "
                "rank's own file with the same world size")
        if "loss_scaler" in meta:
            self.load_loss_scaler_state(meta["loss_scaler"])
        if meta["shapes"] is None:      # from an optimizer not bound yet: hyperparameters only
            self._load_hyperparameters(state_dict)
            return
        if self._inner is None:
            self._pending_state = state_dict
        else:
            self._load_inner(state_dict)

    def _load_inner(self, state_dict: dict) -> None:
        if _PARAM_STATES in state_dict:         # from load_checkpoint_state()
            self._apply_param_states(state_dict[_PARAM_STATES])
            return
        if _TORCH_LAYOUT in state_dict:         # from load_state_dict(), waiting for the shards
            self.load_state_dict(state_dict[_TORCH_LAYOUT])
            return
        shapes = [[tuple(t.shape) for t in ts] for ts in self._bound]
        saved = [[tuple(s) for s in ss] for ss in state_dict["zerocompile"]["shapes"]]
        if shapes != saved:
            raise ValueError("ZeroOptimizer.load_state_dict: the saved shard shapes differ from this "
                             "model's (different model, stage or world size)")
        inner = {k: v for k, v in state_dict.items() if k != "zerocompile"}
        self._inner.load_state_dict(inner)
        for outer, loaded in zip(self.param_groups, self._inner.param_groups):
            for key, value in loaded.items():
                if key != "params":
                    outer[key] = value

    def _unbound_state_dict(self) -> dict:
        """``state_dict()`` of an optimizer that has not bound: no state, the param groups'
        hyperparameters, ``shapes`` None."""
        groups, index = [], 0
        for group in self.param_groups:
            count = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(index, index + count))})
            index += count
        group = self._layout_group()
        sd = {"state": {}, "param_groups": groups,
              "zerocompile": {"rank": group.rank, "world_size": group.world,
                              "optimizer_class": self.optimizer_class.__name__, "shapes": None}}
        scaler_state = self.loss_scaler_state()
        if scaler_state is not None:
            sd["zerocompile"]["loss_scaler"] = scaler_state
        return sd

    def _load_hyperparameters(self, state_dict: dict) -> None:
        """Load the hyperparameters of an unbound optimizer's ``state_dict()`` (it has no state)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("ZeroOptimizer.load_state_dict: the saved param groups hold different numbers "
                             "of parameters than this optimizer's")
        for outer, loaded in zip(self.param_groups, saved):
            outer.update({k: v for k, v in loaded.items() if k != "params"})
        if self._inner is not None:
            self._sync_hyperparameters()

    def _layout_group(self) -> CommGroup:
        for p in self._params():
            sp = get_state(p)
            if sp is not None:
                return sp.group
        return resolve_group(self._default_group)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self._inner is None:
            return 0
        storages = {}
        for st in self._inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:   # not 0-d step counters
                    storages[v.untyped_storage()._cdata] = v.untyped_storage().nbytes()   # fake ones too
        return sum(storages.values())

    @property
    def state(self) -> dict:
        """Per-parameter optimizer state, keyed by *your* parameters: the inner optimizer's state
        of each one's target (this rank's shard at stages 1-3). Read-only view."""
        if self._inner is None:
            return {}
        out = {}
        for group, targets in zip(self.param_groups, self._bound):
            for p, target in zip(group["params"], targets):
                if target in self._inner.state:
                    out[p] = self._target_state(target)
        return out

    def _target_state(self, target) -> dict:
        """The inner optimizer's whole state of ``target`` (offloaded moments read back)."""
        if isinstance(self._inner, OffloadedAdam):
            return self._inner.param_state(target)
        return self._inner.state.get(target, {})

    def offloaded_bytes(self) -> int:
        """Bytes of optimizer state held off the device (host memory or swap file), by offload."""
        return self._inner.offloaded_bytes() if isinstance(self._inner, OffloadedAdam) else 0

    @property
    def offload(self) -> str | None:
        """``"cpu"`` or ``"nvme"`` where the optimizer state is offloaded, else None (also before binding)."""
        return self._inner.settings.device if isinstance(self._inner, OffloadedAdam) else None

    @state.setter
    def state(self, value) -> None:
        # torch.optim.Optimizer.__init__ assigns an empty state; ours lives in the inner optimizer
        pass

    @property
    def inner(self) -> Optimizer | None:
        """The wrapped optimizer (None until the first step binds it)."""
        return self._inner

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        """``{param: ParamState}`` for each of your parameters that has optimizer state, for
        ``zerocompile.save_checkpoint``. State loaded by ``load_checkpoint_state`` and not bound
        yet comes back as it was loaded. No communication."""
        if self._inner is None:
            if self._pending_state is None:
                return {}
            if _PARAM_STATES not in self._pending_state:
                raise RuntimeError(
                    "ZeroOptimizer: it holds a state from load_state_dict() that is applied at the first "
                    "step; run a step before saving a checkpoint")
            return dict(self._pending_state[_PARAM_STATES])
        self._bind()
        out = {}
        for group, targets in zip(self.param_groups, self._bound):
            for p, target in zip(group["params"], targets):
                values = self._target_state(target)
                if values:
                    out[p] = ParamState(dict(values), sharded=target is not p)
        return out

    def load_checkpoint_state(self, states: dict, hyperparameters: list) -> None:
        """Replace all optimizer state with ``states`` (``{param: ParamState}``) and update each
        param group with its dict in ``hyperparameters`` (``zerocompile.load_checkpoint``).

        Applied at once if the optimizer is bound, else when it binds; whole element-wise
        tensors are then cut into this rank's shards. No communication."""
        if len(hyperparameters) != len(self.param_groups):
            raise ValueError(f"ZeroOptimizer: {len(hyperparameters)} param groups of hyperparameters for "
                             f"{len(self.param_groups)} groups")
        for group, values in zip(self.param_groups, hyperparameters):
            group.update({k: v for k, v in values.items() if k != "params"})
        if self._inner is None:
            self._pending_state = {_PARAM_STATES: dict(states)}
            return
        self._bind()
        self._apply_param_states(states)
        self._sync_hyperparameters()

    def _apply_param_states(self, states: dict) -> None:
        """Load ``{param: ParamState}`` into the bound inner optimizer (its ``load_state_dict``
        casts and places the tensors as it does for any state dict)."""
        inner_state, inner_groups, index = {}, [], 0
        for gi, (group, targets) in enumerate(zip(self.param_groups, self._bound)):
            ids = []
            for p, target in zip(group["params"], targets):
                entry = states.get(p)
                if entry is not None:
                    inner_state[index] = self._state_for_target(p, target, entry, gi)
                ids.append(index)
                index += 1
            hyper = {k: v for k, v in self._inner.param_groups[gi].items() if k != "params"}
            inner_groups.append({**hyper, "params": ids})
        self._inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    def _state_for_target(self, p, target, entry: ParamState, group_index: int) -> dict:
        sharded_target = target is not p
        if entry.sharded == sharded_target:
            return dict(entry.values)
        if entry.sharded:
            raise RuntimeError(f"ZeroOptimizer: shard state for parameter {tuple(p.shape)}, which is not sharded")
        sp = get_state(p)
        start = min(sp.group.rank * sp.chunk, sp.numel)
        stop = min(start + sp.chunk, sp.numel)
        elementwise = self._elementwise_keys(p, group_index, entry.values)
        out = {}
        for key, value in entry.values.items():
            if key in elementwise:
                chunk = torch.zeros(sp.chunk, dtype=value.dtype, device=value.device)
                chunk[: stop - start].copy_(value.reshape(-1)[start:stop])
                value = chunk
            out[key] = value
        return out

    def _elementwise_keys(self, p, group_index: int, values: dict) -> set:
        """The keys of ``values`` (whole state of ``p``) that hold one value per element of ``p``."""
        same_shape = {k for k, v in values.items() if isinstance(v, torch.Tensor) and v.shape == p.shape}
        if p.dim() > 0:
            return same_shape
        # a 0-dim parameter's element-wise state is 0-dim, like its scalars (the step count): ask
        # the optimizer class which keys it keeps per element, on a throwaway 2-element tensor
        probe = torch.zeros(2, dtype=p.dtype, device=p.device, requires_grad=True)
        hyper = {k: v for k, v in self.param_groups[group_index].items() if k != "params"}
        opt = self.optimizer_class([{**hyper, "params": [probe]}], **self.defaults)
        probe.grad = torch.zeros_like(probe)
        opt.step()
        return {k for k in same_shape
                if isinstance(opt.state[probe].get(k), torch.Tensor) and opt.state[probe][k].shape == probe.shape}


def _param_name(param, roots) -> str:
    """``param``'s name under the first of ``roots`` (largest first: the model, so the name is
    the same on every rank) that holds it, else its shard state's."""
    for root in roots:
        for name, p in root.named_parameters():
            if p is param:
                return name
    sp = get_state(param)
    return sp.name if sp is not None else f"of shape {list(param.shape)}"


def _norm(grads: list, norm_type: float, device) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``grads`` together, in float32 (one read of each: torch's
    foreach norm for float32 tensors, ``vector_norm`` computing in float32 for the others)."""
    f32 = [g for g in grads if g.dtype == torch.float32]
    norms = [torch.nn.utils.get_total_norm(f32, norm_type, foreach=True).to(device)] if f32 else []
    norms += [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32).to(device)
              for g in grads if g.dtype != torch.float32]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _apply_before_accumulate(opt_ref, key: int):
    """A tensor hook for a shard whose gradient may owe a deferred clipping coefficient: a
    backward about to add to that gradient applies the coefficient to it first."""
    def hook(grad):
        opt = opt_ref()
        if opt is not None and key in opt._deferred:
            opt._apply_deferred([key])
        return None
    return hook


def _all_reduce_scalar(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    if group.world == 1:
        return x
    ACCOUNTING.record("all_reduce", x.numel() * x.element_size())
    return all_reduce_sum(x.reshape(1), group.world, group.name).reshape(())


def _all_reduce_max(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    if group.world == 1:
        return x
    ACCOUNTING.record("all_reduce", x.numel() * x.element_size())
    out = torch.ops._c10d_functional.all_reduce(x.reshape(1).contiguous(), "max", group.name)
    return torch.ops._c10d_functional.wait_tensor(out).reshape(())


_PARAM_STATES = "zerocompile_param_states"
"""Key of ``ZeroOptimizer._pending_state`` that holds ``{param: ParamState}`` from a checkpoint."""
_TORCH_LAYOUT = "zerocompile_torch_layout"
"""Key of ``ZeroOptimizer._pending_state`` that holds a state dict with sharded values of parameters
that were not sharded when it was loaded."""


@dataclass
class ParamState:
    """One parameter's optimizer state as checkpoints carry it."""

    values: dict
    """State name -> value, as the inner optimizer keeps it (``exp_avg``, ``step``, ...)."""
    sharded: bool
    """Element-wise tensors are this rank's flat shard (``chunk`` elements, zero-padded), as the
    inner optimizer holds them for a sharded parameter; otherwise every tensor is whole (the
    element-wise ones in the parameter's shape)."""


def _parameter_names(params: list) -> list:
    """Each parameter's name in the modules the compiled frames were reached from (its shape
    where no such module holds it)."""
    names = {}
    for runner in list(ACCOUNTING.frames):
        for root in runner.roots:
            for name, p in root.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), name)
    return [names.get(id(p), f"a parameter of shape {list(p.shape)}") for p in params]
