"""What Python's garbage collector costs a compile, with zerocompile's pause (as shipped,
``zerocompile/collection_pause.py``) and without it, in fresh processes taking turns.

    python benchmarks/compile_collection.py [--rounds 3] [--layers 4] [--inner-compiler eager] [--quick]

Each process builds an HF Llama (``--layers`` decoder layers of width 32), compiles it whole with
``backend="zero"`` at stage 3 (rank 0 of torch's fake process group of 2 ranks, so that one
process compiles what a rank compiles) and trains 3 steps; then it resets Dynamo and does the
same again: the first run pays the imports a compile makes lazily, the second is a compile in
a process that has made them (a test suite's later tests, ``plan``'s and ``tune``'s later
experiments). "pause off" runs the same code with the pause replaced by a null context in that
process. Reported per system: the median over rounds of each run's wall time, of the
collector's time in it (``gc.callbacks``) and of its full collections, and the ratio of the
pause's wall time to no pause's, each round's pair taken together (paired) and as medians, and
each process's peak RSS (what the garbage a paused compile keeps until it ends costs).
Both systems must end with the same losses bit for bit (the collector moves no value). Results:
``<out>/compile_collection.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_harness import prepare_main, result_header, write_results  # noqa: E402
from common import RESULTS  # noqa: E402

SYSTEMS = ("pause on", "pause off")
RUNS = ("first run", "second run")


def train_llama_whole(layers: int, inner: str, steps: int = 3) -> list:
    """An HF Llama of ``layers`` decoder layers (width 32), compiled whole with ``backend="zero"`` at
    stage 3 and trained ``steps`` AdamW steps in this process (a process group must exist); the
    losses."""
    import torch
    import transformers

    import zerocompile

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": inner})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def child(pause: bool, layers: int, inner: str) -> dict:
    """In a fresh process: the two runs' wall times, collector times, full collections, losses."""
    import contextlib
    import gc
    import time

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerocompile import backend

    if not pause:
        backend.collection_paused = contextlib.nullcontext
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    record = {"seconds": 0.0, "full": 0, "started": 0.0}

    def on_collection(phase, info):
        if phase == "start":
            record["started"] = time.perf_counter()
        else:
            record["seconds"] += time.perf_counter() - record["started"]
            record["full"] += info["generation"] == 2

    gc.callbacks.append(on_collection)
    out = {}
    for run in RUNS:
        torch.compiler.reset()
        record.update(seconds=0.0, full=0)
        started = time.perf_counter()
        losses = train_llama_whole(layers, inner)
        out[run] = {"wall_s": time.perf_counter() - started, "gc_s": record["seconds"],
                    "full_collections": record["full"], "losses": losses}
    dist.destroy_process_group()
    import resource
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # KiB on Linux
    return out


def run_child(script: str, system: str, args, *extra: str) -> dict:
    """``script --child system --layers .. --inner-compiler .. *extra`` in a fresh process; the JSON
    object its last line prints."""
    done = subprocess.run([sys.executable, script, "--child", system, "--layers", str(args.layers),
                           "--inner-compiler", args.inner_compiler, *extra],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{system} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(system: str, args) -> dict:
    return run_child(__file__, system, args)


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="processes per system, the systems in turn")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--inner-compiler", choices=("eager", "inductor"), default="eager")
    p.add_argument("--quick", action="store_true", help="one round, 2 layers")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child == "pause on", args.layers, args.inner_compiler)))
        return 0
    if args.quick:
        args.rounds, args.layers = 1, 2
    prepare_main()
    rounds = []
    for r in range(args.rounds):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        rounds.append({system: measure(system, args) for system in order})
    systems = {}
    for system in SYSTEMS:
        systems[system] = {run: {key: statistics.median(rd[system][run][key] for rd in rounds)
                                 for key in ("wall_s", "gc_s", "full_collections")} for run in RUNS}
    for system in SYSTEMS:
        systems[system]["peak_rss_mb"] = statistics.median(rd[system]["peak_rss_mb"] for rd in rounds)
    same = all(rd["pause on"][run]["losses"] == rd["pause off"][run]["losses"] for rd in rounds for run in RUNS)
    lines = ["| run | system | wall s (median) | collector s | full collections | pause on / off (paired) |",
             "|---|---|---:|---:|---:|---:|"]
    ratios = {}
    for run in RUNS:
        on, off = systems["pause on"][run], systems["pause off"][run]
        paired = statistics.median(rd["pause on"][run]["wall_s"] / rd["pause off"][run]["wall_s"] for rd in rounds)
        ratios[run] = {"median": on["wall_s"] / off["wall_s"], "paired": paired}
        for system in SYSTEMS:
            e = systems[system][run]
            ratio = (f"x{ratios[run]['median']:.3f} (x{paired:.3f})" if system == "pause on" else "")
            lines.append(f"| {run} | {system} | {e['wall_s']:.2f} | {e['gc_s']:.3f} | {e['full_collections']:g} | {ratio} |")
    lines += ["", f"- losses of the two systems bit for bit the same in every round: {same}",
              "- peak RSS of the process (median over rounds): " + ", ".join(
                  f"{system} {systems[system]['peak_rss_mb']:.0f} MB" for system in SYSTEMS)]
    print("\n".join(lines))
    result = {**result_header("compile_collection", args, argv), "systems": systems, "ratios": ratios,
              "rounds": rounds, "losses_equal": same}
    write_results(args.out, "compile_collection", result,
                  f"Python's garbage collector in a compile: HF Llama of {args.layers} layers compiled whole at "
                  f"stage 3 ({args.inner_compiler} inner compiler, rank 0 of 2, fake process group), 3 steps, "
                  f"twice per process (Dynamo reset between); {args.rounds} fresh processes per system, in turn",
                  lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
