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

This module holds the figures' types only; each model's counters are its session's
(``runtime/session.py``), and ``zerocompile.stats()`` sums the sessions of the process.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """A snapshot returned by ``zerocompile.stats()`` (per rank; every model of the process, or one)."""

    all_gather: CollectiveTotals
    reduce_scatter: CollectiveTotals
    all_reduce: CollectiveTotals
    world_size: int
    param_bytes: int
    """Bytes of parameter storage the runtime holds: replicas, master shards, live full parameters."""
    grad_bytes: int
    """Bytes of gradient storage alive on shards, replicas and parameters zerocompile manages."""
    optimizer_state_bytes: int
    """Bytes of optimizer state (the ZeroOptimizers of the models counted) held on the
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
