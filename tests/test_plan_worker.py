"""Plan on one trace (``zerocompile.plan_worker``, ``FrameRunner.recompile``): option sets that
differ in pass options only, planned one after another on one trace of a script, give the
figures a fresh ``zerocompile plan`` of each gives, knob by knob, on an HF model with gradient
checkpointing and on a script with graph breaks and a frame run without autograd."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from dist_utils import run_cli, start_cli
from zerocompile.config import PASS_OPTIONS, ZeroConfig, options_needing_a_new_trace
from zerocompile.plan_worker import PlanWorker, PlanWorkers, trace_key

REPO = Path(__file__).resolve().parent.parent
LLAMA = REPO / "benchmarks" / "train_llama.py"
FIGURES = ("peak_bytes_per_rank", "estimated_step_s", "estimated_compute_s", "estimated_comm_s", "comm_by_kind",
           "model_state_bytes_by_kind", "simulated_peak_bytes", "activations", "num_params", "frames", "stages",
           "unsharded_params")


def _figures(report: dict) -> dict:
    return {k: report[k] for k in FIGURES}


def _fresh(world: int, candidates: list, script: Path, args: list, folder: Path) -> list:
    """A fresh ``zerocompile plan --json`` of each candidate, each in a process of its own (the
    arguments ``cli.plan.plan_in_subprocess`` gives ``python -m zerocompile``), forked from the
    fork server: torch, transformers and zerocompile imported, nothing planned, so as fresh as a
    new interpreter without the ~5 s of CPU of importing them again (``dist_utils.start_cli``)."""
    runs = []
    for i, options in enumerate(candidates):
        out, err = folder / f"fresh{i}.out", folder / f"fresh{i}.err"
        argv = ["plan", "--world-size", str(world), "--hardware", "h100", "--json", "--options", json.dumps(options),
                "--", str(script), *args]
        runs.append((start_cli(argv, out, err, REPO), out, err))
    reports = []
    for (run, out, err), options in zip(runs, candidates):
        run.join(timeout=600)
        assert run.exitcode == 0, (options, run.exitcode, err.read_text()[-3000:])
        reports.append(json.loads(out.read_text().splitlines()[0]))
    return reports


def test_every_tuned_knob_on_one_trace_gives_a_fresh_plans_figures(tmp_path):
    """The tiny HF Llama with ``gradient_checkpointing_enable()`` at 16 ranks of the h100 profile
    (two nodes, so hpZ over a node and qwZ/qgZ apply): the script's own options, then each knob
    ``zerocompile tune`` turns without a new trace, on one worker; every report equals a fresh plan."""
    args = ["--size", "tiny", "--layers", "2", "--seq", "32", "--steps", "20", "--checkpointing", "non_reentrant"]
    candidates = [{}, {"prefetch_mb": 6.25, "bucket_mb": 50.0, "unshard_budget_mb": 0.5},
                  {"reshard_after_forward": False, "recompute": "none"},
                  {"recompute": "none", "offload_activations": {"device": "nvme", "nvme_path": "/local_nvme", "min_kb": 0}},
                  {"zero_hpz_partition_size": 8, "zero_quantized_weights": True, "zero_quantized_gradients": True}]
    worker = PlanWorker(16, "h100", candidates[0], LLAMA, args)
    try:
        reused = [worker.plan(options) for options in candidates]
    finally:
        worker.close()
    fresh = _fresh(16, candidates, LLAMA, args, tmp_path)
    for options, got, want in zip(candidates, reused, fresh):
        assert _figures(got) == _figures(want), options
    # the knobs that must change the figures did (the comparison is not of one plan with itself)
    base = _figures(reused[0])
    assert [options for options, r in zip(candidates, reused) if _figures(r) == base] == [{}]
    assert reused[3]["activations"]["offloaded_bytes"] > 0


# Graph breaks inside the layer loop (a frame per block, Dynamo reuses its code for every block),
# an evaluation under no_grad every step (a frame compiled as an inference graph) and an eager head.
SCRIPT = textwrap.dedent("""
    import argparse, torch, torch.distributed as dist, torch.nn as nn
    import zerocompile

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            h = self.up(self.norm(x))
            torch._dynamo.graph_break()
            return x + self.down(torch.relu(h))

    class Net(nn.Module):
        def __init__(self, d=64, n=3):
            super().__init__()
            self.embed = nn.Embedding(128, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(n))
            self.head = nn.Linear(d, 128)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return x

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    net = Net()
    body = torch.compile(net, backend="zero", options={"stage": 3})
    opt = zerocompile.ZeroOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-3)
    ids = torch.randint(0, 128, (4, 32))
    for step in range(args.steps):
        logits = net.head(body(ids))                      # the head runs eagerly
        nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            body(ids)
    dist.destroy_process_group()
""")


def test_graph_breaks_an_inference_frame_and_a_script_out_of_steps(tmp_path):
    """Several frames, one compiled without autograd, planned on one trace equal fresh plans. A
    stage change is refused on the trace (it binds the shard states) and the worker plans on;
    when the script runs out of steps, ``PlanWorkers`` plans the candidate on a new trace."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    candidates = [{}, {"reshard_after_forward": False}, {"recompute": "full"}, {"zero_quantized_weights": True}]
    workers = PlanWorkers(16, "h100", script)
    try:
        # 4 steps: the first compiles, the next 3 measure one candidate each
        args = ["--steps", "4"]
        first, reused = workers.plan(candidates[0], args)
        assert not reused and first["frames"] >= 3
        worker = workers._idle[0]
        with pytest.raises(RuntimeError, match="stage: other than the frame was compiled with"):
            worker.plan({**candidates[0], "stage": 2})
        got = [first] + [worker.plan(c) for c in candidates[1:3]]
        workers._idle.remove(worker)
        workers._put_back(worker)
        last, reused = workers.plan(candidates[3], args)       # the script has no step left
        assert not reused and workers.ran_out == 1 and workers.started == 2
        got.append(last)
    finally:
        workers.close()
    fresh = _fresh(16, candidates, script, args, tmp_path)
    for options, a, b in zip(candidates, got, fresh):
        assert _figures(a) == _figures(b), options


def test_a_compiled_frame_keeps_no_input_of_its_trace_alive(tmp_path):
    """A frame keeps what a later compile needs, but not Dynamo's example inputs: under plan the
    activations among them are the script's own fake tensors, which plan would count as alive
    in every later step (Llama-3-70B's planned peak was 0.13 GiB too high while it kept them)."""
    script = tmp_path / "inputs.py"
    script.write_text(textwrap.dedent("""
        import gc, weakref, torch, torch.distributed as dist, torch.nn as nn, zerocompile
        dist.init_process_group("gloo")
        net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
        model = torch.compile(net, backend="zero", options={"stage": 3})
        opt = zerocompile.ZeroOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-3)
        refs = []
        for step in range(3):
            x = torch.randn(8, 64, requires_grad=True)
            refs.append(weakref.ref(x))
            model(x).sum().backward()
            del x
            gc.collect()
            print("inputs alive:", sum(r() is not None for r in refs), flush=True)
            opt.step()
            opt.zero_grad()
    """))
    done = run_cli(["plan", "--world-size", "4", "--", str(script)], REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [ln for ln in done.stdout.splitlines() if ln.startswith("inputs alive")] == ["inputs alive: 0"] * 2


def test_the_pass_options_are_those_no_shard_state_or_compile_reads():
    """What may change on one trace: a config differing in pass options only needs no new
    trace; one differing in stage, dtypes, offload, clipping or the compiler does."""
    base = ZeroConfig.from_options({"stage": 3})
    assert options_needing_a_new_trace(base, ZeroConfig.from_options({"stage": 3, "bucket_mb": 50, "recompute": "full",
                                                                      "zero_hpz_partition_size": 8})) == []
    for change in ({"stage": 2}, {"param_dtype": torch.bfloat16}, {"gradient_clipping": 1.0},
                   {"inner_compiler": "eager"}, {"offload_optimizer": {"device": "cpu"}}, {"loss_scale": "dynamic"}):
        assert options_needing_a_new_trace(base, ZeroConfig.from_options({"stage": 3, **change})) == list(change), change
    assert PASS_OPTIONS == set(base.passes.__dataclass_fields__) and PASS_OPTIONS <= set(base.flat())
    assert trace_key({"stage": 3, "bucket_mb": 5}, ["a"]) == trace_key({"stage": 3, "prefetch_mb": 1}, ["a"])
    assert trace_key({"stage": 3}, ["a"]) != trace_key({"stage": 2}, ["a"])
    assert trace_key({"stage": 3}, ["--batch", "2"]) != trace_key({"stage": 3}, ["--batch", "4"])


def test_recompile_outside_plan_is_refused_without_an_override():
    from zerocompile.backend import recompile_with_overriding_options

    with pytest.raises(RuntimeError, match="needs an enclosing overriding_options"):
        recompile_with_overriding_options({"bucket_mb": 5})
