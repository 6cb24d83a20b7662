"""Graph passes on hand-built FX graphs, and the pass manager (no process group needed,
except the last tests, which use torch's fake process group to build graphs for 4 ranks)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from zerocompile.config import ZeroConfig
from zerocompile.passes.analyses.collective_summary import summarize_collectives
from zerocompile.passes.context import PassContext
from zerocompile.passes.insert_param_collectives import insert_param_collectives
from zerocompile.passes.manager import pipeline, run_passes
from zerocompile.passes.analyses import param_identity
from zerocompile.passes.reshard_after_forward import gather_chain, parameter_gathers, tag_parameter_gathers
from zerocompile.runtime import param_ops
from zerocompile.runtime.comm import CommGroup
from zerocompile.runtime.sharded_param import ShardedParam

c10d = torch.ops._c10d_functional
FAKE = CommGroup(rank=1, world=2, name="fake")


def _dynamo_like_graph():
    """x @ w.T + b, with placeholders (x, w, b) as Dynamo would hand them over."""
    graph = torch.fx.Graph()
    x, w, b = graph.placeholder("x"), graph.placeholder("w"), graph.placeholder("b")
    mm = graph.call_function(torch.matmul, (x, graph.call_method("t", (w,))))
    graph.output(graph.call_function(operator.add, (mm, b)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _ctx(stage, **options):
    return PassContext(config=ZeroConfig.from_options({"stage": stage, "inner_compiler": "eager", **options}),
                       group=FAKE, frame="test")


@pytest.mark.parametrize("stage,op,n_inputs", [
    (3, param_ops.gather_param, 1), (2, param_ops.replica_with_sharded_grad, 2), (1, None, 1), (0, None, 1)])
def test_insert_param_collectives_per_stage(stage, op, n_inputs):
    gm = _dynamo_like_graph()
    w, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(5))
    plans = [None, ShardedParam(w, "w", stage, FAKE, torch.float32), ShardedParam(b, "b", stage, FAKE, torch.float32)]
    gm = insert_param_collectives(gm, _ctx(stage), plans=plans)
    gm.graph.lint()
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    assert len(placeholders) == 1 + 2 * n_inputs
    assert placeholders[0].name == "x"                         # order kept: x, then w's, then b's
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]
    if op is None:
        assert not any(n.target in (param_ops.gather_param, param_ops.replica_with_sharded_grad)
                       for n in gm.graph.nodes if n.op == "call_function")
        return
    assert [c.meta["zerocompile"]["param"] for c in sorted(calls, key=lambda n: n.args[0].name)] == ["b", "w"]
    if stage == 3:
        wcall = next(c for c in calls if c.meta["zerocompile"]["param"] == "w")
        # shard, numel, shape, compute dtype, reduce dtype, world, group name
        assert wcall.args[1:] == (15, (5, 3), torch.float32, torch.float32, 2, "fake")
        assert wcall.meta["zerocompile"]["role"] == "param_gather"


def test_stage0_bf16_inserts_a_cast():
    gm = _dynamo_like_graph()
    w, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(5))
    plans = [None, ShardedParam(w, "w", 0, FAKE, torch.bfloat16), ShardedParam(b, "b", 0, FAKE, torch.bfloat16)]
    gm = insert_param_collectives(gm, _ctx(0), plans=plans)
    casts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is param_ops.cast_param]
    assert len(casts) == 2 and all(c.args[1] is torch.bfloat16 for c in casts)


def test_insert_param_collectives_rejects_mismatched_plans():
    with pytest.raises(ValueError, match="one plan entry per placeholder"):
        insert_param_collectives(_dynamo_like_graph(), _ctx(3), plans=[None])


def test_shard_layout_is_flat_padded_equal_chunks():
    p = torch.nn.Parameter(torch.arange(7.0))
    sp = ShardedParam(p, "p", 3, CommGroup(rank=1, world=2, name="fake"), torch.float32)
    assert (sp.chunk, sp.padded_numel) == (4, 8)
    assert sp.shard.tolist() == [4.0, 5.0, 6.0, 0.0]         # rank 1's chunk, zero-padded
    assert sp.shard.is_leaf and sp.shard.requires_grad
    assert p.untyped_storage().nbytes() == 0 and p.shape == (7,)  # freed, shape kept
    q = torch.nn.Parameter(torch.arange(7.0))
    sq = ShardedParam(q, "q", 2, CommGroup(rank=0, world=2, name="fake"), torch.float32)
    # stage 2 in fp32: the parameter lives in the padded flat replica and the shard is a view of it
    assert q.untyped_storage().data_ptr() == sq.shard.untyped_storage().data_ptr()
    assert q.tolist() == list(range(7)) and sq.shard.tolist() == [0.0, 1.0, 2.0, 3.0]


def _traced_gather(dtype=torch.bfloat16):
    """A joint-like aten graph: a parameter gather (cast, all-gather, wait, slice, view, t) feeding a matmul."""
    def fn(shard, x):
        full = c10d.wait_tensor(c10d.all_gather_into_tensor(shard.to(dtype), 2, "fake"))
        w = full[:15].view(5, 3)
        return torch.mm(x.to(dtype), w.t())

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8), torch.randn(4, 3))
    for node in gm.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default):
        param_identity.mark(node, 0, "w")   # as AOTAutograd carries it from insert_param_collectives
    return gm


def test_reshard_after_forward_tags_the_whole_gather_chain_only():
    gm = _traced_gather()
    assert len(parameter_gathers(gm.graph)) == 1
    assert tag_parameter_gathers(gm.graph) == 1
    tagged = {n.target for n in gm.graph.nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE}
    aten = torch.ops.aten
    assert {c10d.all_gather_into_tensor.default, c10d.wait_tensor.default, aten.slice.Tensor,
            aten.view.default, aten.t.default} <= tagged
    assert aten._to_copy.default in tagged                    # the cast before the gather
    assert aten.mm.default not in tagged                       # compute is never tagged
    chain = gather_chain(next(iter(parameter_gathers(gm.graph))))
    assert all(n.meta["ac_graph_id"] == 100000 for n in chain)


def test_gather_of_an_activation_is_not_a_parameter_gather():
    def fn(shard, x):
        y = torch.relu(x)  # computed, not a graph input
        return c10d.wait_tensor(c10d.all_gather_into_tensor(y, 2, "fake")) + shard.sum()

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8), torch.randn(4))
    assert parameter_gathers(gm.graph) == []


def test_collective_summary_counts_full_buffer_bytes():
    summary = summarize_collectives(_traced_gather().graph)
    assert summary.totals["all_gather"].count == 1
    assert summary.totals["all_gather"].bytes == 16 * 2       # 2 ranks x 8 bf16 elements
    assert summary.totals["all_gather"].wire_bytes == 16      # a ring over 2 ranks sends half
    assert summary.totals["reduce_scatter"].count == 0


def test_wire_bytes_follow_each_collectives_own_group():
    """A ring over g ranks sends (g-1)/g of the full buffer per rank: an all-gather over 4
    ranks, a reduce-scatter over 2 and an all-to-all over 2 (qgZ's hops with hpZ) each with
    its own g, an all-reduce (which names no size) with the data-parallel group's, twice."""
    def fn(x, y, z, w):
        a = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 4, "fake"))
        b = c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", 2, "fake"))
        c = c10d.wait_tensor(c10d.all_to_all_single(z, [4, 4], [4, 4], "fake"))
        d = c10d.wait_tensor(c10d.all_reduce(w, "sum", "fake"))
        return a, b, c, d

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(8), torch.randn(16), torch.randn(8), torch.randn(8))
    totals = summarize_collectives(gm.graph, world=8).totals
    assert totals["all_gather"].bytes == 4 * 32 and totals["all_gather"].wire_bytes == 3 / 4 * 128
    # the reduce-scatter and the all-to-all both count as reduce_scatter
    assert totals["reduce_scatter"].count == 2 and totals["reduce_scatter"].bytes == 64 + 32
    assert totals["reduce_scatter"].wire_bytes == 64 / 2 + 32 / 2
    assert totals["all_reduce"].wire_bytes == 2 * 7 / 8 * 32


def test_pipeline_follows_stage_and_options():
    names = lambda ctx, kind: [p.name for p in pipeline(ctx, kind)]  # noqa: E731
    assert names(_ctx(3), "dynamo") == ["insert_param_collectives", "cast_before_gather"]
    assert names(_ctx(3), "joint") == ["tag_collectives", "reshard_after_forward"]
    # point_to_point_collectives runs where "auto" may choose the transfers (the defaults)
    assert names(_ctx(3), "forward") == ["bucketing", "prefetch", "point_to_point_collectives"]
    # reduce_scatter_in_place runs after it on every backward graph of stages 2-3 (it finds the CPU buckets)
    assert names(_ctx(3), "backward") == ["bucketing", "prefetch", "point_to_point_collectives",
                                          "reduce_scatter_in_place"]
    collectives = dict(parameter_gather="all_gather", gradient_reduction="reduce_scatter")
    assert names(_ctx(3, **collectives), "backward") == ["bucketing", "prefetch", "reduce_scatter_in_place"]
    assert names(_ctx(3, passes={"disable": ["reduce_scatter_in_place"]}, **collectives), "backward") == [
        "bucketing", "prefetch"]
    assert names(_ctx(2, gradient_reduction="point_to_point", parameter_gather="all_gather"), "backward") == [
        "bucketing", "prefetch", "all_reduce_gradients", "point_to_point_collectives", "reduce_scatter_in_place"]
    assert names(_ctx(2), "joint") == ["tag_collectives"]
    assert names(_ctx(1), "backward") == []
    assert names(_ctx(3, reshard_after_forward=False), "joint") == ["tag_collectives"]
    assert names(_ctx(3, passes={"disable": ["reshard_after_forward"]}), "joint") == ["tag_collectives"]
    assert names(_ctx(3, bucket_mb=0, prefetch=False, **collectives), "forward") == []
    assert names(_ctx(3, unshard_budget_mb=4, recompute="full"), "joint") == [
        "tag_collectives", "selective_unshard", "reshard_after_forward", "recompute"]


def test_pass_manager_checks_requirements_and_lints():
    gm = _traced_gather()
    with pytest.raises(RuntimeError, match=r"pass 'tag_collectives' requires \['param_collectives'\]"):
        run_passes(gm, _ctx(3), "joint")
    ctx = _ctx(3)
    ctx.provided.add("param_collectives")
    run_passes(gm, ctx, "joint")
    assert {"tags", "resharded"} <= ctx.provided


# ------------------------------------------------------------------ fake process group, 4 ranks
@pytest.mark.parametrize("reshard", [True, False])
def test_stage3_backward_regathers_only_when_resharding(fake_world, reshard):
    import zerocompile
    from models import make_batch, make_model

    model = make_model("mlp")
    compiled = torch.compile(model, backend="zero", options={
        "stage": 3, "inner_compiler": "eager", "reshard_after_forward": reshard,
        "bucket_mb": 0})  # one collective per parameter, as counted below
    x, y = make_batch("mlp", 0, 4)
    loss = compiled(x, y)
    zerocompile.reset_stats()
    loss.backward()
    bw = zerocompile.stats()
    padded = lambda n: -(-n // 4) * 4  # noqa: E731
    assert bw.reduce_scatter.count == 4
    assert bw.reduce_scatter.bytes == 4 * sum(padded(p.numel()) for p in model.parameters())
    if reshard:  # l2.weight is needed by the gradient of l1's output: gathered again
        assert (bw.all_gather.count, bw.all_gather.bytes) == (1, 4 * padded(13 * 5))
    else:        # the gathered weight was saved from forward instead
        assert bw.all_gather.count == 0


@pytest.mark.parametrize("limit_mb,kept", [(1e-6, 0), (1000, None)])
def test_auto_unshard_budget_follows_the_memory_limit(fake_world, limit_mb, kept):
    """``unshard_budget_mb="auto"`` keeps what fits under ``memory_limit_mb`` after the
    simulated peak: nothing under a tiny limit, every re-gathered parameter under a large one."""
    import zerocompile
    from models import make_batch, make_model

    model = make_model("gpt")
    compiled = torch.compile(model, backend="zero", options={
        "stage": 3, "inner_compiler": "eager", "unshard_budget_mb": "auto", "memory_limit_mb": limit_mb,
        "cost_model": {"alpha_us": 50}})
    x, y = make_batch("gpt", 0, 4)
    compiled(x, y).backward()
    report = zerocompile.frame_reports()[-1]["results"]["selective_unshard"]
    assert report["simulated_peak_without_kept"] > 0
    if kept == 0:
        assert report["kept"] == [] and report["budget_bytes"] == 0
    else:
        assert len(report["kept"]) == report["candidates"] > 0
        assert report["kept_bytes"] <= report["budget_bytes"]


def test_cast_before_gather_halves_the_bf16_gather_bytes(fake_world):
    import zerocompile
    from models import make_batch, make_model

    gathered = {}
    for disabled in ([], ["cast_before_gather"]):
        torch._dynamo.reset()
        model = make_model("mlp")
        compiled = torch.compile(model, backend="zero", options={
            "stage": 3, "inner_compiler": "eager", "param_dtype": "bfloat16", "bucket_mb": 0,
            "passes": {"disable": disabled}})
        x, y = make_batch("mlp", 0, 4)
        compiled(x, y).backward()
        report = zerocompile.frame_reports()[-1]
        gathered[bool(disabled)] = report["forward"]["all_gather"]
    assert gathered[False]["count"] == gathered[True]["count"] == 4
    assert gathered[True]["bytes"] == 2 * gathered[False]["bytes"]
    padded = lambda n: -(-n // 4) * 4  # noqa: E731
    assert gathered[False]["bytes"] == 2 * sum(padded(n) for n in (7 * 13, 13, 13 * 5, 5))


@pytest.mark.parametrize("bucket_mb,expected", [(0, 4), (25, 1)])
def test_bucket_mb_zero_also_unbuckets_the_optimizer_step(fake_world, bucket_mb, expected):
    import zerocompile
    from models import make_batch, make_model

    model = make_model("mlp")
    compiled = torch.compile(model, backend="zero", options={
        "stage": 1, "inner_compiler": "eager", "bucket_mb": bucket_mb})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    x, y = make_batch("mlp", 0, 4)
    compiled(x, y).backward()
    zerocompile.reset_stats()
    opt.step()
    stats = zerocompile.stats()
    assert (stats.reduce_scatter.count, stats.all_gather.count) == (expected, expected)


def test_the_cost_model_is_probed_once_per_process_group(fake_world):
    """Two frames compiled on one process group probe the rates once (the probe used to run at
    every frame's compile); a process group made anew is probed anew."""
    from unittest import mock

    import torch.distributed as dist

    from zerocompile._torch_compat import init_fake_process_group
    from zerocompile.passes.analyses import cost_model

    def train(width):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
        compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
        compiled(torch.randn(4, width)).sum().backward()

    with mock.patch.object(cost_model, "probe", wraps=cost_model.probe) as probe:
        train(8)
        train(16)
        assert probe.call_count == 1
        dist.destroy_process_group()
        init_fake_process_group(4)
        torch.compiler.reset()
        train(8)
        assert probe.call_count == 2
