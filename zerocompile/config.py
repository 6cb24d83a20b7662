"""``ZeroConfig``: the options of ``torch.compile(model, backend="zero", options={...})``.

Built with ``ZeroConfig.from_options(options)``, which accepts either zerocompile's
own keys or a DeepSpeed-style config dict. Every unknown key or bad value raises
``ZeroConfigError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from zerocompile import deepspeed_config
from zerocompile.errors import ZeroConfigError, unknown_key_message
from zerocompile.flops_profiler import parse_flops_profiler
from zerocompile.monitor import parse_monitor
from zerocompile.loss_scale import parse_loss_scale
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

    loss_scale: object = None
    """Loss scaling for float16 training, applied inside the compiled backward (the training
    loop does not change): ``"dynamic"`` (DeepSpeed's rules: initial scale 2**16, doubled
    after 1000 clean steps, halved after 2 overflows in a row (hysteresis), minimum 1), a
    number (a static scale), or a dict with any of ``initial_scale``, ``window``,
    ``hysteresis``, ``min_scale``, ``consecutive_hysteresis`` (dynamic). ``ZeroOptimizer``
    unscales the gradients, skips the step on every rank when any rank's gradients are not
    finite, and exposes the scale as ``opt.loss_scale``. None = off (``torch.amp.GradScaler``
    works with ``ZeroOptimizer`` too). Parsed into a ``LossScaleSettings``."""

    bucket_mb: float = 25.0
    """Size cap, in MiB, of one fused collective. The ``bucketing`` pass coalesces consecutive
    all-gathers (forward and backward) and reduce-scatters of the compiled graphs into flat
    buckets of at most this size (the first bucket of a graph is smaller, so its wait is
    short; a bucket of at least 1/16 of this closes where the model's next numbered block
    begins, so a bucket does not gather several blocks at once); the optimizer-step collectives (stage 1 reduce-scatter of accumulated gradients,
    stage 1/2 all-gather of updated parameters) are grouped the same way. 0 turns bucketing
    off: one collective per parameter."""

    gradient_reduction: Literal["auto", "reduce_scatter", "all_reduce", "point_to_point", "shared_memory"] = "auto"
    """Stages 1-3: the collective that reduces the gradients (the eager step's buckets at stage 1,
    the backward graph's buckets at stages 2 and 3). ``"reduce_scatter"``; ``"all_reduce"``
    (stages 1 and 2; stage 3 reduce-scatters instead): each rank keeps its slice of the summed
    bucket (the same values; the full result is a transient, so the model state is the same);
    ``"point_to_point"``: row ``r`` of the bucket goes to rank ``r``, which sums what it
    received in rank order (the reduce-scatter's bytes, and on two ranks its values bit for bit);
    ``"shared_memory"``: the same transfers through a shared-memory segment instead of the
    process group's sockets, where every rank is on one host and tensors are on the CPU
    (``runtime/shared_memory.py``; 2-3x faster than gloo here; anything else is refused with the
    reason when the first frame compiles); ``"auto"``: whichever is fastest for the bucket's size on the process group, timed once per
    group and process when the first stage 1-3 frame compiles (the slowest rank's times, so every
    rank chooses the same); where nothing can be timed (world size 1, ``zerocompile plan``'s fake
    ranks: the hardware profile's choice) ``"reduce_scatter"``. Stage 0 ignores it (it
    all-reduces whole gradients). See ``runtime/reduction_choice.py``."""

    parameter_gather: Literal["auto", "all_gather", "point_to_point", "shared_memory"] = "auto"
    """How the parameters' all-gathers travel: at stages 1 and 2 the updated shards after the
    optimizer step (the replicas' refresh), at stage 3 the compiled graphs' gathers (pass
    ``point_to_point_collectives``). ``"all_gather"``: the all-gather collective;
    ``"point_to_point"``: each rank sends its shard to every other rank and receives theirs
    (the same bytes, copied, so the same parameters bit for bit; on gloo 1.2-3x faster than its
    all-gather at 16-64 MiB); ``"shared_memory"``: the same transfers through a shared-memory
    segment, where every rank is on one host (see ``gradient_reduction``; 3x gloo's all-gather
    here); ``"auto"``: the fastest for the bucket's size, timed by the probe
    ``gradient_reduction`` uses (once per group and process, the slowest rank's times, so
    every rank chooses the same); ``"all_gather"`` where nothing can be timed. Stage 0 ignores
    it. See ``runtime/reduction_choice.py`` and ``runtime/point_to_point.py``."""

    inner_compiler: str = "inductor"
    """What compiles the rewritten forward/backward graphs: ``"inductor"`` (C++ on CPUs,
    Triton on GPUs) or ``"eager"`` (AOTAutograd graphs run op by op; for debugging and tests)."""

    process_group: object = None
    """The data-parallel ``torch.distributed.ProcessGroup``; None = the default (world) group,
    or world size 1 when torch.distributed is not initialised."""

    reshard_after_forward: bool = True
    """Stage 3 only: free gathered parameters after forward and gather them again in backward
    (ZeRO-3). False keeps them from forward to backward (fewer all-gathers, more memory)."""

    prefetch: bool = True
    """Start each all-gather early and wait for it late, so communication overlaps compute
    (the ``prefetch`` pass); in backward, re-gathers are prefetched in backward order and
    reduce-scatters are waited for one bucket later."""

    prefetch_mb: float = 50.0
    """Most MiB of prefetched all-gather outputs in flight at once (gathered ahead of their
    first use). The liveness simulation also keeps the graph's peak within
    ``memory_limit_mb`` when that is set."""

    unshard_budget_mb: float | str = 0.0
    """Stage 3 only (``selective_unshard`` pass): MiB per rank of gathered parameters that may
    stay gathered from forward to backward, so backward need not gather them again. 0 =
    reshard everything (ZeRO-3); a number = keep the parameters that save the most time per
    byte up to that many MiB (``float("inf")``: keep all, which moves as few bytes as stage
    2); ``"auto"`` = as many as fit under ``memory_limit_mb`` by the liveness simulation."""

    memory_limit_mb: float | None = None
    """MiB per rank that the simulated peak of a compiled graph's transient tensors
    (activations, gathered parameters, communication buffers; not the persistent shards,
    gradients and optimizer state) may reach. Drives ``unshard_budget_mb="auto"`` and bounds
    prefetching. None = no limit."""

    recompute: str | dict = "none"
    """Activation recompute (``recompute`` pass): ``"none"``; ``"full"`` = save only the inputs
    of each block (each numbered submodule such as ``layers.3``) and recompute the rest in
    backward; ``{"memory_budget_mb": X}`` = recompute the blocks that free the most bytes per
    unit of recompute cost until the activations saved for backward fit in X MiB per rank."""

    cost_model: str | dict = "probe"
    """Rates the passes use to weigh compute against communication: ``"probe"`` times a
    matmul and two all-gathers once per frame compile (the slowest rank's figures are used on
    every rank), or a dict ``{"flops_per_s": ..., "alpha_us": ..., "bandwidth_gbps": ...,
    "memory_gbps": ..., "offload_gbps": ...}`` (missing keys take defaults; ``offload_gbps``, 1.0: the
    rate activations are offloaded at) for reproducible decisions."""

    profile: bool = False
    """Measure instead of estimate: once per compiled frame, before the passes decide, time
    each distinct op of the frame's graph on its device (on made-up inputs of the real shapes)
    and each distinct all-gather size on the real group (and, when ``offload_activations`` has
    a ``budget_mb``, each distinct size of saved activation through the offload store), keep
    the slowest rank's figures, and let ``selective_unshard``, ``recompute``, ``prefetch`` and
    ``plan_activations`` weigh those (unmeasured sizes and ops keep the ``cost_model``
    estimates). Costs one-off time in the first step; see docs/passes.md."""

    dump: str | None = None
    """Directory to write every frame's graphs (before the pipeline and after each pass)
    and per-pass summaries to; read them with ``zerocompile show DIR``. The environment
    variable ``ZEROCOMPILE_DUMP`` sets it when this option is not given."""

    debug_checks: bool = False
    """Check memory safety while the eager inner compiler runs the graphs (slower): before every
    op, that no tensor argument's storage is smaller than its size, stride and offset need (a
    storage freed with ``resize_(0)`` still in use), and that every collective a graph starts
    is waited for in it. A failed check raises an error naming the graph node, where the run
    would otherwise crash in native code or read freed memory. Only ``inner_compiler="eager"``."""

    allow_unsharded: bool = False
    """At stage 3, let parameters that no frame compiled with this backend uses (code Dynamo
    skipped or ran eagerly) stay whole on every rank, with whole gradients (all-reduced) and
    optimizer state, as DDP keeps them. False: ``ZeroOptimizer`` refuses them at its first step
    with an error naming them, since at scale they are an out-of-memory the plan did not show."""

    offload_optimizer: object = None
    """Where optimizer state (the moments; the master values are the shards) lives between
    steps, as DeepSpeed's ``zero_optimization.offload_optimizer``: None (on the model's device)
    or a dict ``{"device": "nvme", "nvme_path": DIR}`` with optional ``buffer_count`` (4),
    ``buffer_size`` (the most elements per buffer, 4194304; a tile is sized to 1/(8 x buffer_count)
    of the offloaded elements within [65536, buffer_size]), ``ratio`` (1.0: the fraction of the state
    offloaded; ``"auto"``: as little as fits ``memory_limit_mb``), ``threads`` (8 I/O threads), ``block_size`` (1 MiB per request), ``pin_memory``
    (True). ``"device": "cpu"`` keeps it in host memory (a logged no-op when the model is on the
    CPU). Needs ``ZeroOptimizer`` with ``torch.optim.Adam``/``AdamW`` (zerocompile's fused
    kernel streams the state through the buffers). Parsed into an ``OffloadSettings``; see
    docs/offload.md."""

    offload_param: object = None
    """Where stage 3's parameter shards (the master values) live between uses, as DeepSpeed's
    ``zero_optimization.offload_param``: None (on the model's device) or a dict ``{"device":
    "nvme", "nvme_path": DIR}``: one file per parameter under ``DIR``, read by a ``fetch_shard``
    node right before the parameter's all-gather (scheduled with it by the prefetch pass), and
    by the optimizer step, which writes the updated shard back. ``"device": "cpu"`` keeps them
    in host memory (a logged no-op when the model is on the CPU). Optional keys:
    ``buffer_count`` x ``buffer_size`` (4 x 4194304 elements): the most shard elements the
    optimizer step reads back at a time (with zerocompile's fused Adam; torch's optimizers
    update all tensors in one call, so they get all shards at once); ``threads`` (8: files
    read and written in parallel); ``pin_memory`` and ``block_size`` are accepted and have no
    effect; ``ratio`` must stay 1. Stage 3 only. See docs/offload.md."""

    offload_activations: object = None
    """Where the activations a forward saves for backward wait for it (the ``offload_activations``
    pass): None (in memory) or a dict ``{"device": "nvme", "nvme_path": DIR}``: each saved tensor of
    at least ``min_kb`` (64 KiB) is copied to a file under ``DIR`` right after it is made, freed
    from memory once the forward is done with it, and read back ahead of its first use in backward
    (the read of block k overlaps the backward of block k+1); the values are bitwise the same.
    ``"device": "cpu"``: page-locked host memory for a CUDA model (a logged no-op for a CPU model).
    ``budget_mb``: MiB of saved activations that may stay in memory, the planner choosing per block
    among keep, recompute and offload by estimated time (``"auto"``: what ``memory_limit_mb``
    leaves). DeepSpeed's ``activation_checkpointing.cpu_checkpointing`` maps onto ``"cpu"``. See
    docs/offload.md."""

    zero_quantized_weights: bool = False
    """ZeRO++ qwZ (DeepSpeed's key of the same name): every parameter all-gather of the
    compiled graphs moves blockwise-quantized int8 values with one float32 scale per 256
    elements instead of the parameters' dtype (about 0.26x the bytes of float32, 0.51x of
    bfloat16); each rank dequantizes the gathered bucket into the parameters' dtype
    (``quantize_weight_gathers`` pass, runtime/quantization.py). Forward and backward compute
    with the dequantized weights; the shards, gradients and optimizer state keep full
    precision. Not exact: each weight moves by at most half a quantization step (its block's
    max |w| / 254). Stage 3 only. See docs/zeropp.md."""

    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ (DeepSpeed's key of the same name): every gradient reduce-scatter of the
    compiled backward graphs becomes blockwise int8 quantization (one float32 scale per 256
    elements), an all-to-all and a local sum in float32 (``quantize_gradient_reductions``
    pass): about 0.26x the bytes of a float32 reduce-scatter, 0.51x of bfloat16. Each rank's
    contribution moves by at most half a quantization step (its block's max |g| / 254);
    DeepSpeed quantizes gradients to int4, with twice that step. With ``zero_hpz_partition_size
    = k`` it reduces in two hops, within groups of ``k`` ranks then across them (about ``1/k``
    of the bytes cross between groups; a second rounding). Gradient accumulation, the
    gradients' dtype and the optimizer stay full precision. Stages 2 and 3. See docs/zeropp.md."""

    zero_hpz_partition_size: int = 1
    """ZeRO++ hpZ (DeepSpeed's key of the same name): with ``k > 1``, each rank keeps from the
    forward to the backward its ``1/k`` share (a secondary shard) of every parameter the
    backward re-gathers, within its group of ``k`` consecutive ranks (the ranks of one node
    when ``k`` is the devices per node), and the backward re-gathers from those, over ``k``
    ranks instead of all (``hierarchical_partition`` pass). Exact. Costs ``Ψ/k`` of memory
    per rank (in the parameter dtype) between forward and backward. 1 = off. Stage 3 with
    ``reshard_after_forward``; ``k`` must divide the world size; the default process group
    only. See docs/zeropp.md."""

    gradient_clipping: float = 0.0
    """Clip the gradients' global L2 norm (over all ranks and all of a ``ZeroOptimizer``'s
    parameters) to this value in every ``ZeroOptimizer.step()``, after reducing and unscaling
    them, as DeepSpeed's key of the same name (and ``torch.nn.utils.clip_grad_norm_`` in one
    process). 0 = off. A step in which you call ``opt.clip_grad_norm_`` yourself is clipped
    by that call only. See docs/api.md, gradient clipping."""

    disabled_passes: tuple = field(default_factory=tuple)
    """Names of optional graph passes to skip (see docs/passes.md). Also given as
    ``options={"passes": {"disable": [...]}}``."""

    monitor: object = None
    """Monitors ``ZeroOptimizer.step()`` writes its figures to on rank 0 (``zerocompile/monitor.py``):
    ``{"tensorboard": {"enabled": True, "output_path": "logs", "job_name": "run"}, "csv_monitor":
    {...}, "samples_per_step": N}``, as DeepSpeed's top-level keys of those names (which translate
    to it). None = off. Parsed into a ``MonitorSettings``; see docs/monitoring.md."""

    flops_profiler: object = None
    """DeepSpeed's flops profiler: ``{"enabled": True, "profile_step": 1, "module_depth": -1,
    "top_modules": 1, "detailed": True, "output_file": None, "peak_tflops": None}`` (DeepSpeed's key
    of that name translates to it): rank 0 prints the FLOPs per module, the step's latency and
    FLOP/s after that ``ZeroOptimizer.step()``. None = off. Parsed into a
    ``FlopsProfilerSettings``; see docs/monitoring.md."""

    comms_logger: object = None
    """DeepSpeed's comms logger: ``{"enabled": True, "verbose": False, "prof_all": True, "prof_ops": [],
    "debug": False, "blocking": True}`` (DeepSpeed's key of that name translates to it): each
    collective's latency and bandwidth, by kind and message size, in ``stats().comm_latency`` and
    ``zerocompile.log_summary()``. None = off. Parsed into a ``CommsLoggerSettings``
    (``runtime/comms_log.py``); see docs/monitoring.md."""

    collective_timeout_s: float | None = 60.0
    """Seconds a zerocompile collective may wait before the ranks compare where they are (through
    the process group's store) and raise ``CollectiveMismatchError`` with every rank's position
    and the likely cause, instead of hanging until the process group's own timeout. A rank that
    is computing (compiling, running a graph or the optimizer step, in its own code) is busy, not
    stuck: the wait starts again. None = off (collectives wait as torch's do). See
    docs/sharding-and-errors.md, "When the ranks part"."""

    collective_busy_limit_s: float | None = None
    """How long (seconds, counted from the start of the wait) a busy rank may keep the others
    waiting before they raise ``CollectiveMismatchError`` anyway. None = as long as the process
    group's own timeout allows (a long first compile on one rank never stops a healthy job)."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_options(cls, options: "dict | str | os.PathLike | ZeroConfig | None") -> "ZeroConfig":
        """Build and validate a config from a ``torch.compile`` ``options`` dict, a
        DeepSpeed-style dict, or the path of a DeepSpeed JSON config file."""
        if options is None:
            return cls()
        if isinstance(options, ZeroConfig):
            return options
        if isinstance(options, (str, os.PathLike)):
            return cls.from_options(deepspeed_config.load_deepspeed_file(options, [f.name for f in fields(cls)]))
        if not isinstance(options, dict):
            raise ZeroConfigError(
                f"options must be a dict or the path of a DeepSpeed JSON file, got {type(options).__name__}; "
                "e.g. options={'stage': 3}")
        names = [f.name for f in fields(cls)]
        if any(k in options for k in (*deepspeed_config.TOP_LEVEL_TRANSLATED, *deepspeed_config.TRAINING_LOOP_KEYS,
                                      *deepspeed_config.ACCEPTED_KEYS)):
            # gradient_clipping is both a DeepSpeed key and a field of the same meaning: translated
            # ("auto" is DeepSpeed's)
            own = {k: v for k, v in options.items() if k in names and k not in deepspeed_config.TOP_LEVEL_TRANSLATED}
            ds = {k: v for k, v in options.items() if k not in own}
            translated = deepspeed_config.translate_deepspeed(ds, names)
            for key in set(own) & set(translated):
                raise ZeroConfigError(
                    f"option '{key}' is given both directly and through a DeepSpeed key; give it once")
            options = {**translated, **own}
        if "passes" in options:
            options = dict(options)
            options.update(_parse_passes_option(options.pop("passes"), options.get("disabled_passes")))
        for key in options:
            if key not in names:
                raise ZeroConfigError(unknown_key_message(key, names + ["passes"]))
        cfg = cls(**options)
        return cfg

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
            raise ZeroConfigError(f"option 'stage' = {stage!r} is invalid; allowed: 0, 1, 2, 3")
        object.__setattr__(self, "param_dtype", _parse_dtype("param_dtype", self.param_dtype, True))
        object.__setattr__(self, "reduce_dtype", _parse_dtype("reduce_dtype", self.reduce_dtype, False))
        try:
            object.__setattr__(self, "loss_scale", parse_loss_scale(self.loss_scale))
        except (TypeError, ValueError) as err:
            raise ZeroConfigError(str(err)) from None
        bucket = self.bucket_mb
        if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not 0 <= bucket < math.inf:
            raise ZeroConfigError(
                f"option 'bucket_mb' = {bucket!r} is invalid; allowed: a finite number of MiB >= 0 (0 = off)")
        try:
            check_gradient_reduction(self.gradient_reduction)
            check_parameter_gather(self.parameter_gather)
        except ValueError as err:
            raise ZeroConfigError(str(err)) from None
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
        if not isinstance(self.prefetch, bool):
            raise ZeroConfigError(f"option 'prefetch' = {self.prefetch!r} is invalid; allowed: True, False")
        if not isinstance(self.profile, bool):
            raise ZeroConfigError(f"option 'profile' = {self.profile!r} is invalid; allowed: True, False")
        if not isinstance(self.zero_quantized_weights, bool):
            raise ZeroConfigError(f"option 'zero_quantized_weights' = {self.zero_quantized_weights!r} is invalid; "
                                  "allowed: True, False")
        if not isinstance(self.zero_quantized_gradients, bool):
            raise ZeroConfigError(f"option 'zero_quantized_gradients' = {self.zero_quantized_gradients!r} is "
                                  "invalid; allowed: True, False")
        hpz = self.zero_hpz_partition_size
        if isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 1:
            raise ZeroConfigError(f"option 'zero_hpz_partition_size' = {hpz!r} is invalid; allowed: an integer >= 1 "
                                  "(1 = off; the ranks per node)")
        check_stages(self)               # the options that ask for stage-bound passes (ZeRO++)
        if hpz > 1 and not self.reshard_after_forward:
            raise ZeroConfigError("option 'zero_hpz_partition_size' needs reshard_after_forward=True: with it False "
                                  "the backward re-gathers nothing to partition")
        if not isinstance(self.allow_unsharded, bool):
            raise ZeroConfigError(
                f"option 'allow_unsharded' = {self.allow_unsharded!r} is invalid; allowed: True, False")
        if not isinstance(self.debug_checks, bool):
            raise ZeroConfigError(f"option 'debug_checks' = {self.debug_checks!r} is invalid; allowed: True, False")
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or math.isnan(clip) or clip < 0 \
                or math.isinf(clip):
            raise ZeroConfigError(f"option 'gradient_clipping' = {clip!r} is invalid; allowed: a finite number >= 0 "
                                  "(the largest global gradient norm; 0 = off)")
        object.__setattr__(self, "gradient_clipping", float(clip))
        _check_mb("prefetch_mb", self.prefetch_mb)
        if self.unshard_budget_mb != "auto":
            _check_mb("unshard_budget_mb", self.unshard_budget_mb, extra=", or 'auto'", allow_inf=True)
        if self.memory_limit_mb is not None:
            _check_mb("memory_limit_mb", self.memory_limit_mb, extra=", or None")
        if self.unshard_budget_mb == "auto" and self.memory_limit_mb is None:
            raise ZeroConfigError(
                "option 'unshard_budget_mb' = 'auto' needs 'memory_limit_mb' (the per-rank MiB the "
                "simulated peak may reach); set it, or give unshard_budget_mb a number of MiB")
        try:
            offload = parse_offload("offload_optimizer", self.offload_optimizer)
        except ValueError as err:
            raise ZeroConfigError(str(err)) from None
        if offload.ratio == "auto":
            if self.memory_limit_mb is None:
                raise ZeroConfigError("option 'offload_optimizer.ratio' = 'auto' needs 'memory_limit_mb' (the per-rank "
                                      "MiB model state and transient tensors may take); set it, or give a ratio")
            offload = dataclasses.replace(offload, memory_limit_mb=float(self.memory_limit_mb))
        object.__setattr__(self, "offload_optimizer", offload)
        try:
            offload_param = parse_offload("offload_param", self.offload_param)
        except ValueError as err:
            raise ZeroConfigError(str(err)) from None
        if offload_param.enabled and self.stage != 3:
            raise ZeroConfigError(f"option 'offload_param' needs stage 3 (only stage 3 shards the parameters), "
                                  f"not stage {self.stage}; use stage=3, or offload_optimizer alone")
        if offload_param.ratio != 1.0:
            raise ZeroConfigError(f"option 'offload_param.ratio' = {offload_param.ratio!r} is invalid: every "
                                  "parameter shard is offloaded (allowed: 1); partial offload is offload_optimizer's")
        object.__setattr__(self, "offload_param", offload_param)
        object.__setattr__(self, "recompute", _parse_recompute(self.recompute))
        object.__setattr__(self, "monitor", parse_monitor(self.monitor))
        object.__setattr__(self, "flops_profiler", parse_flops_profiler(self.flops_profiler))
        object.__setattr__(self, "comms_logger", parse_comms_logger(self.comms_logger))
        for name in ("collective_timeout_s", "collective_busy_limit_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < math.inf):
                raise ZeroConfigError(f"option '{name}' = {value!r} is invalid; allowed: a number of seconds > 0, "
                                      "or None (off)")
        try:
            activations = parse_activation_offload(self.offload_activations)
        except ValueError as err:
            raise ZeroConfigError(str(err)) from None
        if activations.budget_mb == "auto":
            if self.memory_limit_mb is None:
                raise ZeroConfigError("option 'offload_activations.budget_mb' = 'auto' needs 'memory_limit_mb' (the "
                                      "per-rank MiB the simulated peak may reach); set it, or give budget_mb a number")
            activations = dataclasses.replace(activations, memory_limit_mb=float(self.memory_limit_mb))
        object.__setattr__(self, "offload_activations", activations)
        object.__setattr__(self, "cost_model", _parse_cost_model(self.cost_model))
        if self.dump is not None and not isinstance(self.dump, (str, os.PathLike)):
            raise ZeroConfigError(f"option 'dump' = {self.dump!r} is invalid; allowed: a directory path, or None")
        passes = self.disabled_passes
        if isinstance(passes, str) or not all(isinstance(p, str) for p in passes):
            raise ZeroConfigError(
                f"option 'disabled_passes' = {passes!r} is invalid; allowed: a list of pass names")
        check_disabled_passes(tuple(passes))
        object.__setattr__(self, "disabled_passes", tuple(passes))
        check_pipeline(self)
        if self.param_dtype is torch.float16 and self.loss_scale is None:
            logging.getLogger("zerocompile").warning(
                "param_dtype float16 with no loss scaling: small gradients underflow to zero in "
                "float16. Set options loss_scale='dynamic', use torch.amp.GradScaler with "
                "ZeroOptimizer, or compute in bfloat16")


PASS_OPTIONS = frozenset({
    "bucket_mb", "reshard_after_forward", "prefetch", "prefetch_mb", "unshard_budget_mb", "memory_limit_mb",
    "recompute", "offload_activations", "zero_quantized_weights", "zero_quantized_gradients",
    "zero_hpz_partition_size", "disabled_passes",
})
"""Options only the graph passes read: a compiled frame takes new values of them by running
its passes again over the Dynamo graph it was traced from, with the same parameters and shard
states (``FrameRunner.recompile``; ``zerocompile tune`` plans such candidates on one trace). The
other options bind the parameters' shard states (stage, dtypes, process group, loss scale,
offload, clipping, gradient reduction) or how a frame is compiled (inner compiler, cost model,
profile, dump, debug checks): a new value of one of them needs the script traced again."""


def options_needing_a_new_trace(old: ZeroConfig, new: ZeroConfig) -> list[str]:
    """The options outside ``PASS_OPTIONS`` whose values differ between ``old`` and ``new``."""
    return [f.name for f in fields(ZeroConfig)
            if f.name not in PASS_OPTIONS and getattr(old, f.name) != getattr(new, f.name)]


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


