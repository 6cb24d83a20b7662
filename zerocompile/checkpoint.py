"""Sharded checkpoints: ``save_checkpoint``, ``load_checkpoint``, ``consolidated_state_dict``.

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

Saves are atomic: the ranks write ``<path>.tmp-<id>``; when DCP has written its ``.metadata``
(last, after every rank's data), rank 0 renames it to ``<path>``. A previous checkpoint at
``<path>`` is moved aside to ``<path>.old-<id>`` first and deleted once the new one is in place.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from zerocompile.runtime.dcp_shards import ShardView
from zerocompile.optimizer import ParamState, ZeroOptimizer
from zerocompile.progress import track
from zerocompile.runtime.comm import CommGroup, resolve_group
from zerocompile.runtime.param_offload import resident_shards
from zerocompile.runtime.sharded_param import ShardedParam, get_state
from zerocompile.state_dict import _unwrap

logger = logging.getLogger("zerocompile")

FORMAT = 1
"""Version of the checkpoint layout this module writes (``zerocompile`` entry, ``format``)."""

MODEL = "model."
OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups."
META_KEY = "zerocompile"
EXTRA_KEY = "extra"

_MAX_LISTED = 8


# ============================================================================ public API
def save_checkpoint(path, model: torch.nn.Module, optimizer: ZeroOptimizer | None = None,
                    extra: dict | None = None) -> None:
    """Save ``model`` (and ``optimizer``, and ``extra``) as a sharded DCP checkpoint at ``path``.

    A collective: every rank of the model's process group calls it with the same ``path`` (on
    a file system all ranks share). Each rank writes what it owns. ``extra`` is any picklable
    dict (step, RNG state, data position); rank 0's is stored. The directory appears at
    ``path`` only once complete; a previous checkpoint there stays until then.
    """
    module = _unwrap(model)
    _check_optimizer(optimizer)
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save_checkpoint: extra must be a dict or None, got {type(extra).__name__}")
    path = _clean_path(path)
    group = _layout_group(module, optimizer)
    entries = module.state_dict(keep_vars=True)
    fqns = _param_names(module)
    token = _on_rank0(group, lambda: _prepare_destination(path))
    tmp = f"{path}.tmp-{token}"

    with resident_shards(_offloaded_shards(module)):     # offload_param: shards read back while saved
        state = _model_save_entries(entries, group)
        if optimizer is not None:
            state.update(_optimizer_save_entries(optimizer, fqns, group))
        if group.rank == 0:
            state[META_KEY] = json.dumps(_metadata(entries, fqns, optimizer, group))
            state[EXTRA_KEY] = _pickle(extra)
        with _single_process(group.group is None), _failures_named("saving", tmp):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=group.group,
                     no_dist=group.group is None)
    _on_rank0(group, lambda: _swap_in(tmp, path, token))
    logger.info("zerocompile: saved checkpoint %s (%d ranks)", path, group.world)


def load_checkpoint(path, model: torch.nn.Module, optimizer: ZeroOptimizer | None = None) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` into ``model`` (and ``optimizer``) in
    place; return the saved ``extra`` dict (``{}`` if none).

    A collective: every rank calls it. Any world size and stage, before or after the first
    forward: each rank reads the parts it holds now. Everything is checked against the
    checkpoint first (keys, shapes, optimizer class, param groups); a mismatch raises
    ``ValueError`` before anything is changed.
    """
    module = _unwrap(model)
    _check_optimizer(optimizer)
    path = _clean_path(path)
    metadata = _read_metadata(path)
    saved = _read_small(path, metadata, [META_KEY, EXTRA_KEY] + [
        k for k in metadata.state_dict_metadata if k.startswith(OPTIM_GROUPS)])
    meta = json.loads(saved[META_KEY])
    if meta.get("format", 0) > FORMAT:
        raise ValueError(f"load_checkpoint: '{path}' has checkpoint format {meta['format']}, newer than this "
                         f"zerocompile reads ({FORMAT}); upgrade zerocompile")
    entries = module.state_dict(keep_vars=True)
    _check_model(path, metadata, entries)
    group = _layout_group(module, optimizer)
    # offload_param: the shards are read back, loaded into, and written back to their files
    with resident_shards(_offloaded_shards(module), write=True):
        state, after = _model_load_entries(entries, group)
        if optimizer is not None:
            fqns = _param_names(module)
            plan = _OptimizerLoad(path, optimizer, fqns, metadata, meta, saved)
            state.update(plan.entries(group))
        with torch.no_grad(), _single_process(group.group is None), _failures_named("loading", path):
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
    extra = _unpickle(saved[EXTRA_KEY])
    return {} if extra is None else extra


def consolidated_state_dict(path) -> dict:
    """The full model state dict of a checkpoint, read in this process without a process group:
    keys and shapes of the uncompiled ``model.state_dict()``, each parameter in the dtype it was
    saved in (the master dtype: fp32 under bf16 training). Tied keys share one tensor."""
    path = _clean_path(path)
    metadata = _read_metadata(path)
    meta = json.loads(_read_small(path, metadata, [META_KEY])[META_KEY])
    state = {}
    keys = [key for key in meta["model_keys"] if key not in meta["tied"]]
    with _single_process():
        # one tensor per load, so that a progress bar can follow a large checkpoint
        for key in track(keys, f"reading {os.path.basename(path)}"):
            md = metadata.state_dict_metadata[MODEL + key]
            one = {MODEL + key: torch.empty(md.size, dtype=md.properties.dtype)}
            dcp.load(one, storage_reader=dcp.FileSystemReader(path), no_dist=True)
            state.update(one)
    return {key: state[MODEL + meta["tied"].get(key, key)] for key in meta["model_keys"]}


def write_consolidated(path, out) -> dict:
    """Write ``consolidated_state_dict(path)`` to the file ``out``: safetensors when ``out`` ends in
    ``.safetensors`` (tied keys as separate copies; safetensors stores no shared tensors), else
    ``torch.save``. Returns the state dict written."""
    out = os.fspath(out)
    use_safetensors = out.endswith(".safetensors")
    if use_safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise ImportError("writing a .safetensors file needs the 'safetensors' package (pip install "
                              "'zerocompile[safetensors]', or pip install safetensors); or write a .pt file") from err
    state = consolidated_state_dict(path)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        if use_safetensors:
            seen = set()
            flat = {}
            for key, value in state.items():
                flat[key] = value.clone() if id(value) in seen else value.contiguous()
                seen.add(id(value))
            save_file(flat, tmp, metadata={"format": "pt"})
        else:
            torch.save(state, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return state


# ============================================================================ layout
def _shard_part(flat: torch.Tensor, sp: ShardedParam):
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


def _offloaded_shards(module: torch.nn.Module) -> list[ShardedParam]:
    """The shard states of ``module``'s parameters whose shards live in files (``offload_param``)."""
    return [sp for p in module.parameters() if (sp := get_state(p)) is not None and sp.shard_file is not None]


def _is_sharded(param) -> ShardedParam | None:
    sp = get_state(param) if isinstance(param, torch.nn.Parameter) else None
    return sp if sp is not None and sp.rules.shards_master else None


def _param_names(module: torch.nn.Module) -> dict:
    """``{param: fqn}``: each parameter's first name (``named_parameters()``), as torch's
    ``get_optimizer_state_dict`` keys optimizer state."""
    return {p: name for name, p in module.named_parameters()}


def _metadata(entries: dict, fqns: dict, optimizer, group: CommGroup) -> dict:
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


# ============================================================================ save
def _model_save_entries(entries: dict, group: CommGroup) -> dict:
    out = {}
    for key, value in entries.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"save_checkpoint: model state entry '{key}' is a {type(value).__name__}, "
                             "not a tensor; save_checkpoint saves tensor state only")
        sp = _is_sharded(value)
        if sp is not None:
            part = _shard_part(sp.shard.detach(), sp)
            if part is not None:
                out[MODEL + key] = part
        elif group.rank == 0:
            out[MODEL + key] = value.detach()
    return out


def _optimizer_save_entries(optimizer: ZeroOptimizer, fqns: dict, group: CommGroup) -> dict:
    _check_optimizer_params(optimizer, fqns, "save_checkpoint")
    out = {}
    for p, entry in optimizer.checkpoint_state().items():
        sp = get_state(p)
        for name, value in entry.values.items():
            key = f"{OPTIM_STATE}{fqns[p]}.{name}"
            if entry.sharded and isinstance(value, torch.Tensor) and value.shape == (sp.chunk,):
                part = _shard_part(value.detach(), sp)
                if part is not None:
                    out[key] = part
            elif group.rank == 0:
                out[key] = value.detach() if isinstance(value, torch.Tensor) else value
    if group.rank == 0:
        for param_group in optimizer.param_groups:
            for p in param_group["params"]:
                for name, value in param_group.items():
                    if name != "params":
                        out[f"{OPTIM_GROUPS}{fqns[p]}.{name}"] = value
    return out


# ============================================================================ load
def _check_model(path: str, metadata: Metadata, entries: dict) -> None:
    saved = {k[len(MODEL):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(MODEL)}
    missing = [k for k in entries if k not in saved]
    unexpected = [k for k in saved if k not in entries]
    shapes = [f"{k}: checkpoint {tuple(saved[k].size)}, model {tuple(v.shape)}" for k, v in entries.items()
              if k in saved and not isinstance(saved[k], BytesStorageMetadata)
              and tuple(saved[k].size) != tuple(v.shape)]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {_listed(missing)}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {_listed(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {_listed(shapes)}")
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
            part = _shard_part(sp.shard.detach(), sp)
            if part is not None:
                out[MODEL + key] = part
    return out, after


class _OptimizerLoad:
    """Checks a checkpoint's optimizer entries against ``optimizer``, says what DCP loads into,
    and hands the result to ``optimizer.load_checkpoint_state``."""

    def __init__(self, path, optimizer: ZeroOptimizer, fqns: dict, metadata: Metadata, meta: dict,
                 saved: dict):
        _check_optimizer_params(optimizer, fqns, "load_checkpoint")
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
            parts = ([f"parameters this optimizer does not hold: {_listed(unexpected)}"] if unexpected else []) + \
                    ([f"no param group saved for: {_listed(missing)}"] if missing else [])
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
        for p in self.optimizer._params():
            fqn = self.fqns[p]
            names = self.state_keys.get(fqn)
            if not names:
                continue
            sp = _is_sharded(p)
            sharded = sp is not None and p.dim() > 0
            values = {}
            for name in names:
                key = f"{OPTIM_STATE}{fqn}.{name}"
                md = self.metadata.state_dict_metadata[key]
                if isinstance(md, BytesStorageMetadata):
                    out[key] = None
                    values[name] = key
                elif sharded and tuple(md.size) == tuple(p.shape):
                    flat = torch.zeros(sp.chunk, dtype=md.properties.dtype, device=sp.device)
                    part = _shard_part(flat, sp)
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


# ============================================================================ files
_LEFTOVER = re.compile(r"\.(tmp|old)-[0-9a-f]{12}$")


def _clean_path(path) -> str:
    path = os.fspath(path)
    if not path:
        raise ValueError("checkpoint path is empty")
    return os.path.abspath(path.rstrip(os.sep) or os.sep)


def _leftovers(path: str) -> list[str]:
    parent, name = os.path.split(path)
    if not os.path.isdir(parent):
        return []
    return sorted(os.path.join(parent, n) for n in os.listdir(parent)
                  if n.startswith(name) and _LEFTOVER.fullmatch(n[len(name):]))


def _read_metadata(path: str) -> Metadata:
    """DCP's metadata of the checkpoint at ``path``, after checking that it is a complete
    zerocompile checkpoint (raises ``FileNotFoundError`` / ``ValueError`` saying what is wrong)."""
    if not os.path.exists(path):
        hint = ""
        old = [p for p in _leftovers(path) if ".old-" in p]
        if old:
            hint = (f"; a save was interrupted while replacing it: the previous checkpoint is "
                    f"{old[-1]} (rename it to {path})")
        elif _leftovers(path):
            hint = f"; {_leftovers(path)[-1]} is a save that did not finish"
        raise FileNotFoundError(f"zerocompile: no checkpoint at '{path}'{hint}")
    if not os.path.isdir(path):
        raise ValueError(f"zerocompile: '{path}' is a file; a checkpoint is a directory written by "
                         "zerocompile.save_checkpoint")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise ValueError(f"zerocompile: '{path}' is not a complete checkpoint: it has no .metadata, which "
                         "a save writes last (a save that did not finish, or not a checkpoint "
                         "directory)") from None
    if META_KEY not in metadata.state_dict_metadata:
        raise ValueError(f"zerocompile: '{path}' is a torch.distributed.checkpoint directory but not one "
                         f"written by zerocompile.save_checkpoint (no '{META_KEY}' entry)")
    return metadata


def _read_small(path: str, metadata: Metadata, keys: list) -> dict:
    """The small entries ``keys`` (metadata, extra, hyperparameters), read by this process alone."""
    state = {}
    for key in keys:
        md = metadata.state_dict_metadata[key]
        state[key] = None if isinstance(md, BytesStorageMetadata) else torch.empty(md.size, dtype=md.properties.dtype)
    with _single_process():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state


def _is_checkpoint(path: str) -> bool:
    try:
        _read_metadata(path)
        return True
    except (FileNotFoundError, ValueError):
        return False


def _prepare_destination(path: str) -> str:
    """Rank 0, before a save: refuse to replace anything but a checkpoint; return the save's id."""
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(f"save_checkpoint: '{path}' exists and is not a directory; "
                                  "choose another path")
        if os.listdir(path) and not _is_checkpoint(path):
            raise FileExistsError(f"save_checkpoint: '{path}' exists and is not a zerocompile checkpoint; "
                                  "refusing to replace it (choose another path or remove it)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return uuid.uuid4().hex[:12]


def _swap_in(tmp: str, path: str, token: str) -> None:
    """Rank 0, after every rank wrote ``tmp``: make it ``path``; drop the one it replaces and
    leftovers of saves that did not finish."""
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    os.rename(tmp, path)
    for leftover in _leftovers(path):
        logger.info("zerocompile: removing %s (%s)", leftover,
                    "the checkpoint just replaced" if leftover == old else "left by an unfinished save")
        shutil.rmtree(leftover, ignore_errors=True)


# ============================================================================ helpers
def _check_optimizer(optimizer) -> None:
    if optimizer is not None and not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"zerocompile checkpoints hold a zerocompile.ZeroOptimizer's state, got "
                        f"{type(optimizer).__name__}; for other optimizers use torch.distributed.checkpoint")


def _check_optimizer_params(optimizer: ZeroOptimizer, fqns: dict, caller: str) -> None:
    strangers = [tuple(p.shape) for p in optimizer._params() if p not in fqns]
    if strangers:
        raise ValueError(f"{caller}: the optimizer holds {len(strangers)} parameter(s) that are not in the "
                         f"model (shapes {_listed(strangers)}); pass the model the optimizer trains")


def _layout_group(module: torch.nn.Module, optimizer) -> CommGroup:
    for p in module.parameters():
        sp = get_state(p)
        if sp is not None:
            return sp.group
    return optimizer._layout_group() if optimizer is not None else resolve_group(None)


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


@contextlib.contextmanager
def _failures_named(doing: str, path: str):
    """DCP reports a failure on any rank as a ``CheckpointException`` (a ``BaseException``) on
    every rank; raise a ``RuntimeError`` naming the ranks and the first error instead."""
    try:
        yield
    except CheckpointException as err:
        rank = min(err.failures)
        first = err.failures[rank][0]
        raise RuntimeError(f"zerocompile: {doing} checkpoint '{path}' failed on rank(s) {sorted(err.failures)}; "
                           f"rank {rank}: {type(first).__name__}: {first}") from err


@contextlib.contextmanager
def _single_process(active: bool = True):
    """Silence DCP's warning that it runs in one process: without a process group it is meant to."""
    with warnings.catch_warnings():
        if active:
            warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable")
        yield


def _pickle(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpickle(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _listed(items: list) -> str:
    shown = ", ".join(str(i) for i in items[:_MAX_LISTED])
    return shown + (f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")
