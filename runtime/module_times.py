"""The flops profiler's per-module latency (``flops_profiler`` option): the time each module's ops
took in the profiled step, measured in the compiled graphs.

``passes/lowerings/module_timers.py`` splits each final graph into segments, each a run of consecutive ops of
one module (the innermost module Dynamo recorded for the op, as ``passes/analyses/flop_count.py`` counts
its FLOPs), and puts a ``zerocompile::module_mark`` (``runtime/timer_ops.py``) at each
boundary. A mark stamps the time; the time from one mark to the next is the ending segment's,
added to its module. The first mark of a graph only starts the clock.

Marks stamp only in the profiled step: the ``ZeroOptimizer``'s monitor (``optim/monitoring.py``)
arms them after the step before it (a frame compiled with ``profile_step: 1`` arms them at once)
and disarms them after it; otherwise each returns at once. The host clock on the CPU; CUDA events on the
current stream for CUDA tensors, read when the report asks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class _Site:
    kind: str
    """``"forward"`` or ``"backward"``."""
    path: str | None
    """The module whose segment the mark ends; None: the graph's first mark."""
    cls: str = ""
    """That module's class name."""


class ModuleTimes:
    """One model's per-module latencies (its session's, ``runtime/session.py``). ``new_site``
    numbers a new mark site (unique in the process, so a mark finds its owner by it; by default
    numbered from 0 here)."""

    def __init__(self, new_site: Callable[[], int] | None = None) -> None:
        self.sites: dict[int, _Site] = {}
        self._new_site = new_site if new_site is not None else (lambda: len(self.sites))
        self.active = False
        """Whether the marks stamp: in the profiled step only (``arm``)."""
        self.steps_done = 0
        """Training steps ended so far (``ModelSession.end_step``: an optimizer step after compiled
        graphs ran, or a step of the same optimizer again; a second optimizer's step right after the
        first one ends no new step)."""
        self.last = None
        """The newest stamp of the graph running now."""
        self.seconds: dict = {}
        """``(kind, module path, class name)`` -> seconds in the profiled step."""
        self.pending: list = []
        """``((kind, path, class name), start event, end event)`` of CUDA-timed segments not yet read."""
        self.reported_at: int | None = None
        """``steps_done`` when a profile was last printed: the first of two optimizers ending that
        training step prints it, the second does not."""

    def arm(self, on: bool) -> None:
        """Make the marks stamp from now on (the next step is a profiled one) or stop; a profiled
        step starts with no figures."""
        if on and not self.active:
            self.seconds, self.pending = {}, []
        self.active = on

    def step_ended(self) -> None:
        self.steps_done += 1
        self.last = None

    def site(self, kind: str, path: str | None, cls: str = "") -> int:
        index = self._new_site()
        self.sites[index] = _Site(kind, path, cls)
        return index

    def mark(self, index: int, device: torch.device) -> None:
        if not self.active:
            return
        if device.type == "cuda":
            stamp = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = time.perf_counter_ns()
        site = self.sites[index]
        if site.path is not None and self.last is not None:
            if isinstance(stamp, int):
                key = (site.kind, site.path, site.cls)
                self.seconds[key] = self.seconds.get(key, 0.0) + (stamp - self.last) / 1e9
            else:
                self.pending.append(((site.kind, site.path, site.cls), self.last, stamp))
        self.last = stamp

    def by_module(self) -> dict:
        """``{module path: {"forward": seconds, "backward": seconds, "type": class name}}`` of the
        profiled step."""
        for key, start, end in self.pending:
            end.synchronize()
            self.seconds[key] = self.seconds.get(key, 0.0) + start.elapsed_time(end) / 1e3
        self.pending = []
        out: dict = {}
        for (kind, path, cls), seconds in self.seconds.items():
            out.setdefault(path, {"forward": 0.0, "backward": 0.0, "type": cls})[kind] += seconds
        return out
