"""A restart with the same inductor cache (zerocompile/compile_cache.py): AOTAutograd's cache hits
for zerocompile's frames, training is bitwise what the cold compile trained, ``stats()`` counts
the same collectives, and a changed option or graph misses."""

from __future__ import annotations

import os
import pickle

import torch
import torch.fx

from dist_utils import run_ranks
from harness import Run, assert_matches, reference, zero_train
from zerocompile import compile_cache
from zerocompile.runtime.accounting import CollectiveSummary
from zerocompile.runtime.comm import CommGroup
from zerocompile.runtime.param_ops import gather_param


def _train_in(rank: int, world: int, cache: str, run: Run) -> dict:
    """``zero_train`` in a fresh process whose inductor cache is ``cache``, with torch's cache counters."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    from torch._dynamo.utils import counters

    counters.clear()
    out = zero_train(rank, world, run)
    out["aot"] = dict(counters["aot_autograd"])
    out["fx"] = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return out


def _same_training(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert set(a["state"]) == set(b["state"])
    for key, value in a["state"].items():
        assert torch.equal(value, b["state"][key]), key
    assert a["stats"] == b["stats"], "the collectives counted differ (summaries not restored?)"


def test_restart_hits_the_caches_and_trains_bitwise_alike_a_changed_option_misses(tmp_path):
    cache = str(tmp_path / "inductor")
    # stage 3 with prefetch: the cost model is probed, so the ranks agree on reusing their entries
    run = Run(model="mlp", stage=3, steps=3, inner="inductor")
    cold = run_ranks(_train_in, 2, cache, run)
    assert all(r["aot"].get("autograd_cache_miss", 0) >= 1 and not r["aot"].get("autograd_cache_hit")
               for r in cold), [r["aot"] for r in cold]
    assert_matches(cold[0], reference(run))
    entries = list((tmp_path / "inductor" / "zerocompile" / "frames").glob("*.pkl"))
    assert len(entries) == 2 * len(cold[0]["reports"]), entries   # one per rank and frame
    # the measured parameter_gather choice is kept for the restart (the graphs depend on it)
    assert [p.name for p in (tmp_path / "inductor" / "zerocompile" / "choices").glob("*.json")] == [
        "v5-world2-gloo-cpu-reduce-in-graph-gather-in-graph.json"]   # stage 3: both in its graphs

    warm = run_ranks(_train_in, 2, cache, run)
    for c, w in zip(cold, warm):
        assert w["aot"].get("autograd_cache_hit") == c["aot"]["autograd_cache_miss"], w["aot"]
        assert not w["aot"].get("autograd_cache_miss") and not w["fx"].get("fxgraph_cache_miss"), (w["aot"], w["fx"])
        assert [r["results"] for r in w["reports"]] == [r["results"] for r in c["reports"]]
    _same_training(cold[0], warm[0])
    assert warm[0]["stats"]["all_gather"]["count"] > 0 and warm[0]["stats"]["reduce_scatter"]["count"] > 0

    # an option that changes no graph of this model still misses AOTAutograd's cache (the passes
    # run again); the post-pass graphs are the same, so inductor's FX-graph cache serves them
    changed = Run(model="mlp", stage=3, steps=3, inner="inductor", options=(("memory_limit_mb", 1000.0),))
    other = run_ranks(_train_in, 2, cache, changed)
    assert all(r["aot"].get("autograd_cache_miss", 0) >= 1 and not r["aot"].get("autograd_cache_hit")
               for r in other), [r["aot"] for r in other]
    _same_training(cold[0], other[0])


def test_rank_specific_graphs_are_cached_per_rank(tmp_path):
    """Stage 2 with all-reduced gradients: each rank's backward graph keeps its own rows of the
    gradients. With one cache key for every rank (as once), the ranks' entries overwrote each
    other and a restart trained one rank with the other's graph: a silent wrong answer, here
    the warm run's losses against the cold run's and the single-process reference."""
    cache = str(tmp_path / "inductor")
    run = Run(model="mlp", stage=2, steps=2, inner="inductor", options=(("gradient_reduction", "all_reduce"),))
    cold = run_ranks(_train_in, 2, cache, run)
    assert_matches(cold[0], reference(run))
    assert cold[0]["reports"][0]["results"]["all_reduce_gradients"]["replaced"] > 0, cold[0]["reports"][0]["results"]
    warm = run_ranks(_train_in, 2, cache, run)
    for c, w in zip(cold, warm):
        assert w["aot"].get("autograd_cache_hit") == c["aot"]["autograd_cache_miss"], w["aot"]
        _same_training(c, w)


def _graph(fn) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)


def test_frame_key_changes_with_the_graph_inputs_rank_and_options():
    group = CommGroup(rank=0, world=2, name="0")
    gm = _graph(lambda x: torch.relu(x) * 2)
    x = torch.zeros(4, 3)
    key = compile_cache.frame_key(gm, [x], group, "uuid-a")
    assert key == compile_cache.frame_key(_graph(lambda x: torch.relu(x) * 2), [torch.ones(4, 3)], group, "uuid-a")
    assert key != compile_cache.frame_key(_graph(lambda x: torch.relu(x) * 3), [x], group, "uuid-a")
    assert key != compile_cache.frame_key(gm, [torch.zeros(4, 4)], group, "uuid-a")
    assert key != compile_cache.frame_key(gm, [torch.zeros(4, 3, dtype=torch.float64)], group, "uuid-a")
    assert key != compile_cache.frame_key(gm, [torch.zeros(4, 3).requires_grad_()], group, "uuid-a")
    assert key != compile_cache.frame_key(gm, [torch.zeros(3, 4).t()], group, "uuid-a")
    assert key != compile_cache.frame_key(gm, [x], CommGroup(rank=1, world=2, name="0"), "uuid-a")
    assert key != compile_cache.frame_key(gm, [x], CommGroup(rank=0, world=4, name="0"), "uuid-a")
    assert key != compile_cache.frame_key(gm, [x], group, "uuid-b")


def test_options_and_sources_change_the_partitioner_uuid():
    from zerocompile.partitioner import ZeroPartitioner
    from zerocompile.config import ZeroConfig
    from zerocompile.passes.context import PassContext

    def uuid(**options):
        cfg = ZeroConfig.from_options({"stage": 3, **options})
        return ZeroPartitioner(PassContext(config=cfg, group=CommGroup(0, 1, ""), frame="f")).uuid()

    assert uuid() == uuid()
    assert uuid() != uuid(bucket_mb=1.0)
    assert uuid() != uuid(prefetch=False)

    def uuid_of(rank, world, name="0"):
        cfg = ZeroConfig.from_options({"stage": 2})
        return ZeroPartitioner(PassContext(config=cfg, group=CommGroup(rank, world, name), frame="f")).uuid()

    assert len({uuid_of(0, 2), uuid_of(1, 2), uuid_of(0, 4), uuid_of(0, 2, "1")}) == 4


def _gathering_graph() -> torch.fx.GraphModule:
    """A graph that calls ``gather_param`` (as ``insert_param_collectives`` writes it), then relu."""
    graph = torch.fx.Graph()
    full = graph.call_function(gather_param, (graph.placeholder("shard"), 6, (2, 3), torch.float32,
                                              torch.float32, 2, "0"))
    graph.output(graph.call_function(torch.relu, (full,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_cacheable_functions_names_the_zerocompile_functions_of_the_graph():
    gm = _gathering_graph()
    assert compile_cache.cacheable_functions(gm, "digest") == {
        "zerocompile.runtime.param_ops.gather_param": "digest"}


def test_entries_round_trip_and_a_damaged_one_is_a_miss(tmp_path):
    cache = compile_cache.FrameCache(tmp_path)
    summary = CollectiveSummary()
    summary.add("all_gather", 64, dtype="torch.float32", group_size=2)
    entry = compile_cache.FrameEntry(summary, CollectiveSummary(), None, {"bucketing": {"forward": 1}},
                                     {"flops_per_s": 1.0})
    assert cache.load("k") is None
    cache.save("k", entry)
    assert cache.load("k") == entry
    (tmp_path / "k.pkl").write_bytes(b"not a pickle")
    assert cache.load("k") is None
    (tmp_path / "k.pkl").write_bytes(pickle.dumps({"a": 1}))
    assert cache.load("k") is None


def test_agreement_value_follows_the_cost_model():
    def entry(rates):
        return compile_cache.FrameEntry(None, CollectiveSummary(), None, {}, rates)

    assert entry({"a": 1.0}).agreement_value() == entry({"a": 1.0}).agreement_value() != 0
    assert entry({"a": 1.0}).agreement_value() != entry({"a": 2.0}).agreement_value()
    assert compile_cache.agree(entry(None), CommGroup(0, 1, ""), None)
    assert not compile_cache.agree(None, CommGroup(0, 1, ""), None)


def test_bypass_reasons():
    assert compile_cache.bypass_reason("inductor", False, False, 1) is None
    assert "eager" in compile_cache.bypass_reason("eager", False, False, 1)
    assert "profile" in compile_cache.bypass_reason("inductor", True, False, 1)
    assert "dump" in compile_cache.bypass_reason("inductor", False, True, 1)
    assert "hpz" in compile_cache.bypass_reason("inductor", False, False, 2)
    with torch._inductor.config.patch(fx_graph_cache=False):
        assert "disabled" in compile_cache.bypass_reason("inductor", False, False, 1)


def _step_in_this_process():
    """Compile the MLP at stage 3 (one process, no process group) and run one step; the loss,
    the frame's pass results and torch's AOTAutograd cache counters of that compile."""
    import time

    import zerocompile
    from models import make_batch, make_model
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    zerocompile.reset_stats()
    counters.clear()
    started = time.monotonic_ns()
    compiled = torch.compile(make_model("mlp"), backend="zero", options={"stage": 3, "inner_compiler": "inductor"})
    x, y = make_batch("mlp", 0, 8)
    loss = compiled(x, y)
    loss.backward()
    reports = [r["results"] for r in zerocompile.frame_reports() if r["compiled_at_ns"] > started]
    return loss.item(), reports, dict(counters["aot_autograd"])


def test_a_hit_without_zerocompiles_entry_compiles_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    frames = tmp_path / "zerocompile" / "frames"
    loss, reports, aot = _step_in_this_process()
    assert aot.get("autograd_cache_miss") == 1 and len(list(frames.glob("*.pkl"))) == 1, aot
    assert reports and reports[0].get("simulated_peak_bytes", 0) > 0, reports
    for entry in frames.glob("*.pkl"):
        entry.unlink()
    again = _step_in_this_process()
    # AOTAutograd's cache hit, but with no entry the frame compiled again with the passes (which
    # wrote the pass results and a new entry)
    assert again[2].get("autograd_cache_hit") == 1, again[2]
    assert again[:2] == (loss, reports) and len(list(frames.glob("*.pkl"))) == 1
    third = _step_in_this_process()                                  # and now from the caches
    assert third[2].get("autograd_cache_hit") == 1 and third[:2] == (loss, reports), third
    torch._dynamo.reset()
