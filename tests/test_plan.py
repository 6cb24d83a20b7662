"""``zerocompile plan`` (zerocompile/plan.py): its figures against a real 2-rank run of the same
unmodified script, the step-time model on a hand-timed sequence, hardware profiles, and every
error path of the command."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dist_utils import run_cli, run_script_ranks
from zerocompile.cli import main
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.plan import (HARDWARE, ScalarReadsAreZero, StepTimer, gradient_reduction_line, hardware_from,
                              node_local_groups, plan_options)

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 600

# A torchrun-style training script: it creates its own gloo group, as users' scripts do. With
# PLAN_TEST_MEASURE set (the real run), rank 0 measures as plan does: a LiveStorageTracker from
# before the model is built (exact peak, reset after each step) and zerocompile.stats() right
# after the second step. The peak of steps 2, 3 and 4 is each recorded: every step after the
# first runs the same program, and a sample can only be too high (a gloo worker thread letting
# go of a finished collective's buffers late, which settle_collectives waits out), never too
# low, so the smallest of the three is the program's peak.
SCRIPT = textwrap.dedent("""
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    import zerocompile
    from zerocompile.runtime.memory_tracker import LiveStorageTracker

    sys.path.insert(0, os.path.join({repo!r}, "benchmarks"))
    torch.set_num_threads(1)
    kind, options = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    measure = os.environ.get("PLAN_TEST_MEASURE")
    tracker = LiveStorageTracker(exact_peak=True, track_inputs=True, settle_collectives=0.01) if measure else None
    if tracker is not None:
        tracker.__enter__()
    torch.manual_seed(0)
    options = {{"inner_compiler": "eager", **options}}
    if kind == "mlp":
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.up, self.down = torch.nn.Linear(32, 96), torch.nn.Linear(96, 32)
            def forward(self, x):
                return x + self.down(torch.relu(self.up(x)))
        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = torch.nn.Linear(12, 32)
                self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
                self.out = torch.nn.Linear(32, 5)
            def forward(self, x):
                x = self.inp(x)
                for block in self.blocks:
                    x = block(x)
                return self.out(x).square().mean()
        model = Net()
        loss_of = torch.compile(model, backend="zero", options=options)
        batch = lambda g: torch.randn(6, 12, generator=g)
    else:   # the tiny Llama of benchmarks/train_llama.py (two layers), bf16, compiled block by block
        import transformers
        from train_llama import SIZES, compile_by_blocks
        torch.set_default_dtype(torch.bfloat16)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{{**SIZES["tiny"], "num_hidden_layers": 2}},
                                                                         use_cache=False,
                                                                         attn_implementation="sdpa"))
        torch.set_default_dtype(torch.float32)
        loss_of = compile_by_blocks(model, options)
        batch = lambda g: torch.randint(0, 512, (1, 32), generator=g)
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    peaks, stats = [], None
    for step in range(4):
        loss = loss_of(batch(g))
        loss.backward()
        opt.step()
        if tracker is not None:
            if step >= 1:
                peaks.append(tracker.peak)
            if step == 1:
                stats = zerocompile.stats().as_dict()
            tracker.reset_peak()
            zerocompile.reset_stats()
        if tracker is not None and step == 3 and rank == 0:
            with open(measure, "w") as f:
                json.dump({{"peaks": peaks, "stats": stats}}, f)
        opt.zero_grad()
        print(f"step {{step}} loss {{loss.item():.4f}}")
    dist.barrier()
    dist.destroy_process_group()
""").format(repo=str(REPO))


def _script(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _real_run(script: Path, kind: str, options: dict, out: Path) -> dict:
    env = {**os.environ, "PLAN_TEST_MEASURE": str(out), "OMP_NUM_THREADS": "1"}
    done = run_script_ranks(script, [kind, json.dumps(options)], 2, REPO, env, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind, options", [
    # the real run's "auto" would send the gathers through shared memory on this host, each bucket
    # landing in its members (no rows buffer: a bucket less at the peak); the plan models collectives
    ("mlp", {"stage": 3, "parameter_gather": "all_gather"}),
    # the real run's "auto" would time the collectives; the plan's takes the cpu profile's all_reduce
    ("mlp", {"stage": 1, "param_dtype": "bfloat16", "gradient_reduction": "all_reduce"}),
    ("llama", {"stage": 3, "recompute": "full"}),
], ids=["mlp-stage3", "mlp-stage1-bf16", "llama-bf16-stage3-recompute"])
def test_plan_equals_a_real_two_rank_run(tmp_path, kind, options):
    """Plan on 2 fake ranks with fake tensors gives, byte for byte, what rank 0 of a real
    2-rank run of the same script measures: peak live bytes, model state by kind, and the
    count and bytes of every collective kind in a step."""
    script = _script(tmp_path)
    real = _real_run(script, kind, options, tmp_path / "real.json")
    done = run_cli(["plan", "--world-size", "2", "--hardware", "cpu",
                    "--json", "--", str(script), kind, json.dumps(options)], REPO, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.splitlines()[0])        # the first line: the script printed to stderr
    assert "step 0 loss 0.0000" in done.stderr           # .item() on fake tensors reads 0
    assert got["measured_step"] == 2 and got["world_size"] == 2
    stats = real["stats"]
    assert got["peak_bytes_per_rank"] == min(real["peaks"]), real["peaks"]
    assert got["model_state_bytes_by_kind"]["params"] == stats["param_bytes"]
    assert got["model_state_bytes_by_kind"]["grads"] == stats["grad_bytes"]
    assert got["model_state_bytes_by_kind"]["optimizer_state"] == stats["optimizer_state_bytes"]
    assert got["model_state_bytes_per_rank"] == stats["param_bytes"] + stats["grad_bytes"] + stats[
        "optimizer_state_bytes"]
    for kind_ in ("all_gather", "reduce_scatter", "all_reduce"):
        assert got["comm_by_kind"][kind_] == stats[kind_], kind_
    assert got["comm_bytes_per_rank_per_step"] == sum(stats[k]["bytes"] for k in ("all_gather", "reduce_scatter",
                                                                                   "all_reduce"))
    assert got["estimated_step_s"] >= got["estimated_compute_s"] > 0


def test_plan_at_a_large_world_size_follows_the_formulas(tmp_path):
    """Stage 3 on 64 fake ranks: each rank holds 1/64 of the (padded) parameters, their
    gradients and two AdamW moments; a step all-gathers every parameter in forward, again in
    backward those whose values the backward reads (the weights, but not the first layer's,
    whose input needs no gradient, and no bias), and reduce-scatters every gradient."""
    script = _script(tmp_path)
    done = run_cli(["plan", "--world-size", "64", "--hardware", "h100",
                    "--json", "--", str(script), "mlp", json.dumps({"stage": 3})], REPO, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.splitlines()[0])
    sizes = [12 * 32, 32] + [32 * 96, 96, 96 * 32, 32] * 3 + [32 * 5, 5]
    chunks = [-(-n // 64) for n in sizes]           # each rank's padded share of each parameter
    assert got["num_params"] == sum(sizes)
    assert got["model_state_bytes_by_kind"] == {"params": 4 * sum(chunks), "grads": 4 * sum(chunks),
                                                "optimizer_state": 8 * sum(chunks),
                                                "offloaded_optimizer_state": 0, "offloaded_params": 0}
    read_in_backward = [c for i, c in enumerate(chunks) if i % 2 == 0 and i > 0]     # weights but the first
    assert got["comm_by_kind"]["all_gather"]["bytes"] == 4 * 64 * (sum(chunks) + sum(read_in_backward))
    assert got["comm_by_kind"]["reduce_scatter"]["bytes"] == 4 * 64 * sum(chunks)
    assert got["hardware"]["name"] == "h100" and got["options"]["cost_model"] == HARDWARE["h100"].cost_model()


def test_plan_reports_what_the_activation_planner_chose(tmp_path):
    """Activation offload with a budget of 0 at 64 fake ranks: the planner's choice per block and
    the bytes moved are in the plan (the fake tensors move no bytes; the op's fake kernel runs)."""
    script = _script(tmp_path)
    options = {"stage": 3, "offload_activations": {"device": "nvme", "nvme_path": str(tmp_path / "swap"),
                                                   "budget_mb": 0, "min_kb": 0}}
    done = run_cli(["plan", "--world-size", "64", "--hardware", "h100",
                    "--json", "--", str(script), "mlp", json.dumps(options)], REPO, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    acts = json.loads(done.stdout.splitlines()[0])["activations"]
    assert 0 < acts["offloaded_bytes"] <= acts["saved_bytes"]
    assert acts["recompute"] or acts["offload"]
    swap = tmp_path / "swap"
    assert not swap.exists() or not any(swap.iterdir())      # fake tensors: no file is written


def test_plan_of_hf_gradient_checkpointing_at_1024_ranks_follows_the_formulas():
    """benchmarks/train_llama.py (tiny, two layers) with HF ``gradient_checkpointing_enable()`` on
    1024 fake ranks at stage 3: graph replay runs activation checkpointing's RNG higher-order ops
    (and replays the second layer's runs), no parameter stays whole, and each rank holds its padded share of every parameter (bfloat16
    parameters, gradients and two AdamW moments) and reduce-scatters every gradient in fp32."""
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from train_llama import SIZES

    world = 1024
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES["tiny"], "num_hidden_layers": 2}))
    chunks = sum(-(-p.numel() // world) for p in model.parameters())
    done = run_cli(["plan", "--world-size", str(world), "--json", "--",
                    str(REPO / "benchmarks" / "train_llama.py"), "--size", "tiny", "--layers", "2", "--seq",
                    "16", "--steps", "2", "--checkpointing", "non_reentrant"], REPO, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.splitlines()[0])
    assert got["unsharded_params"] == {"count": 0, "elements": 0, "names": []}
    assert got["graph_runs"]["replayed"] > 0, got["graph_runs"]
    assert got["num_params"] == sum(p.numel() for p in model.parameters())
    assert got["model_state_bytes_by_kind"] == {"params": 2 * chunks, "grads": 2 * chunks,
                                                "optimizer_state": 4 * chunks,
                                                "offloaded_optimizer_state": 0, "offloaded_params": 0}
    assert got["comm_by_kind"]["reduce_scatter"]["bytes"] == 4 * world * chunks


def test_stats_of_a_model_on_the_meta_device(tmp_path):
    """A model built on the meta device trains through every sharded stage on 4 fake ranks
    (the cost model falls back to its default rates: nothing can be timed on meta), and
    stats() counts its shards, gradients and optimizer state as on real tensors."""
    script = textwrap.dedent("""
        import gc, json, torch, zerocompile
        from zerocompile._torch_compat import init_fake_process_group
        init_fake_process_group(4)
        out = {}
        for stage in (1, 2, 3):
            torch.compiler.reset()
            gc.collect()                      # what the reset let go (the step collects it too)
            before = zerocompile.stats()      # the earlier stages' models may still be alive
            with torch.device("meta"):
                model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
            class Loss(torch.nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m
                def forward(self, x):
                    return self.m(x).square().mean()
            c = torch.compile(Loss(model), backend="zero", options={"stage": stage, "inner_compiler": "eager"})
            c(torch.randn(4, 8, device="meta")).backward()
            opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW)
            opt.step()
            now = zerocompile.stats()
            out[stage] = {k: getattr(now, k) - getattr(before, k)
                          for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes")}
            del c, opt, model
        print(json.dumps(out))
    """)
    # in a process of its own (nothing else has touched stats() or a process group there), forked
    # from the fork server rather than a new interpreter importing torch and zerocompile again
    path = tmp_path / "meta.py"
    path.write_text(script)
    done = run_script_ranks(path, [], 1, REPO, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    got = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
    psi, shard = 8 * 8 + 8 + 8 * 4 + 4, 16 + 2 + 8 + 1       # elements; one rank's padded share
    assert (got[1]["param_bytes"], got[1]["grad_bytes"], got[1]["optimizer_state_bytes"]) == (4 * psi, 4 * psi,
                                                                                              8 * shard)
    assert (got[2]["param_bytes"], got[2]["grad_bytes"], got[2]["optimizer_state_bytes"]) == (4 * psi, 4 * shard,
                                                                                              8 * shard)
    assert (got[3]["param_bytes"], got[3]["grad_bytes"], got[3]["optimizer_state_bytes"]) == (4 * shard, 4 * shard,
                                                                                              8 * shard)


def test_plan_prints_tables(tmp_path):
    script = _script(tmp_path)
    done = run_cli(["plan", "--world-size", "8", "--", str(script),
                    "mlp", json.dumps({"stage": 2})], REPO, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "on 8 ranks, stage 2" in out and "hardware h100" in out
    for text in ("model state: params", "peak live bytes in a step", "reduce-scatter", "estimated step:",
                 "gradient reduction (stages 1-2): reduce_scatter (gradient_reduction 'auto': the choice of "
                 "hardware profile h100)"):
        assert text in out, text


def test_plan_compare_runs_every_stage(tmp_path):
    """``--compare`` plans stages 0-3 in subprocesses: the model state per rank falls from
    stage 0 (everything whole) to stage 3 (everything sharded) as the formulas say."""
    script = _script(tmp_path)
    done = run_cli(["plan", "--world-size", "4", "--json", "--compare",
                    "--", str(script), "mlp", "{}"], REPO, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout.splitlines()[0])["compare"]
    assert [r["stages"] for r in rows] == [[0], [1], [2], [3]], rows
    sizes = [12 * 32, 32] + [32 * 96, 96, 96 * 32, 32] * 3 + [32 * 5, 5]
    psi, shard = sum(sizes), sum(-(-n // 4) for n in sizes)
    state = [r["model_state_bytes_by_kind"] for r in rows]
    assert state[0] == {"params": 4 * psi, "grads": 4 * psi, "optimizer_state": 8 * psi,
                        "offloaded_optimizer_state": 0, "offloaded_params": 0}
    assert state[1]["optimizer_state"] == 8 * shard and state[1]["grads"] == 4 * psi
    assert state[2]["grads"] == 4 * shard and state[2]["params"] >= 4 * psi
    assert state[3] == {"params": 4 * shard, "grads": 4 * shard, "optimizer_state": 8 * shard,
                        "offloaded_optimizer_state": 0, "offloaded_params": 0}


@pytest.mark.parametrize("args, message", [
    (["--world-size", "0", "--", "x.py"], "--world-size must be >= 1"),
    (["--world-size", "2", "--compare", "--jobs", "0", "--", "x.py"], "--jobs must be >= 1"),
    (["--", "x.py"], "the following arguments are required: --world-size"),
    (["--world-size", "2", "--hardware", "tpu", "--", "x.py"], "unknown hardware 'tpu'"),
    (["--world-size", "2", "--options", '{"stage": 7}', "--", "x.py"], "zerocompile plan: error: --options"),
    (["--world-size", "2", "--options", '{"offload_optimizer": {"device": "cpu"}}', "--", "x.py"],
     "cannot set 'offload_optimizer' yet"),
    (["--world-size", "2", "--options", '{"dump": "d"}', "--", "x.py"], "cannot set 'dump'; use zerocompile dump"),
    (["--world-size", "2"], "no script given"),
    (["--world-size", "2", "--", "no_such_script.py"], "no such script: no_such_script.py"),
])
def test_plan_errors_are_one_line(capsys, args, message):
    code = main(["plan", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_plan_of_a_script_without_a_step_says_so(capsys, tmp_path):
    script = tmp_path / "no_step.py"
    script.write_text("import torch\nprint(torch.ones(2).sum().item())\n")
    assert main(["plan", "--world-size", "2", "--", str(script)]) == 1
    out, err = capsys.readouterr()
    assert "ran no optimizer step" in err
    assert "0.0" in out                            # its .item() on a fake tensor read 0


def test_hardware_profiles_and_files(tmp_path):
    assert hardware_from("h100") is HARDWARE["h100"]
    good = tmp_path / "mine.json"
    good.write_text(json.dumps({"flops_per_s": 1e15, "memory_gbps": 5000, "bandwidth_gbps": 100, "alpha_us": 10}))
    mine = hardware_from(str(good))
    assert (mine.name, mine.flops_per_s, mine.bandwidth_gbps) == ("mine", 1e15, 100.0)
    assert (mine.ranks_per_node, mine.intra_node_gbps) == (1, 0.0)
    node = {"flops_per_s": 1e15, "memory_gbps": 5000, "bandwidth_gbps": 50, "alpha_us": 10, "ranks_per_node": 4,
            "intra_node_gbps": 300}
    good.write_text(json.dumps(node))
    assert (hardware_from(str(good)).ranks_per_node, hardware_from(str(good)).intra_node_gbps) == (4, 300.0)
    # what gradient_reduction "auto" takes in a plan: the profile's (gloo for cpu), or the option
    assert (mine.gradient_reduction, HARDWARE["cpu"].gradient_reduction) == ("reduce_scatter", "all_reduce")
    good.write_text(json.dumps({**node, "gradient_reduction": "all_reduce"}))
    assert hardware_from(str(good)).gradient_reduction == "all_reduce"
    assert plan_options({"stage": 1}, HARDWARE["cpu"])["gradient_reduction"] == "all_reduce"
    assert plan_options({"stage": 1, "gradient_reduction": "reduce_scatter"},
                        HARDWARE["cpu"])["gradient_reduction"] == "reduce_scatter"
    assert gradient_reduction_line({}, HARDWARE["cpu"]).startswith("all_reduce (gradient_reduction 'auto'")
    for body, message in [(json.dumps({**node, "gradient_reduction": "ring"}), "gradient_reduction = 'ring'"),("{", "cannot read it as JSON"), ('{"flops_per_s": 1}', "needs exactly the keys"),
                          (json.dumps({"flops_per_s": -1, "memory_gbps": 1, "bandwidth_gbps": 1, "alpha_us": 1}),
                           "flops_per_s = -1; it must be a finite number > 0"),
                          (json.dumps({**node, "ranks_per_node": 0}), "ranks_per_node = 0; it must be an integer"),
                          (json.dumps({**node, "intra_node_gbps": "fast"}), "intra_node_gbps = 'fast'"),
                          (json.dumps({**node, "gpus": 8}), "optionally name, description, ranks_per_node")]:
        bad = tmp_path / "bad.json"
        bad.write_text(body)
        with pytest.raises(ValueError, match=message):
            hardware_from(str(bad))


def test_step_timer_overlaps_collectives_with_compute(fake_world):
    """On 4 ranks at 1 TFLOP/s and 1 GB/s per rank: an all-gather of 4 MB (3 MB on the wire,
    3 ms) starts before a 2 ms matmul, so its wait holds compute for 1 ms more; a second
    matmul (2 ms), then a reduce-scatter of 4 MB (3 ms) that nothing overlaps: 8 ms in all,
    4 ms of it compute and 6 ms communication."""
    import torch.distributed as dist

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    timer = StepTimer(CostModel(flops_per_s=1e12, alpha_s=0.0, bandwidth=1e9, memory_bandwidth=1e30), world=4)
    a, shard = torch.randn(1000, 1000), torch.randn(250_000)
    with timer:
        full = c10d.all_gather_into_tensor(shard, 4, group)
        y = a @ a
        full = c10d.wait_tensor(full)
        z = y @ y
        c10d.wait_tensor(c10d.reduce_scatter_tensor(full, "sum", 4, group))
    assert z.shape == (1000, 1000)
    assert timer.compute_s == pytest.approx(4e-3, rel=1e-6)
    assert timer.comm_s == pytest.approx(6e-3, rel=1e-6)
    assert timer.step_s == pytest.approx(8e-3, rel=1e-6)


def test_collectives_inside_a_node_run_at_the_intra_node_bandwidth(fake_world):
    """A gather over a node-local group (hpZ's pair on 4 ranks, 2 per node) is timed at the
    intra-node bandwidth, the same gather over all 4 ranks at the network's; an all-to-all
    over 2 ranks (qgZ's hop) counts half its buffer on the wire, not 3/4."""
    import torch.distributed as dist

    from zerocompile.runtime import comm

    c10d = torch.ops._c10d_functional
    world = comm.resolve_group()
    pair = comm.hpz_subgroup(world, 2)
    hardware = dataclasses.replace(HARDWARE["h100"], ranks_per_node=2, intra_node_gbps=8.0)
    options = {"stage": 3, "zero_hpz_partition_size": 2}
    assert node_local_groups(hardware, options) == {pair.name}
    assert node_local_groups(dataclasses.replace(hardware, ranks_per_node=4), options) == {pair.name, world.name}
    assert node_local_groups(HARDWARE["cpu"], options) == frozenset()
    timer = StepTimer(CostModel(flops_per_s=1e12, alpha_s=0.0, bandwidth=1e9, memory_bandwidth=1e30), world=4,
                      intra_node_bandwidth=8e9)
    timer.node_local_groups = node_local_groups(hardware, options)
    shard = torch.randn(250_000)                                   # 1 MB; 2 MB gathered over the pair
    with timer:
        c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 2, pair.name))
    assert timer.comm_s == pytest.approx(1e6 / 8e9, rel=1e-6)      # half of 2 MB, at 8 GB/s
    timer.reset()
    with timer:
        c10d.wait_tensor(c10d.all_gather_into_tensor(shard, 4, dist.group.WORLD.group_name))
    assert timer.comm_s == pytest.approx(3e6 / 1e9, rel=1e-6)      # 3/4 of 4 MB, at 1 GB/s
    timer.reset()
    with timer:
        c10d.wait_tensor(c10d.all_to_all_single(torch.randn(500_000), [250_000] * 2, [250_000] * 2,
                                                comm.hpz_cross_subgroup(world, 2).name))
    assert timer.comm_s == pytest.approx(1e6 / 1e9, rel=1e-6)      # half of 2 MB, across nodes


def test_scalar_reads_of_fake_tensors_are_zero():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), ScalarReadsAreZero():
        x = torch.randn(3)
        assert x.sum().item() == 0.0
        assert bool((x > 0).any()) is False
        assert int(torch.tensor(5)) == 0


def test_plans_options_reach_the_backend_in_a_scope_not_through_the_environment(monkeypatch):
    """``plan`` runs the script inside ``overriding_options``: its keys win over the script's,
    in place of ``ZEROCOMPILE_OPTIONS`` (still read outside the scope, for ``dump``'s children),
    and the process environment is left alone."""
    import os

    from zerocompile.backend import _with_environment_options, overriding_options
    from zerocompile.config import ZeroConfig

    monkeypatch.setenv("ZEROCOMPILE_OPTIONS", '{"stage": 1}')
    with overriding_options({"stage": 3}):
        assert _with_environment_options({"stage": 2, "bucket_mb": 5}) == \
            ZeroConfig.from_options({"stage": 3, "bucket_mb": 5})
        assert os.environ["ZEROCOMPILE_OPTIONS"] == '{"stage": 1}'
    assert _with_environment_options({"stage": 2}) == ZeroConfig.from_options({"stage": 1})
    monkeypatch.delenv("ZEROCOMPILE_OPTIONS")
    assert _with_environment_options({"stage": 2}) == ZeroConfig.from_options({"stage": 2})
    # over a DeepSpeed config the override's key wins over the DeepSpeed key of the same meaning
    with overriding_options({"stage": 1}):
        assert _with_environment_options({"zero_optimization": {"stage": 3}}).sharding.stage == 1
