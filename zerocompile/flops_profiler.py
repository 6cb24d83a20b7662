"""The flops profiler: DeepSpeed's ``flops_profiler`` key (or the option of that name) makes rank 0
print, after the ``profile_step``-th ``ZeroOptimizer.step()``, what the compiled graphs ran in that
step: FLOPs in all and per module (by torch's ``FlopCounterMode`` formulas, ``passes/analyses/flop_count.py``),
parameters per module, the step's latency, the achieved FLOP/s and, with ``peak_tflops``, the
model FLOPs utilization. ``zerocompile/optim/monitoring.py`` calls ``report``.

Keys: ``enabled`` (false), ``profile_step`` (1), ``module_depth`` (-1: every depth),
``top_modules`` (1: modules listed per depth in the aggregated profile), ``detailed`` (true: the
table of every module), ``output_file`` (None: stdout), and zerocompile's ``peak_tflops`` (a
rank's peak TFLOP/s, for the MFU line). DeepSpeed's ``recompute_fwd_factor`` is checked and not
used: the recomputed forward ops are counted from the compiled backward graphs.

Module paths are relative to the module of the compiled frame that ran the op (the model, for a
model compiled whole). Per-module latency is measured in the compiled graphs themselves: marks at
each module boundary stamp the time in the profiled step (``passes/lowerings/module_timers.py``,
``runtime/module_times.py``); a module's latency is that of its own ops (those of the modules
inside it are theirs). Inductor fuses ops of one module only with ops on the same side of a mark,
so with the profiler on a compiled graph can run a little slower, at every step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from zerocompile.errors import ZeroConfigError

log = logging.getLogger("zerocompile")

__all__ = ["FlopsProfilerSettings", "parse_flops_profiler", "step_modules", "with_latency", "report"]

_KEYS = ("enabled", "profile_step", "module_depth", "top_modules", "detailed", "output_file", "peak_tflops",
         "recompute_fwd_factor")


@dataclass(frozen=True)
class FlopsProfilerSettings:
    """What the flops profiler prints, and when (see the module docstring)."""

    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None
    peak_tflops: float | None = None


def parse_flops_profiler(value) -> FlopsProfilerSettings | None:
    """The ``flops_profiler`` option: None, a ``FlopsProfilerSettings``, or DeepSpeed's dict
    (None when ``enabled`` is false)."""
    if value is None or isinstance(value, FlopsProfilerSettings):
        return value
    if not isinstance(value, dict):
        raise ZeroConfigError(f"option 'flops_profiler' = {value!r} is invalid; give a dict such as "
                              "{'enabled': True, 'profile_step': 1}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ZeroConfigError(f"flops_profiler has unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_KEYS)}")
    for key in ("enabled", "detailed"):
        if key in value and not isinstance(value[key], bool):
            raise ZeroConfigError(f"flops_profiler '{key}' = {value[key]!r} is invalid; give true or false")
    ints = {"profile_step": 1, "module_depth": -1, "top_modules": 1}
    for key, low in ints.items():
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ZeroConfigError(f"flops_profiler '{key}' = {v!r} is invalid; give an integer >= {low}")
    out = value.get("output_file")
    if out is not None and not isinstance(out, str):
        raise ZeroConfigError(f"flops_profiler 'output_file' = {out!r} is invalid; give a path or null")
    factor = value.get("recompute_fwd_factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 0):
        raise ZeroConfigError(f"flops_profiler 'recompute_fwd_factor' = {factor!r} is invalid; give a number >= 0")
    if factor and value.get("enabled", False):
        # DeepSpeed estimates the recomputed forward FLOPs as this share of the forward's; zerocompile
        # counts them in the compiled backward graphs, so the estimate has nothing to add
        log.info("flops_profiler: recompute_fwd_factor %g is not used: the profile counts the forward ops the "
                 "backward recomputes from the compiled graphs ('recomputed forward ops')", factor)
    peak = value.get("peak_tflops")
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0):
        raise ZeroConfigError(f"flops_profiler 'peak_tflops' = {peak!r} is invalid; give a number > 0")
    if not value.get("enabled", False):
        return None
    return FlopsProfilerSettings(**{k: value[k] for k in ints if value.get(k) is not None},
                                 detailed=value.get("detailed", True), output_file=out,
                                 peak_tflops=None if peak is None else float(peak))


def step_modules(frames: list, step_calls: dict, eager: dict | None = None) -> dict:
    """``{module path: {"forward", "backward", "type"}}``: each frame's per-module FLOPs times
    its forward and backward runs in the step (``step_calls``, by frame order), plus the FLOPs
    eager code ran for each module (``eager``: ``{(path, type): [forward, backward]}``,
    ``runtime/eager_flops.py``)."""
    modules: dict = {}
    for (path, cls), (forward, backward) in (eager or {}).items():
        entry = modules.setdefault(path, {"forward": 0, "backward": 0, "type": cls})
        entry["forward"] += forward
        entry["backward"] += backward
    for runner in frames:
        forward_runs, backward_runs = step_calls.get(runner.order, (0, 0))
        by_module = runner.partitioner.ctx.results.get("flops_by_module") or {}
        for kind, runs in (("forward", forward_runs), ("backward", backward_runs)):
            for path, (flops, cls) in by_module.get(kind, {}).items():
                entry = modules.setdefault(path, {"forward": 0, "backward": 0, "type": cls})
                entry[kind] += flops * runs
    return modules


def _params_of(path: str, param_numels: dict) -> int:
    return sum(n for name, n in param_numels.items() if not path or name.startswith(path + "."))


def _num(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def with_latency(modules: dict, latency: dict) -> dict:
    """``step_modules``' figures with each module's ``forward_ms`` and ``backward_ms`` from
    ``latency`` (``ModuleTimes.by_module``: seconds); a module that ran no FLOPs joins with 0 FLOPs."""
    out = {path: {**m, "forward_ms": 0.0, "backward_ms": 0.0} for path, m in modules.items()}
    for path, t in latency.items():
        entry = out.setdefault(path, {"forward": 0, "backward": 0, "type": t["type"], "forward_ms": 0.0,
                                      "backward_ms": 0.0})
        entry["forward_ms"] += t["forward"] * 1e3
        entry["backward_ms"] += t["backward"] * 1e3
    return out


def _rolled(modules: dict, value) -> dict:
    """Every module's ``value(figures)`` summed with those of the modules under it."""
    out: dict = {}
    for path, m in modules.items():
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            out[prefix] = out.get(prefix, 0) + value(m)
    return out


def _depth(path: str) -> int:
    return 0 if not path else path.count(".") + 1


def report(settings: FlopsProfilerSettings, step: int, world: int, flops: int, recompute: int, step_ms: float,
           modules: dict, param_numels: dict) -> str:
    """The profile's text (DeepSpeed's sections: summary, aggregated per depth, detailed).
    ``modules``: ``with_latency``'s figures."""
    forward = sum(m["forward"] for m in modules.values())
    backward = sum(m["backward"] for m in modules.values())
    achieved = flops / max(step_ms, 1e-9) * 1e3
    rule = "-" * 100
    lines = [rule, "zerocompile flops profiler".center(100), rule,
             f"{'profile step:':<40}{step}",
             f"{'world size:':<40}{world}",
             f"{'parameters (whole model):':<40}{_num(sum(param_numels.values()))}",
             f"{'FLOPs of this rank in the step:':<40}{_num(flops, 'FLOPs')} (recomputed forward ops: "
             f"{_num(recompute, 'FLOPs')})",
             f"{'  by module, forward / backward:':<40}{_num(forward, 'FLOPs')} / {_num(backward, 'FLOPs')}",
             f"{'step latency:':<40}{step_ms:.2f} ms",
             f"{'achieved FLOP/s of this rank:':<40}{_num(achieved, 'FLOP/s')}"]
    if settings.peak_tflops:
        lines.append(f"{'model FLOPs utilization (MFU):':<40}{100 * achieved / (settings.peak_tflops * 1e12):.2f}% of "
                     f"{settings.peak_tflops:g} TFLOP/s")
    total = max(forward + backward, 1)
    rolled = _rolled(modules, lambda m: m["forward"] + m["backward"])
    rolled_ms = _rolled(modules, lambda m: m["forward_ms"] + m["backward_ms"])
    measured = sum(m["forward_ms"] + m["backward_ms"] for m in modules.values())
    lines.append(f"{'  by module, measured latency:':<40}{measured:.2f} ms (forward and backward graphs)")
    depths = sorted({_depth(p) for p in rolled})
    if settings.module_depth >= 0:
        depths = [d for d in depths if d <= settings.module_depth]
    lines += ["", "aggregated profile per depth".center(100), rule,
              f"top {settings.top_modules} module(s) at each depth by FLOPs (share of the step's module FLOPs) and "
              "by latency (forward + backward, the modules inside included)"]
    for depth in depths:
        at = sorted(((p, f) for p, f in rolled.items() if _depth(p) == depth), key=lambda pf: -pf[1])
        lines.append(f"depth {depth}: " + ", ".join(f"{p or '(frame)'} {_num(f, 'FLOPs')} ({100 * f / total:.1f}%)"
                                                   for p, f in at[:settings.top_modules]))
        slow = sorted(((p, t) for p, t in rolled_ms.items() if _depth(p) == depth), key=lambda pt: -pt[1])
        lines.append(f"{'':9}latency: " + ", ".join(f"{p or '(frame)'} {t:.2f} ms"
                                                  for p, t in slow[:settings.top_modules]))
    if settings.detailed:
        lines += ["", "detailed profile per module (its own ops; the modules inside it have their rows)".center(100),
                  rule, f"{'module':<36}{'type':<14}{'params':>10}{'fwd FLOPs':>12}{'bwd FLOPs':>12}{'share':>8}"
                  f"{'fwd ms':>9}{'bwd ms':>9}"]
        for path in sorted(modules):
            if settings.module_depth >= 0 and _depth(path) > settings.module_depth:
                continue
            m = modules[path]
            lines.append(f"{path or '(frame)':<36}{m['type'][:13]:<14}{_num(_params_of(path, param_numels)):>10}"
                         f"{_num(m['forward']):>12}{_num(m['backward']):>12}"
                         f"{100 * (m['forward'] + m['backward']) / total:>7.1f}%"
                         f"{m['forward_ms']:>9.2f}{m['backward_ms']:>9.2f}")
    lines += [rule, "latency: measured between marks at the module boundaries of the compiled graphs; "
              "collectives and waits count in the module they sit in", rule]
    return "\n".join(lines) + "\n"
