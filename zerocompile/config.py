"""``ZeroConfig``: the options of ``torch.compile(model, backend="zero", options={...})``.

Built with ``ZeroConfig.from_options(options)``, which accepts either zerocompile's
own keys or a DeepSpeed-style config dict. Every unknown key or bad value raises
``ZeroConfigError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field, fields

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INNER_COMPILERS = ("inductor", "eager")


class ZeroConfigError(ValueError):
    """A bad ``options`` dict: unknown key, bad value, or an untranslatable DeepSpeed key."""


@dataclass(frozen=True)
class ZeroConfig:
    """Configuration of the ``"zero"`` backend. Every field has a default."""

    stage: int = 3
    """ZeRO stage: 0 = replicated, all-reduced gradients (DDP); 1 = sharded optimizer state;
    2 = also sharded gradients (reduce-scattered inside the backward graph); 3 = also sharded
    parameters (all-gathered in forward and again in backward)."""

    param_dtype: torch.dtype | None = None
    """Dtype parameters are gathered and computed in (``"bfloat16"``, ``"float16"``,
    ``"float32"``). None keeps each parameter's own dtype. Master shards keep the parameter's
    dtype; the cast happens before the all-gather, so a 16-bit dtype halves its bytes."""

    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are reduced (reduce-scattered / all-reduced) in."""

    bucket_mb: float = 25.0
    """Size cap, in MiB, of one fused collective. The optimizer-step collectives (stage 1
    reduce-scatter of accumulated gradients, stage 1/2 all-gather of updated parameters)
    are grouped into buckets of at most this size."""

    inner_compiler: str = "inductor"
    """What compiles the rewritten forward/backward graphs: ``"inductor"`` (C++ on CPUs,
    Triton on GPUs) or ``"eager"`` (AOTAutograd graphs run op by op; for debugging and tests)."""

    process_group: object = None
    """The data-parallel ``torch.distributed.ProcessGroup``; None = the default (world) group,
    or world size 1 when torch.distributed is not initialised."""

    reshard_after_forward: bool = True
    """Stage 3 only: free gathered parameters after forward and gather them again in backward
    (ZeRO-3). False keeps them from forward to backward (fewer all-gathers, more memory)."""

    disabled_passes: tuple = field(default_factory=tuple)
    """Names of optional graph passes to skip (see docs/config.md for the list)."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_options(cls, options: dict | "ZeroConfig" | None) -> "ZeroConfig":
        """Build and validate a config from a ``torch.compile`` ``options`` dict."""
        if options is None:
            return cls()
        if isinstance(options, ZeroConfig):
            return options
        if not isinstance(options, dict):
            raise ZeroConfigError(
                f"options must be a dict, got {type(options).__name__}; "
                "e.g. options={'stage': 3}")
        names = [f.name for f in fields(cls)]
        if any(k in options for k in _DEEPSPEED_TOP_LEVEL):
            own = {k: v for k, v in options.items() if k in names}
            ds = {k: v for k, v in options.items() if k not in names}
            translated = translate_deepspeed(ds)
            for key in set(own) & set(translated):
                raise ZeroConfigError(
                    f"option '{key}' is given both directly and through a DeepSpeed key; give it once")
            options = {**translated, **own}
        for key in options:
            if key not in names:
                raise ZeroConfigError(_unknown_key_message(key, names))
        cfg = cls(**options)
        return cfg

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
            raise ZeroConfigError(f"option 'stage' = {stage!r} is invalid; allowed: 0, 1, 2, 3")
        object.__setattr__(self, "param_dtype", _parse_dtype("param_dtype", self.param_dtype, True))
        object.__setattr__(self, "reduce_dtype", _parse_dtype("reduce_dtype", self.reduce_dtype, False))
        bucket = self.bucket_mb
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not bucket > 0:
            raise ZeroConfigError(
                f"option 'bucket_mb' = {bucket!r} is invalid; allowed: a number of MiB > 0")
        if self.inner_compiler not in INNER_COMPILERS:
            raise ZeroConfigError(
                f"option 'inner_compiler' = {self.inner_compiler!r} is invalid; "
                f"allowed: {', '.join(repr(c) for c in INNER_COMPILERS)}")
        pg = self.process_group
        if pg is not None and not isinstance(pg, torch.distributed.ProcessGroup):
            raise ZeroConfigError(
                f"option 'process_group' = {pg!r} is invalid; allowed: None (the default group) "
                "or a torch.distributed.ProcessGroup")
        if not isinstance(self.reshard_after_forward, bool):
            raise ZeroConfigError(
                f"option 'reshard_after_forward' = {self.reshard_after_forward!r} is invalid; "
                "allowed: True, False")
        passes = self.disabled_passes
        if isinstance(passes, str) or not all(isinstance(p, str) for p in passes):
            raise ZeroConfigError(
                f"option 'disabled_passes' = {passes!r} is invalid; allowed: a list of pass names")
        from zerocompile.passes.manager import check_disabled_passes  # avoid an import cycle
        check_disabled_passes(tuple(passes))
        object.__setattr__(self, "disabled_passes", tuple(passes))
        if self.param_dtype is torch.float16:
            logging.getLogger("zerocompile").warning(
                "param_dtype float16: zerocompile does no loss scaling; scale the loss yourself "
                "(torch.amp.GradScaler does not apply to ZeroOptimizer) or use bfloat16")


def _unknown_key_message(key, names) -> str:
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid options: {', '.join(names)}"
    return f"unknown option '{key}'{hint}"


def _parse_dtype(name: str, value, allow_none: bool):
    if value is None and allow_none:
        return None
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.lower().removeprefix("torch.")]
    if isinstance(value, torch.dtype) and value in _ALLOWED_DTYPES:
        return value
    allowed = "'float32', 'bfloat16', 'float16'" + (" or None" if allow_none else "")
    raise ZeroConfigError(f"option '{name}' = {value!r} is invalid; allowed: {allowed}")


# ---------------------------------------------------------------------- DeepSpeed dicts
_DEEPSPEED_TOP_LEVEL = ("zero_optimization", "bf16", "fp16", "communication_data_type")
_DEEPSPEED_ZERO_KEYS = ("stage", "reduce_bucket_size", "allgather_bucket_size")


def translate_deepspeed(ds: dict) -> dict:
    """Translate a DeepSpeed config dict into zerocompile options.

    Translated: ``zero_optimization.stage``, ``zero_optimization.reduce_bucket_size`` /
    ``allgather_bucket_size`` (elements; bucket_mb = elements x 4 bytes), ``bf16.enabled``,
    ``fp16.enabled``, ``communication_data_type``. Every other key is rejected by name.
    """
    out: dict = {}
    for key, value in ds.items():
        if key == "zero_optimization":
            if not isinstance(value, dict):
                raise ZeroConfigError("DeepSpeed key 'zero_optimization' must be a dict")
            for zkey, zval in value.items():
                if zkey == "stage":
                    out["stage"] = zval
                elif zkey in ("reduce_bucket_size", "allgather_bucket_size"):
                    if isinstance(zval, bool) or not isinstance(zval, (int, float)) or zval <= 0:
                        raise ZeroConfigError(
                            f"DeepSpeed key 'zero_optimization.{zkey}' = {zval!r} is invalid; "
                            "allowed: a number of elements > 0")
                    mb = float(zval) * 4 / 2**20
                    if "bucket_mb" in out and out["bucket_mb"] != mb:
                        raise ZeroConfigError(
                            "DeepSpeed keys 'zero_optimization.reduce_bucket_size' and "
                            "'allgather_bucket_size' differ; zerocompile has one bucket size "
                            "(bucket_mb): give them the same value")
                    out["bucket_mb"] = mb
                else:
                    raise ZeroConfigError(
                        f"DeepSpeed key 'zero_optimization.{zkey}' is not supported by zerocompile; "
                        f"supported: {', '.join('zero_optimization.' + k for k in _DEEPSPEED_ZERO_KEYS)}. "
                        "Remove it (see docs/config.md, 'DeepSpeed configs')")
        elif key in ("bf16", "fp16"):
            enabled = value.get("enabled", False) if isinstance(value, dict) else value
            extra = set(value) - {"enabled"} if isinstance(value, dict) else set()
            if extra:
                raise ZeroConfigError(
                    f"DeepSpeed key '{key}.{sorted(extra)[0]}' is not supported by zerocompile; "
                    f"only '{key}.enabled' is translated")
            if enabled is True or enabled == "auto":
                dtype = "bfloat16" if key == "bf16" else "float16"
                if out.get("param_dtype", dtype) != dtype:
                    raise ZeroConfigError("DeepSpeed config enables both 'bf16' and 'fp16'; choose one")
                out["param_dtype"] = dtype
            elif enabled is not False:
                raise ZeroConfigError(
                    f"DeepSpeed key '{key}.enabled' = {enabled!r} is invalid; allowed: true, false")
        elif key == "communication_data_type":
            out["reduce_dtype"] = value
        else:
            own = [f.name for f in fields(ZeroConfig)]
            close = difflib.get_close_matches(str(key), own + list(_DEEPSPEED_TOP_LEVEL), n=1)
            if close:
                raise ZeroConfigError(f"unknown option '{key}'; did you mean '{close[0]}'?")
            raise ZeroConfigError(
                f"DeepSpeed key '{key}' is not supported by zerocompile; supported: "
                f"{', '.join(_DEEPSPEED_TOP_LEVEL)}. Optimizer, scheduler, batch size and clipping "
                "settings belong in your training script (ZeroOptimizer, clip_grad_norm_)")
    return out
