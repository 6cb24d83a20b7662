"""``zerocompile.initialize``: a DeepSpeed config's training-loop sections applied, as
``deepspeed.initialize`` applies them.

    model, optimizer, scheduler = zerocompile.initialize(model, config="ds_config.json")

- the model is compiled in place with ``backend="zero"`` and the config's ZeRO, precision
  and ``gradient_clipping`` settings (``deepspeed_config.translate_deepspeed``);
- ``optimizer`` becomes a ``ZeroOptimizer`` (``optimizer_from_section``): ``Adam`` / ``AdamW``
  as DeepSpeed builds them (``adam_w_mode``, default true, makes ``Adam`` decoupled like
  ``AdamW``; DeepSpeed's fused Adam defaults, weight decay 0; with ``torch_adam`` torch's own
  defaults), ``Muon`` as DeepSpeed's ``MuonWithAuxAdam`` (``muon_param_groups``: the hidden
  matrices with ``torch.optim.Muon`` at ``muon_lr``, the others with AdamW at ``adam_lr``, run
  on whole parameters at owner ranks), any other name the ``torch.optim`` class of that name
  with its own arguments, as DeepSpeed does;
- ``scheduler`` becomes DeepSpeed's schedule of that name (``lr_schedules``);
- ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
  are checked against each other and the world size as DeepSpeed checks them
  (``training_settings``); the loop applies them, which a warning says once.

``"auto"`` values (HF Trainer's) of these keys are filled from ``auto_values``; one without a
value is an error where a number is needed (optimizer and scheduler parameters,
``gradient_clipping``) and counts as not given for the batch sizes.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
from pathlib import Path

import torch

from zerocompile import lr_schedules
from zerocompile.config import ZeroConfig
from zerocompile.errors import ZeroConfigError
from zerocompile.deepspeed_config import gradient_clipping, warn_once
from zerocompile.optim.onebit_adam import OneBitAdam
from zerocompile.optim.zero_one_adam import ZeroOneAdam
from zerocompile.optimizer import ZeroOptimizer
from zerocompile.runtime.comm import resolve_group

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode", "torch_adam",
              "fp32_optimizer_states")
"""``optimizer.params`` keys of DeepSpeed's ``Adam`` / ``AdamW``."""

_FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
"""What DeepSpeed's Adam (its fused and CPU kernels) uses for a key the config leaves out."""

_DEEPSPEED_ONLY_OPTIMIZERS = ("lamb", "onebitlamb", "lion", "muadam", "muadamw", "musgd")
"""DeepSpeed optimizer types that are DeepSpeed's own kernels (no torch class of that name)."""


_MUON_KEYS = {"muon": ("lr", "muon_lr", "momentum", "weight_decay", "ns_method"),
              "adam": ("lr", "adam_lr", "betas", "eps", "weight_decay")}
"""``optimizer.params`` keys of DeepSpeed's ``Muon`` (``MuonWithAuxAdam``) that reach each of its
two param groups: the hidden matrices' (Muon) and the others' (Adam)."""

_MUON_DEFAULTS = {"muon": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0},
                  "adam": {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}}
"""What DeepSpeed's ``MuonWithAuxAdam`` uses for a key the config leaves out, per group."""


@dataclasses.dataclass(frozen=True)
class TrainingSettings:
    """A DeepSpeed config's batch settings, completed and checked as DeepSpeed does."""

    train_batch_size: int | None
    """Samples per optimizer step over all ranks (None: the config gives no batch size)."""
    train_micro_batch_size_per_gpu: int | None
    """Samples per forward on each rank: your DataLoader's ``batch_size`` (None: not given)."""
    gradient_accumulation_steps: int
    """Forward/backward passes per optimizer step (1 when not given)."""
    world_size: int
    """Data-parallel ranks the batch sizes were checked against."""


def read_config(config) -> dict:
    """A copy of the DeepSpeed config ``config`` (a dict, or the path of its JSON file)."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise ZeroConfigError(f"config = {str(config)!r}: no such file; give a DeepSpeed JSON config file or dict")
        try:
            config = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ZeroConfigError(f"config file {str(path)!r} is not a JSON DeepSpeed config: {err}") from None
    if not isinstance(config, dict):
        raise ZeroConfigError(f"config must be a DeepSpeed config dict or the path of its JSON file, got "
                              f"{type(config).__name__}")
    return _copy(config)


def _copy(value):
    """``value`` with its dicts and lists copied (a ``process_group`` option stays the object)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def fill_auto(ds: dict, auto_values: dict | None) -> dict:
    """``ds`` with every ``"auto"`` of the training-loop keys (``gradient_clipping``, the batch
    sizes, ``optimizer.params.*``, ``scheduler.params.*``) replaced by ``auto_values[name]``
    (``name`` the key's last part: ``"lr"``, ``"warmup_num_steps"``...). An ``"auto"`` without
    a value is an error where a number is needed and dropped for a batch size (not given);
    a value that fills nothing is an error (a misspelt name)."""
    auto_values = dict(auto_values or {})
    used, missing = set(), []

    def fill(where: str, holder: dict, key: str) -> None:
        if holder.get(key) != "auto":
            return
        if key in auto_values:
            holder[key] = auto_values[key]
            used.add(key)
        elif key in BATCH_KEYS:
            del holder[key]
        else:
            missing.append(where)

    for key in ("gradient_clipping", *BATCH_KEYS):
        fill(key, ds, key)
    for section in ("optimizer", "scheduler"):
        params = ds.get(section, {}).get("params") if isinstance(ds.get(section), dict) else None
        if isinstance(params, dict):
            for key in list(params):
                fill(f"{section}.params.{key}", params, key)
    if missing:
        names = [m.rsplit(".", 1)[-1] for m in missing]
        raise ZeroConfigError(
            f"DeepSpeed {'keys' if len(missing) > 1 else 'key'} {', '.join(missing)} "
            f"{'are' if len(missing) > 1 else 'is'} 'auto' (HF Trainer fills them from its arguments) and "
            f"zerocompile.initialize needs a number: give it as zerocompile.initialize(model, config, "
            f"auto_values={{{', '.join(repr(n) + ': ...' for n in names)}}}), or write it into the config")
    unused = sorted(set(auto_values) - used)
    if unused:
        raise ZeroConfigError(f"auto_values {', '.join(map(repr, unused))} fill no 'auto' value of this config (its "
                              "'auto' keys: gradient_clipping, the batch sizes, optimizer.params and "
                              "scheduler.params); remove them or check the spelling")
    return ds


def _positive_int(key: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ZeroConfigError(f"DeepSpeed key '{key}' = {value!r} is invalid; allowed: an integer > 0")
    return value


def training_settings(config, world_size: int | None = None, auto_values: dict | None = None) -> TrainingSettings:
    """The batch settings of the DeepSpeed config ``config`` (a dict or JSON path), the missing
    one of the three derived and all three checked as DeepSpeed does: ``train_batch_size =
    train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size``.
    ``world_size``: the default process group's (1 without torch.distributed) when None."""
    ds = read_config(config)
    ds = fill_auto({k: ds[k] for k in BATCH_KEYS if k in ds},
                   {k: v for k, v in (auto_values or {}).items() if k in BATCH_KEYS})
    world = world_size if world_size is not None else resolve_group(None).world
    total = _positive_int("train_batch_size", ds.get("train_batch_size"))
    micro = _positive_int("train_micro_batch_size_per_gpu", ds.get("train_micro_batch_size_per_gpu"))
    accum = _positive_int("gradient_accumulation_steps", ds.get("gradient_accumulation_steps"))
    if total is not None and micro is not None and accum is None:
        accum = max(1, total // (micro * world))
    elif total is not None and accum is not None and micro is None:
        micro = max(1, total // (accum * world))
    elif total is not None and micro is None and accum is None:
        micro, accum = max(1, total // world), 1
    accum = accum or 1
    if total is None and micro is not None:
        total = micro * accum * world
    if total is not None and total != micro * accum * world:
        given = ", ".join(f"{k}={ds[k]}" for k in BATCH_KEYS if k in ds)
        raise ZeroConfigError(
            f"DeepSpeed batch settings {given} do not fit {world} rank(s): train_batch_size must equal "
            f"train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size = {micro} x {accum} x {world} "
            f"= {micro * accum * world}, not {total}; fix one of them (or leave one out to have it derived)")
    return TrainingSettings(total, micro, accum, world)


def _section(ds: dict, name: str) -> tuple[str, dict]:
    section = ds[name]
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise ZeroConfigError(f"DeepSpeed key '{name}' must be a dict with a 'type' (a name) and 'params' (a dict)")
    extra = sorted(set(section) - {"type", "params"})
    if extra:
        raise ZeroConfigError(f"DeepSpeed key '{name}.{extra[0]}' is not supported by zerocompile.initialize; "
                              f"allowed: {name}.type, {name}.params")
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise ZeroConfigError(f"DeepSpeed key '{name}.params' must be a dict")
    return section["type"], dict(params)


def _refuse_unknown(where: str, params: dict, allowed) -> None:
    for key in params:
        if key == "max_grad_norm":
            raise ZeroConfigError(f"DeepSpeed key '{where}.max_grad_norm' is not an optimizer parameter (DeepSpeed "
                                  "refuses it too); use the top-level key 'gradient_clipping'")
        if key not in allowed:
            close = difflib.get_close_matches(key, list(allowed), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ZeroConfigError(f"DeepSpeed key '{where}.{key}' is not supported; {hint}allowed: "
                                  f"{', '.join(allowed)}")


def optimizer_from_section(section: dict) -> tuple[type, dict]:
    """The ``ZeroOptimizer`` ``optimizer_class`` and keyword arguments of a DeepSpeed
    ``optimizer`` section, as DeepSpeed builds that optimizer."""
    name, params = _section({"optimizer": section}, "optimizer")
    if name.lower() in ("adam", "adamw"):
        _refuse_unknown("optimizer.params", params, _ADAM_KEYS)
        torch_adam = params.pop("torch_adam", False)
        adam_w_mode = params.pop("adam_w_mode", True)
        for flag in ("bias_correction", "fp32_optimizer_states"):
            if params.pop(flag, True) is not True:
                raise ZeroConfigError(f"DeepSpeed key 'optimizer.params.{flag}' = false is not supported: torch's Adam "
                                      "corrects the bias and keeps its state in the master dtype (float32); remove it")
        cls = torch.optim.AdamW if name.lower() == "adamw" or adam_w_mode else torch.optim.Adam
        defaults = dict(_FUSED_ADAM_DEFAULTS)
        if torch_adam:      # DeepSpeed passes the params to torch's class as they are
            defaults["weight_decay"] = inspect.signature(cls).parameters["weight_decay"].default
        kwargs = {**defaults, **params}
        kwargs["betas"] = tuple(kwargs["betas"])
        return cls, kwargs
    if name.lower() == "muon":
        raise ZeroConfigError("DeepSpeed optimizer type 'Muon' splits the model's parameters by name; build it "
                              "with zerocompile.initialize(model, config=...) (muon_param_groups), or in your "
                              "script: ZeroOptimizer([{'params': hidden_matrices}, {'params': others, "
                              "'optimizer_class': torch.optim.AdamW}], optimizer_class=torch.optim.Muon, lr=...)")
    onebit = {"onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam}.get(name.lower())
    if onebit is not None:      # DeepSpeed's 1-bit optimizers, with their own parameters (stage 0)
        _refuse_unknown("optimizer.params", params, [p for p in inspect.signature(onebit).parameters
                                                     if p not in ("params", "max_grad_norm")])
        return onebit, {**params, **({"betas": tuple(params["betas"])} if "betas" in params else {})}
    if name.lower() in _DEEPSPEED_ONLY_OPTIMIZERS:
        raise ZeroConfigError(f"DeepSpeed optimizer type '{name}' is DeepSpeed's own kernel and not supported by "
                              "zerocompile; supported: Adam, AdamW, and torch.optim classes by name "
                              "(SGD, Adagrad, ...)")
    cls = torch.optim.Adagrad if name.lower() == "adagrad" else getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        known = ["Adam", "AdamW"] + [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                                     and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)]
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ZeroConfigError(f"DeepSpeed optimizer type '{name}' is not supported{hint}; supported: Adam, AdamW, and "
                              "torch.optim classes by name (SGD, Adagrad, ...)")
    allowed = [p for p in inspect.signature(cls).parameters if p != "params"]
    _refuse_unknown("optimizer.params", params, allowed)
    return cls, params


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """DeepSpeed's rule for which parameters its Muon optimizer updates with Muon (the others
    with Adam): two or more dimensions, and a name without "embed" or "lm_head"."""
    return p.ndim >= 2 and not any(keyword in name.lower() for keyword in ("embed", "lm_head"))


def muon_param_groups(model: torch.nn.Module, params, section: dict) -> list[dict]:
    """The param groups of DeepSpeed's ``"optimizer": {"type": "Muon", "params": {...}}`` over
    ``params`` (parameters or param-group dicts; trainable ones only, as DeepSpeed): the hidden
    matrices (``uses_muon``) with ``torch.optim.Muon`` (``muon_lr`` overrides ``lr``; momentum,
    weight decay; Nesterov momentum and the update scale ``sqrt(max(1, rows / cols))`` as
    DeepSpeed's), the others with ``torch.optim.AdamW`` (``adam_lr`` overrides ``lr``; betas, eps,
    weight decay), each key DeepSpeed's default where the config leaves it out."""
    name, values = _section({"optimizer": section}, "optimizer")
    _refuse_unknown("optimizer.params", values, sorted(set(_MUON_KEYS["muon"] + _MUON_KEYS["adam"])))
    ns_method = values.get("ns_method", "gram")
    if ns_method not in ("gram", "standard"):
        raise ZeroConfigError(f"DeepSpeed key 'optimizer.params.ns_method' = {ns_method!r}: allowed 'gram', 'standard'")
    if ns_method == "gram":
        warn_once("zerocompile: DeepSpeed's Muon ns_method 'gram' iterates Newton-Schulz on the Gram matrix in "
                  "float16; torch.optim.Muon runs the same quintic iteration on the matrix itself (ns_method "
                  "'standard'): same polynomial, different rounding")
    flat = []
    for item in params:
        flat.extend(item["params"] if isinstance(item, dict) else [item])
    names = {id(p): n for n, p in model.named_parameters()}
    trainable = [p for p in flat if p.requires_grad]
    split = {"muon": [p for p in trainable if uses_muon(names.get(id(p), ""), p)]}
    split["adam"] = [p for p in trainable if not any(p is q for q in split["muon"])]
    groups = []
    for kind, cls in (("muon", torch.optim.Muon), ("adam", torch.optim.AdamW)):
        if not split[kind]:
            continue
        group = dict(_MUON_DEFAULTS[kind])
        for key in _MUON_KEYS[kind]:
            if key in values and key not in ("ns_method", "muon_lr", "adam_lr"):
                group[key] = values[key]
        override = f"{kind}_lr"          # muon_lr / adam_lr win over lr, as in DeepSpeed
        if override in values:
            group["lr"] = values[override]
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
        groups.append({"params": split[kind], "optimizer_class": cls, **group})
    return groups


def schedule_from_section(section: dict, optimizer: torch.optim.Optimizer) -> lr_schedules.DeepSpeedSchedule:
    """DeepSpeed's LR schedule of a ``scheduler`` section, on ``optimizer``."""
    name, params = _section({"scheduler": section}, "scheduler")
    cls = lr_schedules.SCHEDULES.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, list(lr_schedules.SCHEDULES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ZeroConfigError(f"DeepSpeed scheduler type '{name}' is not supported{hint}; supported: "
                              f"{', '.join(lr_schedules.SCHEDULES)}")
    if "last_batch_iteration" in params:
        raise ZeroConfigError("DeepSpeed key 'scheduler.params.last_batch_iteration' is not supported: resume a "
                              "schedule with scheduler.load_state_dict(...) (save scheduler.state_dict() in "
                              "zerocompile.save_checkpoint's extra)")
    allowed = [p for p in inspect.signature(cls).parameters if p != "optimizer"]
    _refuse_unknown("scheduler.params", params, allowed)
    try:
        return cls(optimizer, **params)
    except (TypeError, ValueError) as err:
        raise ZeroConfigError(f"DeepSpeed key 'scheduler' ({name}): {err}") from None


def initialize(model: torch.nn.Module, config, model_parameters=None, *, auto_values: dict | None = None):
    """``model, optimizer, scheduler = zerocompile.initialize(model, config=ds)``, as
    ``deepspeed.initialize(model=..., model_parameters=..., config=...)``.

    ``config``: a DeepSpeed config dict or the path of its JSON file (zerocompile options such
    as ``"inner_compiler"`` may be mixed in). The model is compiled in place with
    ``backend="zero"`` and returned; ``optimizer`` is a ``ZeroOptimizer`` over
    ``model_parameters`` (parameters or param-group dicts; default ``model.parameters()``)
    built from the ``optimizer`` section, None without one; ``scheduler`` is DeepSpeed's
    schedule of the ``scheduler`` section (call ``scheduler.step()`` after each
    ``optimizer.step()``), None without one. ``auto_values`` fills ``"auto"`` values by key
    name (``{"lr": 3e-4, "warmup_num_steps": 100, ...}``). The batch sizes are checked, not
    applied: ``training_settings(config)`` gives them to the loop."""
    ds = fill_auto(read_config(config), auto_values)
    settings = training_settings(ds, resolve_group(ds.get("process_group")).world)
    optimizer_section = ds.pop("optimizer", None)
    scheduler_section = ds.pop("scheduler", None)
    for key in BATCH_KEYS:
        ds.pop(key, None)
    if "gradient_clipping" in ds:
        gradient_clipping(ds["gradient_clipping"])      # a bad value named as DeepSpeed's key
    ZeroConfig.from_options(ds)                         # every option checked now, not at the first forward
    if scheduler_section is not None and optimizer_section is None:
        raise ZeroConfigError("DeepSpeed key 'scheduler' needs an 'optimizer' section for zerocompile.initialize to "
                              "build the optimizer it schedules")
    optimizer = scheduler = None
    if optimizer_section is not None:
        params = model.parameters() if model_parameters is None else model_parameters
        if str(optimizer_section.get("type", "")).lower() == "muon":
            groups = muon_param_groups(model, list(params), optimizer_section)
            optimizer = ZeroOptimizer(groups, optimizer_class=torch.optim.Muon, process_group=ds.get("process_group"))
        else:
            cls, kwargs = optimizer_from_section(optimizer_section)
            if cls in (OneBitAdam, ZeroOneAdam) and "stage" not in ds and \
                    "stage" not in ds.get("zero_optimization", {}):
                # DeepSpeed's default stage (0), the one they run at, rather than zerocompile's (3)
                ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": 0}
            optimizer = ZeroOptimizer(params, optimizer_class=cls, process_group=ds.get("process_group"), **kwargs)
    if scheduler_section is not None:
        scheduler = schedule_from_section(scheduler_section, optimizer)
    model.compile(backend="zero", options=ds)
    _warn_batch_settings(settings)
    return model, optimizer, scheduler


def _warn_batch_settings(settings: TrainingSettings) -> None:
    """Say once what the loop must do for the batch settings zerocompile does not apply."""
    parts = []
    if settings.train_micro_batch_size_per_gpu is not None:
        parts.append(f"feed {settings.train_micro_batch_size_per_gpu} samples per rank to each forward "
                     "(train_micro_batch_size_per_gpu: your DataLoader's batch_size)")
    if settings.gradient_accumulation_steps > 1:
        n = settings.gradient_accumulation_steps
        parts.append(f"call optimizer.step() and scheduler.step() after every {n} backward passes, each loss "
                     f"divided by {n} (gradient_accumulation_steps, as DeepSpeed's engine does)")
    if parts:
        warn_once("zerocompile.initialize does not apply DeepSpeed's batch settings; your training loop must "
                  + " and ".join(parts) + ". zerocompile.training_settings(config) gives these numbers")
