"""Analysis: a cost model that weighs compute against communication.

- Compute: an op takes ``max(flops / flops_per_s, bytes touched / memory bytes_per_s)``;
  FLOPs come from ``torch.utils.flop_counter``'s formulas (matmuls, convolutions,
  attention), bytes touched are the op's inputs plus outputs. Views and collectives
  cost no compute.
- Communication: the alpha-beta model, ``alpha + wire bytes / bandwidth``, where wire
  bytes are what a ring algorithm sends per rank (``(N-1)/N`` of the full buffer;
  twice that for an all-reduce).

The rates come from the config (``cost_model={...}``) or from ``probe()``, which times
a matmul, a memory-bound op and two all-gathers on the parameters' device, then takes the
slowest rank's figures (an all-gather of every rank's figures, then their maximum), so
every rank holds the same model and makes the same decisions. The probe runs at the first
compile that needs it, once per process group and device in the process. On torch's fake process
group (``zerocompile dump --world-size N``) the communication rates keep their defaults.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from zerocompile.passes.graph_utils import COLLECTIVE_OPS, concrete_int, tensor_nbytes
from zerocompile.passes.analyses.liveness import is_view, tensors_of
from zerocompile.runtime.comm import CommGroup, all_gather_flat, is_fake_group

log = logging.getLogger("zerocompile")

DEFAULT_RATES = {"flops_per_s": 5e10, "alpha_us": 50.0, "bandwidth_gbps": 2.0, "memory_gbps": 10.0,
                 "offload_gbps": 1.0}


@dataclass(frozen=True)
class CostModel:
    """Rates of one rank (identical on every rank)."""

    flops_per_s: float = DEFAULT_RATES["flops_per_s"]
    """Floating-point operations per second of matmul-like ops."""
    alpha_s: float = DEFAULT_RATES["alpha_us"] * 1e-6
    """Latency of one collective, seconds."""
    bandwidth: float = DEFAULT_RATES["bandwidth_gbps"] * 1e9
    """Bytes per second one rank sends in a collective."""
    memory_bandwidth: float = DEFAULT_RATES["memory_gbps"] * 1e9
    """Bytes per second a memory-bound op reads and writes."""
    offload_bandwidth: float = DEFAULT_RATES["offload_gbps"] * 1e9
    """Bytes per second one rank writes to (or reads from) the tier activations are offloaded to
    (files under ``nvme_path``; the host link for ``"cpu"``)."""

    @classmethod
    def from_rates(cls, rates: dict) -> "CostModel":
        r = {**DEFAULT_RATES, **rates}
        return cls(flops_per_s=float(r["flops_per_s"]), alpha_s=float(r["alpha_us"]) * 1e-6,
                   bandwidth=float(r["bandwidth_gbps"]) * 1e9, memory_bandwidth=float(r["memory_gbps"]) * 1e9,
                   offload_bandwidth=float(r["offload_gbps"]) * 1e9)

    def as_dict(self) -> dict:
        return {"flops_per_s": self.flops_per_s, "alpha_us": self.alpha_s * 1e6,
                "bandwidth_gbps": self.bandwidth / 1e9, "memory_gbps": self.memory_bandwidth / 1e9,
                "offload_gbps": self.offload_bandwidth / 1e9}

    # -------------------------------------------------------------------- estimates
    def collective_time(self, kind: str, nbytes: int, world: int) -> float:
        """Seconds for one collective of ``kind`` over a full buffer of ``nbytes``."""
        if world <= 1:
            return 0.0
        wire = nbytes * (world - 1) / world * (2 if kind == "all_reduce" else 1)
        return self.alpha_s + wire / self.bandwidth

    def node_time(self, node: torch.fx.Node) -> float:
        """Estimated compute seconds of one graph node (0 for views, collectives, inputs)."""
        if node.op != "call_function" or node.target in COLLECTIVE_OPS or is_view(node):
            return 0.0
        flops = node_flops(node)
        moved = sum(tensor_nbytes(t) for a in node.all_input_nodes for t in tensors_of(a.meta.get("val")))
        moved += sum(tensor_nbytes(t) for t in tensors_of(node.meta.get("val")))
        return self.compute_time(flops, moved)

    def op_time(self, func, args, kwargs, out) -> float:
        """Estimated compute seconds of one dispatched op on (fake or real) tensors, as
        ``node_time`` estimates a node: its FLOPs, or the bytes of its tensor arguments and
        outputs, whichever takes longer (``zerocompile plan`` times a whole step this way)."""
        flops = op_flops(func, args, kwargs, out)
        moved = sum(tensor_nbytes(t) for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor))
        return self.compute_time(flops, moved)

    def compute_time(self, flops: int, moved_bytes: int) -> float:
        return max(flops / self.flops_per_s, moved_bytes / self.memory_bandwidth)

    def offload_time(self, nbytes: int) -> float:
        """Estimated seconds to copy one saved tensor of ``nbytes`` out to the offload tier (reading
        it back takes as long)."""
        return nbytes / self.offload_bandwidth


def node_flops(node: torch.fx.Node) -> int:
    """FLOPs of a node by ``torch.utils.flop_counter``'s formulas (0 for ops without one)."""

    def val(a):
        if isinstance(a, torch.fx.Node):
            return a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a

    return op_flops(node.target, val(node.args), {k: val(v) for k, v in node.kwargs.items()},
                    node.meta.get("val"))


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of op ``func`` applied to ``args`` / ``kwargs`` giving ``out`` (tensors, fake
    tensors or their metadata), by ``torch.utils.flop_counter``'s formulas; 0 without one."""
    packet = getattr(func, "overloadpacket", None)
    if packet not in flop_registry:
        return 0
    try:
        flops = flop_registry[packet](*args, **kwargs, out_val=out)
        return concrete_int(flops)  # symbolic shapes: their hints, without guarding on them
    except Exception:  # noqa: BLE001 - a formula that cannot read symbolic shapes: no estimate
        return 0


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a timing must not end before it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe(group: CommGroup, device=None, repeats: int = 3) -> CostModel:
    """Measure the rates on ``device`` (the parameters' device; default CPU); every rank
    returns the slowest rank's figures."""
    device = torch.device(device or "cpu")
    n = 1024 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device)
    best_mm = best_copy = float("inf")
    big = torch.randn(1 << 22, device=device)
    for _ in range(repeats + 1):  # the first round warms up
        synchronize(device)
        t0 = time.perf_counter()
        a @ a
        synchronize(device)
        best_mm = min(best_mm, time.perf_counter() - t0)
        t0 = time.perf_counter()
        big.clone()
        synchronize(device)
        best_copy = min(best_copy, time.perf_counter() - t0)
    flops_per_s = 2 * n**3 / max(best_mm, 1e-9)
    memory_bandwidth = 2 * big.numel() * 4 / max(best_copy, 1e-9)
    alpha, bandwidth = DEFAULT_RATES["alpha_us"] * 1e-6, DEFAULT_RATES["bandwidth_gbps"] * 1e9
    if group.world > 1 and not is_fake_group(group):
        small_n, large_n = 256, 1 << 18  # elements per rank
        times = []
        for numel in (small_n, large_n):
            x = torch.zeros(numel, device=device)
            all_gather_flat(x, group.world, group.name)  # warm-up
            best = float("inf")
            for _ in range(repeats):
                synchronize(device)
                t0 = time.perf_counter()
                all_gather_flat(x, group.world, group.name)
                synchronize(device)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
        frac = (group.world - 1) / group.world
        wire = [n * 4 * group.world * frac for n in (small_n, large_n)]
        beta = max((times[1] - times[0]) / (wire[1] - wire[0]), 1e-12)
        bandwidth = 1.0 / beta
        alpha = max(times[0] - wire[0] * beta, 1e-7)
    # the slowest rank's figures, on every rank: MAX of the times, i.e. of the inverse rates
    mine = torch.tensor([1 / flops_per_s, alpha, 1 / bandwidth, 1 / memory_bandwidth], dtype=torch.float64,
                        device=device)
    if group.world > 1 and not is_fake_group(group):
        worst = all_gather_flat(mine, group.world, group.name).view(group.world, -1).amax(0).cpu()
    else:
        worst = mine
    inv_flops, alpha, inv_bw, inv_mem = worst.tolist()
    return CostModel(flops_per_s=1 / inv_flops, alpha_s=alpha, bandwidth=1 / inv_bw, memory_bandwidth=1 / inv_mem)


def cost_model_for(config_value, group: CommGroup, device=None) -> CostModel:
    """The cost model the config asks for: probed on ``device`` (``"probe"``) or from the
    given rates. A probe runs once per process group and device in the process (``_probed``)."""
    if config_value == "probe":
        if device is not None and torch.device(device).type == "meta":
            log.info("cost model: the parameters are on the meta device, where nothing can be timed; "
                     "the default rates are used (set the cost_model option to give others)")
            return CostModel()
        return _probed(group, str(torch.device(device or "cpu")))
    return CostModel.from_rates(config_value)


@functools.cache
def _probed(group: CommGroup, device: str) -> CostModel:
    """``probe(group, device)``, once per group (keyed by its ``ProcessGroup`` object: a group
    destroyed and made anew is probed anew) and device for the process's life. Each compile
    used to probe (a matmul, 16 MiB allocated and copied, two all-gathers, timed 4 times): about
    a tenth of a second of every frame's compile, for rates that do not change between frames.
    Every rank compiles the same frames in the same order, so every rank probes (a collective)
    at the same first compile and none later; a frame compiled on some ranks only does not
    probe."""
    return probe(group, device)


PROBE_BYTES = 32 << 20
"""Bytes one rank writes and reads back to time the activation offload tier."""


def probe_offload(cost: CostModel, group: CommGroup, settings, device=None) -> CostModel:
    """``cost`` with ``offload_bandwidth`` measured where ``settings`` (the ``offload_activations``
    settings) sends activations: ``PROBE_BYTES`` written to a file under ``nvme_path`` and read
    back (every rank at once, so ranks that share a disk share it here too), or copied to host
    memory and back for a CUDA model with ``"cpu"``. The slowest rank's rate, on every rank.
    Unchanged where nothing is offloaded or nothing can be timed (a fake process group)."""
    import dataclasses

    device = torch.device(device or "cpu")
    if not settings.enabled or is_fake_group(group) or device.type == "meta":
        return cost
    if settings.device != "nvme" and device.type != "cuda":
        return cost                                   # "cpu" for a CPU model: nothing moves
    rate = _offload_rate(group, str(device), settings.device, settings.nvme_path)
    return dataclasses.replace(cost, offload_bandwidth=rate)


@functools.cache
def _offload_rate(group: CommGroup, device: str, where: str, nvme_path: str | None) -> float:
    """The slowest rank's offload rate (bytes/s) to ``where``, measured once per group, device
    and path in the process (as ``_probed``): 32 MiB written and read back per compile before."""
    seconds = _time_file(nvme_path) if where == "nvme" else _time_host_link(torch.device(device))
    mine = torch.tensor([seconds], dtype=torch.float64, device=device)
    if group.world > 1:
        seconds = float(all_gather_flat(mine, group.world, group.name).max())
    rate = 2 * PROBE_BYTES / max(seconds, 1e-9)
    log.info("cost model: activations are offloaded at %.2f GB/s per rank (measured, %s)", rate / 1e9, where)
    return rate


def _time_file(nvme_path: str) -> float:
    """Seconds to write ``PROBE_BYTES`` to a swap file under ``nvme_path`` and read them back."""
    from zerocompile.runtime.swap_file import SwapFile, aligned_empty

    swap = SwapFile(nvme_path, "probe")
    try:
        buffer = aligned_empty(PROBE_BYTES, torch.uint8)
        buffer.fill_(1)
        swap.reserve(0, PROBE_BYTES)
        start = time.perf_counter()
        swap.write(0, buffer).wait()
        swap.read(0, buffer).wait()
        return time.perf_counter() - start
    finally:
        swap.close()


def _time_host_link(device: torch.device) -> float:
    """Seconds to copy ``PROBE_BYTES`` from ``device`` to page-locked host memory and back."""
    on_device = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
    host = torch.empty(PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    host.copy_(on_device)                              # warm-up
    synchronize(device)
    start = time.perf_counter()
    host.copy_(on_device, non_blocking=True)
    on_device.copy_(host, non_blocking=True)
    synchronize(device)
    return time.perf_counter() - start
