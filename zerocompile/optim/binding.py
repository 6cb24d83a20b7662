"""The inner optimizer bound to the tensors it updates (each parameter's target: its shard at
stages 1-3), built lazily: a ``ZeroOptimizer`` may be made before the first forward, when no
parameter is sharded yet. State loaded before that waits here (``pending``) until it binds."""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch.optim import Optimizer

from zerocompile.optim.param_state import PARAM_STATES, ParamState
from zerocompile.optim.params import target_of
from zerocompile.optim.whole_param import OWN_KEYS
from zerocompile.runtime.sharded_param import states_of
from zerocompile.runtime.offloaded_adam import OffloadedAdam

log = logging.getLogger("zerocompile")


class InnerBinding:
    """The inner optimizer (``inner``, None until bound), its kernel name, and per param group
    the target it updates for each parameter (``bound``). ``params``: the optimizer's
    ``OptimizerParams``; ``builder``: its ``InnerOptimizerBuilder``."""

    def __init__(self, params, builder) -> None:
        self.params = params
        self.builder = builder
        self.inner: Optimizer | None = None
        self.kernel: str | None = None
        self.bound: list[list] = []          # per group: the tensor the inner optimizer updates
        self.pending: dict | None = None
        """State loaded before binding, applied by ``bind``'s ``load`` when it binds: a per-rank
        state dict, or one key of ``param_state`` (``PARAM_STATES``, ``TORCH_LAYOUT``)."""
        self._bound_to: list | None = None
        """``_layout()`` when ``bound`` was last checked: the targets follow from it."""

    def _layout(self) -> list:
        """What each parameter's target follows from: per param group, its parameters and their
        shard states, by identity (a target is the parameter itself or its state's shard, fixed
        when the state is made). Read each step, with no Python call per parameter."""
        return [(list(map(id, group["params"])), states_of(group["params"])) for group in self.params.param_groups]

    def bind(self, load: Callable[[dict], None]) -> None:
        """Bind the inner optimizer to the current targets, or swap in the targets of parameters
        first sharded since it bound. ``load`` applies a pending state to the bound optimizer."""
        layout = self._layout()
        if self.inner is not None and layout == self._bound_to:
            return      # no parameter added, swapped or sharded since the last look
        self._bind(load)
        self._bound_to = layout if self.inner is not None else None

    def _bind(self, load: Callable[[dict], None]) -> None:
        """``bind`` once something may have moved."""
        if self.inner is None:
            self.params.check_one_group()
            groups = []
            self.bound = []
            for group in self.params.param_groups:
                targets = [target_of(p) for p in group["params"]]
                self.bound.append(targets)
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": targets})
            self.inner, self.kernel = self.builder.build(groups, self.params)
            if self.pending is not None:
                load(self.pending)
                self.pending = None
            return
        self._forget_replaced()
        # a parameter first sharded after binding: swap it in while it has no state
        moved = [(gi, pi) for gi, group in enumerate(self.params.param_groups)
                 for pi, p in enumerate(group["params"]) if target_of(p) is not self.bound[gi][pi]]
        if not moved:
            return
        self.params.check_one_group()
        # a whole-parameter optimizer assigned owners to the sharded targets when it bound: build it again
        if hasattr(self.inner, "holds_whole_state") or any(
                self.inner.state.get(self.bound[gi][pi]) for gi, pi in moved):
            self._rebind_with_state(load)
            return
        for gi, pi in moved:
            target = target_of(self.params.param_groups[gi]["params"][pi])
            self.bound[gi][pi] = target
            self.inner.param_groups[gi]["params"][pi] = target

    def _forget_replaced(self) -> None:
        """Parameters put in a param group's place of another since the last check (``group["params"][i]
        = new``) start from no optimizer state, as in a torch optimizer, whose state is keyed by
        parameter: the replaced parameter's target's state is dropped (the new one is bound by the
        check that follows). A group whose number of parameters changed, or a replacement where the
        inner optimizer keeps state elsewhere than in its ``state`` dict, is refused with the fix."""
        for gi, (group, targets) in enumerate(zip(self.params.param_groups, self.bound)):
            if len(group["params"]) != len(targets):
                raise ValueError(f"ZeroOptimizer: param group {gi} has {len(group['params'])} parameters, but "
                                 f"{len(targets)} when the optimizer bound to them at its first step. Add "
                                 "parameters with opt.add_param_group({'params': [...]}) instead of changing a "
                                 "group's list, or build a new ZeroOptimizer")
        if self._bound_to is None:
            return
        replaced = [(gi, pi) for gi, (group, (ids, _)) in enumerate(zip(self.params.param_groups, self._bound_to))
                    for pi, (p, old) in enumerate(zip(group["params"], ids)) if id(p) != old]
        if not replaced:
            return
        simple = (isinstance(self.inner.state, dict) and not hasattr(self.inner, "holds_whole_state")
                  and not isinstance(self.inner, OffloadedAdam))
        if not simple:
            gi, pi = replaced[0]
            raise ValueError(f"ZeroOptimizer: parameter {pi} of param group {gi} was replaced by another after the "
                             f"optimizer bound (its kernel: {self.kernel}), whose state it does not keep in one dict "
                             "by parameter. Build a new ZeroOptimizer over the new parameters (or add them with "
                             "opt.add_param_group)")
        for gi, pi in replaced:
            self.inner.state.pop(self.bound[gi][pi], None)

    def _rebind_with_state(self, load: Callable[[dict], None]) -> None:
        """Some parameters that hold optimizer state were sharded since the inner optimizer
        bound (``state_dict()`` or a checkpoint loaded before the first forward bound it to the
        whole parameters): build the inner optimizer again over the current targets, with the
        kernel and offload settings their frames ask for, and cut each whole state into this
        rank's shard. Exact: element-wise state is the same on every rank (whole parameters
        step from averaged gradients), so each rank's chunk of it is its shard's state."""
        states = self.param_states()
        log.info("ZeroOptimizer: %d parameters with optimizer state were sharded after the optimizer bound "
                 "to them whole; their state is cut into this rank's shards", len(states))
        self.inner = None
        self.pending = {PARAM_STATES: states}
        self.bind(load)

    def pairs(self):
        """``(group index, param, target)`` of every parameter of every param group (bound)."""
        for gi, (group, targets) in enumerate(zip(self.params.param_groups, self.bound)):
            for p, target in zip(group["params"], targets):
                yield gi, p, target

    def param_states(self) -> dict:
        """``{param: ParamState}`` of each parameter whose target holds optimizer state."""
        out = {}
        for _, p, target in self.pairs():
            values = self.target_state(target)
            if values:
                whole = self.holds_whole_state(target)
                out[p] = ParamState(dict(values), sharded=target is not p and not whole,
                                    owned=whole and target is not p)
        return out

    def holds_whole_state(self, target) -> bool:
        """The inner optimizer keeps ``target``'s state whole (a whole-parameter optimizer: the
        parameter's owner holds it, in the parameter's shape), never cut into shards."""
        return bool(getattr(self.inner, "holds_whole_state", lambda t: False)(target))

    def target_state(self, target) -> dict:
        """The inner optimizer's whole state of ``target`` (offloaded moments read back)."""
        if isinstance(self.inner, OffloadedAdam):
            return self.inner.param_state(target)
        return self.inner.state.get(target, {})

    def state_view(self) -> dict:
        """The inner optimizer's state of each parameter's target, keyed by the parameter."""
        if self.inner is None:
            return {}
        return {p: self.target_state(target) for _, p, target in self.pairs() if target in self.inner.state}

    def sync_hyperparameters(self) -> None:
        """Copy the param groups' hyperparameters (an LR scheduler changes them) into the inner optimizer's."""
        for outer, inner in zip(self.params.param_groups, self.inner.param_groups):
            for key, value in outer.items():
                if key != "params" and key not in OWN_KEYS:
                    inner[key] = value

    def add_group(self, group: dict) -> None:
        """Add the param group ``group``, just appended to the optimizer's, to the bound inner
        optimizer; where its kernel cannot update it, drop it again and raise ``ValueError``."""
        targets = [target_of(p) for p in group["params"]]
        reason = self.builder.unaddable_reason(self.kernel, {**group, "params": targets})
        if reason is not None:
            self.params.param_groups.pop()
            raise ValueError(f"ZeroOptimizer.add_param_group: {reason}")
        self.bound.append(targets)
        self.inner.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": targets})

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        if self.inner is None:
            return 0
        storages = {}
        for st in self.inner.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:   # not 0-d step counters
                    storages[v.untyped_storage()._cdata] = v.untyped_storage().nbytes()   # fake ones too
        return sum(storages.values())

    def offloaded_bytes(self) -> int:
        """Bytes of optimizer state held off the device (host memory or swap file), by offload."""
        return self.inner.offloaded_bytes() if isinstance(self.inner, OffloadedAdam) else 0

    def offload_buffer_bytes(self) -> int:
        """Bytes of the offload pipeline's host buffers (0 without offload)."""
        return self.inner.buffer_bytes() if isinstance(self.inner, OffloadedAdam) else 0

    def offload(self) -> str | None:
        """``"cpu"`` or ``"nvme"`` where the optimizer state is offloaded, else None (also before binding)."""
        return self.inner.settings.device if isinstance(self.inner, OffloadedAdam) else None
