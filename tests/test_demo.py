"""The demo runs as `make demo` runs it (2 self-launched ranks) and reports the formulas' ratios."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def test_demo_stage3_trains_and_matches_memory_formula():
    out = subprocess.run([sys.executable, str(DEMO), "--stage", "3", "--steps", "3", "--inner-compiler", "eager"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    steps = re.findall(r"step\s+\d+ \| loss ([\d.]+)", out)
    assert len(steps) == 3, out
    summary = re.search(r"mem/formula x([\d.]+), wire/formula x([\d.]+)", out)
    assert summary, out
    mem, wire = map(float, summary.groups())
    assert 1.0 <= mem < 1.01          # 16 Psi / N within padding
    assert 0.9 < wire <= 1.0          # backward re-gathers only what it needs
