"""Helpers of the benchmark scripts that decide what a figure means (``step_breakdown.py``'s op
classes and its pricing of matmuls slowed by collectives). The benchmarks' end-to-end smoke runs
are in ``benchmarks/smoke/`` (``make bench-smoke``, run first by ``make bench``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_op_classes_of_the_breakdown():
    sys.path.insert(0, str(BENCHMARKS))
    from step_breakdown import op_class

    assert op_class("aten::mm") == op_class("aten::_scaled_dot_product_flash_attention_for_cpu") == "compute"
    assert op_class("aten::threshold_backward") == op_class("aten::tanh") == "compute"
    assert op_class("aten::t") == op_class("aten::view") == "copies"
    assert op_class("aten::copy_") == op_class("zerocompile::pack_shards") == op_class("aten::cat") == "copies"
    assert op_class("_c10d_functional::wait_tensor") == op_class("FSDP::all_gather (blocks.0)") == "collectives"
    assert op_class("zerocompile::fused_adam_step") == op_class("aten::_fused_adamw_") == "optimizer"
    assert op_class("FSDP::pre_forward (blocks.1)") == op_class("CompiledFunction") == "other"


def test_matmul_contention_prices_each_call_at_its_idle_speed():
    """matmul_contention on hand-made events: a matmul overlapping a gloo range counts as run
    during a collective and is priced at the idle mean of its own op and shapes; a barrier is
    not a collective; shapes never seen idle keep their own time."""
    from types import SimpleNamespace

    sys.path.insert(0, str(BENCHMARKS))
    from step_breakdown import matmul_contention

    def ev(name, start, end, shapes=()):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), input_shapes=list(shapes))

    a, b = [[4, 8], [8, 16]], [[16, 8], [8, 4]]
    events = [ev("gloo:all_gather", 100, 200), ev("gloo:barrier", 300, 400),
              ev("aten::mm", 0, 1000, a),        # overlaps the gather: 1000 us, priced at 1000 us
              ev("aten::mm", 2000, 2900, a),     # idle: 900 us
              ev("aten::mm", 4000, 5100, a),     # idle: 1100 us (idle mean of shape a: 1000 us)
              ev("aten::mm", 150, 180, b),       # during the gather: 30 us, priced at 80 us
              ev("aten::mm", 310, 390, b),       # during the barrier only, so idle: 80 us
              ev("aten::addmm", 150, 160, a),    # during the gather, addmm never idle: keeps 10 us
              ev("aten::add", 120, 9000, a)]     # not a matmul
    c = matmul_contention(events, steps=2)
    assert c["matmul_ms"] == pytest.approx((1000 + 900 + 1100 + 30 + 80 + 10) / 2e3)
    assert c["matmul_idle_speed_ms"] == pytest.approx((1000 + 900 + 1100 + 80 + 80 + 10) / 2e3)
    assert c["share_during_collective"] == pytest.approx(3 / 6)
    assert matmul_contention([], steps=3) == {"matmul_ms": 0.0, "matmul_idle_speed_ms": 0.0,
                                              "share_during_collective": 0.0}
