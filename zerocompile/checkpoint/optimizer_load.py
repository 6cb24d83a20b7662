"""Loading a checkpoint's optimizer entries: ``OptimizerLoad`` checks them against the
optimizer (class, parameters, param groups), says what DCP loads into, and hands the loaded
state to ``ZeroOptimizer.load_checkpoint_state``."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from zerocompile.checkpoint.checks import check_optimizer_params, listed
from zerocompile.checkpoint.layout import OPTIM_GROUPS, OPTIM_STATE, is_sharded, shard_part
from zerocompile.optimizer import ParamState, ZeroOptimizer
from zerocompile.runtime.comm import CommGroup


class OptimizerLoad:
    """Checks a checkpoint's optimizer entries against ``optimizer``, says what DCP loads into,
    and hands the result to ``optimizer.load_checkpoint_state``."""

    def __init__(self, path, optimizer: ZeroOptimizer, fqns: dict, metadata: Metadata, meta: dict,
                 saved: dict):
        check_optimizer_params(optimizer, fqns, "load_checkpoint")
        where = f"load_checkpoint: '{path}'"
        if meta.get("optimizer") is None:
            raise ValueError(f"{where} holds no optimizer state (saved with optimizer=None); "
                             "call load_checkpoint(path, model) without an optimizer")
        if meta["optimizer"] != optimizer.optimizer_class.__name__:
            raise ValueError(f"{where} holds {meta['optimizer']} state, but this optimizer wraps "
                             f"{optimizer.optimizer_class.__name__}")
        self.optimizer = optimizer
        self.fqns = fqns
        self.metadata = metadata
        self.saved = saved
        names = {fqns[p] for p in optimizer._params()}
        self.state_keys = _by_fqn(metadata, OPTIM_STATE)
        group_keys = _by_fqn(metadata, OPTIM_GROUPS)
        unexpected = sorted((set(self.state_keys) | set(group_keys)) - names)
        missing = sorted(names - set(group_keys))
        if unexpected or missing:
            parts = ([f"parameters this optimizer does not hold: {listed(unexpected)}"] if unexpected else []) + \
                    ([f"no param group saved for: {listed(missing)}"] if missing else [])
            raise ValueError(f"{where} has optimizer state that does not match this optimizer's parameters "
                             f"(different model or param groups?): " + "; ".join(parts))
        self.hyperparameters = [self._group_values(where, g, group_keys) for g in optimizer.param_groups]

    def _group_values(self, where: str, param_group: dict, group_keys: dict) -> dict:
        values, first = {}, {}
        for p in param_group["params"]:
            fqn = self.fqns[p]
            for name in group_keys[fqn]:
                key = f"{OPTIM_GROUPS}{fqn}.{name}"
                value = self.saved[key]
                if name in values and not _same(values[name], value):
                    raise ValueError(
                        f"{where}: parameters '{first[name]}' and '{fqn}' are in one param group here but "
                        f"were saved with different '{name}' ({values[name]!r} and {value!r}); build the "
                        "optimizer with the param groups it was saved with")
                values.setdefault(name, value)
                first.setdefault(name, fqn)
        return values

    def entries(self, group: CommGroup) -> dict:
        """The DCP state dict for the optimizer: shard-sized tensors for the element-wise state of
        sharded parameters, whole tensors otherwise."""
        out = {}
        self.layout = {}            # param -> (sharded, {name: DCP key or tensor})
        whole = self.optimizer.whole_state_parameters()
        for p in self.optimizer._params():
            fqn = self.fqns[p]
            names = self.state_keys.get(fqn)
            if not names:
                continue
            sp = is_sharded(p)
            # a whole-parameter optimizer's state is whole: every rank reads it, its owner keeps it
            sharded = sp is not None and p.dim() > 0 and id(p) not in whole
            values = {}
            for name in names:
                key = f"{OPTIM_STATE}{fqn}.{name}"
                md = self.metadata.state_dict_metadata[key]
                if isinstance(md, BytesStorageMetadata):
                    out[key] = None
                    values[name] = key
                elif sharded and tuple(md.size) == tuple(p.shape):
                    flat = torch.zeros(sp.chunk, dtype=md.properties.dtype, device=sp.device)
                    part = shard_part(flat, sp)
                    if part is not None:
                        out[key] = part
                    values[name] = flat
                else:
                    tensor = torch.empty(md.size, dtype=md.properties.dtype, device=p.device)
                    out[key] = tensor
                    values[name] = tensor
            self.layout[p] = (sharded, values)
        return out

    def apply(self, loaded: dict) -> None:
        states = {}
        for p, (sharded, values) in self.layout.items():
            resolved = {name: loaded[v] if isinstance(v, str) else v for name, v in values.items()}
            states[p] = ParamState(resolved, sharded=sharded)
        self.optimizer.load_checkpoint_state(states, self.hyperparameters)


def _by_fqn(metadata: Metadata, prefix: str) -> dict:
    """``{fqn: [name, ...]}`` of the keys ``<prefix><fqn>.<name>`` (names have no dots)."""
    out = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(prefix):
            fqn, name = key[len(prefix):].rsplit(".", 1)
            out.setdefault(fqn, []).append(name)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
