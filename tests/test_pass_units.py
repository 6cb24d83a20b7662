"""Each pass and analysis on small hand-built FX graphs, without a process group.

Graphs are traced with ``make_fx`` from functions that call the functional collectives
on a made-up 2-rank group, then tagged as ``tag_collectives`` would tag them. To check
that a rewrite keeps the numbers, both graphs run under ``SimulatedCollectives``, an
interpreter that plays rank 0 of a world where rank r holds (r + 1) times rank 0's
tensor: all-gathers concatenate the scaled copies, reduce-scatters sum them and keep
rank 0's chunk. Any mix-up of buckets, offsets or order changes the result.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from zerocompile.config import ZeroConfig
from zerocompile.passes.bucketing import Member, block_of, bucket_collectives, plan_buckets
from zerocompile.passes.cast_before_gather import cast_before_gather
from zerocompile.passes.context import PassContext
from zerocompile.passes.analyses.cost_model import CostModel, node_flops
from zerocompile.passes.graph_utils import set_tag, stable_topological_sort, tag
from zerocompile.passes.insert_param_collectives import insert_param_collectives
from zerocompile.passes.analyses.liveness import saved_activation_bytes, simulate
from zerocompile.passes.prefetch import delay_reduce_waits, prefetch_gathers
from zerocompile.passes.selective_unshard import choose_kept
from zerocompile.runtime import param_ops
from zerocompile.runtime.comm import CommGroup
from zerocompile.runtime.sharded_param import ShardedParam

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
WORLD = 2


class SimulatedCollectives(torch.fx.Interpreter):
    """Rank 0 of a world where rank r's tensors are (r + 1) x rank 0's."""

    def call_function(self, target, args, kwargs):
        if target is c10d.all_gather_into_tensor.default:
            x, world = args[0], args[1]
            return torch.cat([x * (r + 1) for r in range(world)])
        if target is c10d.reduce_scatter_tensor.default:
            x, world = args[0], args[2]
            total = sum(x * (r + 1) for r in range(world))
            return total.view(world, -1)[0].clone()
        if target is c10d.wait_tensor.default:
            return args[0]
        return super().call_function(target, args, kwargs)


def _run(gm, *inputs):
    return SimulatedCollectives(gm).run(*inputs)


def _gather(shard, numel, shape):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(shard, WORLD, "fake"))[:numel].view(shape)


def _reduce(grad):
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(grad.reshape(-1), "sum", WORLD, "fake")) / WORLD


def _three_layer_forward(s1, s2, s3, x):
    """Three "layers" whose weights are gathered from shards of 6, 4 and 8 elements."""
    h = torch.tanh(x @ _gather(s1, 12, (3, 4)))        # 12 of 2 x 6 gathered elements
    h = torch.tanh(h @ _gather(s2, 8, (4, 2)))
    return (h @ _gather(s3, 16, (2, 8))).sum()


def _tagged(fn, inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    for i, node in enumerate(n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default):
        set_tag(node, role="param_gather", param=f"p{i}", params=[f"p{i}"])
        set_tag(next(iter(node.users)), role="param_gather_wait", param=f"p{i}")
    for i, node in enumerate(n for n in gm.graph.nodes if n.target is c10d.reduce_scatter_tensor.default):
        set_tag(node, role="grad_reduce_scatter", param=f"g{i}", params=[f"g{i}"])
        set_tag(next(iter(node.users)), role="grad_reduce_scatter_wait", param=f"g{i}")
    gm.graph.lint()
    gm.recompile()
    return gm


def _forward_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) for n in (6, 4, 8)] + [torch.randn(5, 3, generator=g)]


def _count(gm, target):
    return sum(n.target is target for n in gm.graph.nodes)


# ------------------------------------------------------------------ bucketing
def test_plan_buckets_keeps_order_caps_size_and_makes_the_first_bucket_small():
    def member(nbytes, dtype=torch.float32):
        node = torch.fx.Graph().placeholder("x")
        node.meta["val"] = torch.empty(1, dtype=dtype)
        coll = torch.fx.Graph().placeholder("c")
        coll.args = (node, WORLD, "fake")
        return Member(coll, node, coll, nbytes)

    ms = [member(10), member(10), member(10), member(10), member(30), member(10, torch.bfloat16), member(10)]
    buckets = plan_buckets(ms, cap_bytes=40, first_cap_bytes=15)
    assert [[ms.index(m) for m in b.members] for b in buckets] == [[0], [1, 2, 3], [4], [5], [6]]
    assert [b.nbytes for b in buckets] == [10, 30, 30, 10, 10]


@pytest.mark.parametrize("name, block", [
    ("blocks.3.attn.qkv.weight", "blocks.3"), ("model.layers.12.mlp.up_proj.weight", "model.layers.12"),
    ("transformer.h.0.ln_1.bias", "transformer.h.0"), ("layers.2.experts.7.w1", "layers.2"),
    ("l_self_modules_blocks_modules_4_parameters_weight_", "l.self.modules.blocks.modules.4"),
    ("tok_emb.weight", None), ("lm_head.weight", None), ("", None), (None, None)])
def test_block_of_is_the_name_up_to_its_first_number(name, block):
    assert block_of(name) == block


def test_plan_buckets_closes_a_large_enough_bucket_at_a_block_boundary():
    """Blocks of 30 B with a 100 B cap: without blocks three would share a bucket; a bucket of
    at least ``block_min_bytes`` closes where the next block starts, a smaller one takes the
    next block too, and members outside any block (None) join the bucket they follow."""
    def member(nbytes, block):
        node = torch.fx.Graph().placeholder("x")
        node.meta["val"] = torch.empty(1)
        coll = torch.fx.Graph().placeholder("c")
        coll.args = (node, WORLD, "fake")
        return Member(coll, node, coll, nbytes, block)

    ms = [member(4, None)] + [member(10, f"b.{i}") for i in range(3) for _ in range(3)] + [member(4, None)]
    no_blocks = plan_buckets(ms, cap_bytes=100)
    assert [len(b.members) for b in no_blocks] == [11]
    by_block = plan_buckets(ms, cap_bytes=100, block_min_bytes=20)
    assert [[m.block for m in b.members] for b in by_block] == [
        [None, "b.0", "b.0", "b.0"], ["b.1"] * 3, ["b.2"] * 3 + [None]]
    small_blocks = plan_buckets(ms, cap_bytes=100, block_min_bytes=40)
    assert [b.nbytes for b in small_blocks] == [64, 34]
    assert sum(b.nbytes for b in by_block) == sum(m.nbytes for m in ms)


@pytest.mark.parametrize("cap,expected", [(100, 2), (1, 3)])
def test_bucketing_gathers_keeps_numbers_bitwise(cap, expected):
    inputs = _forward_inputs()
    gm = _tagged(_three_layer_forward, inputs)
    before = _run(gm, *inputs)
    report = bucket_collectives(gm.graph, cap, "fw.")
    gm.graph.lint()
    gm.recompile()
    # cap 100 B: the first bucket (at most 100 / 8 B, but at least one member) holds p0
    # alone, the second p1 and p2 (32 + 64 B)
    assert _count(gm, c10d.all_gather_into_tensor.default) == expected
    assert report["all_gather"] == {"before": 3, "after": expected,
                                    "bucket_bytes": [48, 96] if expected == 2 else [48, 32, 64]}
    gathers = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    if expected == 2:
        assert tag(gathers[1])["params"] == ["p1", "p2"] and tag(gathers[1])["role"] == "bucket_gather"
        assert gathers[1].meta["val"].shape == (2 * (4 + 8),)
        # the copies in and out are one op each: no compute node reads the bucket at an offset
        # (which would make the kernels of every block different; runtime/bucket_ops.py)
        (wait,) = gathers[1].users
        assert [u.target for u in wait.users] == [torch.ops.zerocompile.unpack_gathered_bucket.default]
        assert gathers[1].args[0].target is torch.ops.zerocompile.pack_shards.default
    assert torch.equal(_run(gm, *inputs), before)


def _backward_like(g1, g2, g3):
    """Three gradients reduce-scattered one by one (padded sizes 6, 4, 8)."""
    a = _reduce(torch.tanh(g1))
    b = _reduce(g2 * 2)
    c = _reduce(g3 + 1)
    return a, b, c


def _backward_like_one_not_averaged(g1, g2, g3):
    """As ``_backward_like``, but the second gradient is summed, not averaged."""
    a = _reduce(torch.tanh(g1))
    b = c10d.wait_tensor(c10d.reduce_scatter_tensor((g2 * 2).reshape(-1), "sum", WORLD, "fake"))
    c = _reduce(g3 + 1)
    return a, b, c


@pytest.mark.parametrize("fn, divisions", [(_backward_like, 1), (_backward_like_one_not_averaged, 2)])
def test_bucketing_reduce_scatters_keeps_numbers_bitwise(fn, divisions):
    """One reduce-scatter for the three gradients; when every member is averaged, one division
    of the whole bucket replaces the three, otherwise each member keeps its own."""
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(6, generator=g), torch.randn(2, 2, generator=g), torch.randn(8, generator=g)]
    gm = _tagged(fn, inputs)
    before = _run(gm, *inputs)
    report = bucket_collectives(gm.graph, 10**6, "bw.")
    gm.graph.lint()
    gm.recompile()
    assert _count(gm, c10d.reduce_scatter_tensor.default) == 1
    assert _count(gm, torch.ops.zerocompile.pack_gradients.default) == 1
    assert _count(gm, torch.ops.zerocompile.divide_reduced.default) == divisions
    assert _count(gm, aten.div.Tensor) == 0
    assert report["reduce_scatter"]["after"] == 1
    after = _run(gm, *inputs)
    for x, y in zip(after, before):
        assert torch.equal(x, y)


# ------------------------------------------------------------------ prefetch
def _with_compute_between(s1, s2, s3, x):
    h = x
    for _ in range(3):                    # compute that a prefetch can hide a gather behind
        h = torch.tanh(h @ torch.ones(3, 3))
    return _three_layer_forward(s1, s2, s3, h)


def _gather_positions(gm):
    nodes = list(gm.graph.nodes)
    return [i for i, n in enumerate(nodes) if n.target is c10d.all_gather_into_tensor.default]


def test_prefetch_starts_gathers_early_keeps_their_order_and_the_numbers():
    inputs = _forward_inputs()
    gm = _tagged(_with_compute_between, inputs)
    before = _run(gm, *inputs)
    start = _gather_positions(gm)
    slow_network = CostModel(flops_per_s=1e9, alpha_s=1.0, bandwidth=1.0, memory_bandwidth=1e9)
    records = prefetch_gathers(gm.graph, slow_network, WORLD, inflight_cap=10**6)
    gm.graph.lint()
    gm.recompile()
    after = _gather_positions(gm)
    assert all(a < b for a, b in zip(after, start)), (after, start)      # every gather starts earlier
    assert [tag(n)["param"] for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default] == [
        "p0", "p1", "p2"]                                                 # in the same order
    assert all(r["moved_up"] > 0 for r in records)
    for node in gm.graph.nodes:                                           # each wait still before its use
        if node.target is c10d.wait_tensor.default:
            assert node.args[0] in node.all_input_nodes
    assert torch.equal(_run(gm, *inputs), before)


def test_prefetch_respects_bytes_in_flight_and_stops_when_compute_covers_comm():
    inputs = _forward_inputs()
    gm = _tagged(_with_compute_between, inputs)
    start = _gather_positions(gm)
    slow = CostModel(flops_per_s=1e9, alpha_s=1.0, bandwidth=1.0, memory_bandwidth=1e9)
    prefetch_gathers(gm.graph, slow, WORLD, inflight_cap=0)              # no bytes may be in flight early
    assert _gather_positions(gm) == start
    fast = CostModel(flops_per_s=1e9, alpha_s=1e-12, bandwidth=1e15, memory_bandwidth=1e3)
    records = prefetch_gathers(gm.graph, fast, WORLD, inflight_cap=10**6)
    assert all(r["moved_up"] == 1 for r in records)                      # one node of compute covers it


def _inflight_peak(graph):
    """Most all-gather bytes started and not yet waited for, in the graph's order (a gather
    is in flight until its wait returns, so one started before another's wait overlaps it)."""
    pending, peak = {}, 0
    for node in graph.nodes:
        if node.target is c10d.all_gather_into_tensor.default:
            pending[node] = node.meta["val"].numel() * node.meta["val"].element_size()
            peak = max(peak, sum(pending.values()))
        elif node.target is c10d.wait_tensor.default:
            pending.pop(node.args[0], None)
    return peak


def test_prefetch_never_starts_a_gather_while_one_it_cannot_join_is_in_flight():
    """Gathers of 48, 32 and 64 B under a 70 B cap: no two fit in flight together, so none
    may start before the previous one's wait, though the network wants them all early."""
    inputs = _forward_inputs()
    gm = _tagged(_with_compute_between, inputs)
    before = _run(gm, *inputs)
    assert _inflight_peak(gm.graph) == 64
    slow = CostModel(flops_per_s=1e9, alpha_s=1.0, bandwidth=1.0, memory_bandwidth=1e9)
    records = prefetch_gathers(gm.graph, slow, WORLD, inflight_cap=70)
    gm.graph.lint()
    gm.recompile()
    assert records[0]["moved_up"] > 0                                    # the first one still moves
    assert _inflight_peak(gm.graph) == 64
    assert torch.equal(_run(gm, *inputs), before)
    gm = _tagged(_with_compute_between, inputs)
    prefetch_gathers(gm.graph, slow, WORLD, inflight_cap=10**6)          # without the cap they overlap
    assert _inflight_peak(gm.graph) > 70


def test_prefetch_never_raises_the_peak_over_the_memory_cap():
    inputs = _forward_inputs()
    gm = _tagged(_with_compute_between, inputs)
    base_peak = simulate(gm.graph).peak
    slow = CostModel(flops_per_s=1e9, alpha_s=1.0, bandwidth=1.0, memory_bandwidth=1e9)
    prefetch_gathers(gm.graph, slow, WORLD, inflight_cap=10**6, memory_cap=base_peak)
    assert simulate(gm.graph).peak <= base_peak


def test_delay_reduce_waits_overlaps_one_reduction_and_keeps_the_numbers():
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(6, generator=g), torch.randn(2, 2, generator=g), torch.randn(8, generator=g)]
    gm = _tagged(_backward_like, inputs)
    before = _run(gm, *inputs)
    first_gap = _gap_between_reduce_and_wait(gm)
    assert delay_reduce_waits(gm.graph) == 3
    gm.graph.lint()
    gm.recompile()
    nodes = list(gm.graph.nodes)
    reduces = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
    waits = [next(iter(r.users)) for r in reduces]
    for wait, nxt in zip(waits, reduces[1:]):                            # one reduction in flight:
        between = nodes[nodes.index(wait) + 1:nodes.index(nxt)]          # a wait sits just before the
        assert all(wait in n.all_input_nodes for n in between), between  # next start (its users follow)
    assert _gap_between_reduce_and_wait(gm) > first_gap                  # more compute overlaps it
    for x, y in zip(_run(gm, *inputs), before):
        assert torch.equal(x, y)


def _four_rank_backward(g1, g2, g3):
    """Three gradients reduce-scattered one by one over 4 ranks, some compute between."""
    out = []
    for grad in (g1, g2, g3):
        grad = torch.tanh(grad) * 2
        out.append(c10d.wait_tensor(c10d.reduce_scatter_tensor(grad.reshape(-1), "sum", 4, "fake")) / 4)
    return tuple(out)


def test_two_hop_reductions_overlap_one_bucket_each():
    """qgZ with hpZ (k = 2 of 4 ranks): each reduce-scatter becomes a hop within the group and a
    hop across the groups; after ``delay_reduce_waits`` the first hop of reduction b is waited
    for just before reduction b+1's first hop starts, and the second hop of b is still in
    flight when b+1's first hop starts and is waited for before b+1's first hop is."""
    from zerocompile.passes.quantize_gradient_reductions import quantize_reductions

    inputs = [torch.randn(8), torch.randn(4, 4), torch.randn(12)]
    gm = _tagged(_four_rank_backward, inputs)
    report = quantize_reductions(gm.graph, ("fake", 2, "pairs", "across"))
    assert report == {"quantized": 3, "left": 0, "block": 256, "hierarchical_k": 2}
    delay_reduce_waits(gm.graph)
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    exchanges = [n for n in nodes if n.target is c10d.all_to_all_single.default]
    assert [n.args[3] for n in exchanges[:2]] == ["pairs", "across"]
    firsts = [n for n in exchanges if n.args[3] == "pairs"]
    seconds = [n for n in exchanges if n.args[3] == "across"]
    assert len(firsts) == len(seconds) == 3
    assert all(len(n.args[1]) == 2 for n in exchanges)
    at = nodes.index
    wait = lambda n: next(iter(n.users))  # noqa: E731
    for b in range(2):
        assert at(wait(firsts[b])) < at(firsts[b + 1])                       # hop 1 waited before the next starts
        assert at(firsts[b + 1]) < at(wait(seconds[b])) < at(wait(firsts[b + 1]))   # hop 2 overlaps it
    assert at(wait(seconds[2])) > at(wait(firsts[2]))


def _gap_between_reduce_and_wait(gm):
    nodes = list(gm.graph.nodes)
    return sum(nodes.index(next(iter(r.users))) - nodes.index(r)
               for r in nodes if r.target is c10d.reduce_scatter_tensor.default)


# ------------------------------------------------------------------ analyses
def test_liveness_counts_views_once_and_frees_after_last_use():
    def fn(x):
        a = x * 2                     # 64 B
        v = a.view(4, 4)              # a view: no new bytes, keeps a alive
        b = torch.tanh(x)             # 64 B
        return (v + b.view(4, 4)).sum()   # 64 B, then a 4-byte scalar

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(16))
    live = simulate(gm.graph)
    by_name = dict(zip(live.nodes, live.live))
    assert live.peak == 192                                       # a, b and their sum at once
    assert by_name["view"] == 64 and by_name["tanh"] == 128
    with_inputs = simulate(gm.graph, count_inputs=True)           # the input, until its last use
    assert dict(zip(with_inputs.nodes, with_inputs.live))["mul"] == 128
    assert with_inputs.peak == 192 and with_inputs.peak_breakdown == {"inputs": 64, "activations": 128}
    assert live.peak_breakdown == {"activations": 192}


def test_saved_activation_bytes_ignores_inputs_and_counts_storages_once():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(10)
    y = graph.call_function(aten.mul.Tensor, (x, 2))
    y.meta["val"] = torch.empty(10)
    v = graph.call_function(aten.view.default, (y, [2, 5]))
    v.meta["val"] = torch.empty(2, 5)
    out = graph.call_function(aten.sum.default, (y,))
    out.meta["val"] = torch.empty(())
    graph.output((out, x, y, v))      # 1 real output, then saved: x (input), y, and a view of y
    assert saved_activation_bytes(graph, num_fwd_outputs=1) == 40


def test_cost_model_formulas():
    cost = CostModel(flops_per_s=1e12, alpha_s=1e-5, bandwidth=1e9, memory_bandwidth=1e10)
    assert cost.collective_time("all_gather", 4000, 4) == pytest.approx(1e-5 + 3000 / 1e9)
    assert cost.collective_time("all_reduce", 4000, 4) == pytest.approx(1e-5 + 6000 / 1e9)
    assert cost.collective_time("all_gather", 4000, 1) == 0.0
    gm = make_fx(lambda a, b: a @ b, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 4))
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    assert node_flops(mm) == 2 * 8 * 16 * 4
    assert cost.node_time(mm) == pytest.approx(max(1024 / 1e12, (8 * 16 + 16 * 4 + 8 * 4) * 4 / 1e10))
    assert CostModel.from_rates({"alpha_us": 20}).alpha_s == pytest.approx(2e-5)


def test_stable_topological_sort_moves_only_what_it_must():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.neg, (x,))
    b = graph.call_function(torch.abs, (x,))
    c = graph.call_function(torch.add, (a, b))
    graph.output(c)
    c.prepend(b)          # legal already: nothing should move
    a.prepend(c)          # c now precedes its input a: illegal
    stable_topological_sort(graph)
    graph.lint()
    assert list(graph.nodes) == [x, a, b, c, next(iter(graph.find_nodes(op="output")))]


# ------------------------------------------------------------------ stage-3 decisions
def test_choose_kept_prefers_time_saved_per_byte_within_the_budget():
    graph = torch.fx.Graph()
    nodes = []
    for i, numel in enumerate([1000, 10, 100]):
        n = graph.placeholder(f"g{i}")
        n.meta["val"] = torch.empty(numel)
        nodes.append((n, [n]))
    cost = CostModel(alpha_s=1e-4, bandwidth=1e9)
    assert choose_kept(nodes, math.inf, cost, 2) == [nodes[1][0], nodes[2][0], nodes[0][0]]
    assert choose_kept(nodes, 440, cost, 2) == [nodes[1][0], nodes[2][0]]   # 40 + 400 bytes
    assert choose_kept(nodes, 0, cost, 2) == []


def test_cast_before_gather_moves_the_cast_in_front_of_the_gather():
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(torch.matmul, (x, w)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    group = CommGroup(rank=0, world=2, name="fake")
    sp = ShardedParam(torch.nn.Parameter(torch.randn(3, 4)), "w", 3, group, torch.bfloat16)
    ctx = PassContext(config=ZeroConfig.from_options({"stage": 3, "param_dtype": "bfloat16"}), group=group, frame="t")
    gm = insert_param_collectives(gm, ctx, plans=[None, sp])
    gather = next(n for n in gm.graph.nodes if n.target is param_ops.gather_param)
    assert gather.args[3] is torch.float32                      # gathered in fp32, then cast
    assert _count(gm, param_ops.cast_param) == 1
    gm = cast_before_gather(gm, ctx)
    gm.graph.lint()
    assert gather.args[3] is torch.bfloat16                     # cast first: half the bytes
    assert _count(gm, param_ops.cast_param) == 0
    assert ctx.results["cast_before_gather"] == {"folded": 1}


def _casts_first(s1, s2, s3, x):
    """The shards are all cast up front, as a partitioner may leave them: the gathers' input
    nodes then sit above earlier gathers."""
    c1, c2, c3 = s1.to(torch.float64), s2.to(torch.float64), s3.to(torch.float64)
    h = torch.tanh(x.double() @ _gather(c1, 12, (3, 4)))
    h = torch.tanh(torch.tanh(h) @ _gather(c2, 8, (4, 2)))
    return (torch.tanh(h) @ _gather(c3, 16, (2, 8))).sum()


def test_prefetch_keeps_the_gather_order_when_inputs_were_computed_early():
    inputs = _forward_inputs()
    gm = _tagged(_casts_first, inputs)
    before = _run(gm, *inputs)
    slow = CostModel(flops_per_s=1e9, alpha_s=1.0, bandwidth=1.0, memory_bandwidth=1e9)
    prefetch_gathers(gm.graph, slow, WORLD, inflight_cap=10**6)
    gm.graph.lint()
    gm.recompile()
    assert [tag(n)["param"] for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default] == [
        "p0", "p1", "p2"]
    assert torch.equal(_run(gm, *inputs), before)
