"""``load_deepspeed_checkpoint``: a DeepSpeed ZeRO-1/2/3 checkpoint into a zerocompile model and
its ``ZeroOptimizer``, at any world size and stage, so that a DeepSpeed run goes on under
zerocompile as it would have under DeepSpeed (the Adam moments, the step, the learning-rate
schedule and the loss scale carry over, which ``zero_to_fp32.py`` loses).

What a DeepSpeed checkpoint holds (``global_step<N>/``, written by ``engine.save_checkpoint``):

- ``mp_rank_00_model_states.pt`` (stages 1-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  (stage 3, one per rank): ``param_shapes`` (per optimizer param group, the trainable parameters'
  names and shapes in the order they are flattened), ``lr_scheduler``, ``global_steps``,
  ``global_samples``, ``dp_world_size``, ``ds_config``;
- ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (``bf16_`` in front for DeepSpeed's bf16
  optimizer), one per data-parallel rank: that rank's partition of the float32 master values
  and of the inner optimizer's element-wise state, and the loss scaler.

Stages 1-2 flatten each param group into one vector (each parameter followed by its alignment
padding, the whole padded to a multiple of ``2 x world``) split into equal partitions; stage 3
splits each parameter on its own into ``ceil(numel / world)`` elements per rank and lays a rank's
pieces one after another across its sub-groups. Both are read here the way DeepSpeed's own
``zero_to_fp32.py`` reads the master values, and the optimizer state is laid out like them.

The files are DeepSpeed's pickles, which name DeepSpeed's classes (the loss scaler, the stage
enum): they are read with stand-ins for those classes, so DeepSpeed need not be installed.
Every rank reads every file (each then keeps its shards): the full state passes through each
rank's host memory once, one tensor at a time per parameter.
"""

from __future__ import annotations

import math
import pickle
import re
import types
from pathlib import Path

import torch

from zerocompile.errors import DeepSpeedCheckpointError
from zerocompile.optim.param_state import ParamState
from zerocompile.runtime.sharded_param import get_state
from zerocompile.state_dict import _unwrap


class _StandIn:
    """What a DeepSpeed class in the pickle becomes: its arguments and attributes, nothing more."""

    def __init__(self, *args, **kwargs):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "deepspeed" or module.startswith("deepspeed."):
            return type(name, (_StandIn,), {"__module__": "zerocompile.deepspeed_stand_in"})
        return super().find_class(module, name)


def _read(path: Path) -> dict:
    """A DeepSpeed checkpoint file, its DeepSpeed classes read as stand-ins."""
    stand_ins = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="deepspeed_stand_in_pickle")
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=stand_ins)


def _natural(path: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def checkpoint_directory(path) -> Path:
    """The ``global_step<N>`` directory of ``path``: that directory itself, or the save directory
    whose ``latest`` file names it."""
    path = Path(path)
    if not path.is_dir():
        raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: {str(path)!r} is not a directory; give the "
                                       "directory engine.save_checkpoint wrote (with its 'latest' file) or its "
                                       "global_step<N> directory")
    if (path / "latest").is_file():
        tag = (path / "latest").read_text().strip()
        if not (path / tag).is_dir():
            raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: {path / 'latest'} names {tag!r}, which is "
                                           f"not a directory under {str(path)!r}")
        path = path / tag
    if (path / "zero").is_dir() and not list(path.glob("*optim_states.pt")):
        raise DeepSpeedCheckpointError(
            f"load_deepspeed_checkpoint: {str(path)!r} is a DeepSpeed universal checkpoint (its 'zero/' folder of "
            "per-parameter files), which is not supported: load the ZeRO checkpoint it was converted from")
    if not list(path.glob("*optim_states.pt")):
        raise DeepSpeedCheckpointError(
            f"load_deepspeed_checkpoint: {str(path)!r} holds no ZeRO optimizer files (*_optim_states.pt); give a "
            "directory DeepSpeed's engine.save_checkpoint wrote with ZeRO stage 1, 2 or 3")
    return path


def _refuse_unsupported(directory: Path, model_state: dict) -> None:
    dims = model_state.get("checkpoint_parallel_dimensions") or {}
    parallel = {k: v for k, v in dims.items() if isinstance(v, int) and v > 1}
    if model_state.get("mp_world_size", 1) > 1:
        parallel["mp_world_size"] = model_state["mp_world_size"]
    if parallel or list(directory.glob("layer_*")):
        what = ", ".join(f"{k}={v}" for k, v in parallel.items()) or "pipeline layer files (layer_*)"
        raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: the checkpoint is pipeline- or tensor-parallel "
                                       f"({what}), which is not supported: zerocompile is data-parallel only")
    if list(directory.glob("*expert_*")) or model_state.get("num_experts"):
        raise DeepSpeedCheckpointError("load_deepspeed_checkpoint: the checkpoint has MoE expert files (expert "
                                       "parallel groups), which is not supported")
    zero = (model_state.get("ds_config") or {}).get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        if (zero.get(key) or {}).get("device") == "nvme":
            raise DeepSpeedCheckpointError(
                f"load_deepspeed_checkpoint: the run offloaded to NVMe (zero_optimization.{key}.device 'nvme'), "
                "whose swap files are not supported; save the checkpoint from a run without NVMe offload")


def _zero_stage(optim: dict, model_state: dict) -> int:
    stage = optim.get("zero_stage")
    if isinstance(stage, _StandIn) and stage.args:
        stage = stage.args[0]
    if not isinstance(stage, int):
        stage = ((model_state.get("ds_config") or {}).get("zero_optimization") or {}).get("stage")
    if stage not in (1, 2, 3):
        raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: ZeRO stage {stage!r} in the checkpoint; stages "
                                       "1, 2 and 3 are supported")
    return int(stage)


def _cat_ranks(parts: list) -> torch.Tensor:
    return torch.cat([p.reshape(-1).float() if p.is_floating_point() else p.reshape(-1) for p in parts])


def _own(scalars: dict) -> dict:
    """A parameter's own copy of its group's scalar state (Adam's ``step``, which torch's
    optimizers increment in place)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}


def _stage12_layout(shapes_per_group: list, optims: list, world: int) -> tuple[list, dict]:
    """``(groups, values)``: each group's names, and each name's full master value and full
    element-wise optimizer state (stages 1-2)."""
    values: dict = {}
    groups = []
    for g, shapes in enumerate(shapes_per_group):
        masters = _cat_ranks([o["single_partition_of_fp32_groups"][g] for o in optims])
        states = [o["base_optimizer_state"]["state"].get(g, {}) for o in optims]
        keys = [k for k, v in states[0].items() if torch.is_tensor(v) and v.numel() == optims[0][
            "single_partition_of_fp32_groups"][g].numel()]
        flat_state = {k: _cat_ranks([s[k] for s in states]) for k in keys}
        scalars = {k: v for k, v in states[0].items() if k not in keys}
        paddings = optims[0].get("param_alignment_paddings")
        paddings = paddings[g] if paddings is not None else [0] * len(shapes)
        offset = 0
        names = []
        for (name, shape), pad in zip(shapes.items(), paddings):
            numel = math.prod(shape)
            values[name] = {"master": masters.narrow(0, offset, numel).view(tuple(shape)),
                            "state": {**{k: v.narrow(0, offset, numel).view(tuple(shape)).clone()
                                         for k, v in flat_state.items()}, **_own(scalars)}}
            names.append(name)
            offset += numel + pad
        align = 2 * world
        if align * math.ceil(offset / align) != align * math.ceil(masters.numel() / align):
            raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: param group {g}: the parameters take {offset} "
                                           f"elements, the saved partitions {masters.numel()}; the files do not "
                                           "belong together")
        groups.append(names)
    return groups, values


def _stage3_layout(shapes_per_group: list, optims: list, world: int) -> tuple[list, dict]:
    """The same at stage 3: each parameter split on its own, ``ceil(numel / world)`` per rank."""
    masters = [torch.cat([t.reshape(-1).float() for t in o["fp32_flat_groups"]]) for o in optims]
    inner = [o["optimizer_state_dict"]["state"] for o in optims]
    sub_groups = len(optims[0]["fp32_flat_groups"])
    sizes = [t.numel() for t in optims[0]["fp32_flat_groups"]]
    keys = [k for k, v in inner[0].get(0, {}).items() if torch.is_tensor(v) and v.numel() == sizes[0]]
    flat_state = {k: [torch.cat([s[i][k].reshape(-1).float() for i in range(sub_groups)]) for s in inner]
                  for k in keys}
    scalars = {k: v for k, v in inner[0].get(0, {}).items() if k not in keys}
    values, groups, offset = {}, [], 0
    for shapes in shapes_per_group:
        names = []
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)

            def full(per_rank):
                return torch.cat([r.narrow(0, offset, part) for r in per_rank]).narrow(0, 0, numel).view(tuple(shape))

            values[name] = {"master": full(masters),
                            "state": {**{k: full(v).clone() for k, v in flat_state.items()}, **_own(scalars)}}
            names.append(name)
            offset += part
        groups.append(names)
    if offset != masters[0].numel():
        raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: the parameters take {offset} elements per rank, "
                                       f"the saved partitions {masters[0].numel()}; the files do not belong together")
    return groups, values


def _hyperparameters(stage: int, optims: list, groups: list) -> list:
    """The torch param groups' hyperparameters (lr, betas, ...) as DeepSpeed's inner optimizer
    held them: one group per torch group (stage 3 may split one into sub-groups of equal ones)."""
    saved = optims[0]["base_optimizer_state"]["param_groups"] if stage < 3 else \
        optims[0]["optimizer_state_dict"]["param_groups"]
    saved = [{k: v for k, v in g.items() if k != "params"} for g in saved]
    if len(saved) == len(groups):
        return saved
    if len(groups) == 1 and all(g == saved[0] for g in saved):
        return saved[:1]
    raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: {len(saved)} optimizer sub-groups for {len(groups)} "
                                   "param groups with different hyperparameters; not supported")


def load_deepspeed_checkpoint(path, model: torch.nn.Module, optimizer=None, *, lr_scheduler=None) -> dict:
    """Load the DeepSpeed ZeRO-1/2/3 checkpoint at ``path`` (the ``save_checkpoint`` directory
    with its ``latest`` file, or a ``global_step<N>`` directory) into ``model`` (compiled with
    ``backend="zero"`` or not yet; any stage, any world size) and its ``ZeroOptimizer``: the
    float32 master weights, the inner optimizer's state (Adam's moments and step), its
    hyperparameters, the loss scale and, given ``lr_scheduler``, the learning-rate schedule's
    state. Collective only in what writing shards is (none): every rank calls it and reads the
    files. The optimizer's param groups must match the DeepSpeed run's (one group per torch
    group it was given). Returns ``{"global_steps", "global_samples", "skipped_steps", "stage",
    "world_size", "lr_scheduler"}`` (the schedule's saved state, applied when ``lr_scheduler`` is
    given). Pipeline or tensor parallel, MoE experts, NVMe offload and universal checkpoints are
    refused with ``DeepSpeedCheckpointError``, before anything is written. See
    docs/integrations.md, "Coming from DeepSpeed"."""
    directory = checkpoint_directory(path)
    optim_files = sorted(directory.glob("*zero_pp_rank_*_optim_states.pt"), key=_natural)
    model_files = sorted(directory.glob("*model_states.pt"), key=_natural)
    if not model_files:
        raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: {str(directory)!r} has no *model_states.pt file")
    model_state = _read(model_files[0])
    _refuse_unsupported(directory, model_state)
    optims = [_read(f)["optimizer_state_dict"] for f in optim_files]
    stage = _zero_stage(optims[0], model_state)
    world = len(optims)
    saved_world = model_state.get("dp_world_size", world)
    if saved_world != world:
        raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: the checkpoint's data-parallel world size is "
                                       f"{saved_world}, but {str(directory)!r} holds {world} optimizer files")
    shapes = model_state["param_shapes"]
    groups, values = (_stage3_layout if stage == 3 else _stage12_layout)(shapes, optims, world)
    module = _unwrap(model)
    params = dict(module.named_parameters(remove_duplicate=False))
    missing = [n for n in values if n not in params]
    if missing:
        raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: the checkpoint's parameters {missing[:5]} are not "
                                       f"the model's (its names: {list(params)[:5]} ...); load it into the model "
                                       "DeepSpeed trained")
    for name, value in values.items():
        if tuple(params[name].shape) != tuple(value["master"].shape):
            raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: '{name}' is {tuple(value['master'].shape)} in "
                                           f"the checkpoint, {tuple(params[name].shape)} in the model")
    hyper = _hyperparameters(stage, optims, groups) if optimizer is not None else None
    if optimizer is not None and len(optimizer.param_groups) != len(hyper):
        raise DeepSpeedCheckpointError(f"load_deepspeed_checkpoint: the optimizer has {len(optimizer.param_groups)} "
                                       f"param groups, the DeepSpeed run's had {len(hyper)}; build it with the same "
                                       "groups")
    frozen = model_state.get("frozen_param_fragments") or {}
    for name, value in list(values.items()) + [(n, {"master": t}) for n, t in frozen.items() if n in params]:
        _write(params[name], value["master"])
    if optimizer is not None:
        states = {params[name]: ParamState(values=value["state"], sharded=False) for name, value in values.items()
                  if value.get("state")}
        optimizer.load_checkpoint_state(states, hyper)
        scaler = optims[0].get("loss_scaler")
        if getattr(scaler, "dynamic", False):       # fp16's dynamic scaler: the loss_scale option's state
            optimizer.load_loss_scaler_state({
                "scale": float(scaler.cur_scale), "iteration": int(getattr(scaler, "cur_iter", 0)),
                "last_overflow": int(getattr(scaler, "last_overflow_iter", -1)),
                "hysteresis_left": getattr(scaler, "cur_hysteresis", None)})
    schedule = model_state.get("lr_scheduler")
    if lr_scheduler is not None and schedule is not None:
        lr_scheduler.load_state_dict(schedule)
    return {"global_steps": model_state.get("global_steps"), "global_samples": model_state.get("global_samples"),
            "skipped_steps": model_state.get("skipped_steps"), "stage": stage, "world_size": world,
            "lr_scheduler": schedule}


def _write(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Write ``full`` (float32) as ``param``'s value: into its shards when zerocompile shards it."""
    state = get_state(param)
    if state is not None:
        state.write_full(full.to(state.dtype))
        return
    with torch.no_grad():
        param.copy_(full.to(param.dtype))


