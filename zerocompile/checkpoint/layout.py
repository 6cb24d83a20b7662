"""The checkpoint's layout: its DCP keys, the ``zerocompile`` metadata entry, and the part of
each tensor a rank writes or reads.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory. Each rank writes the
parts of the model and optimizer state it owns; DCP reshards on load, so a checkpoint loads
at any world size and any stage. Entries (flat keys):

- ``model.<key>``: every entry of the uncompiled ``model.state_dict()``, in its real shape
  (tied parameters under each of their keys, as torch saves them).
- ``optim.state.<fqn>.<name>``: the optimizer state of the parameter named ``fqn`` (its first
  name in ``model.named_parameters()``), element-wise tensors in the parameter's shape;
  ``optim.param_groups.<fqn>.<name>``: the hyperparameters of its param group. This is the
  layout of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(...,
  options=StateDictOptions(flatten_optimizer_state_dict=True))`` under the key ``optim``.
- ``zerocompile``: JSON metadata (format, keys, tied names, world size, optimizer class, and
  the ``loss_scale`` option's scaler state: scale, iteration, last overflow, hysteresis left).
- ``extra``: the caller's ``extra`` dict (pickled).

A sharded tensor (a parameter at stages 1-3 and its element-wise optimizer state) is written
by every rank as its flat slice ``[rank * chunk, (rank + 1) * chunk)`` of the unpadded tensor,
described to DCP in the tensor's own shape (``zerocompile.runtime.dcp_shards.ShardView``); everything
else (buffers, stage-0 parameters, step counts, hyperparameters, metadata) by rank 0.
"""

from __future__ import annotations

import io

import torch

from zerocompile.runtime.comm import CommGroup, resolve_group
from zerocompile.runtime.dcp_shards import ShardView
from zerocompile.runtime.sharded_param import ShardedParam, get_state

FORMAT = 1
"""Version of the checkpoint layout this package writes (``zerocompile`` entry, ``format``)."""

MODEL = "model."
OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups."
META_KEY = "zerocompile"
EXTRA_KEY = "extra"


def shard_part(flat: torch.Tensor, sp: ShardedParam):
    """This rank's part of a tensor of ``sp``'s shape whose flat shard (``chunk`` elements,
    zero-padded) is ``flat``, as the DCP state dict holds it: the whole tensor at world size 1,
    a ``ShardView`` otherwise, or None where this rank owns no element."""
    start = min(sp.group.rank * sp.chunk, sp.numel)
    stop = min(start + sp.chunk, sp.numel)
    if stop == start:
        return None
    piece = flat[: stop - start]
    if sp.group.world == 1 or len(sp.shape) == 0:      # the owner holds the whole tensor
        return piece.view(sp.shape)
    return ShardView(piece, sp.shape, start)


def offloaded_shards(module: torch.nn.Module) -> list[ShardedParam]:
    """The shard states of ``module``'s parameters whose shards live in files (``offload_param``)."""
    return [sp for p in module.parameters() if (sp := get_state(p)) is not None and sp.shard_file is not None]


def is_sharded(param) -> ShardedParam | None:
    sp = get_state(param) if isinstance(param, torch.nn.Parameter) else None
    return sp if sp is not None and sp.rules.shards_master else None


def param_names(module: torch.nn.Module) -> dict:
    """``{param: fqn}``: each parameter's first name (``named_parameters()``), as torch's
    ``get_optimizer_state_dict`` keys optimizer state."""
    return {p: name for name, p in module.named_parameters()}


def layout_group(module: torch.nn.Module, optimizer) -> CommGroup:
    for p in module.parameters():
        sp = get_state(p)
        if sp is not None:
            return sp.group
    return optimizer._layout_group() if optimizer is not None else resolve_group(None)


def meta_entry(entries: dict, fqns: dict, optimizer, group: CommGroup) -> dict:
    """The ``zerocompile`` entry (before JSON) of a checkpoint of the state dict ``entries``."""
    first = {}
    tied = {}
    for key, value in entries.items():
        if id(value) in first:
            tied[key] = first[id(value)]
        else:
            first[id(value)] = key
    stages = {name: (sp.stage if (sp := get_state(p)) is not None else None) for p, name in fqns.items()}
    return {"format": FORMAT, "model_keys": list(entries), "tied": tied, "world_size": group.world,
            "stages": stages,
            "optimizer": None if optimizer is None else optimizer.optimizer_class.__name__,
            "loss_scaler": None if optimizer is None else optimizer.loss_scaler_state(),
            "torch": torch.__version__}


def pickle_extra(obj) -> bytes:
    """The ``extra`` entry of ``obj``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpickle_extra(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)
