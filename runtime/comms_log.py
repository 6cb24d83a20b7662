"""The comms logger (DeepSpeed's ``comms_logger`` key, the ``comms_logger`` option): the
latency and bandwidth of each collective, by kind and message size.

Where it measures:

- **Collectives inside compiled graphs.** ``passes/lowerings/comm_timers.py`` puts a
  ``zerocompile::comm_timer_start`` right before each collective it profiles and a
  ``zerocompile::comm_timer_end`` right after the collective's last ``wait_tensor`` (the ops:
  ``runtime/timer_ops.py``). Each declares that it writes the tensors it is given (it writes
  nothing): the start the collective's input, the end the waited results. So no compiler moves the start after the collective or the end
  before the wait, and no dead-code elimination drops them.
- **The optimizer step's bucketed collectives** (``runtime/step_collectives.py``): from the moment
  each is counted in the accounting (right before it is issued) to the end of its wait.
- **A whole-parameter optimizer's all-to-alls** (``start_all_to_all`` to ``finish_all_to_all``, or
  to a wait right after the issue with ``blocking``).
- **Eager regions** (``runtime/eager_regions.py``: code Dynamo left to eager at stage 3): each
  module's forward gather with the ranks' position check before it (``eager forward gather``),
  its backward's gather (``eager backward gather``), the position check before a compiled frame
  run from eager code (``eager position check``), and the end-of-backward mask all-reduce and
  bucketed reduce-scatter of eager gradients (``eager gradients``), each from its count to its
  completion.
- **The step's scalar all-reduces** (the clipping norm and overflow check, ``optim/clipping.py``;
  the gradient-participation check, ``runtime/grad_participation.py``) the same way. The
  collectives of set-up checks (the fingerprint of each compiled frame, the rare second round of
  the participation check when ranks differ) and 1-bit Adam's compressed exchange are counted by
  ``stats()`` but not timed.

What "latency" means: with ``blocking`` (the default, as DeepSpeed's comms logger makes every
profiled op blocking) each collective's waits are moved right after it, so its latency is its
own: issue to completion, nothing overlapping it. With ``blocking: False`` the compiled schedule
is kept and the latency runs from the issue to the return of its wait, which includes whatever
computation the schedule overlaps with it (an upper bound of the collective's own time).

Timing: the host clock (``time.perf_counter_ns``) for CPU tensors, where a wait returns once the
collective is done; CUDA events on the current stream for CUDA tensors (the wait makes that
stream wait for the collective), read when the figures are asked for.

Bandwidths follow nccl-tests: ``algbw = size / latency`` with ``size`` the full buffer (what
``stats()`` counts: the gathered output, the reduce-scatter's input, the all-reduce's tensor), and
``busbw = algbw * factor``, ``factor`` ``(n - 1) / n`` for all-gather and reduce-scatter, ``2 (n - 1)
/ n`` for all-reduce, over the collective's group of ``n`` ranks; an all-to-all's size is what
this rank sends to the others (as ``stats()`` counts it), its factor 1.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from zerocompile.errors import ZeroConfigError

log = logging.getLogger("zerocompile")

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

_OP_NAMES = {
    # zerocompile's kinds, and the names DeepSpeed's ``prof_ops`` uses for the same collectives
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_base": "all_gather",
    "allgather_fn": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter", "reduce_scatter_fn": "reduce_scatter",
    "all_reduce": "all_reduce", "inference_all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
}


@dataclass(frozen=True)
class CommsLoggerSettings:
    """The parsed ``comms_logger`` option (DeepSpeed's sub-keys, plus ``blocking``)."""

    verbose: bool = False
    """Print every profiled collective as it completes (kind, site, size, latency, bandwidths) on
    rank 0, as DeepSpeed's verbose comms logger does. On CUDA this synchronizes at each one."""
    prof_all: bool = True
    """Profile every collective; False: only the kinds in ``prof_ops``."""
    prof_ops: tuple = ()
    """With ``prof_all`` False, the collectives to profile: zerocompile's kinds (``all_gather``,
    ``reduce_scatter``, ``all_reduce``, ``all_to_all``) or DeepSpeed's op names for them
    (``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ...)."""
    debug: bool = False
    """One row per call site as well as kind and size: the frame and the collective's role in it
    (``param_gather``, ``bucket_reduce_scatter``...) or the optimizer step."""
    blocking: bool = True
    """Make each profiled collective blocking (its waits moved right after it), so its latency is
    its own; False: keep the compiled schedule and time issue to wait, overlap included."""

    def profiles(self, kind: str) -> bool:
        return self.prof_all or kind in self.prof_ops


def parse_comms_logger(value) -> CommsLoggerSettings | None:
    """``value`` of the ``comms_logger`` option: None / False (off), True (on, defaults) or a dict
    of DeepSpeed's sub-keys (``enabled``, ``verbose``, ``prof_all``, ``prof_ops``, ``debug``) and
    ``blocking``; an already parsed ``CommsLoggerSettings`` is returned as is."""
    if value is None or value is False:
        return None
    if isinstance(value, CommsLoggerSettings):
        return value
    if value is True:
        return CommsLoggerSettings()
    if not isinstance(value, dict):
        raise ZeroConfigError(f"option 'comms_logger' = {value!r} is invalid: give True or a dict such as "
                              "{'enabled': True, 'verbose': False, 'prof_all': True, 'debug': False}")
    known = {"enabled", "verbose", "prof_all", "prof_ops", "debug", "blocking"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ZeroConfigError(f"comms_logger: unknown key(s) {unknown}; known: {sorted(known)}")
    for key in known - {"prof_ops"}:
        if key in value and not isinstance(value[key], bool):
            raise ZeroConfigError(f"comms_logger.{key} = {value[key]!r} is invalid; allowed: true, false")
    if not value.get("enabled", False):
        return None
    ops = value.get("prof_ops", [])
    if not isinstance(ops, (list, tuple)) or not all(isinstance(op, str) for op in ops):
        raise ZeroConfigError(f"comms_logger.prof_ops = {ops!r} is invalid: give a list of op names")
    bad = sorted(op for op in ops if op not in _OP_NAMES)
    if bad:
        raise ZeroConfigError(f"comms_logger.prof_ops: unknown op name(s) {bad}; known: {sorted(_OP_NAMES)}")
    prof_all = value.get("prof_all", True)
    if not prof_all and not ops:
        raise ZeroConfigError("comms_logger: prof_all is false and prof_ops is empty, so nothing would be "
                              "profiled; list the collectives in prof_ops (e.g. [\"all_gather\"]) or set "
                              "prof_all to true")
    return CommsLoggerSettings(verbose=value.get("verbose", False), prof_all=prof_all,
                               prof_ops=tuple(sorted({_OP_NAMES[op] for op in ops})),
                               debug=value.get("debug", False), blocking=value.get("blocking", True))


def bus_factor(kind: str, group_size: int) -> float:
    """nccl-tests' bus bandwidth factor of a collective of ``kind`` over ``group_size`` ranks, for
    the sizes ``stats()`` counts: an all-to-all's is already what this rank sends to the others
    (nccl-tests' ``size * (n - 1) / n``), so its bus bandwidth is its algorithmic one."""
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    return 2 * share if kind == "all_reduce" else 1.0 if kind == "all_to_all" else share


@dataclass
class _Site:
    kind: str
    group_size: int
    label: str
    out_factor: int
    """The full buffer's bytes over the bytes of the tensor the start op is given."""


def _stamp(device: torch.device):
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter_ns()


def _seconds(start, end) -> float:
    if isinstance(start, int):
        return (end - start) / 1e9
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class CommsLog:
    """One model's comms logger (its session's, ``runtime/session.py``): the call sites its
    compiled graphs registered, the collectives in flight and the latencies. ``new_site``
    numbers a new call site (unique in the process, so a timer op finds its log by it; by
    default numbered from 0 in this log)."""

    def __init__(self, new_site: Callable[[], int] | None = None) -> None:
        self.settings: CommsLoggerSettings | None = None
        """What the model's newest compiled frame asked for; None: off."""
        self.sites: dict[int, _Site] = {}
        self._new_site = new_site if new_site is not None else (lambda: len(self.sites))
        self.started: dict = {}
        """Site index -> (start stamp, bytes) of a graph collective in flight."""
        self.totals: dict = {}
        """``(kind, label, bytes, group_size)`` -> ``[count, seconds, min, max]`` of the collectives timed."""
        self.pending: list = []
        """``(kind, label, bytes, group_size, start event, end event)`` of CUDA-timed ones not yet read."""
        self._issued: list | None = None
        """While ``capturing``: the eager collectives counted, ``[kind, bytes, group_size, start, device]``."""
        self._device = torch.device("cpu")
        """While ``capturing``: the device their timings are taken on."""
        self.held: dict = {}
        """``id`` of an eager collective's result -> what ``capturing`` timed of it, until its wait."""

    def configure(self, settings: CommsLoggerSettings | None) -> None:
        if settings is not None and self.settings is not None and settings != self.settings:
            log.warning("comms_logger: a frame compiled with other comms_logger settings (%s) than the "
                        "ones in use (%s); the newest apply", settings, self.settings)
        if settings is not None:
            self.settings = settings

    def profiles(self, kind: str) -> bool:
        return self.settings is not None and self.settings.profiles(kind)

    # graph collectives (passes/lowerings/comm_timers.py)

    def site(self, kind: str, group_size: int, label: str, out_factor: int) -> int:
        index = self._new_site()
        self.sites[index] = _Site(kind, group_size, label, out_factor)
        return index

    def start(self, index: int, x: torch.Tensor) -> None:
        site = self.sites[index]
        self.started[index] = (_stamp(x.device), x.numel() * x.element_size() * site.out_factor)

    def end(self, index: int, device: torch.device) -> None:
        begun = self.started.pop(index, None)
        if begun is None:
            return
        site = self.sites[index]
        self._add(site.kind, site.label, begun[1], site.group_size, begun[0], _stamp(device))

    # eager collectives (counted with ``ModelSession.record`` right before they are issued)

    @contextlib.contextmanager
    def capturing(self, device: torch.device):
        """Inside the block, time each eager collective counted (``counted``, right before it is
        issued); yields the list they go to, for ``done`` once they were waited for. Empty
        without the comms logger."""
        issued: list = []
        if self.settings is not None:
            self._issued, self._device = issued, device
        try:
            yield issued
        finally:
            self._issued = None

    def counted(self, kind: str, nbytes: int, group_size: int) -> None:
        if self._issued is not None and self.profiles(kind):
            self._issued.append([kind, nbytes, group_size, _stamp(self._device), self._device])

    def hold(self, result: torch.Tensor, issued: list) -> None:
        """Keep ``issued`` until ``unhold(result)``: collectives waited for elsewhere."""
        if issued:
            self.held[id(result)] = issued

    def unhold(self, result: torch.Tensor) -> list:
        return self.held.pop(id(result), [])

    @contextlib.contextmanager
    def timed(self, device: torch.device, label: str):
        """Time the eager collectives counted inside the block, each until the block ends (for
        a block that waits for what it issues)."""
        with self.capturing(device) as issued:
            yield
        self.done(issued, label)

    def done(self, issued: list, label: str) -> None:
        """The collectives of ``issued`` (from ``capturing``) were waited for: their timings end now."""
        if not issued:
            return
        end = _stamp(issued[0][4])
        for kind, nbytes, group_size, start, _ in issued:
            self._add(kind, label, nbytes, group_size, start, end)

    def _add(self, kind, label, nbytes, group_size, start, end) -> None:
        if isinstance(start, int):
            self._fold(kind, label, nbytes, group_size, _seconds(start, end))
        else:
            self.pending.append((kind, label, nbytes, group_size, start, end))
            if len(self.pending) >= 1024:      # fold the finished ones: the list stays short
                self._resolve(wait=False)
        if self.settings is not None and self.settings.verbose:
            self._resolve(wait=True)
            seconds = _seconds(start, end)
            algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"comm op: {kind} | {label or '-'} | msg size: {nbytes} B | time: {seconds * 1e3:.3f} ms | "
                      f"algbw: {algbw:.3f} GB/s | busbw: {algbw * bus_factor(kind, group_size):.3f} GB/s", flush=True)

    def _fold(self, kind, label, nbytes, group_size, seconds: float) -> None:
        entry = self.totals.setdefault((kind, label, nbytes, group_size), [0, 0.0, float("inf"), 0.0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] = min(entry[2], seconds)
        entry[3] = max(entry[3], seconds)

    def _resolve(self, wait: bool) -> None:
        """Fold the CUDA-timed collectives whose end event completed (all of them with ``wait``)."""
        left = []
        for kind, label, nbytes, group_size, start, end in self.pending:
            if wait or end.query():
                self._fold(kind, label, nbytes, group_size, _seconds(start, end))
            else:
                left.append((kind, label, nbytes, group_size, start, end))
        self.pending = left

    # the figures

    def rows(self) -> list[dict]:
        """One row per kind and message size (and call site with ``debug``): ``kind``, ``site``
        (empty without ``debug``), ``group_size``, ``msg_bytes``, ``count``, ``total_ms``,
        ``avg_ms``, ``min_ms``, ``max_ms``, ``algbw_gbps`` and ``busbw_gbps`` (GB/s: the bytes of
        every call over their summed latency). CUDA timings are waited for."""
        self._resolve(wait=True)
        debug = self.settings is not None and self.settings.debug
        groups: dict = {}
        for (kind, label, nbytes, group_size), (count, total, low, high) in self.totals.items():
            entry = groups.setdefault((kind, label if debug else "", nbytes, group_size), [0, 0.0, float("inf"), 0.0])
            entry[0] += count
            entry[1] += total
            entry[2] = min(entry[2], low)
            entry[3] = max(entry[3], high)
        out = []
        for (kind, label, nbytes, group_size), (count, total, low, high) in sorted(groups.items()):
            algbw = nbytes * count / total / 1e9 if total > 0 else 0.0
            out.append({"kind": kind, "site": label, "group_size": group_size, "msg_bytes": nbytes,
                        "count": count, "total_ms": total * 1e3, "avg_ms": total * 1e3 / count,
                        "min_ms": low * 1e3, "max_ms": high * 1e3, "algbw_gbps": algbw,
                        "busbw_gbps": algbw * bus_factor(kind, group_size)})
        return out

    def reset(self) -> None:
        """Forget the timings (the sites and settings stay: the compiled graphs use them)."""
        self.totals, self.pending, self.started, self.held = {}, [], {}, {}
