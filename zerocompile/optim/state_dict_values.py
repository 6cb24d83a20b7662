"""How ``ZeroOptimizer.state_dict()`` shows one parameter's optimizer state, and how
``load_state_dict`` reads it back: torch's layout, with sharded state as DTensors.

A parameter zerocompile has sharded (stages 1-3) has its element-wise state (Adam's moments,
SGD's momentum) as this rank's flat shard of ``chunk`` elements, zero-padded. In a state dict
such a tensor is ``ShardedParam.sharded_value``: a ``DTensor`` of the parameter's shape whose
local tensor holds this rank's elements (``zerocompile.runtime.dcp_shards``), as FSDP2 gives DTensors,
so ``torch.distributed.checkpoint`` saves every rank's part and reshards on load. Scalars (the
step count) and the state of parameters that are not sharded stay plain tensors.

Loading accepts, per parameter, any mix of: those DTensors (they must hold this rank's current
elements: what ``dcp.load`` fills in a state dict taken from this optimizer), other DTensors
(gathered whole: ``full_tensor()``, a collective), and whole tensors (cut into this rank's shard
when the parameter is sharded, now or when the optimizer binds).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from zerocompile.runtime.dcp_shards import local_part
from zerocompile.runtime.sharded_param import get_state


def exported(p: torch.Tensor, target: torch.Tensor, value):
    """``value`` of the inner optimizer's state of ``target`` (``p``'s shard, or ``p``) as the
    state dict shows it."""
    sp = get_state(p)
    if target is p or sp is None or not isinstance(value, torch.Tensor) or value.shape != (sp.chunk,):
        return value
    return sp.sharded_value(value.detach())


def is_sharded_value(value) -> bool:
    """Whether ``value`` is a sharded value ``exported`` made (a DTensor over a ``ShardView``)."""
    return local_part(value) is not None


def imported(p: torch.Tensor, name: str, values: dict) -> tuple[dict, bool]:
    """``p``'s state from a state dict as ``(values, sharded)`` for ``ParamState``: with
    ``sharded`` the element-wise tensors are this rank's flat shards (``chunk`` elements), else
    every tensor is whole. ``name`` names ``p`` in errors."""
    sp = get_state(p)
    sharded_now = sp is not None and sp.rules.shards_master
    out = {}
    if sharded_now and any(local_part(v) is not None for v in values.values()):
        start, stop = sp.own_range()
        for key, value in values.items():
            view = local_part(value)
            if view is not None:
                _check_range(name, key, view, (start, stop), sp)
                chunk = torch.zeros(sp.chunk, dtype=view.flat.dtype, device=view.flat.device)
                chunk[: stop - start].copy_(view.flat)
                out[key] = chunk
            elif isinstance(value, DTensor):
                out[key] = _cut(value.full_tensor(), sp)
            elif isinstance(value, torch.Tensor) and p.dim() > 0 and value.shape == p.shape:
                out[key] = _cut(value, sp)
            else:
                out[key] = value
        return out, True
    for key, value in values.items():
        view = local_part(value)
        if view is not None:
            _check_range(name, key, view, (0, p.numel()), sp)
            out[key] = view.flat.view(p.shape)
        elif isinstance(value, DTensor):
            out[key] = value.full_tensor()
        else:
            out[key] = value
    return out, False


def _cut(whole: torch.Tensor, sp) -> torch.Tensor:
    start, stop = sp.own_range()
    chunk = torch.zeros(sp.chunk, dtype=whole.dtype, device=whole.device)
    chunk[: stop - start].copy_(whole.reshape(-1)[start:stop])
    return chunk


def _check_range(name: str, key: str, view, held: tuple, sp) -> None:
    have = (view.start, view.start + view.flat.numel())
    if have != held:
        where = "holds it whole" if sp is None or not sp.rules.shards_master else \
            f"(rank {sp.group.rank} of {sp.group.world}, stage {sp.stage}) holds [{held[0]}, {held[1]})"
        raise ValueError(
            f"ZeroOptimizer.load_state_dict: state '{key}' of parameter {name} holds its elements "
            f"[{have[0]}, {have[1]}), but this rank {where}: a sharded value loads only into the layout "
            "it was taken from. Load through torch.distributed.checkpoint: dcp.load into "
            "get_optimizer_state_dict(model, opt) (or opt.state_dict()) of this optimizer, which reshards, "
            "then set_optimizer_state_dict / load_state_dict")
