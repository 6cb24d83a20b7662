"""One ``ZeroOptimizer``'s state in and out: ``state_dict`` / ``load_state_dict`` in torch's
layout (sharded state as DTensors, ``state_dict_values``), the per-rank layout of earlier
versions, and ``{param: ParamState}`` for ``zerocompile.save_checkpoint`` / ``load_checkpoint``.
State loaded before the optimizer binds waits in ``InnerBinding.pending``."""

from __future__ import annotations

import torch

from zerocompile.optim import state_dict_values
from zerocompile.optim.param_state import PARAM_STATES, TORCH_LAYOUT, ParamState
from zerocompile.optim.rules import class_name
from zerocompile.optim.whole_param import OWN_KEYS
from zerocompile.runtime.sharded_param import get_state


class StateIO:
    """``binding``: the optimizer's ``InnerBinding``; ``scaling``: its ``LossScaling`` (the
    ``loss_scale`` option's scaler state travels along); ``optimizer_class`` and ``defaults``:
    the class and hyperparameters it was built with."""

    def __init__(self, binding, scaling, optimizer_class: type, defaults: dict) -> None:
        self.binding = binding
        self.params = binding.params
        self.scaling = scaling
        self.optimizer_class = optimizer_class
        self.defaults = defaults

    def bind(self) -> None:
        """Bind the inner optimizer (or swap in newly sharded targets), applying pending state."""
        self.binding.bind(self.load_inner)

    # ------------------------------------------------------------------ torch's layout
    def state_dict(self) -> dict:
        """See ``ZeroOptimizer.state_dict``."""
        if self.binding.inner is None and self.binding.pending is None:
            return self._unbound_state_dict()
        self.bind()
        self.binding.sync_hyperparameters()
        state, groups, index = {}, [], 0
        for group, targets in zip(self.params.param_groups, self.binding.bound):
            ids = []
            for p, target in zip(group["params"], targets):
                values = self.binding.target_state(target)
                if values and self.binding.holds_whole_state(target):
                    state[index] = dict(values)     # whole, at this rank only (it owns the parameter)
                elif values:
                    state[index] = {k: state_dict_values.exported(p, target, v) for k, v in values.items()}
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        layout = self.params.layout_group()
        meta = {"rank": layout.rank, "world_size": layout.world, "optimizer_class": self.optimizer_class.__name__}
        scaler_state = self.scaling.state()
        if scaler_state is not None:
            meta["loss_scaler"] = scaler_state
        return {"state": state, "param_groups": groups, "zerocompile": meta}

    def load_state_dict(self, state_dict: dict) -> None:
        """See ``ZeroOptimizer.load_state_dict``."""
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
        param_groups = self.params.param_groups
        if len(saved_groups) != len(param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, param_groups)):
            raise ValueError(
                "ZeroOptimizer.load_state_dict: the state dict's param groups (sizes "
                f"{[len(s['params']) for s in saved_groups]}) do not match this optimizer's "
                f"({[len(g['params']) for g in param_groups]})")
        positions = {}
        for saved, group in zip(saved_groups, param_groups):
            positions.update(zip(saved["params"], group["params"]))
        group = self.params.layout_group()
        if "rank" in meta and (meta["rank"], meta["world_size"]) != (group.rank, group.world) and any(
                state_dict_values.is_sharded_value(v) for st in state_dict["state"].values() for v in st.values()):
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
            self.scaling.scaler.load_state_dict(meta["loss_scaler"])
        if self.binding.inner is None and any(
                get_state(positions[key]) is None and state_dict_values.is_sharded_value(v)
                for key, st in state_dict["state"].items() for v in st.values()):
            # shards of parameters not sharded yet (a forward shards them): read when binding
            self.binding.pending = {TORCH_LAYOUT: state_dict}
            return
        states = {}
        for key, values in state_dict["state"].items():
            p = positions[key]
            values, sharded = state_dict_values.imported(p, repr(key), values)
            states[p] = ParamState(values, sharded=sharded)
        self.load_checkpoint_state(states, [{k: v for k, v in g.items() if k != "params"} for g in saved_groups])

    def _load_per_rank(self, state_dict: dict, meta: dict) -> None:
        group = self.params.layout_group()
        if (meta["rank"], meta["world_size"]) != (group.rank, group.world):
            raise ValueError(
                f"ZeroOptimizer.load_state_dict: this state was saved by rank {meta['rank']} of "
                f"{meta['world_size']}, but this is rank {group.rank} of {group.world}; load each "
                "rank's own file with the same world size")
        if "loss_scaler" in meta:
            self.scaling.scaler.load_state_dict(meta["loss_scaler"])
        if meta["shapes"] is None:      # from an optimizer not bound yet: hyperparameters only
            self._load_hyperparameters(state_dict)
            return
        if self.binding.inner is None:
            self.binding.pending = state_dict
        else:
            self.load_inner(state_dict)

    def load_inner(self, state_dict: dict) -> None:
        """Apply a state loaded before binding (``InnerBinding.pending``) to the bound inner optimizer."""
        if PARAM_STATES in state_dict:         # from load_checkpoint_state()
            self._apply_param_states(state_dict[PARAM_STATES])
            return
        if TORCH_LAYOUT in state_dict:         # from load_state_dict(), waiting for the shards
            self.load_state_dict(state_dict[TORCH_LAYOUT])
            return
        shapes = [[tuple(t.shape) for t in ts] for ts in self.binding.bound]
        saved = [[tuple(s) for s in ss] for ss in state_dict["zerocompile"]["shapes"]]
        if shapes != saved:
            raise ValueError("ZeroOptimizer.load_state_dict: the saved shard shapes differ from this "
                             "model's (different model, stage or world size)")
        inner = {k: v for k, v in state_dict.items() if k != "zerocompile"}
        self.binding.inner.load_state_dict(inner)
        for outer, loaded in zip(self.params.param_groups, self.binding.inner.param_groups):
            for key, value in loaded.items():
                if key != "params":
                    outer[key] = value

    def _unbound_state_dict(self) -> dict:
        """``state_dict()`` of an optimizer that has not bound: no state, the param groups'
        hyperparameters, ``shapes`` None."""
        groups, index = [], 0
        for group in self.params.param_groups:
            count = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(index, index + count))})
            index += count
        group = self.params.layout_group()
        sd = {"state": {}, "param_groups": groups,
              "zerocompile": {"rank": group.rank, "world_size": group.world,
                              "optimizer_class": self.optimizer_class.__name__, "shapes": None}}
        scaler_state = self.scaling.state()
        if scaler_state is not None:
            sd["zerocompile"]["loss_scaler"] = scaler_state
        return sd

    def _load_hyperparameters(self, state_dict: dict) -> None:
        """Load the hyperparameters of an unbound optimizer's ``state_dict()`` (it has no state)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.params.param_groups]:
            raise ValueError("ZeroOptimizer.load_state_dict: the saved param groups hold different numbers "
                             "of parameters than this optimizer's")
        for outer, loaded in zip(self.params.param_groups, saved):
            check_same_class(outer, loaded)
            outer.update({k: v for k, v in loaded.items() if k != "params" and k not in OWN_KEYS})
        if self.binding.inner is not None:
            self.binding.sync_hyperparameters()

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        """See ``ZeroOptimizer.checkpoint_state``."""
        if self.binding.inner is None:
            if self.binding.pending is None:
                return {}
            if PARAM_STATES not in self.binding.pending:
                raise RuntimeError(
                    "ZeroOptimizer: it holds a state from load_state_dict() that is applied at the first "
                    "step; run a step before saving a checkpoint")
            return dict(self.binding.pending[PARAM_STATES])
        self.bind()
        return self.binding.param_states()

    def load_checkpoint_state(self, states: dict, hyperparameters: list) -> None:
        """See ``ZeroOptimizer.load_checkpoint_state``."""
        param_groups = self.params.param_groups
        if len(hyperparameters) != len(param_groups):
            raise ValueError(f"ZeroOptimizer: {len(hyperparameters)} param groups of hyperparameters for "
                             f"{len(param_groups)} groups")
        for group, values in zip(param_groups, hyperparameters):
            check_same_class(group, values)
            group.update({k: v for k, v in values.items() if k != "params" and k not in OWN_KEYS})
        if self.binding.inner is None:
            self.binding.pending = {PARAM_STATES: dict(states)}
            return
        self.bind()
        self._apply_param_states(states)
        self.binding.sync_hyperparameters()

    def _apply_param_states(self, states: dict) -> None:
        """Load ``{param: ParamState}`` into the bound inner optimizer (its ``load_state_dict``
        casts and places the tensors as it does for any state dict)."""
        inner_state, inner_groups, index = {}, [], 0
        for gi, (group, targets) in enumerate(zip(self.params.param_groups, self.binding.bound)):
            ids = []
            for p, target in zip(group["params"], targets):
                entry = states.get(p)
                if entry is not None:
                    inner_state[index] = self._state_for_target(p, target, entry, gi)
                ids.append(index)
                index += 1
            hyper = {k: v for k, v in self.binding.inner.param_groups[gi].items() if k != "params"}
            inner_groups.append({**hyper, "params": ids})
        self.binding.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})

    def _state_for_target(self, p, target, entry: ParamState, group_index: int) -> dict:
        sharded_target = target is not p
        if self.binding.holds_whole_state(target):
            if entry.sharded:
                raise RuntimeError(f"ZeroOptimizer: shard state for parameter {tuple(p.shape)}, whose optimizer "
                                   "keeps its state whole (a whole-parameter optimizer)")
            return dict(entry.values)       # the inner optimizer keeps what its rank owns
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
        hyper = {k: v for k, v in self.params.param_groups[group_index].items() if k != "params"}
        opt = self.optimizer_class([{**hyper, "params": [probe]}], **self.defaults)
        probe.grad = torch.zeros_like(probe)
        opt.step()
        return {k for k in same_shape
                if isinstance(opt.state[probe].get(k), torch.Tensor) and opt.state[probe][k].shape == probe.shape}


def check_same_class(group: dict, saved: dict) -> None:
    """A param group that names its own optimizer class loads only state saved with that class
    (``saved``: the saved group's hyperparameters; the class as an object or by name)."""
    if "optimizer_class" not in group and "optimizer_class" not in saved:
        return
    have, had = group.get("optimizer_class"), saved.get("optimizer_class")
    have = class_name(have) if isinstance(have, type) else have
    had = class_name(had) if isinstance(had, type) else had
    if have != had:
        raise ValueError(f"ZeroOptimizer: a param group saved with optimizer_class {had or '(the default)'} "
                         f"loads into a group with optimizer_class {have or '(the default)'}; build the "
                         "optimizer with the param groups it was saved with")
