"""The flops profiler: DeepSpeed's ``flops_profiler`` key (or the option of that name) makes rank 0
print, after the ``profile_step``-th ``ZeroOptimizer.step()``, what the compiled graphs ran in that
step: FLOPs in all and per module (by torch's ``FlopCounterMode`` formulas, ``passes/flop_count.py``),
parameters per module, the step's latency, the achieved FLOP/s and, with ``peak_tflops``, the
model FLOPs utilization. ``zerocompile/optim/monitoring.py`` calls ``report``.

Keys: ``enabled`` (false), ``profile_step`` (1), ``module_depth`` (-1: every depth),
``top_modules`` (1: modules listed per depth in the aggregated profile), ``detailed`` (true: the
table of every module), ``output_file`` (None: stdout), and zerocompile's ``peak_tflops`` (a
rank's peak TFLOP/s, for the MFU line).

Module paths are relative to the module of the compiled frame that ran the op (the model, for a
model compiled whole). Per-module latency is not measured: a compiled graph runs many modules'
ops as one (fused, reordered, overlapped with communication), so only the step's is.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerocompile.errors import ZeroConfigError

__all__ = ["FlopsProfilerSettings", "parse_flops_profiler", "step_modules", "report"]

_KEYS = ("enabled", "profile_step", "module_depth", "top_modules", "detailed", "output_file", "peak_tflops")


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
    peak = value.get("peak_tflops")
    if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0):
        raise ZeroConfigError(f"flops_profiler 'peak_tflops' = {peak!r} is invalid; give a number > 0")
    if not value.get("enabled", False):
        return None
    return FlopsProfilerSettings(**{k: value[k] for k in ints if value.get(k) is not None},
                                 detailed=value.get("detailed", True), output_file=out,
                                 peak_tflops=None if peak is None else float(peak))


def step_modules(frames: list, step_calls: dict) -> dict:
    """``{module path: {"forward", "backward", "type"}}``: each frame's per-module FLOPs times
    its forward and backward runs in the step (``step_calls``, by frame order)."""
    modules: dict = {}
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


def report(settings: FlopsProfilerSettings, step: int, world: int, flops: int, recompute: int, step_ms: float,
           modules: dict, param_numels: dict) -> str:
    """The profile's text (DeepSpeed's sections: summary, aggregated per depth, detailed)."""
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
    # every module's FLOPs and those of the modules under it
    rolled: dict = {}
    for path, m in modules.items():
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            rolled[prefix] = rolled.get(prefix, 0) + m["forward"] + m["backward"]
    depths = sorted({0 if not p else p.count(".") + 1 for p in rolled})
    if settings.module_depth >= 0:
        depths = [d for d in depths if d <= settings.module_depth]
    lines += ["", "aggregated profile per depth".center(100), rule,
              f"top {settings.top_modules} module(s) by FLOPs at each depth (share of the step's module FLOPs)"]
    for depth in depths:
        at = sorted(((p, f) for p, f in rolled.items() if (0 if not p else p.count(".") + 1) == depth),
                    key=lambda pf: -pf[1])[:settings.top_modules]
        lines.append(f"depth {depth}: " + ", ".join(f"{p or '(frame)'} {_num(f, 'FLOPs')} ({100 * f / total:.1f}%)"
                                                   for p, f in at))
    if settings.detailed:
        lines += ["", "detailed profile per module".center(100), rule,
                  f"{'module':<40}{'type':<16}{'params':>12}{'forward FLOPs':>18}{'backward FLOPs':>18}{'share':>9}"]
        for path in sorted(modules):
            if settings.module_depth >= 0 and (path.count(".") + 1 if path else 0) > settings.module_depth:
                continue
            m = modules[path]
            lines.append(f"{path or '(frame)':<40}{m['type'][:15]:<16}{_num(_params_of(path, param_numels)):>12}"
                         f"{_num(m['forward']):>18}{_num(m['backward']):>18}"
                         f"{100 * (m['forward'] + m['backward']) / total:>8.1f}%")
    lines += [rule, "per-module latency is not measured: a compiled graph runs many modules' ops as one "
              "(fused, reordered, overlapped); the step's latency is", rule]
    return "\n".join(lines) + "\n"
