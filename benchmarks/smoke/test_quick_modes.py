"""Smoke runs of the benchmarks in their quick modes, run by ``make bench`` before the full runs
(``make bench-smoke`` alone): ``stage3_vs_fsdp2.py``, ``run.py``, ``optimizer_step.py``,
``first_step.py``, ``step_breakdown.py``, ``quantize.py``, ``collectives.py``,
``whole_param_step.py``, ``compile_collection.py``, ``deep_stack.py`` and ``gpu_check.py`` (``make gpu-check``) run end to end and write sane
figures. They are out of ``make test`` (each spawns ranks and compiles models for a minute or
more); the code they run is tested there."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent.parent

BENCH = HERE / "stage3_vs_fsdp2.py"
SYSTEMS = ("zero3", "zero3-one-graph", "zero3-profile", "zero3-nopass", "zero3-per-block", "fsdp2")


def test_stage3_vs_fsdp2_quick(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--inner-compiler", "eager", "--peak-anatomy",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["psi"] > 0 and result["machine"]["cpu_count"] >= 1
    disabled = result["disabled_passes"]
    assert disabled and "cast_forward_inputs" not in disabled, disabled
    assert set(result["systems"]) == set(SYSTEMS)
    for name in SYSTEMS:
        entry = result["systems"][name]
        assert entry["status"] == "ok", (name, entry["status"], entry.get("error"))
        for key in ("median_ms", "min_ms", "max_ms", "first_step_s", "peak_bytes", "allocator_peak_bytes",
                    "comm_bytes", "ms_ratio", "ms_ratio_paired", "peak_ratio", "comm_ratio"):
            value = entry[key]
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (name, key, value)
        # the allocator sees every storage the tracker sees, and what no op returns (kernels' temporaries)
        for tensors, allocated in zip(entry["peak_bytes_per_rank"], entry["allocator_peak_bytes_per_rank"]):
            assert allocated >= tensors, (name, tensors, allocated)
        assert entry["max_rel_loss_diff"] <= result["config"]["rtol"], (name, entry["max_rel_loss_diff"])
        if name != "fsdp2":
            assert entry["zero_stats_match"], (name, entry["zero_stats"], entry["comm_by_kind"])
        # --peak-anatomy: the storages live at the (exact) peak, by the op that made them, add up to it
        anatomy = entry["at_peak"]
        assert sum(nbytes for nbytes, _ in anatomy["by_op"].values()) == entry["peak_bytes"], (name, anatomy)
        assert anatomy["op"].startswith(("aten.", "_c10d_functional.", "zerocompile.")), anatomy["op"]
        # and the allocator's blocks at its own peak: what the step allocated, within that peak
        blocks = entry["allocator_at_peak"]
        assert blocks and all(nbytes > 0 for nbytes in blocks.values()), (name, blocks)
        assert 0 < sum(blocks.values()) <= entry["allocator_peak_bytes"], (name, blocks)
    assert "FSDP2 eager" in proc.stdout and "DIVERGED" not in proc.stdout, proc.stdout
    assert proc.stdout.count("live then, by the op that made it:") == len(SYSTEMS), proc.stdout


RUN = HERE / "run.py"


def _run_systems() -> tuple:
    """``run.py``'s ``SYSTEMS``: what ``--quick`` runs (read from the file, not imported: no
    torch in the test's own process)."""
    import ast

    for node in ast.parse(RUN.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["SYSTEMS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("run.py defines no SYSTEMS")


def test_make_bench_quick(tmp_path):
    """``benchmarks/run.py --quick`` runs every system on a tiny GPT, and writes the three outputs
    with sane figures; DeepSpeed rows may only be skipped, never failed or diverged."""
    proc = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "latest.json").read_text())
    assert (tmp_path / "latest.md").read_text().count("| FSDP2 eager |") == 1
    assert (tmp_path / "latest.png").stat().st_size > 0
    disabled = result["disabled_passes"]
    assert disabled and "cast_forward_inputs" not in disabled, disabled
    workload = result["workloads"]["gpt-tiny"]
    assert workload["reference"] == "fsdp2" and workload["psi"] > 0
    # the offloaded rows come with what the disk alone costs their step
    assert math.isfinite(workload["disk_floor_ms"]) and workload["disk_floor_ms"] > 0, workload["disk_floor_ms"]
    assert "Disk floor:" in (tmp_path / "latest.md").read_text()
    # beside the compute floor: the step's transfers alone (every rank, shared memory, in place)
    transfers = workload["transfer_floor_ms"]
    assert set(transfers) == {"gather", "reduce_scatter"}, transfers
    assert all(math.isfinite(v) and v > 0 for v in transfers.values()), transfers
    assert "Transfer floor (`transfer_floor_ms`)" in (tmp_path / "latest.md").read_text()
    systems = workload["systems"]
    assert list(systems) == list(_run_systems()), list(systems)
    for name, entry in systems.items():
        if name.startswith("ds-") and entry["status"] == "skipped":
            continue
        assert entry["status"] == "ok", (name, entry["status"], entry.get("error"))
        for key in ("median_ms", "min_ms", "max_ms", "first_step_s", "peak_bytes", "allocator_peak_bytes",
                    "state_bytes", "ms_ratio", "comm_wire_bytes", "comm_formula_bytes"):
            value = entry[key]
            if name == "floor" and key == "comm_wire_bytes":     # each rank alone: nothing sent
                assert value == 0, value
                continue
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (name, key, value)
        if name == "floor":          # its ranks train apart on their own micro-batches: no loss compared
            continue
        # quantized communication (ZeRO++) changes the numbers, within issue 11's 2%
        tolerance = 0.02 if name == "zero3-qwz" else result["config"]["rtol"]
        assert entry["max_rel_loss_diff"] <= tolerance, (name, entry["max_rel_loss_diff"])
        if name.startswith("zero") and name not in ("zero3-offload", "zero3-infinity"):
            # zerocompile holds the model state of the formula (within the batch and small buffers)
            assert 0.9 < entry["state_bytes"] / entry["state_formula_bytes"] < 1.2, (name, entry["state_ratio"])
    # the offloaded moments are not resident: parameters, gradients (8 Psi/N) and the pipeline's
    # buffers (on this tiny model, about as large as the state they stream)
    offload = systems["zero3-offload"]
    assert offload["state_formula_bytes"] == systems["zero3"]["state_formula_bytes"] / 2
    assert offload["state_formula_bytes"] <= offload["state_bytes"] < systems["zero3"]["state_bytes"] * 1.2
    # with the parameter shards in files as well: the gradients (4 Psi/N) and the same buffers
    infinity = systems["zero3-infinity"]
    assert infinity["state_formula_bytes"] == systems["zero3"]["state_formula_bytes"] / 4
    assert infinity["state_formula_bytes"] <= infinity["state_bytes"]
    # fewer by the shards (4 Psi/N; the real ones padded a little), more by an 8-byte file number each
    shards = offload["state_formula_bytes"] / 2
    assert abs(offload["state_bytes"] - infinity["state_bytes"] - shards) < 0.01 * shards
    # ZeRO++: int8 values and a float32 scale per 256 elements in every gather and reduction
    qwz = systems["zero3-qwz"]
    assert qwz["max_rel_loss_diff"] > 0
    assert qwz["comm_wire_bytes"] <= 0.3 * systems["zero3"]["comm_wire_bytes"], (qwz, systems["zero3"])
    assert "DIVERGED" not in proc.stdout and "FAILED" not in proc.stdout, proc.stdout


def test_the_compute_floor_is_never_the_loss_reference(tmp_path):
    """Without FSDP2 or DDP in the run, the losses are compared with the first system that trains
    on the whole batch, not with the compute floor (each rank alone on its micro-batch)."""
    proc = subprocess.run([sys.executable, str(RUN), "--quick", "--systems", "floor", "zero1", "zero3",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    workload = json.loads((tmp_path / "latest.json").read_text())["workloads"]["gpt-tiny"]
    assert workload["reference"] == "zero1", workload["reference"]
    assert {n: e["status"] for n, e in workload["systems"].items()} == {"floor": "ok", "zero1": "ok", "zero3": "ok"}
    md = (tmp_path / "latest.md").read_text()
    assert "DIVERGED" not in md and "Against compute floor + transfers: zerocompile stage 1 ×" in md, md


OPTIMIZER_STEP = HERE / "optimizer_step.py"
GPU_CHECK = HERE / "gpu_check.py"


def test_optimizer_step_benchmark_small(tmp_path):
    """benchmarks/optimizer_step.py on a small size, with clipping (each timed call clips, then
    steps): every variant timed, ratios to torch fused, the stage-3 ZeroOptimizer on
    zerocompile's C++ kernel."""
    out = tmp_path / "opt.json"
    proc = subprocess.run([sys.executable, str(OPTIMIZER_STEP), "--tensors", "2", "--rows", "64", "--cols", "96",
                           "--rounds", "2", "--threads", "1", "--clip", "0.01", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"torch fused", "torch foreach", "torch for-loop", "zerocompile stage 3",
                            "zerocompile stage 3, torch fused", "memory floor", "deepspeed cpu adam"}
    deepspeed = results.pop("deepspeed cpu adam")       # timed where DeepSpeed is installed, else why not
    assert deepspeed.get("skipped") or deepspeed["kernel"] == "deepspeed", deepspeed
    assert results["zerocompile stage 3"]["kernel"] == "cpp" and results["memory floor"]["kernel"] == "floor"
    assert results["zerocompile stage 3, torch fused"]["kernel"] == "torch_fused"
    assert results["torch fused"]["x_peer"] == 1.0
    for entry in results.values():
        assert len(entry["ms_each"]) == 2 and entry["ms_per_step"] > 0 and math.isfinite(entry["x_peer_paired"])
    assert "target: zerocompile stage 3 <= 1.0x torch fused" in proc.stdout
    # and each against the memory floor (issue 50: zerocompile's within 5% of it)
    assert results["memory floor"]["x_floor"] == 1.0
    assert all(math.isfinite(e["x_floor"]) and math.isfinite(e["x_floor_paired"]) for e in results.values())
    assert "target: zerocompile stage 3 within 5% of the memory floor" in proc.stdout
    assert "optimizer step with clipping to 0.01" in proc.stdout


def test_gpu_check_says_there_is_no_gpu_and_its_cpu_dry_run_passes(tmp_path):
    """Without a CUDA device `make gpu-check` says so and exits 0; `--device cpu` runs the same
    checks here (Triton kernel in the interpreter, stage-3 run on gloo) so the script is tested."""
    proc = subprocess.run([sys.executable, str(GPU_CHECK)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no CUDA device here" in proc.stdout
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(GPU_CHECK), "--device", "cpu", "--steps", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert all(v["ok"] for v in result["triton_kernel"].values()) and len(result["triton_kernel"]) == 6
    assert result["zero_optimizer_kernel"] == {"kernel": "cpp", "ok": True}
    stage3 = result["stage3_step"]
    assert stage3["ok"] and stage3["max_loss_diff"] < 1e-3 and len(stage3["zerocompile_stage3"]["losses"]) == 3
    assert stage3["offload_bitwise_equal"] and stage3["zerocompile_stage3_offload_all"]["offload"] == "nvme"


FIRST_STEP = HERE / "first_step.py"


def test_first_step_benchmark_quick(tmp_path):
    """benchmarks/first_step.py --quick: plain torch.compile, DDP + torch.compile and zerocompile
    stage 3 each in a fresh process on a cold cache and again on the warm one, the ratios, and
    the report files."""
    proc = subprocess.run([sys.executable, str(FIRST_STEP), "--quick", "--world-sizes", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "first_step.json").read_text())
    plain, ddp, zero = result["rows"]
    assert [(r["stage"], r["world_size"]) for r in (plain, ddp, zero)] == [(0, 1), (-1, 2), (3, 2)]
    for row in (plain, ddp, zero):
        assert math.isfinite(row["first_step_s"]) and row["first_step_s"] > row["step_s"] > 0, row
        assert row["warm_first_step_s"] > 0 and row["warm_ratio"] == row["warm_first_step_s"] / row["first_step_s"]
    assert zero["ratio"] == zero["first_step_s"] / plain["first_step_s"] == result["worst_ratio"]
    assert zero["ddp_ratio"] == zero["first_step_s"] / ddp["first_step_s"] == result["worst_ratio_ddp"]
    md = (tmp_path / "first_step.md").read_text()
    assert "| plain torch.compile | 1 |" in md and "| DDP + torch.compile | 2 |" in md
    assert "| zerocompile stage 3 | 2 |" in md
    assert "target: every zerocompile cold first step at most ×1.0 DDP + torch.compile's" in md
    assert "target: every zerocompile restart (warm cache) at most ×0.3 its cold first step" in md


STEP_BREAKDOWN = HERE / "step_breakdown.py"


def test_step_breakdown_quick(tmp_path):
    """benchmarks/step_breakdown.py --quick: FSDP2 and zerocompile stage 3 profiled on the tiny
    GPT; every op class and each system's packing ops are reported, and the report files."""
    proc = subprocess.run([sys.executable, str(STEP_BREAKDOWN), "--quick", "--steps", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "step_breakdown.json").read_text())
    fsdp2, zero3 = result["systems"]["fsdp2"], result["systems"]["zero3"]
    for system in (fsdp2, zero3):
        assert system["step_ms"] > 0
        assert system["classes_ms"]["compute"] > 0 and system["classes_ms"]["copies"] > 0, system
        assert system["classes_ms"]["collectives"] > 0, system
    # no unpack_gathered_bucket where "auto" takes shared memory: the gathers land in the parameters
    assert {"zerocompile::pack_shards", "zerocompile::pack_gradients"} <= set(zero3["packing"]), zero3["packing"]
    assert {"fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy"} <= set(fsdp2["packing"]), fsdp2["packing"]
    for system in (fsdp2, zero3):
        c = system["contention"]
        assert c["matmul_ms"] > 0 and c["matmul_idle_speed_ms"] > 0 and 0 <= c["share_during_collective"] <= 1, c
        assert system["compute_ops"] and all(op.startswith("aten::") for op in system["compute_ops"]), system
    assert "| step (profiled) |" in (tmp_path / "step_breakdown.md").read_text()


QUANTIZE = HERE / "quantize.py"


def test_quantize_benchmark_small(tmp_path):
    """benchmarks/quantize.py on a small bucket: the four ZeRO++ ops timed as the C++ kernel,
    torch eager and torch inductor, with the ratios to the C++ kernel."""
    out = tmp_path / "q.json"
    proc = subprocess.run([sys.executable, str(QUANTIZE), "--numel", "20000", "--params", "5", "--reps", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"quantize_pack", "dequantize_unpack", "quantize_rows", "dequantize_reduce"}
    for name, r in results.items():
        assert set(r["ms"]) == {"cpp", "torch eager", "torch inductor"}, name
        assert all(v > 0 and math.isfinite(v) for v in r["ms"].values()), (name, r)
        assert r["ratio_to_cpp"]["cpp"] == 1.0


COLLECTIVES = HERE / "collectives.py"


def test_collectives_benchmark_small(tmp_path):
    """benchmarks/collectives.py on a small buffer: every kind timed on 2 gloo ranks (the
    point-to-point transfers too, through the sockets and through shared memory), the ratios to the all-reduce and the stages-1/2 sum written out."""
    out = tmp_path / "coll.json"
    proc = subprocess.run([sys.executable, str(COLLECTIVES), "--numel", "300000", "--bucket-mb", "1", "--reps", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"all_reduce", "reduce_scatter", "all_gather"} | {
        f"{how}_{form}" for how in ("point_to_point", "shared_memory")
        for form in ("reduce_scatter", "gather", "reduce_scatter_in_place", "gather_in_place")}
    assert all(v > 0 and math.isfinite(v) for v in result["ms"].values())
    assert result["x_all_reduce"]["all_reduce"] == 1.0
    total = result["ms"]["reduce_scatter"] + result["ms"]["all_gather"]
    assert math.isclose(result["stages_1_2_x_all_reduce"], total / result["ms"]["all_reduce"])
    assert "| reduce-scatter |" in proc.stdout and "ZeRO stages 1-2" in proc.stdout
    assert "| point-to-point-gather |" in proc.stdout and "the same point to point" in proc.stdout
    assert "| point-to-point-gather-in-place |" in proc.stdout and "in place, as the stage 1-2 optimizer step" in proc.stdout
    assert "| shared-memory-gather-in-place |" in proc.stdout and "through shared memory" in proc.stdout


WHOLE_PARAM_STEP = HERE / "whole_param_step.py"


def test_whole_param_step_benchmark_quick(tmp_path):
    """benchmarks/whole_param_step.py --quick: AdamW, Muon + AdamW and Adafactor on 2 ranks at
    stages 1 and 3; the all-to-alls send what the design says (Muon's: 1/2 of DeepSpeed's two
    all-gathers at stage 1, 3/4 at stage 3, with the master pieces), Muon's state is held once
    and split by owner, and the report files."""
    proc = subprocess.run([sys.executable, str(WHOLE_PARAM_STEP), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "whole_param_step.json").read_text())
    assert set(result["stages"]) == {"1", "3"}
    muon_bytes = 4 * result["muon_numel"]
    assert result["deepspeed_muon_bytes"] == muon_bytes      # 2 (N-1)/N at N = 2
    for stage, rows in result["stages"].items():
        assert set(rows) == {"AdamW", "Muon + AdamW", "Adafactor"}
        for name, e in rows.items():
            for key in ("step_ms", "total_ms", "plain_step_ms", "peak_bytes", "state_bytes_max"):
                assert math.isfinite(e[key]) and e[key] > 0, (stage, name, key, e[key])
            assert (e["bytes_by_kind"]["all_to_all"] > 0) == (name != "AdamW"), (stage, name)
            assert bool(e["owners"]) == (name != "AdamW")
        muon = rows["Muon + AdamW"]
        assert muon["all_to_all_x_deepspeed"] == pytest.approx(0.5 if stage == "1" else 0.75)
        adamw_state = rows["AdamW"]["state_bytes_sum"]
        # momentum (4 bytes) of the matrices instead of AdamW's 8, split over the owners
        assert muon["state_bytes_sum"] == pytest.approx(adamw_state - muon_bytes, rel=0.01)
        assert muon["state_bytes_max"] <= muon["state_bytes_sum"] / 2 + max(4 * 64 * 256, 1)
    md = (tmp_path / "whole_param_step.md").read_text()
    assert "| 3 | Muon + AdamW |" in md and "DeepSpeed's ZeRO Muon" in md


COMPILE_COLLECTION = HERE / "compile_collection.py"


def test_compile_collection_benchmark_quick(tmp_path):
    """benchmarks/compile_collection.py --quick: the HF Llama compiled with the collector paused
    and not, the same losses bit for bit, the pause's compile with no full collection of its own
    beyond the step's, and the report files."""
    proc = subprocess.run([sys.executable, str(COMPILE_COLLECTION), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "compile_collection.json").read_text())
    assert result["losses_equal"] is True
    for run in ("first run", "second run"):
        on, off = result["systems"]["pause on"][run], result["systems"]["pause off"][run]
        for e in (on, off):
            assert math.isfinite(e["wall_s"]) and e["wall_s"] > 0 and e["gc_s"] >= 0
        # the step's collection is full either way; the pause adds none, and takes some away
        assert 1 <= on["full_collections"] <= off["full_collections"], (run, on, off)
        assert math.isfinite(result["ratios"][run]["paired"])
    md = (tmp_path / "compile_collection.md").read_text()
    assert "| second run | pause on |" in md


DEEP_STACK = HERE / "deep_stack.py"


def test_deep_stack_benchmark_quick(tmp_path):
    """benchmarks/deep_stack.py --quick: the HF Llama compiled with the backend on a plain call, on
    the deep stack (as shipped) and with the whole loop there, the same losses bit for bit, fewer
    page faults on the deep stack than on the plain call, and the report files."""
    proc = subprocess.run([sys.executable, str(DEEP_STACK), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "deep_stack.json").read_text())
    assert result["losses_equal"] is True
    for run in ("first run", "second run"):
        row = result["table"][run]
        for system in ("plain call", "backend deep", "loop deep"):
            assert math.isfinite(row[system]["wall_s"]) and row[system]["wall_s"] > 0
        # each chunk mapped anew faults: the deep stack maps fewer
        assert row["loop deep"]["faults"] < row["plain call"]["faults"], row
        assert math.isfinite(row["backend deep"]["paired_ratio"])
    md = (tmp_path / "deep_stack.md").read_text()
    assert "| second run | loop deep |" in md
