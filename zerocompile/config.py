"""``ZeroConfig``: the options of ``torch.compile(model, backend="zero", options={...})``.

Built with ``ZeroConfig.from_options(options)``, which accepts zerocompile's own (flat) keys,
a DeepSpeed-style config dict, or the path of a DeepSpeed JSON file. Each value is parsed once,
by the parser of its key (``_PARSERS``), into the typed field of its section
(``option_sections.py``: ``sharding``, ``passes``, ``compiler``, ``step``, ``observability``);
``ZeroConfig.__post_init__`` then checks what involves several options. Every unknown key or
bad value raises ``ZeroConfigError`` naming the key, the value and what is allowed.
``config.with_options(extra)`` parses ``extra`` the same way over an existing config (the
options of ``zerocompile dump --options`` or ``plan``/``tune``'s experiments over the script's).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field, fields

import torch

from zerocompile import deepspeed_config
from zerocompile.errors import ZeroConfigError, unknown_key_message
from zerocompile.flops_profiler import parse_flops_profiler
from zerocompile.loss_scale import parse_loss_scale
from zerocompile.monitor import parse_monitor
from zerocompile.option_sections import (CompilerOptions, ObservabilityOptions, PassOptions, ShardingOptions,
                                         StepOptions)
from zerocompile.passes.manager import check_disabled_passes, check_pipeline, check_stages
from zerocompile.runtime.comms_log import parse_comms_logger
from zerocompile.runtime.offload_settings import parse_activation_offload, parse_offload
from zerocompile.runtime.reduction_choice import check_gradient_reduction, check_parameter_gather

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INNER_COMPILERS = ("inductor", "eager")

SECTIONS = {"sharding": ShardingOptions, "passes": PassOptions, "compiler": CompilerOptions, "step": StepOptions,
            "observability": ObservabilityOptions}
"""``ZeroConfig``'s sections, by attribute name."""

OPTION_SECTION = {f.name: section for section, cls in SECTIONS.items() for f in fields(cls)}
"""Each flat option name -> the section that holds it."""

PASS_OPTIONS = frozenset(f.name for f in fields(PassOptions))
"""Options only the graph passes read (``PassOptions``): a compiled frame takes new values of
them by running its passes again over the Dynamo graph it was traced from, with the same
parameters and shard states (``FrameRunner.recompile``; ``zerocompile tune`` plans such
candidates on one trace). The other sections bind the parameters' shard states (sharding,
step) or how a frame is compiled (compiler, observability): a new value of one of them needs
the script traced again."""


@dataclass(frozen=True)
class ZeroConfig:
    """Configuration of the ``"zero"`` backend, in sections (see ``option_sections.py`` for every
    option, its default and meaning). Build it with ``ZeroConfig.from_options``."""

    sharding: ShardingOptions = field(default_factory=ShardingOptions)
    passes: PassOptions = field(default_factory=PassOptions)
    compiler: CompilerOptions = field(default_factory=CompilerOptions)
    step: StepOptions = field(default_factory=StepOptions)
    observability: ObservabilityOptions = field(default_factory=ObservabilityOptions)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_options(cls, options: "dict | str | os.PathLike | ZeroConfig | None") -> "ZeroConfig":
        """Build and validate a config from a ``torch.compile`` ``options`` dict (flat option
        names, or DeepSpeed's keys), or the path of a DeepSpeed JSON config file."""
        if options is None:
            return cls()
        if isinstance(options, ZeroConfig):
            return options
        return cls().with_options(options)

    def with_options(self, options: "dict | str | os.PathLike") -> "ZeroConfig":
        """This config with ``options`` (as ``from_options`` takes them) parsed over it."""
        given = _flat_options(options)
        for key in given:
            if key not in OPTION_SECTION:
                raise ZeroConfigError(unknown_key_message(key, [*OPTION_SECTION, "passes"]))
        parsed: dict[str, dict] = {}
        for key, value in given.items():
            parsed.setdefault(OPTION_SECTION[key], {})[key] = parse_option(key, value)
        return ZeroConfig(**{name: dataclasses.replace(getattr(self, name), **parsed.get(name, {}))
                             for name in SECTIONS})

    def flat(self) -> dict:
        """Every option by its flat name, with its parsed value."""
        return {f.name: getattr(getattr(self, section), f.name)
                for section, cls in SECTIONS.items() for f in fields(cls)}

    def __post_init__(self) -> None:
        """What involves options of several sections (each value was checked by its parser)."""
        sharding, passes, step = self.sharding, self.passes, self.step
        check_stages(self)               # the options that ask for stage-bound passes (ZeRO++)
        if passes.zero_hpz_partition_size > 1 and not passes.reshard_after_forward:
            raise ZeroConfigError("option 'zero_hpz_partition_size' needs reshard_after_forward=True: with it False "
                                  "the backward re-gathers nothing to partition")
        limit = passes.memory_limit_mb
        for name, auto in (("unshard_budget_mb", passes.unshard_budget_mb == "auto"),
                           ("offload_optimizer.ratio", step.offload_optimizer.ratio == "auto"),
                           ("offload_activations.budget_mb", passes.offload_activations.budget_mb == "auto")):
            if auto and limit is None:
                raise ZeroConfigError(f"option '{name}' = 'auto' needs 'memory_limit_mb' (the per-rank MiB the "
                                      f"simulated peak may reach); set it, or give {name} a number")
        # the settings that size themselves read the limit from their own object
        offload = step.offload_optimizer
        limit_for = float(limit) if limit is not None else None
        object.__setattr__(self, "step", dataclasses.replace(step, offload_optimizer=dataclasses.replace(
            offload, memory_limit_mb=limit_for if offload.ratio == "auto" else offload.memory_limit_mb)))
        activations = passes.offload_activations
        object.__setattr__(self, "passes", dataclasses.replace(passes, offload_activations=dataclasses.replace(
            activations, memory_limit_mb=limit_for if activations.budget_mb == "auto" else
            activations.memory_limit_mb)))
        if step.offload_param.enabled and sharding.stage != 3:
            raise ZeroConfigError(f"option 'offload_param' needs stage 3 (only stage 3 shards the parameters), "
                                  f"not stage {sharding.stage}; use stage=3, or offload_optimizer alone")
        check_pipeline(self)
        if sharding.param_dtype is torch.float16 and step.loss_scale is None:
            logging.getLogger("zerocompile").warning(
                "param_dtype float16 with no loss scaling: small gradients underflow to zero in "
                "float16. Set options loss_scale='dynamic', use torch.amp.GradScaler with "
                "ZeroOptimizer, or compute in bfloat16")


def options_needing_a_new_trace(old: ZeroConfig, new: ZeroConfig) -> list[str]:
    """The options outside ``PASS_OPTIONS`` whose values differ between ``old`` and ``new``."""
    before, after = old.flat(), new.flat()
    return [name for name in before if name not in PASS_OPTIONS and before[name] != after[name]]


def parse_option(name: str, value):
    """The parsed value of the flat option ``name`` (``ZeroConfigError`` when invalid)."""
    try:
        return _PARSERS[name](value)
    except ZeroConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ZeroConfigError(str(err)) from None


def _flat_options(options) -> dict:
    """The flat options of a dict of flat options and/or DeepSpeed keys, or of a DeepSpeed JSON
    file, with ``passes={"disable": [...]}`` read as ``disabled_passes``."""
    if isinstance(options, (str, os.PathLike)):
        return deepspeed_config.load_deepspeed_file(options, list(OPTION_SECTION))
    if not isinstance(options, dict):
        raise ZeroConfigError(
            f"options must be a dict or the path of a DeepSpeed JSON file, got {type(options).__name__}; "
            "e.g. options={'stage': 3}")
    if any(k in options for k in (*deepspeed_config.TOP_LEVEL_TRANSLATED, *deepspeed_config.TRAINING_LOOP_KEYS,
                                  *deepspeed_config.ACCEPTED_KEYS)):
        # gradient_clipping is both a DeepSpeed key and an option of the same meaning: translated
        # ("auto" is DeepSpeed's)
        own = {k: v for k, v in options.items()
               if k in OPTION_SECTION and k not in deepspeed_config.TOP_LEVEL_TRANSLATED}
        translated = deepspeed_config.translate_deepspeed({k: v for k, v in options.items() if k not in own},
                                                          list(OPTION_SECTION))
        for key in set(own) & set(translated):
            raise ZeroConfigError(f"option '{key}' is given both directly and through a DeepSpeed key; give it once")
        options = {**translated, **own}
    if "passes" in options:
        options = dict(options)
        options.update(_parse_passes_option(options.pop("passes"), options.get("disabled_passes")))
    return options


# ---------------------------------------------------------------------- one option's parser
def _bool(name: str):
    def parse(value):
        if not isinstance(value, bool):
            raise ZeroConfigError(f"option '{name}' = {value!r} is invalid; allowed: True, False")
        return value
    return parse


def _stage(value):
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2, 3):
        raise ZeroConfigError(f"option 'stage' = {value!r} is invalid; allowed: 0, 1, 2, 3")
    return value


def _bucket_mb(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ZeroConfigError(
            f"option 'bucket_mb' = {value!r} is invalid; allowed: a finite number of MiB >= 0 (0 = off)")
    return value


def _inner_compiler(value):
    if value not in INNER_COMPILERS:
        raise ZeroConfigError(f"option 'inner_compiler' = {value!r} is invalid; "
                              f"allowed: {', '.join(repr(c) for c in INNER_COMPILERS)}")
    return value


def _repeated_blocks(value):
    if value in ("auto", "off") or (isinstance(value, int) and not isinstance(value, bool) and value >= 2):
        return value
    raise ZeroConfigError(f"option 'repeated_blocks' = {value!r} is invalid; allowed: 'auto' (frames with 8 or "
                          "more identical blocks compile one), an integer >= 2 (with at least that many), or 'off'")


def _process_group(value):
    if value is not None and not isinstance(value, torch.distributed.ProcessGroup):
        raise ZeroConfigError(f"option 'process_group' = {value!r} is invalid; allowed: None (the default group) "
                              "or a torch.distributed.ProcessGroup")
    return value


def _hpz(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ZeroConfigError(f"option 'zero_hpz_partition_size' = {value!r} is invalid; allowed: an integer >= 1 "
                              "(1 = off; the ranks per node)")
    return value


def _gradient_clipping(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0 \
            or math.isinf(value):
        raise ZeroConfigError(f"option 'gradient_clipping' = {value!r} is invalid; allowed: a finite number >= 0 "
                              "(the largest global gradient norm; 0 = off)")
    return float(value)


def _mb(name: str, extra: str = "", allow_inf: bool = False, auto: bool = False, none: bool = False):
    def parse(value):
        if not (auto and value == "auto") and not (none and value is None):
            _check_mb(name, value, extra=extra, allow_inf=allow_inf)
        return value
    return parse


def _seconds(name: str):
    def parse(value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ZeroConfigError(f"option '{name}' = {value!r} is invalid; allowed: a number of seconds > 0, "
                                  "or None (off)")
        return value
    return parse


def _offload_param(value):
    settings = parse_offload("offload_param", value)
    if settings.ratio != 1.0:
        raise ZeroConfigError(f"option 'offload_param.ratio' = {settings.ratio!r} is invalid: every "
                              "parameter shard is offloaded (allowed: 1); partial offload is offload_optimizer's")
    return settings


def _dump(value):
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ZeroConfigError(f"option 'dump' = {value!r} is invalid; allowed: a directory path, or None")
    return value


def _disabled_passes(value):
    if isinstance(value, str) or not all(isinstance(p, str) for p in value):
        raise ZeroConfigError(f"option 'disabled_passes' = {value!r} is invalid; allowed: a list of pass names")
    check_disabled_passes(tuple(value))
    return tuple(value)


_PARSERS = {
    "stage": _stage,
    "param_dtype": lambda v: _parse_dtype("param_dtype", v, True),
    "reduce_dtype": lambda v: _parse_dtype("reduce_dtype", v, False),
    "process_group": _process_group,
    "gradient_reduction": check_gradient_reduction,
    "parameter_gather": check_parameter_gather,
    "collective_timeout_s": _seconds("collective_timeout_s"),
    "collective_busy_limit_s": _seconds("collective_busy_limit_s"),
    "bucket_mb": _bucket_mb,
    "reshard_after_forward": _bool("reshard_after_forward"),
    "prefetch": _bool("prefetch"),
    "prefetch_mb": _mb("prefetch_mb"),
    "unshard_budget_mb": _mb("unshard_budget_mb", extra=", or 'auto'", allow_inf=True, auto=True),
    "memory_limit_mb": _mb("memory_limit_mb", extra=", or None", none=True),
    "recompute": lambda v: _parse_recompute(v),
    "offload_activations": parse_activation_offload,
    "zero_quantized_weights": _bool("zero_quantized_weights"),
    "zero_quantized_gradients": _bool("zero_quantized_gradients"),
    "zero_hpz_partition_size": _hpz,
    "disabled_passes": _disabled_passes,
    "inner_compiler": _inner_compiler,
    "cost_model": lambda v: _parse_cost_model(v),
    "profile": _bool("profile"),
    "debug_checks": _bool("debug_checks"),
    "repeated_blocks": _repeated_blocks,
    "gradient_clipping": _gradient_clipping,
    "loss_scale": parse_loss_scale,
    "offload_optimizer": lambda v: parse_offload("offload_optimizer", v),
    "offload_param": _offload_param,
    "overlap_reduction": _bool("overlap_reduction"),
    "allow_unsharded": _bool("allow_unsharded"),
    "dump": _dump,
    "monitor": parse_monitor,
    "flops_profiler": parse_flops_profiler,
    "comms_logger": parse_comms_logger,
}
"""Each flat option's parser: the user's value -> the section field's typed value."""


def _check_mb(name: str, value, extra: str = "", allow_inf: bool = False) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0
            or (math.isinf(value) and not allow_inf)):
        allowed = "a number of MiB >= 0" + ("" if allow_inf else " (finite)")
        raise ZeroConfigError(f"option '{name}' = {value!r} is invalid; allowed: {allowed}{extra}")


def _parse_passes_option(value, disabled_passes) -> dict:
    """``passes={"disable": [...]}`` -> ``{"disabled_passes": (...)}``."""
    if not isinstance(value, dict) or set(value) - {"disable"}:
        raise ZeroConfigError(
            f"option 'passes' = {value!r} is invalid; allowed: a dict {{'disable': [pass names]}}")
    if disabled_passes is not None:
        raise ZeroConfigError("give disabled passes once: either 'passes': {'disable': [...]} or 'disabled_passes'")
    names = value.get("disable", ())
    if isinstance(names, str):
        raise ZeroConfigError(f"option 'passes.disable' = {names!r} is invalid; allowed: a list of pass names")
    return {"disabled_passes": tuple(names)}


_RECOMPUTE_MODES = ("none", "full")


def _parse_recompute(value):
    if value in _RECOMPUTE_MODES:
        return value
    if isinstance(value, dict) and set(value) == {"memory_budget_mb"}:
        budget = value["memory_budget_mb"]
        _check_mb("recompute.memory_budget_mb", budget)
        return {"memory_budget_mb": float(budget)}
    raise ZeroConfigError(
        f"option 'recompute' = {value!r} is invalid; allowed: 'none', 'full', or "
        "{'memory_budget_mb': MiB}")


_COST_MODEL_KEYS = ("flops_per_s", "alpha_us", "bandwidth_gbps", "memory_gbps", "offload_gbps")


def _parse_cost_model(value):
    if value == "probe":
        return value
    if isinstance(value, dict):
        for key, v in value.items():
            if key not in _COST_MODEL_KEYS:
                raise ZeroConfigError(unknown_key_message(key, list(_COST_MODEL_KEYS)).replace(
                    "unknown option", "unknown key in option 'cost_model':"))
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise ZeroConfigError(f"option 'cost_model.{key}' = {v!r} is invalid; allowed: a finite number > 0")
        return dict(value)
    raise ZeroConfigError(
        f"option 'cost_model' = {value!r} is invalid; allowed: 'probe' or a dict with keys "
        f"{', '.join(_COST_MODEL_KEYS)}")


def _parse_dtype(name: str, value, allow_none: bool):
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    if isinstance(value, torch.dtype) and value in _ALLOWED_DTYPES:
        return value
    allowed = "'float32', 'bfloat16', 'float16'" + (" or None" if allow_none else "")
    raise ZeroConfigError(f"option '{name}' = {value!r} is invalid; allowed: {allowed}")


