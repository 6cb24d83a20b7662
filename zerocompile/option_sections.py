"""The backend's options, in the sections of the code that reads them.

``ZeroConfig`` (``config.py``) holds one of each: ``sharding`` (``ShardingOptions``),
``passes`` (``PassOptions``), ``compiler`` (``CompilerOptions``), ``step`` (``StepOptions``)
and ``observability`` (``ObservabilityOptions``). Users give the options flat, by the field
names below (``options={"stage": 3, "bucket_mb": 50}``) or as a DeepSpeed config;
``ZeroConfig.from_options`` parses each value once into the typed field of its section. The
sections hold parsed values only: build them through ``ZeroConfig.from_options``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from zerocompile.flops_profiler import FlopsProfilerSettings
from zerocompile.loss_scale import LossScaleSettings
from zerocompile.monitor import MonitorSettings
from zerocompile.runtime.comms_log import CommsLoggerSettings
from zerocompile.runtime.offload_settings import ActivationOffloadSettings, OffloadSettings


@dataclass(frozen=True)
class ShardingOptions:
    """How the model's state is split over the ranks and moved between them: the stage, the
    dtypes, the process group, the collectives' kind, and how long a collective may wait."""

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

    process_group: torch.distributed.ProcessGroup | None = None
    """The data-parallel ``torch.distributed.ProcessGroup``; None = the default (world) group,
    or world size 1 when torch.distributed is not initialised."""

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


@dataclass(frozen=True)
class PassOptions:
    """The graph passes' options (``PASS_OPTIONS``): a compiled frame takes new values of them by
    running its passes again over its traced graph (``FrameRunner.recompile``), with the same
    shard states; ``zerocompile plan``/``tune`` try several on one trace."""

    bucket_mb: float = 25.0
    """Size cap, in MiB, of one fused collective. The ``bucketing`` pass coalesces consecutive
    all-gathers (forward and backward) and reduce-scatters of the compiled graphs into flat
    buckets of at most this size (the first bucket of a graph is smaller, so its wait is
    short; a bucket of at least 1/16 of this closes where the model's next numbered block
    begins, so a bucket does not gather several blocks at once); the optimizer-step collectives (stage 1 reduce-scatter of accumulated gradients,
    stage 1/2 all-gather of updated parameters) are grouped the same way. 0 turns bucketing
    off: one collective per parameter."""

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

    unshard_budget_mb: float | Literal["auto"] = 0.0
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

    offload_activations: ActivationOffloadSettings = field(default_factory=ActivationOffloadSettings)
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

    disabled_passes: tuple[str, ...] = ()
    """Names of optional graph passes to skip (see docs/passes.md). Also given as
    ``options={"passes": {"disable": [...]}}``."""


@dataclass(frozen=True)
class CompilerOptions:
    """How a frame is compiled: the inner compiler, the rates the passes weigh, measuring them,
    and the eager runner's memory checks."""

    inner_compiler: Literal["inductor", "eager"] = "inductor"
    """What compiles the rewritten forward/backward graphs: ``"inductor"`` (C++ on CPUs,
    Triton on GPUs) or ``"eager"`` (AOTAutograd graphs run op by op; for debugging and tests)."""

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

    repeated_blocks: str | int = "auto"
    """Compile a frame's identical repeated blocks once (``zerocompile/repeated_blocks.py``): the
    layers of an ``nn.ModuleList`` (children of one container, of one class, with the same graph)
    become one compiled block that runs for every layer, and the code before, between and after
    them frames of their own, as per-block compilation (``layer.compile()``) gives. ``"auto"``:
    in frames with at least 8 such blocks; an integer N >= 2: with at least N; ``"off"``: the
    frame stays one graph (every layer traced, partitioned and compiled, and the passes see across
    layers: prefetch of the next layer's gather inside the graph). Changing it needs a new trace."""

    debug_checks: bool = False
    """Check memory safety while the eager inner compiler runs the graphs (slower): before every
    op, that no tensor argument's storage is smaller than its size, stride and offset need (a
    storage freed with ``resize_(0)`` still in use), and that every collective a graph starts
    is waited for in it. A failed check raises an error naming the graph node, where the run
    would otherwise crash in native code or read freed memory. Only ``inner_compiler="eager"``."""


@dataclass(frozen=True)
class StepOptions:
    """The optimizer step's options, one value per model (``ModelSession.check_model_options``):
    clipping, loss scaling, where the optimizer state and stage 3's parameter shards live, and
    whether parameters no frame shards may stay whole. ``ZeroOptimizer`` reads them from its
    model's session."""

    gradient_clipping: float = 0.0
    """Clip the gradients' global L2 norm (over all ranks and all of a ``ZeroOptimizer``'s
    parameters) to this value in every ``ZeroOptimizer.step()``, after reducing and unscaling
    them, as DeepSpeed's key of the same name (and ``torch.nn.utils.clip_grad_norm_`` in one
    process). 0 = off. A step in which you call ``opt.clip_grad_norm_`` yourself is clipped
    by that call only. See docs/api.md, gradient clipping."""

    loss_scale: LossScaleSettings | None = None
    """Loss scaling for float16 training, applied inside the compiled backward (the training
    loop does not change): ``"dynamic"`` (DeepSpeed's rules: initial scale 2**16, doubled
    after 1000 clean steps, halved after 2 overflows in a row (hysteresis), minimum 1), a
    number (a static scale), or a dict with any of ``initial_scale``, ``window``,
    ``hysteresis``, ``min_scale``, ``consecutive_hysteresis`` (dynamic). ``ZeroOptimizer``
    unscales the gradients, skips the step on every rank when any rank's gradients are not
    finite, and exposes the scale as ``opt.loss_scale``. None = off (``torch.amp.GradScaler``
    works with ``ZeroOptimizer`` too). Parsed into a ``LossScaleSettings``."""

    offload_optimizer: OffloadSettings = field(default_factory=OffloadSettings)
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

    offload_param: OffloadSettings = field(default_factory=OffloadSettings)
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

    overlap_reduction: bool = False
    """Stage 1: reduce the full gradients into the shards during the backward before the
    optimizer step, bucket by bucket (``bucket_mb``) as autograd finishes them, instead of in
    the step: DDP's overlap of its all-reduce with the backward (DeepSpeed's ``overlap_comm``).
    The step still decides: a bucket whose gradients changed after it was reduced (another
    micro-batch's backward, an in-place change) is reduced again there, so the numbers are the
    step's (bit for bit on two ranks). Which backward is the last before the step is guessed
    from the last step (the same number of micro-batches), so the first two steps reduce in the
    step. Every rank must follow the same pattern of backwards per step, as with DDP: a rank that
    runs fewer backwards than in its last step while another does not pairs collectives wrongly
    (docs/config.md). Overlap needs
    the gradients to arrive in parts: a model compiled as pieces (``repeated_blocks``, graph
    breaks, per-block compilation); one graph delivers them all at its end. Stages 0, 2 and 3
    ignore it (stages 2 and 3 reduce inside the backward graph anyway). See
    ``zerocompile/optim/early_reduction.py``."""

    allow_unsharded: bool = False
    """At stage 3, let parameters that no frame compiled with this backend uses (code Dynamo
    skipped or ran eagerly) stay whole on every rank, with whole gradients (all-reduced) and
    optimizer state, as DDP keeps them. False: ``ZeroOptimizer`` refuses them at its first step
    with an error naming them, since at scale they are an out-of-memory the plan did not show."""


@dataclass(frozen=True)
class ObservabilityOptions:
    """What the run writes about itself: graph dumps, monitors, DeepSpeed's flops profiler and
    comms logger. None of them changes a number of the training."""

    dump: str | None = None
    """Directory to write every frame's graphs (before the pipeline and after each pass)
    and per-pass summaries to; read them with ``zerocompile show DIR``. The environment
    variable ``ZEROCOMPILE_DUMP`` sets it when this option is not given."""

    monitor: MonitorSettings | None = None
    """Monitors ``ZeroOptimizer.step()`` writes its figures to on rank 0 (``zerocompile/monitor.py``):
    ``{"tensorboard": {"enabled": True, "output_path": "logs", "job_name": "run"}, "csv_monitor":
    {...}, "samples_per_step": N}``, as DeepSpeed's top-level keys of those names (which translate
    to it). None = off. Parsed into a ``MonitorSettings``; see docs/monitoring.md."""

    flops_profiler: FlopsProfilerSettings | None = None
    """DeepSpeed's flops profiler: ``{"enabled": True, "profile_step": 1, "module_depth": -1,
    "top_modules": 1, "detailed": True, "output_file": None, "peak_tflops": None}`` (DeepSpeed's key
    of that name translates to it): rank 0 prints the FLOPs per module, the step's latency and
    FLOP/s after that ``ZeroOptimizer.step()``. None = off. Parsed into a
    ``FlopsProfilerSettings``; see docs/monitoring.md."""

    comms_logger: CommsLoggerSettings | None = None
    """DeepSpeed's comms logger: ``{"enabled": True, "verbose": False, "prof_all": True, "prof_ops": [],
    "debug": False, "blocking": True}`` (DeepSpeed's key of that name translates to it): each
    collective's latency and bandwidth, by kind and message size, in ``stats().comm_latency`` and
    ``zerocompile.log_summary()``. None = off. Parsed into a ``CommsLoggerSettings``
    (``runtime/comms_log.py``); see docs/monitoring.md."""
