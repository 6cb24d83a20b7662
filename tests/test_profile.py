"""``options={"profile": True}`` (passes/analyses/profiler.py): the cost model measured on the graph.

Unit tests on small traced graphs (what is timed, what keeps its estimate, the fit, the
random-number state left as it was, decisions that follow the measured times), and a
2-rank run: exact against the single-process reference, the same figures on every rank,
and a clear error when the ranks would profile different graphs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from harness import Run, assert_matches, reference, zero_train, zero_train_many
from test_pass_units import WORLD, _forward_inputs, _tagged, _with_compute_between
from torch.fx.experimental.proxy_tensor import make_fx

from zerocompile.config import ZeroConfig, ZeroConfigError
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.passes.prefetch import prefetch_gathers
from zerocompile.passes.analyses.profiler import (ProfiledCostModel, fit_alpha_beta, gather_sizes, op_signature,
                                         profile_graph)
from zerocompile.runtime.comm import CommGroup

aten = torch.ops.aten
ONE = CommGroup(rank=0, world=1, name="")


def _three_blocks(x, w):
    for _ in range(3):                                   # three identical blocks
        x = torch.relu(x @ w)
    return (torch.rand_like(x) * x).sum()              # a random op, as dropout draws


def _graph(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def test_identical_ops_share_one_signature_and_are_timed_once():
    gm = _graph(_three_blocks, torch.randn(16, 32), torch.randn(32, 32))
    mms = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    assert len(mms) == 3 and len({op_signature(n) for n in mms}) == 1
    model, summary = profile_graph(gm.graph, CostModel(), ONE, torch.device("cpu"))
    assert isinstance(model, ProfiledCostModel)
    distinct = {op_signature(n) for n in gm.graph.nodes} - {None}
    assert summary["ops_timed"] + summary["ops_estimated"] == len(distinct) < sum(
        n.op == "call_function" for n in gm.graph.nodes)
    assert summary["ops_estimated"] == 0 and summary["gather_sizes"] == 0  # world 1: nothing to gather
    times = {model.node_time(n) for n in mms}
    assert len(times) == 1 and times.pop() == model.op_seconds[op_signature(mms[0])] > 0


def test_a_signature_tells_shapes_strides_dtypes_and_arguments_apart():
    def f(a, b):
        return a @ b, a.t() @ b, a.double() @ b.double(), torch.sum(a, 0), torch.sum(a, 1)

    gm = _graph(f, torch.randn(8, 8), torch.randn(8, 8))
    sigs = [op_signature(n) for n in gm.graph.nodes if n.target in (aten.mm.default, aten.sum.dim_IntList)]
    assert len(sigs) == 5 and len(set(sigs)) == 5


def test_the_profile_leaves_the_random_number_generator_as_it_was():
    gm = _graph(_three_blocks, torch.randn(16, 32), torch.randn(32, 32))
    assert any(n.target is aten.rand_like.default for n in gm.graph.nodes)   # timed: draws numbers
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model, _ = profile_graph(gm.graph, CostModel(), ONE, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
    drop = next(n for n in gm.graph.nodes if n.target is aten.rand_like.default)
    assert op_signature(drop) in model.op_seconds


def test_ops_that_cannot_run_on_made_up_values_keep_their_estimate():
    def f(p):
        return torch.multinomial(p, 2)                   # made-up values are negative: it raises

    gm = _graph(f, torch.rand(4, 5))
    base = CostModel()
    model, summary = profile_graph(gm.graph, base, ONE, torch.device("cpu"))
    node = next(n for n in gm.graph.nodes if n.target is aten.multinomial.default)
    assert summary["ops_estimated"] == 1 and op_signature(node) not in model.op_seconds
    assert model.node_time(node) == base.node_time(node)


def test_nothing_is_timed_on_the_meta_device_or_for_fake_parameters():
    gm = _graph(_three_blocks, torch.randn(16, 32), torch.randn(32, 32))
    base = CostModel()
    for kwargs in ({"device": torch.device("meta")}, {"device": torch.device("cpu"), "fake_params": True}):
        device = kwargs.pop("device")
        model, summary = profile_graph(gm.graph, base, ONE, device, **kwargs)
        assert model is base and "skipped" in summary


def test_alpha_beta_fit_and_the_sizes_timed():
    assert fit_alpha_beta([(100.0, 1.0 + 100 * 0.01), (1000.0, 1.0 + 1000 * 0.01), (500.0, 6.0)]) == (
        pytest.approx(1.0), pytest.approx(0.01))
    assert fit_alpha_beta([(100.0, 1.0), (100.0, 2.0)]) is None          # one size: no slope
    assert fit_alpha_beta([(100.0, 2.0), (1000.0, 1.0)]) is None         # falling: no bandwidth
    gm = _tagged(_with_compute_between, _forward_inputs())
    assert gather_sizes(gm.graph, 0) == [32, 48, 64]                     # gathered bytes, distinct
    assert gather_sizes(gm.graph, 4096) == [32, 48, 64, 4096]            # and one bucket
    assert gather_sizes(gm.graph, 4096, limit=2) == [32, 4096]           # spread over the range


def test_prefetch_follows_the_measured_times():
    """The same graph and rates: with the compute measured as slow, one node covers each
    gather; measured as instant, nothing covers it and the gathers move as far as they can."""
    inputs = _forward_inputs()
    rates = {"flops_per_s": 1e9, "alpha_s": 1e-3, "bandwidth": 1e12, "memory_bandwidth": 1e9}
    moved = {}
    for name, seconds in (("slow", 1.0), ("instant", 0.0)):
        gm = _tagged(_with_compute_between, inputs)
        ops = {op_signature(n) for n in gm.graph.nodes} - {None}
        model = ProfiledCostModel(**rates, op_seconds=dict.fromkeys(ops, seconds))
        records = prefetch_gathers(gm.graph, model, WORLD, inflight_cap=10**6)
        moved[name] = [r["moved_up"] for r in records]
    assert moved["slow"] == [1, 1, 1]
    assert all(m > 1 for m in moved["instant"]), moved
    measured = ProfiledCostModel(**rates, gather_seconds={48: 0.5})
    assert measured.collective_time("all_gather", 48, WORLD) == 0.5                  # measured
    assert measured.collective_time("all_gather", 64, WORLD) == CostModel(**rates).collective_time(
        "all_gather", 64, WORLD)                                                    # estimated


def test_profile_option_is_validated():
    assert ZeroConfig().compiler.profile is False and ZeroConfig.from_options({"profile": True}).compiler.profile is True
    with pytest.raises(ZeroConfigError, match=r"option 'profile' = 'yes' is invalid; allowed: True, False"):
        ZeroConfig.from_options({"profile": "yes"})


# ------------------------------------------------------------------ two ranks
PROFILED = Run(model="gpt", stage=3, steps=3, options=(
    ("profile", True), ("recompute", {"memory_budget_mb": 0.05}), ("unshard_budget_mb", 0.05)))


def test_profiled_stage3_training_is_exact_and_every_rank_has_the_same_figures():
    results = run_ranks(zero_train, 2, PROFILED)
    assert_matches(results[0], reference(PROFILED))
    profiles = [r["reports"][0]["results"]["profile"] for r in results]
    assert profiles[0]["ops_timed"] > 0 and profiles[0]["gather_sizes"] > 0
    assert profiles[0]["digest"] == profiles[1]["digest"]                # the slowest rank's, on both
    assert profiles[0]["graph_compute_s"] == profiles[1]["graph_compute_s"]
    decisions = [(r["reports"][0]["results"]["recompute"], r["reports"][0]["results"]["selective_unshard"])
                 for r in results]
    assert decisions[0] == decisions[1]


ZOO = [Run(model="tied", stage=3, steps=3, options=(("profile", True),)),             # tied embedding / head
       Run(model="frozen", stage=2, steps=3, options=(("profile", True),)),           # frozen parameters
       Run(model="eager_head", stage=3, steps=3, accum=2,                             # a graph break, two frames
           options=(("profile", True), ("recompute", "full")))]


def test_profiled_training_is_exact_on_tied_frozen_and_graph_broken_models():
    results = run_ranks(zero_train_many, 2, ZOO)
    for run, result in zip(ZOO, results[0]):
        assert_matches(result, reference(run))
        profiled = [r["results"]["profile"] for r in result["reports"] if "profile" in r["results"]]
        assert profiled and all(p["ops_timed"] > 0 for p in profiled), (run.model, result["reports"])


def _different_graphs(rank, world):
    from zerocompile.runtime.comm import resolve_group

    n = 8 if rank == 0 else 12                            # rank 1 was given other shapes
    gm = _graph(lambda a: torch.relu(a @ a), torch.randn(n, n))
    try:
        profile_graph(gm.graph, CostModel(), resolve_group(dist.group.WORLD), torch.device("cpu"), frame="f")
    except RuntimeError as err:
        return str(err)
    return None


def test_ranks_that_would_profile_different_graphs_get_an_error_not_a_hang():
    for message in run_ranks(_different_graphs, 2):
        assert message is not None and "ranks [1] are about to time other ops" in message


def test_gathers_are_timed_the_same_number_of_times_on_every_rank(monkeypatch):
    """An op slow to warm up is timed once more, not three times; a collective never is,
    since ranks that warm up at different speeds would then issue different numbers of
    gathers and hang."""
    from zerocompile.passes.analyses import profiler

    calls = []
    monkeypatch.setattr(profiler, "_SLOW_OP_S", 0.0)                   # every warm-up counts as slow
    monkeypatch.setattr(profiler, "_gather", lambda x, group, works, out=None: calls.append(x.numel()))
    profiler.time_gather(4096, CommGroup(rank=0, world=2, name="g"), torch.device("cpu"), repeats=3)
    assert len(calls) == 4                                              # warm-up + 3, whatever the timing
    ops = []
    profiler._best_time(lambda: ops.append(1), torch.device("cpu"), 3)
    assert len(ops) == 2                                                # a local op: warm-up + 1
