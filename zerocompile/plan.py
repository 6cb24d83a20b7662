"""``zerocompile plan``: what each rank of an N-rank job would hold, move and spend per step,
measured from the real graphs in one process on this machine.

The training script runs unmodified in this process, as rank 0 of torch's fake process group
of N ranks (``zerocompile.script_runner``), under a ``FakeTensorMode``: every tensor it creates
is fake (shape, dtype and storage size, no values), so nothing the size of the model is
allocated. The backend shards, compiles and runs every frame as rank 0 of a real job would:
the same shards, passes and collectives. The inner compiler is the eager one (inductor's
kernels need real data) and the passes decide with the hardware profile's rates.

Plan watches the script's optimizer steps and measures the second one (the first compiles and
creates the optimizer state), then stops the script. At the end of the first step every live
fake tensor is recorded, and from then on:

- model-state bytes by kind: ``zerocompile.stats()`` right after the step;
- peak live bytes: a ``LiveStorageTracker`` over the step, as the tests and benchmarks measure
  a real run (every storage created, freed or resized);
- bytes per collective kind: ``stats()``'s counters over the step;
- estimated step time: every op the step dispatches, timed by the cost model at the profile's
  rates; collectives run one at a time on a stream of their own, and a ``wait_tensor`` holds
  the compute stream until its collective is done.

Values the script reads (``loss.item()``, ``if torch.isnan(loss):``) are 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from zerocompile import _torch_compat
from zerocompile.passes.analyses.collective_summary import COLLECTIVE_KINDS_BY_OP, collective_group_size
from zerocompile.errors import ZeroConfigError
from zerocompile.passes.analyses.cost_model import DEFAULT_RATES, CostModel
from zerocompile.runtime import accounting, session as sessions
from zerocompile.runtime.memory_tracker import LiveStorageTracker


@dataclass(frozen=True)
class Hardware:
    """Sustained rates of one rank of the machine the job is planned for."""

    name: str
    description: str
    flops_per_s: float
    """Matmul FLOP/s a rank sustains (about 70% of the dense bf16 peak on GPUs)."""
    memory_gbps: float
    """GB/s a memory-bound op reads plus writes."""
    bandwidth_gbps: float
    """GB/s one rank sends in a collective: the slowest link of the ring (the network
    interface between nodes of a multi-node job)."""
    alpha_us: float
    """Latency of one collective, microseconds."""
    ranks_per_node: int = 1
    """Ranks (GPUs) per node: ranks ``n*ranks_per_node ..`` share a node."""
    intra_node_gbps: float = 0.0
    """GB/s one rank sends in a collective whose group lies inside one node (NVLink): the
    world group when the job fits in a node, hpZ's groups of ``k`` consecutive ranks when ``k``
    divides ``ranks_per_node``. 0: ``bandwidth_gbps`` for every collective. The passes decide
    with ``bandwidth_gbps`` only."""
    offload_gbps: float = 1.0
    """GB/s one rank writes (or reads) offloaded activations at (``offload_activations``): the
    disk under ``nvme_path``, or the host link for ``"cpu"``; the planner weighs transfers with it."""
    memory_gb: float = 0.0
    """GiB of device memory per rank (``zerocompile tune``'s default memory limit); 0: unknown."""
    gradient_reduction: str = "reduce_scatter"
    """What the ``gradient_reduction`` option ``"auto"`` chooses on this machine (plan's fake
    ranks time nothing): ``"reduce_scatter"`` where the collectives are rings (NCCL), whose
    reduce-scatter moves half an all-reduce's bytes; ``"all_reduce"`` over gloo, whose
    reduce-scatter costs about 1.5x its all-reduce (``benchmarks/results/collectives.json``)."""

    def cost_model(self) -> dict:
        """The ``cost_model`` option with these rates."""
        return {"flops_per_s": self.flops_per_s, "memory_gbps": self.memory_gbps,
                "bandwidth_gbps": self.bandwidth_gbps, "alpha_us": self.alpha_us, "offload_gbps": self.offload_gbps}


HARDWARE = MappingProxyType({
    h.name: h for h in (
        # inside a node: NVLink 4 (H100, H200) moves 450 GB/s per direction, NVLink 3 (A100)
        # 300; collectives sustain about 80% of that
        Hardware("h100", "NVIDIA H100 SXM nodes, 8 GPUs each, NVLink inside a node, 400 Gb/s InfiniBand per GPU",
                 flops_per_s=700e12, memory_gbps=3000.0, bandwidth_gbps=45.0, alpha_us=30.0, ranks_per_node=8,
                 intra_node_gbps=360.0, memory_gb=80.0),
        Hardware("h200", "NVIDIA H200 SXM nodes, 8 GPUs each, NVLink inside a node, 400 Gb/s InfiniBand per GPU",
                 flops_per_s=700e12, memory_gbps=4300.0, bandwidth_gbps=45.0, alpha_us=30.0, ranks_per_node=8,
                 intra_node_gbps=360.0, memory_gb=141.0),
        Hardware("a100", "NVIDIA A100 SXM nodes, 8 GPUs each, NVLink inside a node, 200 Gb/s InfiniBand per GPU",
                 flops_per_s=220e12, memory_gbps=1800.0, bandwidth_gbps=22.0, alpha_us=30.0, ranks_per_node=8,
                 intra_node_gbps=240.0, memory_gb=80.0),
        Hardware("cpu", "the cost model's defaults: a small CPU machine over gloo",
                 **DEFAULT_RATES, gradient_reduction="all_reduce"),
    )
})
"""Built-in ``--hardware`` profiles (a JSON file with the four rates gives any other)."""

_OPTIONAL_HARDWARE_KEYS = ("name", "description", "ranks_per_node", "intra_node_gbps", "gradient_reduction",
                           "offload_gbps", "memory_gb")


def hardware_from(value: str) -> Hardware:
    """A profile by name, or from a JSON file holding ``flops_per_s``, ``memory_gbps``,
    ``bandwidth_gbps`` and ``alpha_us`` (and optionally ``name``, ``description``,
    ``ranks_per_node``, ``intra_node_gbps``, ``gradient_reduction``, ``offload_gbps`` and ``memory_gb``)."""
    if value in HARDWARE:
        return HARDWARE[value]
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"unknown hardware {value!r}: give one of {', '.join(HARDWARE)} or a JSON file "
                         "with flops_per_s, memory_gbps, bandwidth_gbps and alpha_us")
    try:
        rates = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"hardware file {path}: cannot read it as JSON: {exc}") from None
    needed = ("flops_per_s", "memory_gbps", "bandwidth_gbps", "alpha_us")
    if not isinstance(rates, dict) or set(rates) - {*needed, *_OPTIONAL_HARDWARE_KEYS} or not set(needed) <= set(rates):
        raise ValueError(f"hardware file {path}: needs exactly the keys {', '.join(needed)} "
                         f"(and optionally {', '.join(_OPTIONAL_HARDWARE_KEYS)})")
    for key in (*needed, "intra_node_gbps", "offload_gbps", "memory_gb"):
        v = rates.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"hardware file {path}: {key} = {v!r}; it must be a finite number > 0")
    per_node = rates.get("ranks_per_node", 1)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"hardware file {path}: ranks_per_node = {per_node!r}; it must be an integer >= 1")
    reduction = rates.get("gradient_reduction", "reduce_scatter")
    if reduction not in ("reduce_scatter", "all_reduce"):
        raise ValueError(f"hardware file {path}: gradient_reduction = {reduction!r}; it must be 'reduce_scatter' "
                         "or 'all_reduce'")
    return Hardware(name=str(rates.get("name", path.stem)), description=str(rates.get("description", str(path))),
                    **{k: float(rates[k]) for k in needed}, ranks_per_node=per_node,
                    intra_node_gbps=float(rates.get("intra_node_gbps", 0.0)), gradient_reduction=reduction,
                    offload_gbps=float(rates.get("offload_gbps", 1.0)),
                    memory_gb=float(rates.get("memory_gb", 0.0)))


# ------------------------------------------------------------------------------- dispatch modes
class ScalarReadsAreZero(TorchDispatchMode):
    """Fake tensors have no values: a read of one (``.item()``, ``bool(t)``, ``float(t)``)
    gives 0 of its dtype, so a script's logging and checks run on."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:      # compiled code stays compiled under it
        return True

    supports_higher_order_operators = True     # they pass through (run on the modes below)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return False if dtype is torch.bool else (0.0 if dtype.is_floating_point or dtype.is_complex else 0)
        return func(*args, **(kwargs or {}))


class StepTimer(TorchDispatchMode):
    """Times every dispatched op with a ``CostModel``: compute ops one after another; each
    collective on the communication stream, which starts it once both the op that issued it
    and the previous collective are done; ``wait_tensor`` holds compute until its collective
    is done. ``now`` is the compute stream's clock."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, model: CostModel, world: int, intra_node_bandwidth: float = 0.0):
        super().__init__()
        self.model = model
        self.world = world
        self.intra_node_bandwidth = intra_node_bandwidth
        """Bytes/s a rank sends in a collective over one of ``node_local_groups`` (0: the model's)."""
        self.node_local_groups: frozenset = frozenset()
        """Names of the process groups whose ranks share a node."""
        self.reset()

    def reset(self) -> None:
        self.now = 0.0
        self.compute_s = 0.0
        self.comm_s = 0.0
        self.comm_free = 0.0
        self._done: dict = {}
        self.recording: list | None = None
        """While a list: every event is also appended to it (``zerocompile.graph_replay``)."""

    # a higher-order operator runs on the modes below: the op it wraps is timed here
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _torch_compat.is_higher_order_op(func):
            inner = _torch_compat.op_run_by(func, args, kwargs, out)
            if inner is not None:
                self.apply(("compute", self.model.op_time(*inner)))
            return out
        if func in COLLECTIVE_KINDS_BY_OP:
            kind, which = COLLECTIVE_KINDS_BY_OP[func]
            full = out if which == "out" else args[0]
            # each over its own group: hpZ's re-gathers and qgZ's hops run over fewer ranks
            world = collective_group_size(func, args, self.world)
            nbytes = full.numel() * full.element_size()
            if self.intra_node_bandwidth > 0 and args[-1] in self.node_local_groups:
                seconds = self.model.alpha_s + accounting.ring_wire_bytes(kind, nbytes, world) / self.intra_node_bandwidth
            else:
                seconds = self.model.collective_time(kind, nbytes, world)
            # what its wait reads: the result, or the buffer an in-place collective reduces
            waited = out if out is not None else args[0]
            self.apply(("collective", seconds, waited.untyped_storage()._cdata))
        elif func is torch.ops._c10d_functional.wait_tensor.default:
            self.apply(("wait", args[0].untyped_storage()._cdata))
        elif not (func.is_view or func in _FREE_OPS):
            self.apply(("compute", self.model.op_time(func, args, kwargs, out)))
        return out

    def apply(self, event: tuple) -> None:
        """Advance the clocks by one event: ``("compute", seconds)``, ``("collective", seconds,
        key)`` (its result's storage) or ``("wait", key)``."""
        if self.recording is not None:
            self.recording.append(event)
        if event[0] == "collective":
            finish = max(self.now, self.comm_free) + event[1]
            self.comm_free = finish
            self.comm_s += event[1]
            self._done[event[2]] = finish
        elif event[0] == "wait":
            self.now = max(self.now, self._done.pop(event[1], self.now))
        else:
            self.now += event[1]
            self.compute_s += event[1]

    @property
    def step_s(self) -> float:
        """The step's estimated seconds: compute, plus the communication nothing overlapped."""
        return max(self.now, self.comm_free)


# ops that move no data (their cost is the allocator's or nothing)
_FREE_OPS = frozenset({
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
    torch.ops.aten.detach.default, torch.ops.aten.set_.source_Storage,
    torch.ops.aten.set_.source_Storage_storage_offset, torch.ops.aten.lift_fresh.default,
    torch.ops.aten._local_scalar_dense.default, torch.ops.prim.device.default,
})


class StepWatcher:
    """Counts the script's optimizer steps (a ``ZeroOptimizer``'s inner optimizer is not a
    step of its own) and calls ``on_step(n)`` after each."""

    def __init__(self, on_step):
        self.on_step = on_step
        self.steps = 0
        self._handle = None

    def __enter__(self):
        self._handle = register_optimizer_step_post_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self._handle.remove()

    def _hook(self, optimizer, args, kwargs) -> None:
        if any(optimizer in z.inner_optimizers() for z in list(sessions.PROCESS.optimizers)):
            return
        self.steps += 1
        self.on_step(self.steps)


class PlanReplayError(RuntimeError):
    """A replayed graph run did not behave as the run it replays (``zerocompile.graph_replay``)."""


class PlanFinished(BaseException):
    """Raised after the measured step to end the script (a ``BaseException``, so the script's
    own ``except Exception`` does not catch it)."""


# ------------------------------------------------------------------------------------- report
@dataclass
class PlanReport:
    """Per-rank figures of one planned run; ``as_dict()`` is what ``--json`` prints."""

    world_size: int
    hardware: Hardware
    options: dict
    num_params: int = 0
    """Elements of the parameters the compiled frames shard (each parameter once)."""
    model_state_bytes: dict = field(default_factory=dict)
    """Bytes held after the step, by kind: params, grads, optimizer_state (on the device),
    offloaded_optimizer_state, offloaded_params."""
    peak_bytes: int = 0
    """Largest live bytes during the measured step (every storage the process holds)."""
    comm: dict = field(default_factory=dict)
    """Per collective kind: ``{"count", "bytes"}`` over the step (full buffers, as ``stats()``)."""
    compute_s: float = 0.0
    comm_s: float = 0.0
    step_s: float = 0.0
    steps_seen: int = 0
    measured_step: int = 0
    """2 once the second step was measured; 0 when the script ran fewer steps (no figures)."""
    frames: int = 0
    stages: list = field(default_factory=list)
    """The ZeRO stages the compiled frames ran with (one, unless the script mixes them)."""
    simulated_peak_bytes: int = 0
    """The largest transient peak the pass pipeline simulated for one frame's graphs."""
    wall_s: float = 0.0
    exit_code: int = 0
    graph_runs: dict = field(default_factory=dict)
    """Compiled-graph runs over the whole script: ``{"executed", "replayed"}`` (empty without
    replay; see ``zerocompile.graph_replay``)."""
    unsharded_params: dict = field(default_factory=dict)
    """Trainable parameters no compiled frame used, kept whole on every rank (stage 3 refuses
    them unless ``allow_unsharded``): ``{"count", "elements", "names"}``; their bytes and their
    gradients' are in ``model_state_bytes``."""
    gradient_reduction: str = ""
    """The collective stages 1/2 reduce gradients with, and where the choice comes from."""
    replay_mismatch: str | None = None
    """Why a replay could not vouch for its figures (``plan_script`` then raises)."""
    error: str | None = None
    """Why these options could not be planned on the trace of an earlier report
    (``plan_script``'s ``next_options``); None otherwise."""
    activations: dict = field(default_factory=dict)
    """What the compiled frames do with the activations they save for backward, summed over the
    frames: ``saved_bytes`` (the forward saves, as partitioned), ``offloaded_bytes`` and the
    blocks the planner chose to ``recompute`` and to ``offload`` (``offload_activations``)."""

    @property
    def model_state_bytes_per_rank(self) -> int:
        return sum(v for k, v in self.model_state_bytes.items() if not k.startswith("offloaded"))

    @property
    def comm_bytes_per_rank_per_step(self) -> int:
        return sum(v["bytes"] for v in self.comm.values())

    @property
    def wire_bytes_per_rank_per_step(self) -> float:
        """Bytes each rank sends with ring algorithms, each collective over its own group (an
        all-reduce counts twice)."""
        return sum(v["wire_bytes"] for v in self.comm.values())

    def as_dict(self) -> dict:
        return {
            "num_params": self.num_params,
            "world_size": self.world_size,
            "model_state_bytes_per_rank": self.model_state_bytes_per_rank,
            "model_state_bytes_by_kind": dict(self.model_state_bytes),
            "peak_bytes_per_rank": self.peak_bytes,
            "comm_bytes_per_rank_per_step": self.comm_bytes_per_rank_per_step,
            "comm_by_kind": {k: dict(v) for k, v in self.comm.items()},
            "wire_bytes_per_rank_per_step": self.wire_bytes_per_rank_per_step,
            "estimated_step_s": self.step_s,
            "estimated_compute_s": self.compute_s,
            "estimated_comm_s": self.comm_s,
            "hardware": dataclasses.asdict(self.hardware),
            "options": self.options,
            "frames": self.frames,
            "stages": list(self.stages),
            "simulated_peak_bytes": self.simulated_peak_bytes,
            "measured_step": self.measured_step,
            "steps_seen": self.steps_seen,
            "wall_s": self.wall_s,
            "exit_code": self.exit_code,
            "graph_runs": dict(self.graph_runs),
            "unsharded_params": dict(self.unsharded_params),
            "gradient_reduction": self.gradient_reduction,
            "activations": dict(self.activations),
            "error": self.error,
        }


def plan_options(options: dict | None, hardware: Hardware) -> dict:
    """The options plan runs the script with: the user's, over which the eager inner compiler, no
    monitor, and (unless given) the hardware's rates as ``cost_model`` and its ``gradient_reduction`` for
    ``"auto"`` (fake ranks time nothing)."""
    out = dict(options or {})
    out["inner_compiler"] = "eager"
    out["monitor"] = None           # a fake step's figures are not the job's: the script's monitors stay off
    out["flops_profiler"] = None
    out["comms_logger"] = None      # nor are its latencies: a fake collective takes no time
    out.setdefault("cost_model", hardware.cost_model())
    if out.get("gradient_reduction", "auto") == "auto":
        out["gradient_reduction"] = hardware.gradient_reduction
    return out


def gradient_reduction_line(options: dict | None, hardware: Hardware) -> str:
    """Where the planned stage 1/2 gradient reduction comes from: the user's option, else the
    hardware profile's choice for ``"auto"``."""
    given = (options or {}).get("gradient_reduction", "auto")
    if given != "auto":
        return f"{given} (option gradient_reduction)"
    return f"{hardware.gradient_reduction} (gradient_reduction 'auto': the choice of hardware profile {hardware.name})"


def plan_script(script: Path, script_args: list, world_size: int, options: dict | None = None,
                hardware: Hardware = HARDWARE["h100"], stdout=None, replay: bool = True,
                next_options=None) -> PlanReport:
    """Run ``script`` as rank 0 of ``world_size`` fake ranks with fake tensors and measure its
    second optimizer step. ``stdout``: where the script's own output goes (``--json`` sends it
    to stderr). ``report.measured_step`` is 0 when the script ran fewer than two steps.

    ``replay``: replay graph runs identical to an earlier one instead of running them
    (``zerocompile.graph_replay``; the figures are the same). If a replay cannot vouch for its
    figures, ``PlanReplayError`` says so (plan again with ``replay=False``, ``--no-replay``).

    ``next_options(report)``: plan more option sets on this one trace of the script. It is
    called with each measured report (the first included) and returns the next options, or
    None to stop the script. The next option sets may differ from the first in the pass options
    only (``config.PASS_OPTIONS``): every compiled frame runs its passes again with them
    (``backend.recompile_with_overriding_options``) and the script's next step is measured, as a
    fresh plan measures its second. A report whose options could not be compiled carries
    ``error`` (and the callback is asked again); a report the script ended before measuring
    (``measured_step`` 0) is passed last (what the callback returns then is not used). Only the
    first report is returned; replay mismatches are in each report's ``replay_mismatch``.

    Plan each script in a process of its own, as the CLI does: models and compiled frames an
    earlier plan in this process left alive would count again."""
    run = _PlanRun(world_size, options, hardware, replay, next_options)
    run.run(script, script_args, stdout)
    report = run.reports[0]
    if report.replay_mismatch and next_options is None:
        raise PlanReplayError(f"{report.replay_mismatch}, so its figures may be wrong; plan again without "
                              "replay (--no-replay, or replay=False)")
    return report


class _PlanRun:
    """One run of a script under plan: the fake mode, the measurements, and the reports of the
    option sets measured on its trace (see ``plan_script``)."""

    def __init__(self, world_size: int, options: dict | None, hardware: Hardware, replay: bool, next_options):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from zerocompile.graph_replay import GraphReplay

        self.world_size, self.hardware, self.next_options = world_size, hardware, next_options
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.replayer = GraphReplay() if replay else None
        self.measuring = contextlib.ExitStack()
        self.reports: list[PlanReport] = []
        self.start_step = 1
        """The script's optimizer step after which the current report's measured step begins."""
        self._new_report(options)
        self.tracker = self.timer = None

    def _new_report(self, options: dict | None) -> PlanReport:
        self.report = PlanReport(world_size=self.world_size, hardware=self.hardware,
                                 options=plan_options(options, self.hardware),
                                 gradient_reduction=gradient_reduction_line(options, self.hardware))
        self.reports.append(self.report)
        self._started = time.perf_counter()
        return self.report

    def run(self, script: Path, script_args: list, stdout) -> None:
        from zerocompile.backend import overriding_options
        from zerocompile.script_runner import run_script

        @contextlib.contextmanager
        def around():
            with self.fake_mode, ScalarReadsAreZero(), StepWatcher(self.on_step), \
                    (self.replayer if self.replayer is not None else contextlib.nullcontext()), \
                    contextlib.redirect_stdout(stdout or sys.stdout):
                try:
                    yield
                finally:
                    self.measuring.close()       # the modes pushed at the first step, innermost first

        # the backend compiles every frame with plan's options
        with overriding_options(self.report.options):
            exit_code = run_script(Path(script).resolve(), script_args, {}, self.world_size, around=around(),
                                   stop=PlanFinished)
        for report in self.reports:
            report.exit_code = exit_code
        last = self.report
        if last.measured_step == 0 and last.error is None:
            self._finish(last)
            if len(self.reports) > 1 and self.next_options is not None:
                self.next_options(last)      # the script ended before this report's step

    def on_step(self, step: int) -> None:
        report = self.report
        report.steps_seen = step - self.start_step + 1
        if step == self.start_step:
            self._start_measuring()
            return
        _record(report, self.tracker, self.timer, 2)
        self.measuring.close()
        self._finish(report)
        if self.next_options is None:
            raise PlanFinished
        while True:
            options = self.next_options(report)
            if options is None:
                raise PlanFinished
            report = self._new_report(options)
            try:
                self._switch(report.options)
            except (ZeroConfigError, ValueError, RuntimeError) as exc:
                report.error = str(exc)
                self._finish(report)
                continue
            break
        self.start_step = step
        report.steps_seen = 1
        self._start_measuring()

    def _switch(self, options: dict) -> None:
        """Recompile every frame with ``options`` (measurements off: compiling is not the step)."""
        from zerocompile.backend import recompile_with_overriding_options

        recompile_with_overriding_options(options)

    def _start_measuring(self) -> None:
        # the tracker and the timer watch the measured step only (they would slow the first,
        # which compiles, for nothing): every fake tensor alive now is recorded first (after a
        # collection: what a compile left in reference cycles is not alive)
        gc.collect()
        # incremental peak: the resizes of a step are ops the tracker sees (resize_storage_bytes_)
        self.tracker = LiveStorageTracker(track_inputs=True, fake_mode=self.fake_mode)
        hardware = self.hardware
        self.timer = StepTimer(CostModel.from_rates(hardware.cost_model()), self.world_size,
                               hardware.intra_node_gbps * 1e9)
        track_live_tensors(self.tracker, self.fake_mode)
        self.timer.node_local_groups = node_local_groups(hardware, self.report.options)
        self.measuring.enter_context(self.tracker)
        self.measuring.enter_context(self.timer)
        self.tracker.reset_peak()
        sessions.reset_stats()
        if self.replayer is not None:
            self.replayer.start_measuring(self.tracker, self.timer)

    def _finish(self, report: PlanReport) -> None:
        report.wall_s = time.perf_counter() - self._started
        if self.replayer is not None:
            report.graph_runs = {"executed": self.replayer.executed, "replayed": self.replayer.replayed}
            report.replay_mismatch = self.replayer.mismatch


def unmeasured_reason(report: PlanReport, script: Path) -> str:
    """Why ``report`` (a first plan of ``script``) has no measured step."""
    ran = {0: "ran no optimizer step", 1: "ran only one optimizer step"}[report.steps_seen]
    reason = f"exited with code {report.exit_code} after {report.steps_seen} optimizer step(s)" \
        if report.exit_code != 0 else ran
    return (f"{script} {reason}: plan measures the second training step (forward, backward and "
            "optimizer.step()); the first compiles. Let the script run two steps")


def node_local_groups(hardware: Hardware, options: dict) -> frozenset:
    """Names of the process groups the compiled graphs use whose ranks all share a node of
    ``hardware``: the world group when it fits in one node; hpZ's groups of ``k`` consecutive
    ranks when ``k`` divides the ranks per node (and qgZ's second-hop groups when the world
    fits in one node). Called after the first step compiled, so the groups exist."""
    from zerocompile.config import ZeroConfig
    from zerocompile.runtime import comm

    per_node = hardware.ranks_per_node
    if hardware.intra_node_gbps <= 0 or per_node <= 1:
        return frozenset()
    config = ZeroConfig.from_options(options)
    group = comm.resolve_group(config.sharding.process_group)
    world, k = group.world, config.passes.zero_hpz_partition_size
    names = set()
    fits = world <= per_node and per_node % world == 0
    if fits:
        names.add(group.name)
    if 1 < k < world and world % k == 0:
        if per_node % k == 0:
            names.add(comm.hpz_subgroup(group, k).name)
        if fits and config.passes.zero_quantized_gradients:
            names.add(comm.hpz_cross_subgroup(group, k).name)
    return frozenset(names)


def track_live_tensors(tracker: LiveStorageTracker, fake_mode=None) -> None:
    """Record the storage of every live tensor (parameters, shards, gradients, optimizer state,
    the script's own tensors) in ``tracker``: the fake tensors of ``fake_mode``, or with None the
    real ones (not on the meta device; ``zerocompile.measure``)."""
    for obj in gc.get_objects():
        # type(), not isinstance(): gc also holds weak proxies, which raise once their object is gone
        if issubclass(type(obj), torch.Tensor) and getattr(obj, "fake_mode", None) is fake_mode \
                and (fake_mode is not None or not obj.is_meta):
            tracker.track(obj)


def _record(report: PlanReport, tracker: LiveStorageTracker, timer: StepTimer, step: int) -> None:
    """The figures of the step that just ended."""
    stats = sessions.stats()
    report.measured_step = step
    report.peak_bytes = tracker.peak
    report.model_state_bytes = {
        "params": stats.param_bytes, "grads": stats.grad_bytes, "optimizer_state": stats.optimizer_state_bytes,
        "offloaded_optimizer_state": stats.offloaded_bytes, "offloaded_params": stats.offloaded_param_bytes}
    _record_unsharded(report)
    report.comm = {k: {"count": getattr(stats, k).count, "bytes": getattr(stats, k).bytes,
                       "wire_bytes": getattr(stats, k).wire_bytes} for k in accounting.COLLECTIVE_KINDS}
    report.compute_s, report.comm_s, report.step_s = timer.compute_s, timer.comm_s, timer.step_s
    states = {id(s): s for session in sessions.PROCESS.all() for s in list(session.states)}
    report.num_params = sum(s.numel for s in states.values())
    frames = sessions.frame_reports()
    report.frames = len(frames)
    report.stages = sorted({f["stage"] for f in frames})
    report.simulated_peak_bytes = max((f["results"].get("simulated_peak_bytes", 0) for f in frames), default=0)
    report.activations = _activations(frames)


def _activations(frames: list) -> dict:
    """``PlanReport.activations`` from the frames' pass results."""
    out = {"saved_bytes": 0, "offloaded_bytes": 0, "recompute": [], "offload": []}
    for frame in frames:
        results = frame["results"]
        out["saved_bytes"] += results.get("saved_activation_bytes", 0) or 0
        out["offloaded_bytes"] += (results.get("offload_activations") or {}).get("offloaded_bytes", 0)
        plan = results.get("plan_activations") or {}
        out["recompute"] += plan.get("recomputed", [])
        out["offload"] += plan.get("offloaded", [])
    return out


def activations_line(acts: dict, fmt_bytes) -> str | None:
    """One line on ``PlanReport.activations`` (what the frames save for backward, what is
    offloaded, what the activation planner chose), or None when nothing is offloaded or planned;
    ``fmt_bytes`` formats a byte count."""
    if not (acts.get("offloaded_bytes") or acts.get("recompute") or acts.get("offload")):
        return None
    line = (f"activations saved for backward: {fmt_bytes(acts.get('saved_bytes', 0))}, of which "
            f"{fmt_bytes(acts.get('offloaded_bytes', 0))} offloaded (offload_activations)")
    if acts.get("recompute") or acts.get("offload"):
        line += (f"; planner: recompute {', '.join(acts.get('recompute', [])) or 'none'}, "
                 f"offload {', '.join(acts.get('offload', [])) or 'none'}")
    return line


def _record_unsharded(report: PlanReport) -> None:
    """The parameters every rank keeps whole (no compiled frame used them), and their bytes
    and their gradients' added to the model state."""
    whole = {}
    for opt in list(sessions.PROCESS.optimizers):
        for name, p in opt.unsharded_parameters():
            whole.setdefault(id(p), (name, p))
    params = [p for _, p in whole.values()]
    report.unsharded_params = {"count": len(params), "elements": sum(p.numel() for p in params),
                               "names": [name for name, _ in whole.values()]}
    report.model_state_bytes["params"] += sum(p.untyped_storage().nbytes() for p in params)
    report.model_state_bytes["grads"] += sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
