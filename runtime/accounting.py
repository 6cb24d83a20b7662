"""Communication and memory accounting behind ``zerocompile.stats()``.

Collectives inside compiled graphs are counted from the graphs themselves: when a
frame is compiled, its forward and backward graphs are summarised (count and
bytes of each collective); each run of the frame adds its forward summary and
each run of its backward adds the backward summary. Collectives the optimizer
issues in eager code are recorded where they are issued.

Bytes of a collective are the bytes of the *full* (unsharded, padded) buffer:
the output of an all-gather, the input of a reduce-scatter, the tensor of an
all-reduce. A ring algorithm over a group of ``g`` ranks sends and receives
``bytes * (g - 1) / g`` of it per rank (twice that for an all-reduce); ``wire_bytes`` sums
that figure over the collectives, each with its own group (with ZeRO++ hpZ and qgZ some run
over groups smaller than the world).

``stats()`` is process-wide by definition (like ``torch.cuda.memory_stats()``), so
the counters live in the one ``ACCOUNTING`` instance below; it holds only weak
references to the shard states and optimizers it measures.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from zerocompile.runtime import activation_offload
from zerocompile.runtime.collective_watch import CollectiveWatch
from zerocompile.runtime.comms_log import CommsLog
from zerocompile.runtime.module_times import ModuleTimes

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
COMPRESSED_KINDS = ("compressed_all_to_all", "compressed_all_gather")
"""Eager collectives of 1-bit Adam / 0/1 Adam's compressed all-reduce (runtime/compressed_allreduce.py):
packed signs and scales; never inside compiled graphs."""


@dataclass
class CollectiveTotals:
    """Number of collectives of one kind and the bytes of their full buffers."""

    count: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0
    """Bytes each rank sends for these collectives with ring algorithms, each over its own group."""

    def add(self, other: "CollectiveTotals", times: int = 1) -> None:
        self.count += other.count * times
        self.bytes += other.bytes * times
        self.wire_bytes += other.wire_bytes * times


def ring_wire_bytes(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends in a ring collective of ``kind`` over ``group_size`` ranks whose
    full buffer is ``nbytes`` (an all-reduce is a reduce-scatter and an all-gather). An
    all-to-all's ``nbytes`` is what the rank sends to the others already."""
    if group_size <= 1:
        return 0.0
    if kind == "all_to_all":
        return float(nbytes)
    return nbytes * (group_size - 1) / group_size * (2 if kind == "all_reduce" else 1)


@dataclass
class ZeroStats:
    """A snapshot returned by ``zerocompile.stats()`` (per rank)."""

    all_gather: CollectiveTotals
    reduce_scatter: CollectiveTotals
    all_reduce: CollectiveTotals
    world_size: int
    param_bytes: int
    """Bytes of parameter storage the runtime holds: replicas, master shards, live full parameters."""
    grad_bytes: int
    """Bytes of gradient storage alive on shards, replicas and parameters zerocompile manages."""
    optimizer_state_bytes: int
    """Bytes of optimizer state (all ZeroOptimizer instances alive in this process) held on the
    model's device; offloaded state is in ``offloaded_bytes``."""
    offloaded_bytes: int = 0
    """Bytes of optimizer state offloaded to host memory or swap files (``offload_optimizer``)."""
    offloaded_param_bytes: int = 0
    """Bytes of parameter shards held in files instead of ``param_bytes`` (``offload_param``)."""
    offload_buffer_bytes: int = 0
    """Bytes of the optimizer offload pipeline's host buffers (``offload_optimizer``), resident
    beside the model state and counted in none of the figures above."""
    shared_memory_bytes: int = 0
    """Bytes of the shared-memory segments this process maps for transfers between the ranks of
    one host (``"shared_memory"`` collectives, ``runtime/shared_memory.py``): ``world * 4 MiB``
    per process group that uses them. One segment per host, shared by its ranks (the host holds
    it once, not once per rank); counted in none of the figures above."""
    offloaded_activation_bytes: int = 0
    """Bytes of saved activations held out of memory now (``offload_activations``: in swap files or
    host memory, waiting for their backward); 0 between steps."""
    activation_buffer_bytes: int = 0
    """Bytes of the activation offload's staging buffers (``offload_activations``, ``"nvme"``), kept
    between steps and counted in none of the figures above."""
    all_to_all: CollectiveTotals = field(default_factory=CollectiveTotals)
    """All-to-alls the optimizer step issues (a whole-parameter optimizer's gradient pieces to each
    parameter's owner and the updated pieces back); ``bytes``: what this rank sends to the others."""
    compressed_all_to_all: CollectiveTotals = field(default_factory=CollectiveTotals)
    """1-bit Adam / 0/1 Adam: the all-to-alls of packed signs and scales (``COMPRESSED_KINDS``)."""
    compressed_all_gather: CollectiveTotals = field(default_factory=CollectiveTotals)
    """1-bit Adam / 0/1 Adam: the all-gathers of the servers' packed signs and scales."""
    flops_per_step: int = 0
    """FLOPs this rank's compiled graphs ran in the last ``ZeroOptimizer.step()``'s step (forward
    and backward of every frame call since the step before, by torch's ``FlopCounterMode``
    formulas), recomputed forward ops included; 0 before the first step."""
    recompute_flops_per_step: int = 0
    """The share of ``flops_per_step`` the backward spent recomputing forward ops."""
    compile_seconds: float = 0.0
    """Seconds zerocompile spent compiling frames since the last ``reset_stats()``: its passes,
    AOTAutograd and the inner compiler (Dynamo's tracing, before them, is not included)."""
    comm_latency: list = field(default_factory=list)
    """The comms logger's figures (``comms_logger`` option; empty when it is off): one dict per
    collective kind and message size, see ``runtime/comms_log.py``'s ``CommsLog.rows``."""

    @property
    def comm_bytes(self) -> int:
        return sum(getattr(self, k).bytes for k in COLLECTIVE_KINDS + COMPRESSED_KINDS)

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends with ring algorithms, each collective over its own group: an
        all-reduce counts twice (reduce-scatter + all-gather)."""
        return sum(getattr(self, k).wire_bytes for k in COLLECTIVE_KINDS + COMPRESSED_KINDS)

    def as_dict(self) -> dict:
        out = {k: {"count": getattr(self, k).count, "bytes": getattr(self, k).bytes,
                   "wire_bytes": getattr(self, k).wire_bytes}
               for k in COLLECTIVE_KINDS + COMPRESSED_KINDS}
        out.update(world_size=self.world_size, param_bytes=self.param_bytes,
                   grad_bytes=self.grad_bytes, optimizer_state_bytes=self.optimizer_state_bytes,
                   offloaded_bytes=self.offloaded_bytes, offloaded_param_bytes=self.offloaded_param_bytes,
                   offload_buffer_bytes=self.offload_buffer_bytes, shared_memory_bytes=self.shared_memory_bytes,
                   offloaded_activation_bytes=self.offloaded_activation_bytes,
                   activation_buffer_bytes=self.activation_buffer_bytes, flops_per_step=self.flops_per_step,
                   recompute_flops_per_step=self.recompute_flops_per_step, compile_seconds=self.compile_seconds,
                   comm_latency=[dict(row) for row in self.comm_latency])
        return out


@dataclass
class CollectiveSummary:
    """Collectives of one graph (or one eager operation), by kind, and in issue order."""

    totals: dict = field(default_factory=lambda: {k: CollectiveTotals() for k in COLLECTIVE_KINDS})
    sequence: list = field(default_factory=list)
    """``(kind, dtype, bytes)`` of each collective in the order the graph issues them."""

    def add(self, kind: str, nbytes: int, count: int = 1, dtype: str = "", group_size: int = 1) -> None:
        """``count`` collectives of ``kind`` over ``group_size`` ranks, ``nbytes`` in all."""
        self.totals[kind].count += count
        self.totals[kind].bytes += nbytes
        self.totals[kind].wire_bytes += ring_wire_bytes(kind, nbytes, group_size)
        self.sequence.extend([(kind, dtype, nbytes // count)] * count)

    def __str__(self) -> str:
        parts = [f"{k}={v.count}x/{v.bytes}B" for k, v in self.totals.items() if v.count]
        return ", ".join(parts) or "no collectives"


class Accounting:
    """Process-wide counters; see the module docstring."""

    def __init__(self) -> None:
        self.comm = {k: CollectiveTotals() for k in COLLECTIVE_KINDS + COMPRESSED_KINDS}
        self.world_size = 1
        self.states: "weakref.WeakSet" = weakref.WeakSet()
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self.frames: "weakref.WeakSet" = weakref.WeakSet()
        """Compiled frames alive (their reports: ``frame_reports()``)."""
        self.pending_metrics: dict = {}
        """``zerocompile.log_metrics``' values waiting for the next ``ZeroOptimizer.step()``."""
        self.channels: "weakref.WeakSet" = weakref.WeakSet()
        """Shared-memory channels alive (``runtime/shared_memory.py``): their segments' bytes."""
        self.flops = {"flops": 0, "recompute": 0}
        """FLOPs the compiled graphs ran since the last optimizer step ended."""
        self.step_flops = {"flops": 0, "recompute": 0}
        """The same, of the last step (``end_step_flops``)."""
        self.calls: dict = {}
        """Forward and backward runs per compiled frame (by ``FrameRunner.order``) since the last step."""
        self.eager_modules: dict = {}
        """FLOPs of eager code since the last step, ``{(module path, type): [forward, backward]}``
        (``runtime/eager_flops.py``); included in ``flops``."""
        self.step_eager_modules: dict = {}
        """The same, of the last step."""
        self.step_calls: dict = {}
        """The same, of the last step."""
        self.comms = CommsLog()
        """The comms logger's settings, call sites and timings (``comms_logger`` option)."""
        self.compile_seconds = 0.0
        """Seconds spent in ``compile_frame`` since the last reset."""
        self.last_stepped = 0
        """``id`` of the optimizer whose step ended last (``end_step_flops``)."""
        self.module_times = ModuleTimes()
        """The flops profiler's per-module latencies (``flops_profiler`` option)."""
        self.watch = CollectiveWatch()
        """The collective watchdog (``collective_timeout_s`` option): this rank's position."""
        self.watch.board.counts = self.calls_since_step

    def record(self, kind: str, nbytes: int, count: int = 1) -> None:
        """``count`` eager collectives of ``kind`` over the data-parallel group, ``nbytes`` in all."""
        self.comm[kind].count += count
        self.comm[kind].bytes += nbytes
        self.comm[kind].wire_bytes += ring_wire_bytes(kind, nbytes, self.world_size)
        self.comms.counted(kind, nbytes, self.world_size)

    def record_summary(self, summary: CollectiveSummary) -> None:
        for kind, tot in summary.totals.items():
            self.comm[kind].add(tot)

    def record_flops(self, flops: int, recompute: int = 0, frame: int | None = None, backward: bool = False) -> None:
        """A compiled graph's run: its FLOPs, of which ``recompute`` recomputed forward ops;
        ``frame`` (its ``FrameRunner.order``) counts the run among that frame's forward or
        backward runs of the step (the flops profiler's per-module figures)."""
        self.flops["flops"] += flops
        self.flops["recompute"] += recompute
        if frame is not None:
            self.calls.setdefault(frame, [0, 0])[int(backward)] += 1

    def record_eager_flops(self, module: tuple, flops: int, backward: bool) -> None:
        """FLOPs of an eager op (``runtime/eager_flops.py``) run for ``module`` (``(path, type)``),
        in its forward or its backward."""
        self.flops["flops"] += flops
        self.eager_modules.setdefault(module, [0, 0])[int(backward)] += flops

    def end_step_flops(self, optimizer: int = 0) -> None:
        """An optimizer step ended (``optimizer``: its ``id``): what ran since the last one is the
        step's. Another optimizer stepping right after (no compiled graph ran in between: Muon for
        the matrices and AdamW beside it) ends the same training step, which keeps its figures."""
        if not self.calls and optimizer != self.last_stepped:
            self.last_stepped = optimizer
            return
        self.last_stepped = optimizer
        self.step_flops, self.flops = self.flops, {"flops": 0, "recompute": 0}
        self.step_calls, self.calls = self.calls, {}
        self.step_eager_modules, self.eager_modules = self.eager_modules, {}
        self.module_times.step_ended()
        self.watch.step_ended()

    def calls_since_step(self) -> dict:
        """A copy of ``calls`` (read by the collective watchdog's responder thread)."""
        return self.calls.copy()

    def reset(self) -> None:
        self.comm = {k: CollectiveTotals() for k in COLLECTIVE_KINDS + COMPRESSED_KINDS}
        self.flops = {"flops": 0, "recompute": 0}
        self.step_flops = {"flops": 0, "recompute": 0}
        self.calls, self.step_calls = {}, {}
        self.eager_modules, self.step_eager_modules = {}, {}
        self.comms.reset()
        self.compile_seconds = 0.0

    def snapshot(self) -> ZeroStats:
        params: dict[int, int] = {}
        grads: dict[int, int] = {}
        offloaded_params = 0
        for state in list(self.states):
            p, g = state.storages()
            params.update(p)
            grads.update(g)
            if state.shard_file is not None:
                offloaded_params += state.shard_file.nbytes
        optimizers = list(self.optimizers)
        opt_bytes = sum(opt.state_bytes() for opt in optimizers)
        offloaded = sum(opt.offloaded_bytes() for opt in optimizers)
        buffers = sum(opt.offload_buffer_bytes() for opt in optimizers)
        return ZeroStats(
            **{k: CollectiveTotals(v.count, v.bytes, v.wire_bytes) for k, v in self.comm.items()},
            world_size=self.world_size,
            param_bytes=sum(params.values()),
            grad_bytes=sum(grads.values()),
            optimizer_state_bytes=opt_bytes,
            offloaded_bytes=offloaded,
            offloaded_param_bytes=offloaded_params,
            offload_buffer_bytes=buffers,
            shared_memory_bytes=sum(channel.nbytes for channel in list(self.channels)),
            offloaded_activation_bytes=sum(store.held_bytes() for store in activation_offload.stores.all()),
            activation_buffer_bytes=sum(store.buffer_bytes() for store in activation_offload.stores.all()),
            flops_per_step=self.step_flops["flops"],
            recompute_flops_per_step=self.step_flops["recompute"],
            compile_seconds=self.compile_seconds,
            comm_latency=self.comms.rows(),
        )


ACCOUNTING = Accounting()


def stats() -> ZeroStats:
    """Collectives since the last ``reset_stats()`` and bytes held now, for this rank."""
    return ACCOUNTING.snapshot()


def reset_stats() -> None:
    """Zero the collective counters (memory figures are always current)."""
    ACCOUNTING.reset()


def frame_reports() -> list[dict]:
    """What the pass pipeline decided for each compiled frame still alive in this process:
    ``{"frame", "compiled_at_ns" (``time.monotonic_ns()`` at compile), "stage", "results",
    "forward", "backward"}`` where ``results`` holds each
    pass's report (buckets formed, parameters kept gathered, blocks recomputed, bytes
    saved for backward...) and ``forward`` / ``backward`` the collectives per run."""
    out = []
    for runner in sorted(ACCOUNTING.frames, key=lambda r: r.order):
        out.append(runner.report())
    return out


def frame_roots() -> list:
    """The modules each compiled frame alive was reached from (``FrameRunner.roots``), frame
    by frame; a module several frames share comes once per frame."""
    return [root for runner in list(ACCOUNTING.frames) for root in runner.roots]


def newest_frame_order() -> int:
    """The compile order (``FrameRunner.order``) of the newest compiled frame alive, 0 if none."""
    return max((runner.order for runner in list(ACCOUNTING.frames)), default=0)


def simulated_peak_bytes(states) -> int:
    """The largest simulated transient peak of the compiled frames alive that use any of the
    shard states ``states`` (their reports' ``simulated_peak_bytes``), 0 if none."""
    ids = {id(sp) for sp in states}
    frames = [r for r in list(ACCOUNTING.frames) if any(id(sp) in ids for sp in r.plans if sp is not None)]
    return max((r.report()["results"].get("simulated_peak_bytes", 0) for r in frames), default=0)


def comm_counts() -> dict:
    """``{kind: (count, bytes)}`` of every collective kind counted so far (eager and graphs)."""
    return {k: (v.count, v.bytes) for k, v in ACCOUNTING.comm.items()}


def dump_roots() -> list:
    """The dump directories of the compiled frames alive (``options={"dump": DIR}`` or
    ``ZEROCOMPILE_DUMP``), each once."""
    return sorted({root for r in list(ACCOUNTING.frames) if (root := getattr(r, "dump_root", None))})
