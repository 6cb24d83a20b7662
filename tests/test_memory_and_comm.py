"""Per-rank memory after ``step()`` matches the ZeRO formulas; bytes communicated per step,
counted by an independent dispatch mode, match the formulas and ``zerocompile.stats()``."""

from __future__ import annotations

import gc

import pytest
import torch

import zerocompile
from census import CollectiveCounter, GatheredBytes, StorageCensus
from dist_utils import run_ranks
from models import make_batch, make_model


def _worker(rank, world, stage, reduction="reduce_scatter", gather="all_gather"):
    census = StorageCensus()
    with census:
        model = make_model("gpt")
        sizes = [p.numel() for p in model.parameters()]  # tied weight counted once
        options = {"stage": stage, "inner_compiler": "eager"}
        if reduction is not None:
            options["gradient_reduction"] = reduction
        if gather is not None:
            options["parameter_gather"] = gather
        compiled = torch.compile(model, backend="zero", options=options)
        opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        for step in range(2):       # the first step compiles; the second is measured
            x, y = make_batch("gpt", step, 8)
            per = 8 // world
            counter = CollectiveCounter()
            zerocompile.reset_stats()
            with counter:
                loss = compiled(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
                loss.backward()
                opt.step()
            del x, y, loss
            gc.collect()
            live = census.settled_live_bytes()  # gloo's threads let go of buffers late
            stats = zerocompile.stats()
            opt.zero_grad()
    return {"sizes": sizes, "live": live, "stats": stats.as_dict(), "wire": stats.wire_bytes,
            "held": stats.param_bytes + stats.grad_bytes + stats.optimizer_state_bytes,
            "counted": {k: (counter.count[k], counter.bytes[k]) for k in ("all_gather", "reduce_scatter", "all_reduce")},
            "point_to_point": counter.point_to_point}


def _formula(stage, psi, n):
    """Per-rank model-state bytes for fp32 AdamW (design brief section 2)."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


# every stage on 2 ranks; the replicated and fully sharded extremes on 4 as well; stages 1 and 2
# with each gradient_reduction (the all-reduced bucket is a transient: the same model state); the
# parameters' gathers and the gradients' reductions point to point (counted as the collectives
# they replace) at stages 1 and 2 (the step's) and stage 3 (the graphs', 4 ranks). One group of
# ranks per case: stats() counts every model alive in the process.
CASES = [
    (0, 2, None, None), (1, 2, "reduce_scatter", "all_gather"), (2, 2, "reduce_scatter", "all_gather"),
    (3, 2, "reduce_scatter", "all_gather"), (0, 4, None, None), (3, 4, "point_to_point", "point_to_point"),
    (1, 2, "all_reduce", "all_gather"), (2, 2, "all_reduce", "point_to_point"),
    (1, 2, "point_to_point", "all_gather"), (2, 2, "point_to_point", "point_to_point")]


@pytest.mark.parametrize("stage,world,reduction,gather", CASES)
def test_memory_and_communication_match_formulas(stage, world, reduction, gather):
    results = run_ranks(_worker, world, stage, reduction, gather)
    for rank, res in enumerate(results):
        sizes = res["sizes"]
        psi = sum(sizes)
        psi_padded = sum(-(-s // world) * world for s in sizes)
        # memory: the census of live storages vs the formula, within padding (and AdamW's
        # 4-byte step counters plus a little for small tensors the run keeps)
        low = _formula(stage, psi, world)
        high = _formula(stage, psi_padded, world) + 8 * len(sizes) + 4096
        assert low <= res["live"] <= high, (rank, res["live"], low, high)
        # zerocompile's own figure agrees with the census
        assert res["held"] <= res["live"] <= res["held"] + 8 * len(sizes) + 4096, res["stats"]
        # communication: the dispatch-mode count equals stats(), kind by kind
        assert (res["point_to_point"] > 0) == ("point_to_point" in (gather, reduction)), res["point_to_point"]
        for kind, (count, nbytes) in res["counted"].items():
            assert (count, nbytes) == (res["stats"][kind]["count"], res["stats"][kind]["bytes"]), kind
        ag, rs, ar = (res["counted"][k][1] for k in ("all_gather", "reduce_scatter", "all_reduce"))
        ring = (world - 1) / world
        # every step first compares which gradients each rank holds: a 16-byte all-reduce
        # (runtime/grad_participation.py)
        agree = 16
        if stage == 0:
            assert (ag, rs, ar) == (0, 0, 4 * psi + agree)
            assert res["wire"] == pytest.approx(2 * ring * (4 * psi + agree))
        elif stage in (1, 2) and reduction == "all_reduce":
            assert (ag, rs, ar) == (4 * psi_padded, 0, 4 * psi_padded + agree)
            assert res["wire"] == pytest.approx(ring * 4 * psi_padded + 2 * ring * (4 * psi_padded + agree))
        elif stage in (1, 2):
            assert (ag, rs, ar) == (4 * psi_padded, 4 * psi_padded, agree)
            assert res["wire"] == pytest.approx(2 * ring * (4 * psi_padded + agree))
        else:
            # forward gathers every parameter, backward re-gathers those its gradients need
            assert rs == 4 * psi_padded and ar == agree
            assert 4 * psi_padded < ag <= 2 * 4 * psi_padded
            assert 2 * ring * 4 * psi < res["wire"] - 2 * ring * agree <= 3 * ring * 4 * psi_padded


def _gathered_peak_worker(rank, world, reshard, extra=None):
    from models import GPT

    torch.manual_seed(0)
    model = GPT(layers=4)
    padded = [-(-p.numel() // world) * world * 4 for p in model.parameters()]
    compiled = torch.compile(model, backend="zero", options={
        "stage": 3, "inner_compiler": "eager", "reshard_after_forward": reshard, **(extra or {})})
    x, y = make_batch("gpt", 0, 8)
    compiled(x, y).backward()                 # compile outside the measurement
    tracker = GatheredBytes()
    with tracker:
        compiled(x, y).backward()
    return {"peak": tracker.peak, "inflight_peak": tracker.inflight_peak,
            "overlapped": tracker.started_behind_another, "total": sum(padded),
            "largest": max(padded)}


def _gathered_peaks(rank, world, configs):
    out = {}
    for name, reshard, extra in configs:
        torch._dynamo.reset()
        out[name] = _gathered_peak_worker(rank, world, reshard, extra)
    return out


# a slow network: the cost model asks every all-gather to start as early as it may, so
# prefetch_mb is what stops it (the probe would make the decisions depend on machine load)
_SLOW_NETWORK = {"flops_per_s": 1e9, "alpha_us": 1000, "bandwidth_gbps": 0.001, "memory_gbps": 1}
_CAP_MB = 0.05
_BASE = {"bucket_mb": 0, "cost_model": _SLOW_NETWORK}
_PEAK_CONFIGS = [
    ("reshard", True, {"prefetch": False, "bucket_mb": 0}),
    ("no reshard", False, {"prefetch": False, "bucket_mb": 0}),
    ("off", True, {**_BASE, "prefetch": False}),
    ("capped", True, {**_BASE, "prefetch_mb": _CAP_MB}),
    ("wide", True, {**_BASE, "prefetch_mb": 100}),
]
@pytest.fixture(scope="module")
def peaks(once_per_run):
    """The five stage-3 gathered-bytes runs, in one group of 2 ranks, once per pytest run
    (the tests reading them may run on either xdist worker)."""
    return once_per_run("test_memory_and_comm.peaks", lambda: run_ranks(_gathered_peaks, 2, _PEAK_CONFIGS))


@pytest.mark.parametrize("reshard", [True, False])
def test_stage3_frees_each_gathered_parameter_after_its_last_use(peaks, reshard):
    """With resharding, at most about one block's parameters (plus the embeddings, which the
    tied head uses again at the end) are gathered at any time; without it, the forward keeps
    every gathered parameter for backward. (No prefetch here: it gathers ahead on purpose.)"""
    for rank, ranks in enumerate(peaks):
        res = ranks["reshard" if reshard else "no reshard"]
        if reshard:
            assert res["peak"] < 0.5 * res["total"], (rank, res)
        else:
            assert res["peak"] > 0.9 * res["total"], (rank, res)


def test_prefetch_keeps_gathered_bytes_in_flight_within_prefetch_mb(peaks):
    """Prefetching gathers ahead by at most ``prefetch_mb`` (bytes started but not yet waited
    for, counted in the order the ops run), unless a single all-gather is larger; a larger
    ``prefetch_mb`` lets more overlap; gathered bytes alive stay far below the model."""
    cap_mb = _CAP_MB
    for ranks in peaks:
        r_off, r_cap, r_wide = ranks["off"], ranks["capped"], ranks["wide"]
        # without prefetch, one gather at a time
        assert r_off["overlapped"] == 0 and r_off["inflight_peak"] == r_off["largest"], r_off
        # with it, gathers start while others are in flight, within the cap (or one gather)
        assert r_cap["overlapped"] > 0, r_cap
        assert r_cap["inflight_peak"] <= max(cap_mb * 2**20, r_cap["largest"]), r_cap
        assert r_cap["peak"] < 0.5 * r_cap["total"], r_cap
        # the cap is what held it back
        assert r_wide["inflight_peak"] > cap_mb * 2**20 and r_wide["overlapped"] > r_cap["overlapped"], (
            r_cap, r_wide)


def test_settled_live_bytes_waits_for_a_buffer_another_thread_lets_go_of_late():
    """What gloo's worker thread does to a finished collective's buffers, done by hand: the
    immediate reading still counts the buffer, the settled one does not."""
    import threading

    census = StorageCensus()
    with census:
        kept = torch.zeros(1000)
        held = [torch.zeros(4000)]
    release = threading.Timer(0.05, held.clear)
    release.start()
    assert census.live_bytes() == 4 * 5000
    assert census.settled_live_bytes() == 4 * 1000
    release.join()
    del kept


def test_settle_collectives_samples_after_another_thread_lets_go_of_a_buffer():
    """The same late release around a ``wait_tensor`` (as gloo's worker does it): without
    ``settle_collectives`` the sample after the wait still counts the buffer; with it, the
    tracker waits for the release and the peak is what the program itself holds."""
    import threading

    from zerocompile.runtime.memory_tracker import LiveStorageTracker

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default
    for settle in (0.0, 0.5):
        tracker = LiveStorageTracker(exact_peak=True, settle_collectives=settle)
        go = threading.Event()
        with tracker:
            kept = torch.zeros(1000)
            held = [torch.zeros(4000)]
            if settle:      # released 20 ms into the settling window
                threading.Timer(0.02, go.set).start()
            release = threading.Thread(target=lambda: (go.wait(), held.clear()))
            release.start()
            tracker.reset_peak()
            wait_tensor(kept)
            after_wait = tracker.current
        go.set()
        release.join()
        assert after_wait == (4 * 5000 if settle == 0 else 4 * 1000), (settle, after_wait)
        del kept


def test_a_fake_wait_tensor_result_counts_as_the_storage_it_waited_for():
    """Under a FakeTensorMode (``zerocompile plan``) ``wait_tensor`` returns a new fake tensor,
    where a real run gets its argument back: the tracker counts the two as one storage, alive
    while either is, so plan's peak is the real run's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerocompile.runtime.memory_tracker import LiveStorageTracker

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default
    fake_mode = FakeTensorMode()
    tracker = LiveStorageTracker(track_inputs=True, fake_mode=fake_mode)
    with fake_mode, tracker:
        sent = torch.empty(1000)
        done = wait_tensor(sent)
        assert tracker.current == tracker.peak == 4 * 1000
        other = done + 1                  # reading the result does not count it a second time
        assert tracker.current == 4 * 2000
        del other, sent                   # the storage lives on in the result
        assert tracker.current == 4 * 1000
        del done
        assert tracker.current == 0


def test_peak_anatomy_says_whose_memory_the_peak_is():
    """``PeakAnatomy``: the storages alive at the peak, grouped by the op that made them (or, for
    one made before, the op that first read it), add up to the peak."""
    from zerocompile.runtime.memory_tracker import PeakAnatomy

    earlier = torch.zeros(1000)                               # 4000 bytes, made before the tracker
    with PeakAnatomy() as tracker:
        tracker.reset_peak()
        kept = earlier + 1                                    # 4000 bytes
        product = torch.mm(torch.ones(100, 10), torch.ones(10, 100))   # 40000 bytes, the peak
        del product
        kept = kept * 2                                       # below the peak
    op, groups = tracker.at_peak
    assert op == "aten.mm.default" and tracker.peak == 56000
    assert groups == {"aten.mm.default": [40000, 1], "aten.ones.default": [8000, 2],
                      "made earlier, first read by aten.add.Tensor": [4000, 1], "aten.add.Tensor": [4000, 1]}
