"""The benchmarks (``stage3_vs_fsdp2.py`` and ``run.py``, what ``make bench`` runs) run end to end in
their quick modes and write sane figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "stage3_vs_fsdp2.py"
SYSTEMS = ("zero3", "zero3-nopass", "fsdp2")


def test_stage3_vs_fsdp2_quick(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--inner-compiler", "eager", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["psi"] > 0 and result["machine"]["cpu_count"] >= 1
    disabled = result["disabled_passes"]
    assert disabled and "cast_forward_inputs" not in disabled, disabled
    assert set(result["systems"]) == set(SYSTEMS)
    for name in SYSTEMS:
        entry = result["systems"][name]
        assert entry["status"] == "ok", (name, entry["status"], entry.get("error"))
        for key in ("median_ms", "min_ms", "max_ms", "first_step_s", "peak_bytes", "comm_bytes",
                    "ms_ratio", "ms_ratio_paired", "peak_ratio", "comm_ratio"):
            value = entry[key]
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (name, key, value)
        assert entry["max_rel_loss_diff"] <= result["config"]["rtol"], (name, entry["max_rel_loss_diff"])
        if name != "fsdp2":
            assert entry["zero_stats_match"], (name, entry["zero_stats"], entry["comm_by_kind"])
    assert "FSDP2 eager" in proc.stdout and "DIVERGED" not in proc.stdout, proc.stdout


RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def test_make_bench_quick(tmp_path):
    """``benchmarks/run.py --quick`` runs every system on a tiny GPT, and writes the three outputs
    with sane figures; DeepSpeed rows may only be skipped, never failed or diverged."""
    proc = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "latest.json").read_text())
    assert (tmp_path / "latest.md").read_text().count("| FSDP2 eager |") == 1
    assert (tmp_path / "latest.png").stat().st_size > 0
    disabled = result["disabled_passes"]
    assert disabled and "cast_forward_inputs" not in disabled, disabled
    workload = result["workloads"]["gpt-tiny"]
    assert workload["reference"] == "fsdp2" and workload["psi"] > 0
    systems = workload["systems"]
    assert len(systems) == 10
    for name, entry in systems.items():
        if name.startswith("ds-") and entry["status"] == "skipped":
            continue
        assert entry["status"] == "ok", (name, entry["status"], entry.get("error"))
        for key in ("median_ms", "min_ms", "max_ms", "first_step_s", "peak_bytes", "state_bytes",
                    "ms_ratio", "comm_wire_bytes", "comm_formula_bytes"):
            value = entry[key]
            assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (name, key, value)
        assert entry["max_rel_loss_diff"] <= result["config"]["rtol"], (name, entry["max_rel_loss_diff"])
        if name.startswith("zero"):
            # zerocompile holds the model state of the formula (within the batch and small buffers)
            assert 0.9 < entry["state_bytes"] / entry["state_formula_bytes"] < 1.2, (name, entry["state_ratio"])
    assert "DIVERGED" not in proc.stdout and "FAILED" not in proc.stdout, proc.stdout
