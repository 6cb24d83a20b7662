"""The default inner compiler (inductor, C++ on CPU): stages 2 and 3 on 2 ranks match the
single-process reference. Uses the persistent TORCHINDUCTOR_CACHE_DIR the Makefile sets."""

from __future__ import annotations

import pytest

from dist_utils import run_ranks
from harness import Run, assert_matches, reference, zero_train_many


def test_inductor_stage2_and_stage3_with_tied_weights_and_graph_break():
    # stage 2 with its reduce-scatters made all-reduces (passes/all_reduce_gradients.py): the
    # reduce-scatter path is the one stage 3 runs
    runs = [Run(model="tied", stage=stage, opt="adamw", steps=3, accum=2, clip=1.0, inner="inductor",
                options=(("gradient_reduction", "all_reduce"),) if stage == 2 else ())
            for stage in (2, 3)]
    results = run_ranks(zero_train_many, 2, runs)
    for run, res in zip(runs, results[0]):
        assert_matches(res, reference(run))
        # the forward and backward graphs' collectives were summarised from inductor's partition
        if run.stage == 3:
            assert res["stats"]["all_gather"]["count"] > 0 and res["stats"]["reduce_scatter"]["count"] > 0
        else:
            assert res["stats"]["reduce_scatter"]["count"] == 0 and res["stats"]["all_reduce"]["count"] > 6


@pytest.mark.parametrize("stage", [3])
def test_inductor_bf16(stage):
    run = Run(model="gpt", stage=stage, opt="adamw", steps=3, param_dtype="bfloat16", inner="inductor")
    res = run_ranks(zero_train_many, 2, [run])[0][0]
    ref = reference(run)
    assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) < 5e-2


def _gathered_peak(rank, world):
    import torch

    from census import GatheredBytes
    from models import GPT, make_batch

    torch.manual_seed(0)
    model = GPT(layers=4)
    total = sum(-(-p.numel() // world) * world * 4 for p in model.parameters())
    # per-parameter gathers, no prefetch: what is measured is when inductor's code frees them
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "bucket_mb": 0, "prefetch": False})
    x, y = make_batch("gpt", 0, 8)
    compiled(x, y).backward()
    tracker = GatheredBytes()
    with tracker:
        compiled(x, y).backward()
    return tracker.peak / total


def test_inductor_stage3_keeps_few_parameters_gathered_at_once():
    """Inductor's code frees each gathered parameter after its last use too."""
    assert run_ranks(_gathered_peak, 2)[0] < 0.5


def test_allocator_peak_sees_the_buffers_inductor_allocates_that_the_tracker_cannot():
    """``AllocatorPeak`` (the benchmarks' peak): inductor's code allocates its buffers without the
    dispatcher (``empty_strided_cpu``), so a buffer that no dispatched op reads, here the
    function's result, dropped at once, is invisible to the tracker; the allocator's events see
    it, and see it freed."""
    import torch

    from zerocompile.runtime.memory_tracker import AllocatorPeak, LiveStorageTracker

    n = 512
    nbytes = n * n * 4
    f = torch.compile(lambda x: x.sin() * 2, backend="inductor")
    x = torch.randn(n, n)
    f(x)
    tracker = LiveStorageTracker(exact_peak=True, track_inputs=True)
    with tracker:
        tracker.track(x)
        tracker.reset_peak()
        start = tracker.live_bytes()
        with AllocatorPeak(start=start) as allocator:
            out = f(x)
            del out
    assert start == nbytes and tracker.peak == start, (start, tracker.peak)
    assert nbytes <= allocator.rise < nbytes + (1 << 16), allocator.rise
    assert allocator.peak == start + allocator.rise and abs(allocator.net) < 1 << 16, allocator.net
    assert sum(allocator.at_peak.values()) >= nbytes, allocator.at_peak
