"""``load_checkpoint``: a checkpoint read into a model (and its ``ZeroOptimizer``) in place, at
any world size and stage, each rank reading the parts it holds now."""

from __future__ import annotations

import json
import logging

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from zerocompile.checkpoint.checks import check_every_rank_called, check_optimizer, listed
from zerocompile.checkpoint.files import clean_path, failures_named, read_metadata, read_small, single_process
from zerocompile.checkpoint.layout import (EXTRA_KEY, FORMAT, META_KEY, MODEL, OPTIM_GROUPS, layout_group,
                                           offloaded_shards, param_names, shard_part, unpickle_extra)
from zerocompile.checkpoint.optimizer_load import OptimizerLoad
from zerocompile.optimizer import ZeroOptimizer
from zerocompile.runtime.comm import CommGroup
from zerocompile.runtime.param_offload import resident_shards
from zerocompile.runtime.sharded_param import get_state
from zerocompile.state_dict import _unwrap

logger = logging.getLogger("zerocompile")


def load_checkpoint(path, model: torch.nn.Module, optimizer: ZeroOptimizer | None = None) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` into ``model`` (and ``optimizer``) in
    place; return the saved ``extra`` dict (``{}`` if none).

    A collective: every rank calls it. Any world size and stage, before or after the first
    forward: each rank reads the parts it holds now. Everything is checked against the
    checkpoint first (keys, shapes, optimizer class, param groups); a mismatch raises
    ``ValueError`` before anything is changed.
    """
    module = _unwrap(model)
    check_optimizer(optimizer)
    path = clean_path(path)
    metadata = read_metadata(path)
    saved = read_small(path, metadata, [META_KEY, EXTRA_KEY] + [
        k for k in metadata.state_dict_metadata if k.startswith(OPTIM_GROUPS)])
    meta = json.loads(saved[META_KEY])
    if meta.get("format", 0) > FORMAT:
        raise ValueError(f"load_checkpoint: '{path}' has checkpoint format {meta['format']}, newer than this "
                         f"zerocompile reads ({FORMAT}); upgrade zerocompile")
    entries = module.state_dict(keep_vars=True)
    _check_model(path, metadata, entries)
    group = layout_group(module, optimizer)
    check_every_rank_called(group, "load_checkpoint", path)
    # offload_param: the shards are read back, loaded into, and written back to their files
    with resident_shards(offloaded_shards(module), write=True):
        state, after = _model_load_entries(entries, group)
        if optimizer is not None:
            fqns = param_names(module)
            plan = OptimizerLoad(path, optimizer, fqns, metadata, meta, saved)
            state.update(plan.entries(group))
        with torch.no_grad(), single_process(group.group is None), failures_named("loading", path):
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group.group,
                     no_dist=group.group is None)
            for finish in after:
                finish()
    if optimizer is not None:
        plan.apply(state)
        if meta.get("loss_scaler") is not None:     # the loss_scale option's scale and history
            optimizer.load_loss_scaler_state(meta["loss_scaler"])
    logger.info("zerocompile: loaded checkpoint %s (saved on %s ranks, loaded on %d)",
                path, meta.get("world_size"), group.world)
    extra = unpickle_extra(saved[EXTRA_KEY])
    return {} if extra is None else extra


def _check_model(path: str, metadata: Metadata, entries: dict) -> None:
    saved = {k[len(MODEL):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(MODEL)}
    missing = [k for k in entries if k not in saved]
    unexpected = [k for k in saved if k not in entries]
    shapes = [f"{k}: checkpoint {tuple(saved[k].size)}, model {tuple(v.shape)}" for k, v in entries.items()
              if k in saved and not isinstance(saved[k], BytesStorageMetadata)
              and tuple(saved[k].size) != tuple(v.shape)]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {listed(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {listed(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {listed(shapes)}")
    if problems:
        raise ValueError(f"load_checkpoint: '{path}' does not match this model's state_dict() "
                         f"(a checkpoint of a different model?): " + "; ".join(problems))


def _model_load_entries(entries: dict, group: CommGroup) -> tuple[dict, list]:
    """What DCP loads into for each model entry (once per tied tensor), and what to do after."""
    out, after, seen = {}, [], set()
    for key, value in entries.items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        sp = get_state(value) if isinstance(value, torch.nn.Parameter) else None
        if sp is None or not sp.rules.shards_master:
            out[MODEL + key] = value.detach()
        elif not sp.storage_freed or sp.materialized:     # the parameter holds its full value
            full = value.detach()
            out[MODEL + key] = full
            after.append(lambda sp=sp, full=full: sp.write_full(full))
        elif sp.rules.keeps_replica:                       # a replica in another dtype
            full = torch.empty(sp.shape, dtype=sp.dtype, device=sp.device)
            out[MODEL + key] = full
            after.append(lambda sp=sp, full=full: sp.write_full(full))
        else:                                              # stage 3: straight into the shard
            part = shard_part(sp.shard.detach(), sp)
            if part is not None:
                out[MODEL + key] = part
    return out, after
