"""``save_checkpoint``: a model (and its ``ZeroOptimizer``, and the caller's ``extra``) written
as a sharded DCP checkpoint, each rank writing what it owns, the directory swapped in atomically."""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from zerocompile.checkpoint.checks import check_every_rank_called, check_optimizer, check_optimizer_params
from zerocompile.checkpoint.files import clean_path, failures_named, prepare_destination, single_process, swap_in
from zerocompile.checkpoint.layout import (EXTRA_KEY, META_KEY, MODEL, OPTIM_GROUPS, OPTIM_STATE, is_sharded,
                                           layout_group, meta_entry, offloaded_shards, param_names,
                                           pickle_extra, shard_part)
from zerocompile.optim.rules import class_name
from zerocompile.optimizer import ZeroOptimizer
from zerocompile.runtime.comm import CommGroup
from zerocompile.runtime.param_offload import resident_shards
from zerocompile.runtime.sharded_param import get_state
from zerocompile.state_dict import _unwrap

logger = logging.getLogger("zerocompile")


def save_checkpoint(path, model: torch.nn.Module, optimizer: ZeroOptimizer | None = None,
                    extra: dict | None = None) -> None:
    """Save ``model`` (and ``optimizer``, and ``extra``) as a sharded DCP checkpoint at ``path``.

    A collective: every rank of the model's process group calls it with the same ``path`` (on
    a file system all ranks share). Each rank writes what it owns. ``extra`` is any picklable
    dict (step, RNG state, data position); rank 0's is stored. The directory appears at
    ``path`` only once complete; a previous checkpoint there stays until then.
    """
    module = _unwrap(model)
    check_optimizer(optimizer)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint: extra must be a dict or None, got {type(extra).__name__}")
    path = clean_path(path)
    group = layout_group(module, optimizer)
    check_every_rank_called(group, "save_checkpoint", path)
    entries = module.state_dict(keep_vars=True)
    fqns = param_names(module)
    token = _on_rank0(group, lambda: prepare_destination(path))
    tmp = f"{path}.tmp-{token}"

    with resident_shards(offloaded_shards(module)):     # offload_param: shards read back while saved
        state = _model_save_entries(entries, group)
        if optimizer is not None:
            state.update(_optimizer_save_entries(optimizer, fqns, group))
        if group.rank == 0:
            state[META_KEY] = json.dumps(meta_entry(entries, fqns, optimizer, group))
            state[EXTRA_KEY] = pickle_extra(extra)
        with single_process(group.group is None), failures_named("saving", tmp):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=group.group,
                     no_dist=group.group is None)
    _on_rank0(group, lambda: swap_in(tmp, path, token))
    logger.info("zerocompile: saved checkpoint %s (%d ranks)", path, group.world)


def _model_save_entries(entries: dict, group: CommGroup) -> dict:
    out = {}
    for key, value in entries.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"save_checkpoint: model state entry '{key}' is a {type(value).__name__}, "
                             "not a tensor; save_checkpoint saves tensor state only")
        sp = is_sharded(value)
        if sp is not None:
            part = shard_part(sp.shard.detach(), sp)
            if part is not None:
                out[MODEL + key] = part
        elif group.rank == 0:
            out[MODEL + key] = value.detach()
    return out


def _optimizer_save_entries(optimizer: ZeroOptimizer, fqns: dict, group: CommGroup) -> dict:
    check_optimizer_params(optimizer, fqns, "save_checkpoint")
    out = {}
    for p, entry in optimizer.checkpoint_state().items():
        sp = get_state(p)
        for name, value in entry.values.items():
            key = f"{OPTIM_STATE}{fqns[p]}.{name}"
            if entry.sharded and isinstance(value, torch.Tensor) and value.shape == (sp.chunk,):
                part = shard_part(value.detach(), sp)
                if part is not None:
                    out[key] = part
            elif group.rank == 0 or entry.owned:     # owned: whole state only this rank holds
                out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    if group.rank == 0:
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                for name, value in param_group.items():
                    if name == "optimizer_class":    # a param group's own class, by name
                        value = class_name(value)
                    if name != "params":
                        out[f"{OPTIM_GROUPS}{fqns[p]}.{name}"] = value
    return out


def _on_rank0(group: CommGroup, fn):
    """Run ``fn`` on rank 0 of ``group``; every rank returns its result or raises its error."""
    result, error = None, None
    if group.rank == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - every rank raises it below
            if group.world == 1:
                raise
            error = err
    if group.world > 1:
        box = [(result, error)]
        dist.broadcast_object_list(box, group_src=0, group=group.group)
        result, error = box[0]
    if error is not None:
        raise error
    return result
