"""The stage-3-vs-FSDP2 benchmark runs end to end in its quick mode and writes sane figures."""

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
