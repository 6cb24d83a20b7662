"""``zerocompile tune``: search backend options for an N-rank job with ``zerocompile plan``'s
simulation, from one process on this machine.

Each *experiment* plans the unmodified script at the target world size with one set of
options, as ``zerocompile plan`` does. Its figures are the plan's: the peak live bytes per rank
and the estimated step time at the hardware profile's rates. An experiment *fits* when its peak
is within the memory limit.

**Search.** A coordinate search guided by the figures, as DeepSpeed's autotuner walks its space:

1. the baseline: the script's own options (``--options`` merged over them);
2. the other ZeRO stages, except those whose model state alone (parameters, gradients and
   optimizer state, scaled from the baseline's by the ZeRO formulas) is over the limit;
3. around the best experiment so far (the fastest that fits; while none fits, the one with the
   lowest peak), one knob at a time, in the order ``neighbours`` gives: the micro-batch size
   (when the script takes it from its arguments, below), ``reshard_after_forward``,
   ``prefetch_mb``, ``bucket_mb``, ``unshard_budget_mb``, ``recompute``, activation offload,
   the hpZ group size and qwZ / qgZ where the world spans nodes (they round the values they move,
   which the summary says; ``exact`` leaves them out), and optimizer offload only while nothing
   fits. The order follows the best experiment's figures: while it does not fit, the knobs that
   lower the peak come first; where its estimated communication outweighs its compute, those
   that move fewer bytes; else the micro-batch and the collectives' sizes. The selective-unshard
   budget tried is 90% of the headroom the best's peak leaves, shared among the step's calls of
   the compiled frames.

It stops after ``patience`` experiments in a row that do not improve the best by ``min_gain``
(0.5%; 5 experiments, as DeepSpeed) or ``max_experiments`` (50), or when no neighbour is left
untried. The stage sweep is never cut short.

**Micro-batch size.** A script exposes it through its arguments: the placeholders
``{micro_batch}`` and ``{grad_accum}`` in ``ARGS`` are replaced by each experiment's values. The
baseline is ``micro_batch`` x ``grad_accum`` samples per rank per optimizer step; the search keeps
that product (so every experiment trains the same global batch) and tries twice and half the best
experiment's micro-batch where they divide it. With a known batch the summary gives samples per
second (and tokens per second with ``tokens_per_sample``, the sequence length).

**Cost.** Experiments that differ in pass options only (``config.PASS_OPTIONS``) share one trace
of the script: ``zerocompile.plan_worker`` keeps a script running under plan, and each such
experiment recompiles the frames' passes over their traced graphs and measures one more step
(the figures are a fresh plan's). A new stage or micro-batch starts a new trace. ``--no-reuse``
plans each experiment in a fresh process. ``--jobs`` experiments run at once.

Not simulated: optimizer offload (plan refuses it, its state moves with real I/O). Its rows are
derived from the experiment they offload from: the optimizer state leaves the model state and the
peak (times ``ratio``), and the step gains the time to read and write it at ``offload_gbps``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from zerocompile.config import ZeroConfig, parse_option
from zerocompile.errors import ZeroConfigError
from zerocompile.plan import Hardware, activations_line

_MiB = 2**20
PLACEHOLDERS = ("{micro_batch}", "{grad_accum}")
QUANTIZING = ("zero_quantized_weights", "zero_quantized_gradients")
"""Options that round the values they move: a tuned configuration with them trains other numbers."""


@dataclass
class Experiment:
    """One planned configuration and its figures."""

    name: str
    """Short and unique, from what differs from the baseline (``z3_bucket50``)."""
    options: dict
    """The backend options planned (the baseline's with the overrides)."""
    overrides: dict = field(default_factory=dict)
    """What differs from the baseline's options (and micro-batch)."""
    micro_batch: int | None = None
    grad_accum: int | None = None
    report: dict | None = None
    """``zerocompile plan --json``'s object, or None on an error."""
    error: str | None = None
    derived_from: str | None = None
    """For a derived row (optimizer offload): the experiment its figures are derived from."""
    verdict: str = ""
    """``"best"``, or why it lost: ``"memory: ..."``, ``"time: ..."``, ``"error: ..."``."""
    measured: dict | None = None
    """``--verify``: the real run's ``step_ms`` and ``peak_bytes`` on this machine."""

    @property
    def peak_bytes(self) -> int | None:
        return None if self.report is None else int(self.report["peak_bytes_per_rank"])

    @property
    def step_ms(self) -> float | None:
        return None if self.report is None else float(self.report["estimated_step_s"]) * 1e3

    def fits(self, limit_bytes: float) -> bool:
        return self.report is not None and self.peak_bytes <= limit_bytes

    def samples_per_s(self, world_size: int) -> float | None:
        if self.report is None or self.micro_batch is None or not self.step_ms:
            return None
        return self.micro_batch * (self.grad_accum or 1) * world_size / (self.step_ms / 1e3)

    def summary(self, world_size: int, tokens_per_sample: int | None = None) -> dict:
        samples = self.samples_per_s(world_size)
        return {"name": self.name, "options": self.options, "overrides": self.overrides,
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "estimated_step_ms": self.step_ms, "peak_bytes_per_rank": self.peak_bytes,
                "samples_per_s": samples,
                "tokens_per_s": samples * tokens_per_sample if samples is not None and tokens_per_sample else None,
                "verdict": self.verdict, "error": self.error,
                "derived_from": self.derived_from, "measured": self.measured,
                "trace": (self.report or {}).get("trace") if self.derived_from is None else None,
                "activations": (self.report or {}).get("activations")}


@dataclass
class TuneSettings:
    world_size: int
    hardware: Hardware
    memory_limit_bytes: float
    base_options: dict
    micro_batch: int | None = None
    """The baseline micro-batch size, when the script's arguments hold ``{micro_batch}``."""
    grad_accum: int | None = None
    patience: int = 5
    max_experiments: int = 50
    exact: bool = False
    """Leave out what rounds the values it moves (qwZ, qgZ): every candidate trains the baseline's numbers."""
    min_gain: float = 0.005
    """A new best must be this much faster to count as progress (early stopping)."""
    nvme_path: str = "/local_nvme"
    """Where a tuned activation offload would put its files (plan writes none)."""
    tokens_per_sample: int | None = None
    """Tokens in one sample (the sequence length), for tokens per second beside samples."""


# ----------------------------------------------------------------------------- naming
_SHORT = {"stage": "z", "bucket_mb": "bucket", "prefetch_mb": "prefetch", "unshard_budget_mb": "unshard",
          "reshard_after_forward": "reshard", "recompute": "rc", "offload_activations": "actoff",
          "offload_optimizer": "optoff", "zero_hpz_partition_size": "hpz", "zero_quantized_weights": "qwz",
          "zero_quantized_gradients": "qgz", "memory_limit_mb": "", "micro_batch": "mb", "grad_accum": "gas"}


def experiment_name(overrides: dict) -> str:
    """``baseline`` or the overrides, short: ``z3_bucket50_mb2_gas4``."""
    parts = []
    for key, value in overrides.items():
        short = _SHORT.get(key, key)
        if not short:
            continue
        if isinstance(value, bool):
            value = int(value)
        elif isinstance(value, dict):
            value = value.get("budget_mb", value.get("memory_budget_mb", value.get("ratio", value.get("device", ""))))
        elif isinstance(value, float) and value.is_integer():
            value = int(value)
        parts.append(f"{short}{value}")
    name = "_".join(parts) or "baseline"
    return re.sub(r"[^A-Za-z0-9_.-]", "", name)


# ----------------------------------------------------------------------------- the space
def model_state_by_stage(report: dict, world: int) -> dict:
    """Model state bytes per rank at each stage 0-3, scaled by the ZeRO formulas from the
    baseline's (its stage shards parameters at 3, gradients at 2-3, optimizer state at 1-3)."""
    stage = (report.get("stages") or [3])[0]
    kinds = report.get("model_state_bytes_by_kind", {})
    full = {"params": kinds.get("params", 0) * (world if stage == 3 else 1),
            "grads": kinds.get("grads", 0) * (world if stage >= 2 else 1),
            "optimizer_state": kinds.get("optimizer_state", 0) * (world if stage >= 1 else 1)}
    return {s: (full["params"] / (world if s == 3 else 1) + full["grads"] / (world if s >= 2 else 1)
                + full["optimizer_state"] / (world if s >= 1 else 1)) for s in range(4)}


def _halve_double(value: float, low: float, high: float) -> list:
    return [v for v in (value / 2, value * 2) if low <= v <= high]


def calls_per_step(report: dict) -> float:
    """How many times a step calls a compiled frame (each layer of a model compiled block by block
    is one call), from plan's graph runs (a forward and a backward graph per call); the number
    of frames where plan did not count them."""
    runs = report.get("graph_runs") or {}
    total = runs.get("executed", 0) + runs.get("replayed", 0)
    steps = report.get("steps_seen") or 0
    frames = max(1, int(report.get("frames", 1) or 1))
    return max(frames, total / steps / 2) if total and steps else frames


def neighbours(best: Experiment, settings: TuneSettings) -> list[tuple[dict, int | None, int | None]]:
    """Candidates one knob away from ``best``: ``(options, micro_batch, grad_accum)``, most
    promising first by ``best``'s own figures: while it does not fit, the knobs that lower the
    peak; where its step is mostly communication, those that move fewer bytes (or move them
    faster); else the micro-batch size and the collectives' sizes first."""
    o = best.options
    report = best.report or {}
    stage = o.get("stage", (report.get("stages") or [3])[0])
    limit = settings.memory_limit_bytes
    memory: list = []            # lower the peak
    comm: list = []              # fewer or faster bytes
    shape: list = []             # micro-batch, bucket and prefetch sizes

    def option(change: dict, mb=None, gas=None):
        return ({**o, **change}, best.micro_batch if mb is None else mb, best.grad_accum if gas is None else gas)

    if best.micro_batch is not None:
        total = best.micro_batch * (best.grad_accum or 1)
        for mb in (best.micro_batch * 2, best.micro_batch // 2):
            if 1 <= mb <= total and total % mb == 0:
                shape.append(option({}, mb, total // mb))
    if stage == 3:
        for v in _halve_double(float(o.get("prefetch_mb", 50.0)), 6.25, 800):
            shape.append(option({"prefetch_mb": v}))
    if stage in (2, 3):
        for v in _halve_double(float(o.get("bucket_mb", 25.0)), 3.125, 400):
            shape.append(option({"bucket_mb": v}))
    # stage 3 keeps parameters gathered from forward to backward within the headroom the peak
    # leaves, shared among the compiled graphs' calls of a step (each call keeps up to the budget)
    headroom = limit - (best.peak_bytes or limit)
    if stage == 3 and headroom > 0 and o.get("unshard_budget_mb", 0.0) in (0, 0.0):
        comm.append(option({"unshard_budget_mb": round(0.9 * headroom / calls_per_step(report) / _MiB, 1)}))
    hpz = o.get("zero_hpz_partition_size", 1) > 1
    if stage == 3 and not hpz:         # hpZ partitions what the backward re-gathers: it needs resharding
        if o.get("reshard_after_forward", True):
            comm.append(option({"reshard_after_forward": False}))
        else:
            memory.append(option({"reshard_after_forward": True}))
    per_node = settings.hardware.ranks_per_node
    spans_nodes = settings.world_size > per_node > 1
    if spans_nodes and stage == 3 and not hpz and o.get("reshard_after_forward", True) \
            and settings.world_size % per_node == 0:
        comm.append(option({"zero_hpz_partition_size": per_node}))
    if spans_nodes and not settings.exact and stage == 3 and not o.get("zero_quantized_weights"):
        comm.append(option({"zero_quantized_weights": True}))
    if spans_nodes and not settings.exact and stage in (2, 3) and not o.get("zero_quantized_gradients"):
        comm.append(option({"zero_quantized_gradients": True}))
    recompute = o.get("recompute", "none")
    if recompute == "none":
        memory.append(option({"recompute": "full"}))
    elif recompute == "full":
        shape.append(option({"recompute": "none"}))
    if not o.get("offload_activations"):
        memory.append(option({"offload_activations": {"device": "nvme", "nvme_path": settings.nvme_path,
                                                      "budget_mb": "auto"},
                              "memory_limit_mb": round(limit / _MiB, 1)}))
    if best.report is not None and not best.fits(limit):
        return memory + shape + comm
    comm_bound = report.get("estimated_comm_s", 0) > report.get("estimated_compute_s", 0)
    return comm + shape + memory if comm_bound else shape + comm + memory


def derived_offload(source: Experiment, settings: TuneSettings, ratio: float = 1.0) -> Experiment:
    """Optimizer offload (``ratio`` of the state) derived from ``source``'s figures: its optimizer
    state leaves the model state and the peak; the step reads and writes it once at
    ``offload_gbps`` (and the updated parameters travel back)."""
    report = dict(source.report)
    kinds = dict(report.get("model_state_bytes_by_kind", {}))
    moved = kinds.get("optimizer_state", 0) * ratio
    kinds["optimizer_state"] = kinds.get("optimizer_state", 0) - moved
    kinds["offloaded_optimizer_state"] = kinds.get("offloaded_optimizer_state", 0) + moved
    extra_s = (2 * moved + kinds.get("params", 0) * ratio) / (settings.hardware.offload_gbps * 1e9)
    report.update(model_state_bytes_by_kind=kinds,
                  model_state_bytes_per_rank=report["model_state_bytes_per_rank"] - moved,
                  peak_bytes_per_rank=int(report["peak_bytes_per_rank"] - moved),
                  estimated_step_s=report["estimated_step_s"] + extra_s)
    overrides = {**source.overrides, "offload_optimizer": {"device": "nvme", "nvme_path": settings.nvme_path,
                                                           "ratio": ratio}}
    options = {**source.options, "offload_optimizer": overrides["offload_optimizer"]}
    return Experiment(name=experiment_name(overrides), options=options, overrides=overrides,
                      micro_batch=source.micro_batch, grad_accum=source.grad_accum, report=report,
                      derived_from=source.name)


# ----------------------------------------------------------------------------- the search
class Tuner:
    """Runs the search (see the module docstring). ``plan_one(options, micro_batch, grad_accum)``
    returns plan's JSON object or raises ``RuntimeError`` with plan's error; ``plan_many`` (optional)
    plans a list of candidates at once (``--jobs``) and returns one result or exception each."""

    def __init__(self, settings: TuneSettings, plan_one, plan_many=None, on_experiment=None):
        self.settings = settings
        self.plan_one = plan_one
        self.plan_many = plan_many
        self.on_experiment = on_experiment or (lambda e: None)
        self.experiments: list[Experiment] = []
        self.skipped: list[dict] = []
        """Candidates not planned, with why (a stage whose model state alone is over the limit)."""
        self._tried: set = set()

    # ------------------------------------------------------------------ ranking
    def _key(self, e: Experiment) -> tuple:
        limit = self.settings.memory_limit_bytes
        if e.report is None:
            return (2, math.inf, e.name)
        if not e.fits(limit):
            return (1, e.peak_bytes, e.name)
        return (0, e.step_ms, e.name)

    def _better(self, new: Experiment, old: Experiment) -> bool:
        """``new`` ranks above ``old`` by enough to count as progress: it fits where ``old`` does
        not, or, both fitting, is faster by ``min_gain`` (the search does not chase estimates that
        differ in the fourth digit); neither fitting, it has the lower peak."""
        a, b = self._key(new), self._key(old)
        if a[0] != b[0] or a[0] == 1:
            return a < b
        return a[0] == 0 and a[1] < b[1] * (1 - self.settings.min_gain)

    def best(self) -> Experiment | None:
        done = [e for e in self.experiments if e.report is not None]
        return min(done, key=self._key) if done else None

    def ranked(self) -> list[Experiment]:
        return sorted(self.experiments, key=self._key)

    # ------------------------------------------------------------------ running
    def _fingerprint(self, options: dict, mb, gas) -> str:
        # an option set to its default is the same experiment as one without it (bucket 50 halved is 25)
        given = {k: v for k, v in options.items() if not _is_default(k, v)}
        return json.dumps([given, mb, gas], sort_keys=True, default=str)

    def _plan(self, candidates: list) -> list[Experiment]:
        base = self.experiments[0].options if self.experiments else self.settings.base_options
        made = []
        for options, mb, gas in candidates:
            self._tried.add(self._fingerprint(options, mb, gas))
            overrides = {k: v for k, v in options.items() if base.get(k, _MISSING) != v}
            if self.experiments and mb is not None and (mb, gas) != (self.settings.micro_batch, self.settings.grad_accum):
                overrides.update(micro_batch=mb, grad_accum=gas)
            name = experiment_name(overrides) if self.experiments else "baseline"
            names = {e.name for e in self.experiments} | {e.name for e in made}
            while name in names:
                name += "_"
            made.append(Experiment(name=name, options=options, overrides=overrides, micro_batch=mb, grad_accum=gas))
        if self.plan_many is not None and len(made) > 1:
            results = self.plan_many([(e.options, e.micro_batch, e.grad_accum) for e in made])
        else:
            results = []
            for e in made:
                try:
                    results.append(self.plan_one(e.options, e.micro_batch, e.grad_accum))
                except RuntimeError as exc:
                    results.append(exc)
        for e, result in zip(made, results):
            if isinstance(result, BaseException):
                e.error = str(result)
            else:
                e.report = result
            self.experiments.append(e)
            self.on_experiment(e)
        return made

    def run(self, jobs: int = 1) -> list[Experiment]:
        s = self.settings
        baseline = self._plan([(dict(s.base_options), s.micro_batch, s.grad_accum)])[0]
        if baseline.report is None:
            raise RuntimeError(f"the baseline (the script's own options) could not be planned: {baseline.error}")
        states = model_state_by_stage(baseline.report, s.world_size)
        # the stage the script itself chose, where --options does not set it
        base_stage = s.base_options.get("stage", (baseline.report.get("stages") or [3])[0])
        stages = []
        for stage in (3, 2, 1, 0):
            if stage == base_stage:
                continue
            if states[stage] > s.memory_limit_bytes:
                self.skipped.append({"options": {"stage": stage}, "why": f"memory: its model state alone, "
                                     f"{size(states[stage])} per rank by the ZeRO formulas, is over the limit"})
                continue
            stages.append(({**s.base_options, "stage": stage}, s.micro_batch, s.grad_accum))
        best = self.best()
        stale = 0
        queue, sweeping = stages, True           # every stage first, then around the best
        while len(self.experiments) < s.max_experiments:
            if not queue:
                sweeping = False
                # a derived row (optimizer offload) is not planned: its neighbours are its source's
                anchor = next(e for e in self.experiments if e.name == best.derived_from) if best.derived_from \
                    else best
                pending = [c for c in neighbours(anchor, s) if self._fingerprint(*c) not in self._tried]
                if not best.fits(s.memory_limit_bytes) and not best.options.get("offload_optimizer") \
                        and best.derived_from is None:
                    derived = derived_offload(best, s)
                    if self._fingerprint(derived.options, derived.micro_batch, derived.grad_accum) not in self._tried:
                        self._tried.add(self._fingerprint(derived.options, derived.micro_batch, derived.grad_accum))
                        self.experiments.append(derived)
                        self.on_experiment(derived)
                if not pending:
                    break
                queue = pending
            batch, queue = queue[:max(1, jobs)], queue[max(1, jobs):]
            batch = batch[:s.max_experiments - len(self.experiments)]
            self._plan(batch)
            now = self.best()
            if self._better(now, best):
                best, stale = now, 0
                if not sweeping:
                    queue = []            # a new best: look around it next
            else:
                stale += len(batch)
                if stale >= s.patience and not sweeping:
                    break
        self._judge()
        return self.experiments

    def _judge(self) -> None:
        best = self.best()
        limit = self.settings.memory_limit_bytes
        for e in self.experiments:
            if e is best:
                e.verdict = "best" if e.fits(limit) else "best, but over the memory limit"
            elif e.report is None:
                e.verdict = f"error: {e.error}"
            elif not e.fits(limit):
                e.verdict = f"memory: peak {size(e.peak_bytes)} > limit {size(limit)}"
            elif best is not None and best.fits(limit):
                e.verdict = f"time: {ms(e.step_ms)} vs {ms(best.step_ms)} (x{e.step_ms / best.step_ms:.2f})"
            else:
                e.verdict = "fits"


_MISSING = object()
_DEFAULTS = ZeroConfig().flat()


def _is_default(name: str, value) -> bool:
    """Whether the option ``name`` = ``value`` is its default (parsed: ``"bf16"`` is ``"bfloat16"``)."""
    if name not in _DEFAULTS:
        return False
    try:
        return parse_option(name, value) == _DEFAULTS[name]
    except ZeroConfigError:
        return False


def size(nbytes: float) -> str:
    """Bytes as GiB from 1 GiB up, else MiB, two decimals."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def ms(milliseconds: float) -> str:
    """Milliseconds with a decimal from 10 ms up, three below."""
    return f"{milliseconds:.{1 if milliseconds >= 10 else 3}f} ms"


# ----------------------------------------------------------------------------- outputs
def substitute(script_args: list, micro_batch: int | None, grad_accum: int | None) -> list:
    """``script_args`` with ``{micro_batch}`` and ``{grad_accum}`` replaced."""
    out = []
    for a in script_args:
        if micro_batch is not None:
            a = a.replace("{micro_batch}", str(micro_batch))
        if grad_accum is not None:
            a = a.replace("{grad_accum}", str(grad_accum))
        out.append(a)
    return out


def deepspeed_config(options: dict, micro_batch: int | None = None, grad_accum: int | None = None) -> tuple[dict, list]:
    """A DeepSpeed config that zerocompile translates back into ``options``' ZeRO keys, and the
    option names DeepSpeed has no key for (they are in ``best_options.json`` only)."""
    zero: dict = {}
    ds: dict = {"zero_optimization": zero}
    left = []
    for key, value in options.items():
        if key == "stage":
            zero["stage"] = value
        elif key == "bucket_mb":
            elements = int(round(value * _MiB / 4))
            zero["reduce_bucket_size"] = zero["allgather_bucket_size"] = elements
        elif key == "prefetch":
            zero["overlap_comm"] = value
        elif key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size"):
            zero[key] = value
        elif key in ("offload_optimizer", "offload_param"):
            zero[key] = {k: v for k, v in value.items() if k != "ratio"} | (
                {"ratio": value["ratio"]} if "ratio" in value and key == "offload_optimizer" else {})
        elif key == "offload_activations" and isinstance(value, dict) and value.get("device") == "cpu" \
                and set(value) == {"device"}:
            ds["activation_checkpointing"] = {"cpu_checkpointing": True}
        elif key in ("inner_compiler", "cost_model"):
            continue
        else:
            left.append(key)
    if micro_batch is not None:
        ds["train_micro_batch_size_per_gpu"] = micro_batch
        ds["gradient_accumulation_steps"] = grad_accum or 1
    return ds, left


def write_results(out_dir: Path, tuner: Tuner, settings: TuneSettings, command: list,
                  traces: dict | None = None) -> dict:
    """``summary.txt``, ``experiments/<name>.json``, ``best_options.json``,
    ``ds_config_optimal.json`` and ``cmd_optimal.txt`` under ``out_dir`` (replacing an earlier
    tune's; other files there are left alone); returns the ``--json`` object (``best``,
    ``baseline``, ``experiments``). ``traces``: ``PlanWorkers``' counts (``made``, ``reused``,
    ``ran_out``), or None when every experiment ran in a fresh process."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "experiments").mkdir(exist_ok=True)
    for stale in (out_dir / "experiments").glob("*.json"):     # an earlier tune's experiments
        stale.unlink()
    world = settings.world_size
    tokens = settings.tokens_per_sample
    for e in tuner.experiments:
        (out_dir / "experiments" / f"{e.name}.json").write_text(json.dumps(
            {**e.summary(world, tokens), "report": e.report}, indent=2, default=str))
    best = tuner.best()
    baseline = tuner.experiments[0]
    clean = {k: v for k, v in best.options.items() if k not in ("inner_compiler", "cost_model")}
    (out_dir / "best_options.json").write_text(json.dumps(clean, indent=2) + "\n")
    ds, left = deepspeed_config(clean, best.micro_batch, best.grad_accum)
    (out_dir / "ds_config_optimal.json").write_text(json.dumps(ds, indent=2) + "\n")
    cmd = " ".join(command[:1] + substitute(command[1:], best.micro_batch, best.grad_accum))
    (out_dir / "cmd_optimal.txt").write_text(
        f"ZEROCOMPILE_OPTIONS='{json.dumps(clean)}' torchrun --nproc-per-node <GPUS> {cmd}\n")
    (out_dir / "summary.txt").write_text(summary_text(tuner, settings, left, traces))
    return {"best": best.summary(world, tokens), "baseline": baseline.summary(world, tokens),
            "experiments": [e.summary(world, tokens) for e in tuner.ranked()], "skipped": tuner.skipped,
            "memory_limit_bytes": settings.memory_limit_bytes, "world_size": world,
            "hardware": dataclasses.asdict(settings.hardware), "out": str(out_dir), "traces": traces}


def _measured_text(measured: dict | None) -> str:
    if not measured:
        return ""
    if "error" in measured:
        return f"; --verify failed: {measured['error']}"
    return f"; measured {ms(measured['step_ms'])}, {size(measured['peak_bytes'])}"


def summary_text(tuner: Tuner, settings: TuneSettings, ds_left: list, traces: dict | None = None) -> str:
    limit = settings.memory_limit_bytes
    lines = [f"zerocompile tune: {settings.world_size} ranks, hardware {settings.hardware.name}, memory limit "
             f"{size(limit)} per rank", ""]
    header = f"{'experiment':<36} {'peak/rank':>11} {'est. step':>12} {'samples/s':>10} {'fits':>5}  verdict"
    lines += [header, "-" * len(header)]
    for e in tuner.ranked():
        peak = "-" if e.peak_bytes is None else size(e.peak_bytes)
        step = "-" if e.step_ms is None else ms(e.step_ms)
        sps = e.samples_per_s(settings.world_size)
        lines.append(f"{e.name:<36} {peak:>11} {step:>12} {'-' if sps is None else f'{sps:.1f}':>10} "
                     f"{'yes' if e.fits(limit) else 'no':>5}  {e.verdict}"
                     + (f" (derived from {e.derived_from})" if e.derived_from else "")
                     + _measured_text(e.measured))
    lines.append("")
    for e in tuner.experiments:
        lines.append(f"{e.name}: {json.dumps(e.overrides, default=str) if e.overrides else '(the script’s own options)'}")
    for s in tuner.skipped:
        lines.append(f"not planned: {json.dumps(s['options'])}: {s['why']}")
    best = tuner.best()
    lines += ["", f"best: {best.name} ({best.verdict})"]
    sps = best.samples_per_s(settings.world_size)
    if sps is not None:
        lines.append(f"best's throughput: {sps:.1f} samples/s"
                     + (f", {sps * settings.tokens_per_sample:,.0f} tokens/s" if settings.tokens_per_sample else "")
                     + f" over {settings.world_size} ranks (estimate)")
    line = activations_line((best.report or {}).get("activations") or {}, size)
    if line is not None:
        lines.append(f"best's {line}")
    if any(best.options.get(k) for k in QUANTIZING):
        lines.append("note: the best configuration quantizes what it moves (qwZ / qgZ): it trains other numbers "
                     "than the baseline (--exact leaves them out)")
        exact = [e for e in tuner.ranked() if e.fits(limit) and not any(e.options.get(k) for k in QUANTIZING)]
        if exact:
            lines.append(f"best without quantization: {exact[0].name} ({ms(exact[0].step_ms)}, "
                         f"x{exact[0].step_ms / best.step_ms:.2f} of the best)")
    if best.derived_from:
        lines.append(f"note: the best row is derived from {best.derived_from} (optimizer offload is not simulated)")
    if any(k in best.options for k in ("offload_activations", "offload_optimizer")):
        lines.append(f"note: set nvme_path (here {settings.nvme_path}) to a local disk of the training machines")
    planned = sum(e.derived_from is None for e in tuner.experiments)
    if traces is None:
        lines.append(f"traces: {planned} experiments, each traced in a fresh process (--no-reuse)")
    else:
        lines.append(f"traces: {planned} experiments on {traces['made']} traces of the script ({traces['reused']} "
                     "planned on a trace made for an earlier experiment: they differ from it in pass options only)")
        if traces["ran_out"]:
            lines.append(f"note: the script ran out of steps {traces['ran_out']} time(s) while its trace was "
                         "reused: give it more steps (e.g. --steps 100; tune stops it after its last experiment)")
    if ds_left:
        lines.append(f"ds_config_optimal.json has no DeepSpeed key for {', '.join(ds_left)}: pass those as options "
                     "(best_options.json)")
    return "\n".join(lines) + "\n"
