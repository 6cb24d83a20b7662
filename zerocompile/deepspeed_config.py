"""DeepSpeed configs as they are: a DeepSpeed JSON file or dict -> zerocompile options.

``translate_deepspeed(ds)`` sorts every key of a DeepSpeed config into one of four kinds:

- **translated**: keys with a zerocompile meaning become the options of that meaning
  (``zero_optimization.stage``, bucket sizes, offload, ZeRO++, ``overlap_comm``,
  ``stage3_prefetch_bucket_size``, ``fp16`` with its loss-scale keys, ``bf16``,
  ``communication_data_type``, ``aio``, ``gradient_clipping``,
  ``activation_checkpointing.cpu_checkpointing``);
- **not applied, with a warning**: the training-loop keys a compiler backend cannot apply
  (``optimizer``, ``scheduler``, the batch sizes, ``gradient_accumulation_steps`` above 1).
  One WARNING per key and process (logger ``zerocompile``, which a script without logging
  configuration shows) says where that setting lives: ``zerocompile.initialize`` applies the
  optimizer and scheduler sections and checks the batch sizes (``deepspeed_training.py``);
- **accepted, with advice**: keys for logging and monitoring, or that name something
  zerocompile always does or decides itself (contiguous gradient buffers, reduce-scatter, the
  stage-3 persistence and reuse thresholds). They change no number; one INFO line per key and
  process says what to use instead;
- **rejected**: anything else raises ``ZeroConfigError`` naming the key.

``"auto"`` (the value HF Trainer fills in from its own arguments) keeps zerocompile's default
for that key, with a log line; the training-loop keys that are ``"auto"`` get one WARNING
together (HF Trainer, and so ``ZeroTrainer``, applies them from its arguments; nothing else
does). ``load_deepspeed_file(path)`` reads a JSON file for ``options=path``.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import os
from pathlib import Path

from zerocompile.errors import ZeroConfigError

log = logging.getLogger("zerocompile")

TOP_LEVEL_TRANSLATED = ("zero_optimization", "bf16", "bfloat16", "fp16", "communication_data_type", "aio",
                        "gradient_clipping", "activation_checkpointing", "tensorboard", "csv_monitor", "wandb", "comet",
                        "flops_profiler", "comms_logger")
"""Top-level DeepSpeed keys with a zerocompile meaning (``bfloat16`` is DeepSpeed's alias of ``bf16``)."""

ZERO_TRANSLATED = ("stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
                   "stage3_prefetch_bucket_size", "offload_optimizer", "offload_param", "cpu_offload",
                   "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")
"""``zero_optimization`` keys that become zerocompile options."""

TRAINING_LOOP_KEYS = {
    "train_batch_size": "the global batch is your DataLoader's batch size x world size x gradient accumulation "
                        "steps (zerocompile.initialize checks the three agree)",
    "train_micro_batch_size_per_gpu": "set it as your DataLoader's batch_size on each rank",
    "gradient_accumulation_steps": "run that many forward/backward passes per opt.step(), each loss divided by it "
                                   "as DeepSpeed's engine.backward does; gradients accumulate in the shards "
                                   "(docs/api.md, gradient accumulation)",
    "optimizer": "build it with zerocompile.initialize(model, config=...), or in your script: "
                 "zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=...)",
    "scheduler": "build it with zerocompile.initialize(model, config=...) (DeepSpeed's schedules), or any "
                 "torch.optim.lr_scheduler on your ZeroOptimizer",
}
"""DeepSpeed keys for what a zerocompile training script does itself: not applied by the
backend, with a warning saying where that setting lives."""

ACCEPTED_KEYS = {
    "steps_per_print": "log from your training loop (zerocompile.stats() has memory and communication)",
    "wall_clock_breakdown": "time steps in your script or profile them (torch.profiler, "
                            "benchmarks/step_breakdown.py)",
    "prescale_gradients": "zerocompile averages gradients in its reduce-scatter (op avg, or a sum divided by "
                          "the world size in float32)",
    "gradient_predivide_factor": "zerocompile averages gradients in its reduce-scatter (op avg, or a sum divided "
                                 "by the world size in float32)",
    "zero_allow_untested_optimizer": "ZeroOptimizer wraps any torch.optim optimizer",
    "memory_breakdown": "zerocompile.stats() reports parameter, gradient and optimizer-state bytes",
}
"""Other top-level DeepSpeed keys zerocompile accepts without a setting of its own (logging,
monitoring, how gradients are averaged), with what to use instead."""

ACTIVATION_CHECKPOINTING_ACCEPTED = {
    "partition_activations": "it splits deepspeed.checkpointing's saved inputs over model-parallel ranks; "
                             "zerocompile has no model parallelism, so each rank's activations are its own "
                             "(offload_activations moves them out of memory)",
    "contiguous_memory_optimization": "it lays out deepspeed.checkpointing's buffers; the compiled graphs "
                                      "plan their own memory",
    "number_checkpoints": "it sizes deepspeed.checkpointing's contiguous buffers; not needed here",
    "synchronize_checkpoint_boundary": "it synchronizes CUDA at deepspeed.checkpointing's boundaries; not "
                                       "needed here",
    "profile": "profile a step with torch.profiler or benchmarks/step_breakdown.py",
}
"""``activation_checkpointing`` keys for DeepSpeed's own checkpointing API, accepted with advice.
Recomputation itself is the ``recompute`` option (or the model's ``torch.utils.checkpoint``
regions, which the compiled graphs keep); ``cpu_checkpointing`` is translated."""

ZERO_ACCEPTED_KEYS = {
    "contiguous_gradients": "zerocompile always packs each bucket's gradients contiguously (bucketing pass)",
    "reduce_scatter": "the gradient_reduction option chooses reduce-scatters, all-reduces (stages 1-2) or "
                      "point-to-point transfers (default 'auto': the fastest on the process group)",
    "allgather_partitions": "zerocompile always all-gathers updated partitions at stages 1-2",
    "round_robin_gradients": "zerocompile's partitioning is fixed per parameter",
    "sub_group_size": "the optimizer step works tile by tile (offload_optimizer's buffer_size)",
    "stage3_max_live_parameters": "the prefetch pass bounds gathered bytes in flight by prefetch_mb, and "
                                  "memory_limit_mb bounds the simulated peak",
    "stage3_max_reuse_distance": "the selective_unshard pass keeps gathered the parameters worth keeping from "
                                 "forward to backward (unshard_budget_mb), chosen by the cost model",
    "stage3_param_persistence_threshold": "the selective_unshard pass keeps gathered the parameters worth keeping "
                                          "from forward to backward (unshard_budget_mb), chosen by the cost model",
    "stage3_gather_16bit_weights_on_model_save": "save a full model with zerocompile.full_state_dict() or "
                                                 "zerocompile.save_pretrained(); sharded checkpoints with "
                                                 "zerocompile's checkpoint functions",
    "stage3_gather_fp16_weights_on_model_save": "save a full model with zerocompile.full_state_dict() or "
                                                "zerocompile.save_pretrained()",
    "ignore_unused_parameters": "parameters that get no gradient keep None as their gradient, and the optimizer "
                                "skips them, as torch's do",
    "load_from_fp32_weights": "zerocompile's checkpoints hold the float32 master shards",
    "elastic_checkpoint": "zerocompile's checkpoints (torch.distributed.checkpoint) load at any world size",
    "memory_efficient_linear": "no effect in zerocompile",
}
"""``zero_optimization`` keys zerocompile accepts without a setting of its own."""

_AIO = {"block_size": "block_size", "thread_count": "threads", "intra_op_parallelism": None,
        "queue_depth": None, "single_submit": None, "overlap_events": None, "use_gds": None}
"""DeepSpeed's ``aio`` keys: the ones with a name here set that offload setting; the others are
accepted and have no effect (a thread pool with one request per thread does the I/O)."""

_FP16_SCALING = {
    "loss_scale": None, "initial_scale_power": "initial_scale", "loss_scale_window": "window",
    "hysteresis": "hysteresis", "min_loss_scale": "min_scale", "consecutive_hysteresis": "consecutive_hysteresis",
}


@functools.cache
def _advise(key: str, advice: str) -> None:
    # once per key and process: the backend translates the same options for every frame it compiles
    log.info("DeepSpeed key '%s' has no zerocompile option: %s", key, advice)


@functools.cache
def warn_once(message: str) -> None:
    """``message`` as a WARNING of the ``zerocompile`` logger, once per process (the backend
    translates the same options for every frame it compiles). Python's last-resort handler
    shows it in a script that configures no logging."""
    log.warning("%s", message)


def contains_auto(value) -> bool:
    """Whether ``value`` (a DeepSpeed value, or a section of them) is or holds ``"auto"``."""
    if isinstance(value, dict):
        return any(contains_auto(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(contains_auto(v) for v in value)
    return value == "auto"


def gradient_clipping(value) -> float:
    """DeepSpeed's ``gradient_clipping`` value -> the option (0 = off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ZeroConfigError(f"DeepSpeed key 'gradient_clipping' = {value!r} is invalid; allowed: a number >= 0 "
                              "(0 = off), or 'auto' under HF Trainer")
    return float(value)


def load_deepspeed_file(path: str | os.PathLike, option_names=()) -> dict:
    """The DeepSpeed config in the JSON file ``path`` (``options=path``), translated
    (``option_names``: as for ``translate_deepspeed``)."""
    p = Path(path)
    if not p.is_file():
        raise ZeroConfigError(f"options = {str(path)!r}: no such file; give a DeepSpeed JSON config file or an "
                              "options dict such as {'stage': 3}")
    try:
        ds = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ZeroConfigError(f"options file {str(path)!r} is not a JSON DeepSpeed config: {err}") from None
    if not isinstance(ds, dict):
        raise ZeroConfigError(f"options file {str(path)!r} must hold a JSON object (a DeepSpeed config), got "
                              f"{type(ds).__name__}")
    return translate_deepspeed(ds, option_names)


def _is_auto(where: str, value) -> bool:
    if value == "auto":
        _advise(where, "'auto' (filled in by HF Trainer from its arguments) keeps zerocompile's default")
        return True
    return False


def _elements(where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ZeroConfigError(f"DeepSpeed key '{where}' = {value!r} is invalid; allowed: a number of elements > 0")
    return float(value)


def _translate_fp16_scaling(fp16: dict):
    """DeepSpeed's ``fp16`` loss-scaling keys -> the ``loss_scale`` option. ``loss_scale`` 0
    (DeepSpeed's default) is dynamic scaling, a positive value a static scale."""
    static = fp16.get("loss_scale", 0)
    if isinstance(static, bool) or not isinstance(static, (int, float)) or static < 0:
        raise ZeroConfigError(f"DeepSpeed key 'fp16.loss_scale' = {static!r} is invalid; allowed: 0 "
                              "(dynamic) or a static scale > 0")
    if static > 0:
        dynamic_keys = sorted(set(fp16) - {"enabled", "loss_scale"})
        if dynamic_keys:
            raise ZeroConfigError(f"DeepSpeed key 'fp16.{dynamic_keys[0]}' applies to dynamic loss scaling, "
                                  f"but 'fp16.loss_scale' = {static} asks for a static scale")
        return float(static)
    out = {}
    for ds_key, ours in _FP16_SCALING.items():
        if ours is None or ds_key not in fp16:
            continue
        value = fp16[ds_key]
        if ds_key == "initial_scale_power":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ZeroConfigError(f"DeepSpeed key 'fp16.initial_scale_power' = {value!r} is invalid; "
                                      "allowed: an integer")
            value = 2.0**value
        out[ours] = value
    return out or "dynamic"


def _translate_activation_checkpointing(section, out: dict) -> None:
    """``cpu_checkpointing: true`` -> ``offload_activations = {"device": "cpu"}`` (page-locked host
    memory for a CUDA model, a logged no-op for a CPU model); the other keys with advice."""
    if not isinstance(section, dict):
        raise ZeroConfigError("DeepSpeed key 'activation_checkpointing' must be a dict")
    for key, value in section.items():
        where = f"activation_checkpointing.{key}"
        if key == "cpu_checkpointing":
            if not isinstance(value, bool):
                raise ZeroConfigError(f"DeepSpeed key '{where}' = {value!r} is invalid; allowed: true, false")
            if value:
                out["offload_activations"] = {"device": "cpu"}
        elif key in ACTIVATION_CHECKPOINTING_ACCEPTED:
            _advise(where, ACTIVATION_CHECKPOINTING_ACCEPTED[key])
        else:
            known = ["cpu_checkpointing", *ACTIVATION_CHECKPOINTING_ACCEPTED]
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean 'activation_checkpointing.{close[0]}'?" if close else ""
            raise ZeroConfigError(f"DeepSpeed key '{where}' is not supported by zerocompile{hint}; translated: "
                                  f"activation_checkpointing.cpu_checkpointing; accepted without effect: "
                                  f"{', '.join(ACTIVATION_CHECKPOINTING_ACCEPTED)}")


def _translate_zero(section, out: dict) -> None:
    if not isinstance(section, dict):
        raise ZeroConfigError("DeepSpeed key 'zero_optimization' must be a dict")
    for key, value in section.items():
        where = f"zero_optimization.{key}"
        if key in ZERO_ACCEPTED_KEYS:
            _advise(where, ZERO_ACCEPTED_KEYS[key])
        elif key == "stage":
            out["stage"] = value
        elif key in ("reduce_bucket_size", "allgather_bucket_size"):
            if _is_auto(where, value):
                continue
            mb = _elements(where, value) * 4 / 2**20
            if "bucket_mb" in out and out["bucket_mb"] != mb:
                raise ZeroConfigError(
                    "DeepSpeed keys 'zero_optimization.reduce_bucket_size' and 'allgather_bucket_size' differ; "
                    "zerocompile has one bucket size (bucket_mb): give them the same value")
            out["bucket_mb"] = mb
        elif key == "overlap_comm":
            if not isinstance(value, bool):
                raise ZeroConfigError(f"DeepSpeed key '{where}' = {value!r} is invalid; allowed: true, false")
            out["prefetch"] = value
            if section.get("stage") == 1:      # stage 1's overlap: its reduction with the backward
                out["overlap_reduction"] = value
        elif key == "stage3_prefetch_bucket_size":
            if not _is_auto(where, value):
                out["_prefetch_elements"] = _elements(where, value)
        elif key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"):
            out[key] = value
        elif key == "cpu_offload":           # DeepSpeed's older spelling of offload_optimizer.device "cpu"
            if not isinstance(value, bool):
                raise ZeroConfigError(f"DeepSpeed key '{where}' = {value!r} is invalid; allowed: true, false")
            if value:
                if "offload_optimizer" in section:
                    raise ZeroConfigError("DeepSpeed keys 'zero_optimization.cpu_offload' and 'offload_optimizer' "
                                          "both offload the optimizer state; keep offload_optimizer")
                out["offload_optimizer"] = {"device": "cpu"}
        elif key in ("offload_optimizer", "offload_param"):
            if not isinstance(value, dict):
                raise ZeroConfigError(f"DeepSpeed key '{where}' must be a dict")
            out[key] = dict(value)
        else:
            known = list(ZERO_TRANSLATED) + list(ZERO_ACCEPTED_KEYS)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean 'zero_optimization.{close[0]}'?" if close else ""
            raise ZeroConfigError(
                f"DeepSpeed key '{where}' is not supported by zerocompile{hint}; translated: "
                f"{', '.join('zero_optimization.' + k for k in ZERO_TRANSLATED)}; accepted without effect: "
                f"{', '.join(ZERO_ACCEPTED_KEYS)}. Remove it (see docs/config.md, 'DeepSpeed configs')")


_MUST_BE_FALSE = {
    "fp16_master_weights_and_grads": "zerocompile keeps float32 master weights and gradients shards",
    "auto_cast": "zerocompile casts parameters and floating-point inputs to param_dtype itself",
}
"""``fp16`` keys zerocompile accepts only as false (their default), with why."""


def _translate_precision(key: str, value, out: dict) -> None:
    name = "bf16" if key == "bfloat16" else key
    enabled = value.get("enabled", False) if isinstance(value, dict) else value
    allowed = {"enabled"} | (set(_FP16_SCALING) if name == "fp16" else set())
    if isinstance(value, dict) and name == "fp16":
        for flag, why in _MUST_BE_FALSE.items():
            if value.get(flag, False) is not False:
                raise ZeroConfigError(f"DeepSpeed key 'fp16.{flag}' = {value[flag]!r} is not supported: {why}; "
                                      "set it to false or remove it")
        value = {k: v for k, v in value.items() if k not in _MUST_BE_FALSE}
    extra = set(value) - allowed if isinstance(value, dict) else set()
    if extra:
        raise ZeroConfigError(f"DeepSpeed key '{key}.{sorted(extra)[0]}' is not supported by zerocompile; "
                              f"translated: {', '.join(key + '.' + k for k in sorted(allowed))}")
    if enabled == "auto":
        _advise(f"{key}.enabled", "'auto' (filled in by HF Trainer from --fp16/--bf16) reads as false here; set "
                                  "it to true, or set the param_dtype option")
        return
    if enabled is True:
        dtype = "bfloat16" if name == "bf16" else "float16"
        if out.get("param_dtype", dtype) != dtype:
            raise ZeroConfigError("DeepSpeed config enables both 'bf16' and 'fp16'; choose one")
        out["param_dtype"] = dtype
        if name == "fp16":
            out["loss_scale"] = _translate_fp16_scaling(value if isinstance(value, dict) else {})
    elif enabled is not False:
        raise ZeroConfigError(f"DeepSpeed key '{key}.enabled' = {enabled!r} is invalid; allowed: true, false, 'auto'")


def translate_deepspeed(ds: dict, option_names=()) -> dict:
    """Translate a DeepSpeed config dict into zerocompile options (see the module docstring
    and docs/config.md, 'DeepSpeed configs', for every key). ``option_names``: the backend's own
    option names (``ZeroConfig``'s fields), for the did-you-mean of a key that is neither."""
    out: dict = {}
    aio: dict = {}
    autos: list[str] = []
    for key, value in ds.items():
        if key == "zero_optimization":
            _translate_zero(value, out)
        elif key in ("bf16", "bfloat16", "fp16"):
            _translate_precision(key, value, out)
        elif key == "activation_checkpointing":
            _translate_activation_checkpointing(value, out)
        elif key == "communication_data_type":
            if value is not None:
                out["reduce_dtype"] = value
        elif key == "aio":
            if not isinstance(value, dict):
                raise ZeroConfigError("DeepSpeed key 'aio' must be a dict")
            for akey in value:
                if akey not in _AIO:
                    raise ZeroConfigError(f"DeepSpeed key 'aio.{akey}' is not supported by zerocompile; "
                                          f"supported: {', '.join('aio.' + k for k in _AIO)}")
            aio = {ours: value[k] for k, ours in _AIO.items() if ours and k in value}
        elif key == "gradient_clipping":
            if value == "auto":
                autos.append(key)
            else:
                out["gradient_clipping"] = gradient_clipping(value)
        elif key in TRAINING_LOOP_KEYS:
            if contains_auto(value):
                autos.append(key)
            elif key == "gradient_accumulation_steps" and value == 1:
                _advise(key, "1 is what a loop without accumulation does")
            else:
                warn_once(f"DeepSpeed key '{key}' is not applied by the 'zero' backend: {TRAINING_LOOP_KEYS[key]}")
        elif key in ("tensorboard", "csv_monitor", "wandb", "comet"):
            out.setdefault("monitor", {})[key] = value
        elif key in ("flops_profiler", "comms_logger"):
            out[key] = value
        elif key in ACCEPTED_KEYS:
            _advise(key, ACCEPTED_KEYS[key])
        else:
            close = difflib.get_close_matches(str(key), list(option_names) + list(TOP_LEVEL_TRANSLATED), n=1)
            if close:
                raise ZeroConfigError(f"unknown option '{key}'; did you mean '{close[0]}'?")
            raise ZeroConfigError(
                f"DeepSpeed key '{key}' is not supported by zerocompile; translated: "
                f"{', '.join(TOP_LEVEL_TRANSLATED)}; accepted as training-loop settings (not applied, with a warning): "
                f"{', '.join(TRAINING_LOOP_KEYS)}; accepted without effect: {', '.join(ACCEPTED_KEYS)}. "
                "Remove it (see docs/config.md, 'DeepSpeed configs')")
    if autos:
        keys = f"keys {', '.join(autos)} are" if len(autos) > 1 else f"key {autos[0]} is"
        warn_once(f"DeepSpeed {keys} 'auto', which HF Trainer (and so ZeroTrainer) fills in from its own arguments "
                  "and applies itself; nothing else applies them. Outside HF Trainer give them values: "
                  "zerocompile.initialize(model, config=..., auto_values={...}) (docs/api.md)")
    batch = ds.get("train_batch_size")
    if "monitor" in out and isinstance(batch, int) and not isinstance(batch, bool) and batch > 0:
        out["monitor"]["samples_per_step"] = batch        # the monitors' x counts samples, as DeepSpeed's
    elements = out.pop("_prefetch_elements", None)
    if elements is not None:
        bytes_per_element = 2 if out.get("param_dtype") in ("bfloat16", "float16") else 4
        out["prefetch_mb"] = elements * bytes_per_element / 2**20
    for kind in ("offload_optimizer", "offload_param"):
        if aio and kind in out:
            out[kind] = {**aio, **out[kind]}
    return out
