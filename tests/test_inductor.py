"""The default inner compiler (inductor, C++ on CPU): stages 2 and 3 on 2 ranks match the
single-process reference. Uses the persistent TORCHINDUCTOR_CACHE_DIR the Makefile sets."""

from __future__ import annotations

import pytest

from dist_utils import run_ranks
from harness import Run, assert_matches, ranks_of, reference, runs_apart, zero_train_many


# stage 2 with its reduce-scatters made all-reduces (passes/all_reduce_gradients.py): the
# reduce-scatter path is the one stage 3 runs
TIED_RUNS = [Run(model="tied", stage=stage, opt="adamw", steps=3, accum=2, clip=1.0, inner="inductor",
                 options=(("gradient_reduction", "all_reduce"),) if stage == 2 else ())
             for stage in (2, 3)]
BF16_RUNS = {stage: Run(model="gpt", stage=stage, opt="adamw", steps=3, param_dtype="bfloat16", inner="inductor")
             for stage in (3,)}


def _all_runs(rank, world):
    """Every 2-rank run of this module in one group of ranks (``harness.runs_apart``)."""
    return runs_apart(rank, world, (("tied", zero_train_many, (TIED_RUNS,)),
                                    *((("bf16", stage), zero_train_many, ([run],)) for stage, run in BF16_RUNS.items()),
                                    ("peak", _gathered_peak, ())))


@pytest.fixture(scope="module")
def inductor_results(once_per_run):
    return once_per_run("test_inductor.inductor_results", lambda: run_ranks(_all_runs, 2))


def _rank0(results, key):
    return ranks_of(results, key)[0]


def test_inductor_stage2_and_stage3_with_tied_weights_and_graph_break(inductor_results):
    runs = TIED_RUNS
    for run, res in zip(runs, _rank0(inductor_results, "tied")):
        assert_matches(res, reference(run))
        # the forward and backward graphs' collectives were summarised from inductor's partition
        if run.stage == 3:
            assert res["stats"]["all_gather"]["count"] > 0 and res["stats"]["reduce_scatter"]["count"] > 0
        else:
            assert res["stats"]["reduce_scatter"]["count"] == 0 and res["stats"]["all_reduce"]["count"] > 6


@pytest.mark.parametrize("stage", list(BF16_RUNS))
def test_inductor_bf16(inductor_results, stage):
    run = BF16_RUNS[stage]
    res = _rank0(inductor_results, ("bf16", stage))[0]
    ref = reference(run)
    assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) < 5e-2


def _gathered_peak(rank, world):
    import torch

    from census import GatheredBytes
    from models import GPT, make_batch

    torch._dynamo.reset()
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


def test_inductor_stage3_keeps_few_parameters_gathered_at_once(inductor_results):
    """Inductor's code frees each gathered parameter after its last use too."""
    _rank0(inductor_results, "peak")
    assert inductor_results[0]["peak"] < 0.5


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
