"""What a ``ZeroOptimizer`` writes to the monitors after each step (``zerocompile/monitor.py``).

The settings come from the ``monitor`` option of the frames that use the optimizer's
parameters (the first step that finds one turns monitoring on; frames that disagree are an
error). Rank 0 of the optimizer's group writes; at the first step every rank learns whether it
could (a broadcast), so a path it cannot write is one clear error on every rank, not a crash of
rank 0 and a hang of the others.

Tags (DeepSpeed's ``Train/Samples/...``), each step:

- ``lr`` (the first param group's; ``lr_group{i}`` for the others);
- ``grad_norm``: the global norm before clipping, in the steps that clipped (the
  ``gradient_clipping`` option or ``opt.clip_grad_norm_``);
- ``loss_scale`` and ``skipped_steps`` (so far) with loss scaling;
- ``step_time_ms``: wall time since the previous step ended (the first: since the optimizer
  was made, so it holds the first step's compile);
- ``comm_bytes_<kind>``: bytes each collective kind moved since the previous step (``stats()``);
- ``model_state_bytes``: parameters, gradients and optimizer state held (``stats()``);
- ``flops``, ``recompute_flops`` and ``achieved_tflops``: this rank's compiled graphs' FLOPs in the
  step (``stats().flops_per_step``, the recomputed share apart) and per second of ``step_time_ms``;
- ``compile_seconds``: in the steps where frames compiled, the seconds zerocompile spent on them
  (``stats().compile_seconds``);
- ``simulated_peak_bytes``: the largest transient peak the compiler simulated for the frames using
  this optimizer's parameters (their reports' ``simulated_peak_bytes``: what the compiled graphs
  hold at their fullest, beside the model state), on every device;
- ``cuda_peak_bytes``: ``torch.cuda.max_memory_allocated()`` on a CUDA device;
- the user's values from ``zerocompile.log_metrics``, as given (``train_loss`` becomes
  ``Train/Samples/train_loss``), each the mean over the ranks.
"""

from __future__ import annotations

import atexit
import logging
import time

import torch
import torch.distributed as dist

from zerocompile.errors import ZeroConfigError
from zerocompile.flops_profiler import FlopsProfilerSettings, report, step_modules, with_latency
from zerocompile.monitor import MetricWriter, MonitorSettings
from zerocompile.runtime import accounting, session as sessions
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.comm import agreement_digest, all_reduce, every_rank_holds

log = logging.getLogger("zerocompile")
TAG_PREFIX = "Train/Samples/"


def log_metrics(values: dict) -> None:
    """Add the user's figures to the monitors: each is reduced over the ranks (mean) and written
    with the figures of the next ``ZeroOptimizer.step()``; values given after the last step are
    written by ``close_monitors()`` (called on every rank), at the step after it, as the next step
    would have. Every rank must log the same names in a step. Values: numbers or one-element
    tensors (read when written, a host sync for a device tensor). Without an enabled monitor they
    are dropped (one warning); at exit, values ``close_monitors()`` did not write are dropped with
    a warning (exit handlers run no collectives)."""
    if not isinstance(values, dict):
        raise TypeError(f"zerocompile.log_metrics takes a dict of name -> number, got {type(values).__name__}")
    for name, value in values.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"zerocompile.log_metrics: metric names are non-empty strings, got {name!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"zerocompile.log_metrics: '{name}' is a tensor of {value.numel()} elements; "
                                 "give one number")
            value = value.detach()
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"zerocompile.log_metrics: '{name}' = {value!r}; give a number or a one-element tensor")
        PROCESS.pending_metrics[name] = value


def close_monitors() -> None:
    """Write the ``log_metrics`` values given since the last step (a collective: every rank calls
    it), then flush the monitors of every ``ZeroOptimizer`` alive, close their files and end the
    W&B runs and Comet experiments they started (done at exit otherwise, without those last values;
    a script that leaves with ``os._exit`` must call it). They write nothing more afterwards."""
    monitors = [m for m in (getattr(o, "_monitor", None) for o in list(PROCESS.optimizers)) if m is not None]
    for monitor in sorted(monitors, key=lambda m: m.settings is None):     # one that writes takes them
        monitor.write_pending()
    for monitor in monitors:
        monitor.close()


class StepMonitor:
    """The ``ZeroOptimizer``'s monitoring: ``after_step`` writes one step's figures."""

    def __init__(self, params_view, layout_group):
        self.params = params_view
        self._layout_group = layout_group
        self.settings: MonitorSettings | None = None
        self._writer: MetricWriter | None = None
        self._steps = 0
        self._last_end = time.monotonic()
        self._comm_before: dict | None = None
        self.grad_norm: torch.Tensor | None = None
        """The norm ``clip_grad_norm_`` returned in this step (None: no clipping)."""
        self._warned = False
        self._looked_through = 0
        """The compile order of the newest frame whose options were looked at."""
        self.profiler: FlopsProfilerSettings | None = None
        self._opened = False

    def _frames(self) -> list:
        """The compiled frames alive that use this optimizer's parameters (its model's session's)."""
        return self.params.session().frames_using(self.params.states())

    def after_step(self, optimizer) -> None:
        """Write this step's figures (rank 0), once a frame's options enable a monitor; print the
        flops profile at its step."""
        now = time.monotonic()
        elapsed_ms, self._last_end = (now - self._last_end) * 1e3, now
        grad_norm, self.grad_norm = self.grad_norm, None
        self._steps += 1
        newest = sessions.newest_frame_order()
        if newest != self._looked_through:       # a frame compiled since the last look
            self._looked_through = newest
            # the model's (every frame of a session has its options: ModelSession.check_model_options)
            session = self.params.session()
            options = session.config.observability if session is not None and session.config is not None else None
            if options is not None:
                self.settings = self.settings or options.monitor
                self.profiler = self.profiler or options.flops_profiler
        if self.profiler is not None:
            times = self.params.session().module_times
            if self._steps == self.profiler.profile_step and times.reported_at != times.steps_done:
                # this optimizer's profiled step just ended; with two optimizers (Muon and AdamW)
                # stepping in one training step, the first one reports it
                times.reported_at = times.steps_done
                self._profile(elapsed_ms)
            times.arm(self._steps + 1 == self.profiler.profile_step)
        if self.settings is None:
            self._drop_pending()
            return
        if not self._opened:
            self._open()
        group = self._layout_group()
        metrics = {f"{TAG_PREFIX}lr": float(optimizer.param_groups[0]["lr"])}
        for i, g in enumerate(optimizer.param_groups[1:], start=1):
            metrics[f"{TAG_PREFIX}lr_group{i}"] = float(g["lr"])
        if grad_norm is not None:
            metrics[f"{TAG_PREFIX}grad_norm"] = float(grad_norm)
        if optimizer.loss_scale is not None:
            metrics[f"{TAG_PREFIX}loss_scale"] = float(optimizer.loss_scale)
            metrics[f"{TAG_PREFIX}skipped_steps"] = float(optimizer.skipped_steps)
        metrics[f"{TAG_PREFIX}step_time_ms"] = elapsed_ms
        stats = sessions.snapshot([self.params.session()])      # this model's figures
        counters = {f"comm_bytes_{k}": getattr(stats, k).bytes
                    for k in accounting.COLLECTIVE_KINDS + accounting.COMPRESSED_KINDS}
        counters["compile_seconds"] = stats.compile_seconds
        before = self._comm_before or dict.fromkeys(counters, 0)
        for name, total in counters.items():
            # since the last step; a counter below its last value was reset (reset_stats) in between
            delta = total - before.get(name, 0) if total >= before.get(name, 0) else total
            if delta:
                metrics[f"{TAG_PREFIX}{name}"] = float(delta)
        self._comm_before = counters
        metrics[f"{TAG_PREFIX}model_state_bytes"] = float(stats.param_bytes + stats.grad_bytes
                                                          + stats.optimizer_state_bytes)
        if stats.flops_per_step:
            metrics[f"{TAG_PREFIX}flops"] = float(stats.flops_per_step)
            metrics[f"{TAG_PREFIX}recompute_flops"] = float(stats.recompute_flops_per_step)
            metrics[f"{TAG_PREFIX}achieved_tflops"] = stats.flops_per_step / max(elapsed_ms, 1e-9) / 1e9
        states = list(self.params.states())
        simulated = sessions.simulated_peak_bytes(states)
        if simulated:
            metrics[f"{TAG_PREFIX}simulated_peak_bytes"] = float(simulated)
        device = states[0].device if states else torch.device("cpu")     # the group's (NCCL: CUDA)
        if device.type == "cuda":
            metrics[f"{TAG_PREFIX}cuda_peak_bytes"] = float(torch.cuda.max_memory_allocated(device))
        metrics.update(self._user_metrics(group, device))
        if self._writer is not None:
            samples = self.settings.samples_per_step
            try:
                self._writer.write(metrics, self._steps * samples if samples else self._steps)
            except Exception as exc:     # a full disk, or W&B / Comet raising their own errors
                # rank 0 alone writes: raising here would leave the other ranks waiting at the
                # next collective, so the monitor stops with an error in the log instead
                log.error("monitor: cannot write step %d's figures (%s); monitoring stops, training goes on",
                          self._steps, exc)
                self.close()

    def _profile(self, step_ms: float) -> None:
        """The flops profile of this step, printed (or written to ``output_file``) by rank 0."""
        if self._layout_group().rank != 0:
            return
        session = self.params.session()
        stats = sessions.snapshot([session])
        frames = self._frames()
        # the whole model's parameters: those of every frame, whichever optimizer holds them
        numels = {sp.name: sp.numel for runner in frames for sp in runner.plans if sp is not None}
        modules = with_latency(step_modules(frames, session.step_calls, session.step_eager_modules),
                               session.module_times.by_module())
        text = report(self.profiler, self._steps, self._layout_group().world, stats.flops_per_step,
                      stats.recompute_flops_per_step, step_ms, modules, numels)
        if self.profiler.output_file:
            try:
                with open(self.profiler.output_file, "w") as f:
                    f.write(text)
            except OSError as exc:
                log.warning("flops profiler: cannot write %s (%s); the profile follows", self.profiler.output_file, exc)
                print(text, end="", flush=True)
        else:
            print(text, end="", flush=True)

    def _open(self) -> None:
        """Rank 0 makes its writers; every rank learns whether it could (one broadcast)."""
        self._opened = True
        group = self._layout_group()
        error = None
        if group.rank == 0:
            try:
                self._writer = MetricWriter(self.settings)
            except (OSError, ZeroConfigError) as exc:
                error = str(exc)
        if group.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group.group, 0), group=group.group)
            error = box[0]
        if error is not None:
            settings, self.settings, self._opened = self.settings, None, False
            raise ZeroConfigError(f"ZeroOptimizer: the monitor cannot write ({settings}): {error}. Give an "
                                  "output_path this process can create and write, and for W&B and Comet their "
                                  "package and login (or their offline modes)")
        log.info("monitoring to %s", self.settings.describe())
        atexit.register(self._warn_dropped_at_exit)

    def _user_metrics(self, group, device: torch.device) -> dict:
        """``log_metrics``' values since the last step, each the mean over the ranks (collectives on
        ``device``)."""
        pending = dict(PROCESS.pending_metrics)
        PROCESS.pending_metrics.clear()
        names = sorted(pending)
        if group.world > 1:
            # one small all-gather of a digest of the names; their lists only to name a mismatch
            if not every_rank_holds(agreement_digest(names), group.world, group.name, device):
                everyone = [None] * group.world
                dist.all_gather_object(everyone, names, group=group.group)
                raise ValueError("zerocompile.log_metrics: the ranks logged different names in this step ("
                                 + "; ".join(f"rank {r}: {', '.join(n) or 'none'}" for r, n in enumerate(everyone))
                                 + "): log the same names on every rank")
        if not names:
            return {}
        values = torch.tensor([float(pending[n]) for n in names], dtype=torch.float64, device=device)
        if group.world > 1:         # watched, as every zerocompile collective of the step
            values = all_reduce(values, "sum", group.name) / group.world
        return {f"{TAG_PREFIX}{name}": float(v) for name, v in zip(names, values.tolist())}

    def write_pending(self) -> None:
        """``log_metrics``' values given since the last step, written at the next step's number
        (``close_monitors``); dropped with the usual warning without a monitor."""
        if not PROCESS.pending_metrics:
            return
        if self.settings is None or not self._opened:
            self._drop_pending()
            return
        states = list(self.params.states())
        metrics = self._user_metrics(self._layout_group(), states[0].device if states else torch.device("cpu"))
        if self._writer is not None and metrics:
            samples = self.settings.samples_per_step
            self._writer.write(metrics, (self._steps + 1) * samples if samples else self._steps + 1)

    def _warn_dropped_at_exit(self) -> None:
        if PROCESS.pending_metrics and self.settings is not None:
            log.warning("zerocompile.log_metrics: %d value(s) given after the last opt.step() (%s) were not written: "
                        "call zerocompile.close_monitors() on every rank at the end of training to write them",
                        len(PROCESS.pending_metrics), ", ".join(sorted(PROCESS.pending_metrics)))
            PROCESS.pending_metrics.clear()

    def _drop_pending(self) -> None:
        if PROCESS.pending_metrics and not self._warned:
            self._warned = True
            log.warning("zerocompile.log_metrics: no monitor is enabled, so the values are dropped; enable one "
                        "with the 'monitor' option or a DeepSpeed config's tensorboard, csv_monitor, wandb or "
                        "comet keys")
        PROCESS.pending_metrics.clear()

    def close(self) -> None:
        """Close the writers; the monitor writes nothing more (its figures are still gathered on
        every rank: a rank that stopped alone must not skip the collectives the others make)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
