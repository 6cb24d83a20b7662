"""The first training step (compilation included) of zerocompile against plain ``torch.compile``
and DDP + ``torch.compile`` of the same model with the same inner compiler, on a cold compile
cache and on a restart that finds the cache warm, at several world sizes.

    python benchmarks/first_step.py [--workload gpt-4m] [--inner-compiler inductor]
                                    [--stages 1 2 3] [--world-sizes 2 8 64] [--quick]

Issue 28's targets: zerocompile's cold first step at most DDP + ``torch.compile``'s, and a restart
with the same inductor cache at most 0.3x its cold first step. Each figure is one fresh Python
process that builds the workload's model (``benchmarks/run.py``'s ``gpt-4m``, ``llama`` or
``gpt-tiny``) and times, from its ``torch.compile`` call (what that call does counts: plain
``torch.compile`` imports inductor there, the ``"zero"`` backend at its first compile), its
first forward, backward and optimizer step:

- **plain torch.compile**: ``torch.compile(model, backend=inductor | aot_eager)``, torch's AdamW,
  no process group;
- **DDP + torch.compile**: ``torch.compile(DistributedDataParallel(model))`` (Dynamo's
  DDPOptimizer splits the graph at DDP's buckets) as rank 0 of torch's fake process group of 2
  ranks, with DDP's no-op communication hook (the fake group's all-reduce returns nothing DDP
  can use), torch's AdamW;
- **zerocompile stage S, N ranks**: ``backend="zero"``, ``ZeroOptimizer(AdamW)``, as rank 0 of
  torch's fake process group (``torch.testing._internal.distributed.fake_pg``) of N ranks:
  every graph, pass and kernel is what rank 0 of a real N-rank job compiles, and the
  collectives return at once, so the time is compile time, and N can be 64 on one machine.

**Cold**: the process gets an empty ``TORCHINDUCTOR_CACHE_DIR`` (a user's first run on a new
model). **Warm**: a second fresh process with the same ``TORCHINDUCTOR_CACHE_DIR`` (a restart:
torch's FX-graph and AOTAutograd caches and zerocompile's entries beside them, see
docs/architecture.md "Compile caches"). zerocompile's C++ optimizer kernel is built (or found in
torch's extension cache) once before the timed runs: it is built once per machine, not per
model. After the first step each cold process times three more steps (the steady step on one
process; ``benchmarks/run.py`` times real multi-rank steps). Results: ``<out>/first_step.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
COLD_TARGET = 1.0
"""The largest cold first-step ratio to DDP + torch.compile that meets issue 28's target."""
WARM_TARGET = 0.3
"""The largest ratio of a restart's first step to the cold one that meets issue 28's target."""
PLAIN, DDP, TRACE = 0, -1, -2
"""``stage`` of the torch references (zerocompile rows carry their ZeRO stage, 1-3): plain
``torch.compile``, DDP + ``torch.compile``, and Dynamo's trace alone (``backend="eager"``: the
graph runs as traced, nothing compiled; what every backend's first step pays before its own work)."""


def system_name(stage: int) -> str:
    return {PLAIN: "plain torch.compile", DDP: "DDP + torch.compile",
            TRACE: "Dynamo's trace alone (backend=\"eager\")"}.get(stage, f"zerocompile stage {stage}")


def child(workload: str, inner: str, stage: int, world: int, layers: int | None = None,
          options: dict | None = None) -> dict:
    """One measurement, in this (fresh) process: ``stage`` PLAIN, DDP, TRACE or a ZeRO stage;
    ``layers``: the workload's model with that many blocks; ``options``: more backend options."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import load_example
    from run import make_model, workload_spec

    torch.set_num_threads(1)
    spec = workload_spec(workload, quick=False)
    if layers is not None:
        spec["n_layers"] = layers
    torch.manual_seed(0)
    model = make_model(spec, load_example())
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, spec["vocab"], (spec["batch"], spec["seq_len"]), generator=g) for _ in range(2))
    backend = "inductor" if inner == "inductor" else "aot_eager"
    if stage not in (PLAIN, TRACE):
        from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    if stage not in (PLAIN, DDP, TRACE):
        import zerocompile       # a script imports it at its top, as it imports torch
    # the timer starts before torch.compile: what torch.compile itself does (plain torch.compile
    # imports inductor there; the "zero" backend at its first compile) counts for every system
    start = time.perf_counter()
    if stage in (PLAIN, TRACE):
        compiled = torch.compile(model, backend=backend if stage == PLAIN else "eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif stage == DDP:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, noop_hook)
        compiled = torch.compile(ddp, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": inner,
                                                                 **(options or {})})
        opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-3)

    def step():
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    step()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(3):
        step()
    steady = (time.perf_counter() - start) / 3
    from torch._dynamo.utils import counters

    caches = {k: v for k, v in {**counters["aot_autograd"], **counters["inductor"]}.items()
              if "cache_hit" in k or "cache_miss" in k or "cache_bypass" in k}
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"stage": stage, "world_size": world if stage not in (PLAIN, TRACE) else 1, "first_step_s": first, "step_s": steady,
            "caches": caches}


def measure(args, stage: int, world: int, cache: str, layers: int | None = None, options: dict | None = None) -> dict:
    """Run ``child`` in a fresh process with the inductor cache ``cache``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", args.workload, args.inner_compiler,
                           str(stage), str(world), json.dumps(layers), json.dumps(options)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{system_name(stage)}, world size {world} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cold_and_warm(args, stage: int, world: int, layers: int | None = None, options: dict | None = None) -> dict:
    """The cold first step (an empty inductor cache), then the warm one (a second process, same cache)."""
    with tempfile.TemporaryDirectory(prefix="zerocompile-first-step-") as cache:
        row = measure(args, stage, world, cache, layers, options)
        warm = measure(args, stage, world, cache, layers, options)
    row["cold_caches"] = row.pop("caches")
    row["warm_first_step_s"] = warm["first_step_s"]
    row["warm_caches"] = warm["caches"]
    row["warm_ratio"] = warm["first_step_s"] / row["first_step_s"]
    return row


def _shown_path(path: Path) -> str:
    """``path`` relative to the checkout when inside it (the results name no local folder)."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def bytecode_cache_on() -> bool:
    """Whether processes started with this one's environment write and read ``.pyc`` files
    (``PYTHONDONTWRITEBYTECODE`` unset)."""
    return not os.environ.get("PYTHONDONTWRITEBYTECODE")


def bytecode_note() -> str:
    """Whether the timed processes (children of this one, with its environment) read and write
    Python's bytecode cache: with ``PYTHONDONTWRITEBYTECODE`` set no ``.pyc`` is written, and each
    process compiles every module it imports from source (torch, inductor, transformers: about
    6 s of CPU here), inside the first step that imports them. ``make bench`` writes the cache
    under the venv (``PYTHONPYCACHEPREFIX``, Makefile), as an ordinary install has it."""
    if not bytecode_cache_on():
        return ("Python's bytecode cache off (PYTHONDONTWRITEBYTECODE set): every process compiled the modules it "
                "imported from source, several seconds of each first step here; run through make bench for figures "
                "as an ordinary install has them")
    prefix = os.environ.get("PYTHONPYCACHEPREFIX")
    return "Python's bytecode cache on" + (f" (PYTHONPYCACHEPREFIX={_shown_path(Path(prefix))})" if prefix else "")


def prepare_bytecode(args, layers: int | None = None) -> str:
    """Where Python's bytecode cache is on, fill it before the timed runs: one untimed process of
    zerocompile stage 3 and one of DDP + ``torch.compile`` (each with a throwaway inductor cache)
    import what every timed process imports, so that no timed first step, the first one measured
    included, compiles modules from source (an installed package has its ``.pyc`` from the start;
    the Makefile's venv writes them on first import). Returns ``bytecode_note()`` saying so."""
    note = bytecode_note()
    if not bytecode_cache_on():
        return note
    start = time.perf_counter()
    for stage in (3, DDP):
        with tempfile.TemporaryDirectory(prefix="zerocompile-bytecode-") as cache:
            measure(args, stage, 2, cache, layers)
    return f"{note}, filled by two untimed processes first ({time.perf_counter() - start:.0f} s)"


def build_cpp_kernel() -> str:
    """Build (or load from torch's extension cache) the C++ optimizer kernel before any timing."""
    from zerocompile.runtime import cpu_extension

    start = time.perf_counter()
    module = cpu_extension.load("fused_adam")
    took = time.perf_counter() - start
    return (f"zerocompile's C++ optimizer kernel {'loaded' if module is not None else 'unavailable (torch kernels)'} "
            f"before the timed runs in {took:.1f} s (once per machine)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default="gpt-4m", choices=("gpt-4m", "llama", "gpt-tiny"),
                   help="benchmarks/run.py's workload")
    p.add_argument("--inner-compiler", default=None, choices=("inductor", "eager"),
                   help="inductor, or eager (aot_eager for the torch references); default inductor, eager with --quick")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=(1, 2, 3))
    p.add_argument("--world-sizes", type=int, nargs="+", default=None,
                   help="ranks of the fake process group; stage 3 runs at every size, stages 1-2 at the first "
                        "(default: 2 8 64; with --quick: 2 4)")
    p.add_argument("--quick", action="store_true", help="gpt-tiny, stage 3 only (at world sizes 2 and 4 unless "
                                                        "--world-sizes says otherwise), eager unless "
                                                        "--inner-compiler says otherwise")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for first_step.json and first_step.md")
    args = p.parse_args(argv)
    if args.quick:
        args.workload, args.stages = "gpt-tiny", [3]
        args.inner_compiler = args.inner_compiler or "eager"
    args.inner_compiler = args.inner_compiler or "inductor"
    if args.world_sizes is None:
        args.world_sizes = [2, 4] if args.quick else [2, 8, 64]
    if any(w < 1 for w in args.world_sizes):
        p.error("--world-sizes must be >= 1")
    return args


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        workload, inner, stage, world = sys.argv[2:6]
        layers, options = (json.loads(a) for a in (sys.argv[6:8] if len(sys.argv) > 7 else ("null", "null")))
        print(json.dumps(child(workload, inner, int(stage), int(world), layers, options)))
        return 0
    args = parse_args(argv)
    started = time.time()
    load_before = os.getloadavg()
    notes = [build_cpp_kernel(), prepare_bytecode(args)]
    rows = []
    plain = cold_and_warm(args, PLAIN, 1)
    ddp = cold_and_warm(args, DDP, 2)
    for ref in (plain, ddp):
        print(f"{system_name(ref['stage'])}: first step {ref['first_step_s']:.2f} s cold, "
              f"{ref['warm_first_step_s']:.2f} s warm (x{ref['warm_ratio']:.2f})", flush=True)
        rows.append(ref)
    for stage in sorted(args.stages):
        for world in (args.world_sizes if stage == 3 else args.world_sizes[:1]):
            row = cold_and_warm(args, stage, world)
            row["ratio"] = row["first_step_s"] / plain["first_step_s"]
            row["ddp_ratio"] = row["first_step_s"] / ddp["first_step_s"]
            rows.append(row)
            print(f"zerocompile stage {stage}, {world} ranks: first step {row['first_step_s']:.2f} s cold "
                  f"(x{row['ratio']:.2f} plain torch.compile, x{row['ddp_ratio']:.2f} DDP + torch.compile), "
                  f"{row['warm_first_step_s']:.2f} s warm (x{row['warm_ratio']:.2f})", flush=True)
    zero = [r for r in rows if r["stage"] > 0]
    worst = max(r["ratio"] for r in zero)
    worst_ddp = max(r["ddp_ratio"] for r in zero)
    worst_warm = max(r["warm_ratio"] for r in zero)
    stage3 = [r["first_step_s"] for r in zero if r["stage"] == 3]
    growth = max(stage3) / min(stage3) if stage3 else None
    lines = [f"# First step: zerocompile against plain torch.compile and DDP + torch.compile ({args.workload}, "
             f"inner compiler {args.inner_compiler}; cold and warm inductor cache)", "",
             "| system | ranks | cold first step s | × plain torch.compile | × DDP + torch.compile "
             "| warm first step s | warm / cold | steady step s (one process) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plain_ratio = r["first_step_s"] / plain["first_step_s"]
        ddp_ratio = r["first_step_s"] / ddp["first_step_s"]
        lines.append(f"| {system_name(r['stage'])} | {r['world_size']} | {r['first_step_s']:.2f} | ×{plain_ratio:.2f} "
                     f"| ×{ddp_ratio:.2f} | {r['warm_first_step_s']:.2f} | ×{r['warm_ratio']:.2f} | {r['step_s']:.3f} |")
    cold_verdict = "met" if worst_ddp <= COLD_TARGET else "missed"
    warm_verdict = "met" if worst_warm <= WARM_TARGET else "missed"
    notes += [f"target: every zerocompile cold first step at most ×{COLD_TARGET} DDP + torch.compile's: "
              f"{cold_verdict} (worst ×{worst_ddp:.2f}; worst ×{worst:.2f} plain torch.compile).",
              f"target: every zerocompile restart (warm cache) at most ×{WARM_TARGET} its cold first step: "
              f"{warm_verdict} (worst ×{worst_warm:.2f}).",
              "warm caches (zerocompile rows): " + "; ".join(
                  f"stage {r['stage']}/{r['world_size']}: " + (", ".join(f"{k} {v}" for k, v in sorted(
                      r["warm_caches"].items())) or "none used") for r in zero) + "."]
    if growth is not None and len(stage3) > 1:
        notes.append(f"stage 3 over world sizes {args.world_sizes}: slowest / fastest cold first step ×{growth:.2f}.")
    load_after = os.getloadavg()
    notes.append(f"{os.cpu_count()} CPUs, torch threads 1, one process per figure; load average (1 min) "
                 f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; wall time {time.time() - started:.0f} s.")
    md = "\n".join(lines) + "\n\n" + "\n".join("- " + n for n in notes) + "\n"
    print("\n" + md)
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_step.md").write_text(md)
    payload = {"benchmark": "first_step", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "config": {k: (_shown_path(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "load_average_before": load_before, "load_average_after": load_after},
        "rows": rows, "cold_target_ratio_ddp": COLD_TARGET, "warm_target_ratio": WARM_TARGET,
        "worst_ratio": worst, "worst_ratio_ddp": worst_ddp, "worst_warm_ratio": worst_warm,
        "stage3_growth": growth, "notes": notes}
    (args.out / "first_step.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
