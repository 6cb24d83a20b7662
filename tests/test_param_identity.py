"""Parameters are resolved by object, not by where Dynamo first met them.

With a graph break inside a layer loop Dynamo compiles a block's frame once and runs the same
code for every block its guards accept; zerocompile once ran every later block with the
parameters of the block the frame was traced with (issue 8, problem 1). Each model of the zoo
(tests/zoo.py) trains on 2 ranks at every stage exactly as plain PyTorch does in one process.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

import zerocompile
import zoo
from zerocompile.passes.analyses import param_identity
from dist_utils import run_ranks
from harness import train_on_rank_slices

STEPS, BATCH = 3, 4


def reference(name: str) -> tuple[list, dict]:
    model = zoo.make(name)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        loss = model(*zoo.batch(step, BATCH))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank: int, world: int, name: str, stage: int, inner: str) -> tuple[list, dict, int]:
    torch._dynamo.reset()
    model = zoo.make(name)
    # by design of these models some parameters are used by no compiled frame: a graph break in
    # a loop makes Dynamo skip the looping forward, so the head it calls runs eagerly (an
    # nn.Linear is no frame of its own), and the eager block is torch.compiler.disable'd
    options = {"stage": stage, "inner_compiler": inner, "allow_unsharded": True}
    compiled = torch.compile(model, backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05,
                                    weight_decay=0.1)
    losses = train_on_rank_slices(compiled, opt, (zoo.batch(step, BATCH) for step in range(STEPS)), rank, world)
    sharded = sum(1 for p in model.parameters() if zerocompile.runtime.sharded_param.get_state(p) is not None)
    return losses, zerocompile.full_state_dict(compiled, rank0_only=False), sharded


def assert_same(result, ref, label):
    losses, state, _ = result
    ref_losses, ref_state = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{label} losses: {m}")
    assert set(state) == set(ref_state), label
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, atol=2e-5, rtol=2e-5, msg=lambda m: f"{label} {key}: {m}")


def test_original_report_graph_break_between_blocks_world_one():
    """The minimal repro: three residual blocks, a break after block 0, stage 0, one process."""
    torch._dynamo.reset()
    torch.manual_seed(0)

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return x + self.l(x)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Blk() for _ in range(3))

        def forward(self, x):
            for i, blk in enumerate(self.blocks):
                x = blk(x)
                if i == 0:
                    torch._dynamo.graph_break()
            return x.sum()

    x = torch.randn(2, 4)
    for stage in (0, 3):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = M()
        with torch.no_grad():
            eager = model(x).item()
            b = model.blocks
            wrong = b[1](b[1](b[0](x))).sum().item()   # what the bug computed: blocks (0, 1, 1)
        assert abs(eager - wrong) > 1e-3  # the bug's answer is distinguishable from the right one
        compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
        assert compiled(x).item() == pytest.approx(eager, abs=1e-6), f"stage {stage}"


def train_cases(rank, world, cases, inner):
    return {(name, stage): train(rank, world, name, stage, inner) for stage, names in cases for name in names}


# the whole zoo at stages 0 and 3 (sharding nothing, sharding everything); stages 1 and 2 on
# the models whose parameters reach frames in the most ways (a suite-time budget)
ZOO_CASES = [
    (0, list(zoo.ZOO)), (3, list(zoo.ZOO)),
    (1, ["loop_break_between", "shared_across_blocks", "eager_block", "called_twice"]),
    (2, ["loop_break_every", "hook_breaks", "shared_across_blocks", "nested_lists", "param_view_across_break"])]
INDUCTOR_CASES = [(stage, ["loop_break_between", "hook_breaks", "shared_across_blocks"]) for stage in (0, 3)]


@functools.cache
def _ref(name):
    """Each model's single-process reference, computed once per test process."""
    return reference(name)


@pytest.fixture(scope="module")
def zoo_results(once_per_run):
    """``zoo_results(inner)``: the spawned runs of every parametrization together, once per
    pytest run (the parametrizations may run on either xdist worker)."""
    def results(inner):
        cases = ZOO_CASES if inner == "eager" else INDUCTOR_CASES
        return once_per_run(f"test_param_identity.zoo_{inner}", lambda: run_ranks(train_cases, 2, cases, inner))
    return results


@pytest.mark.parametrize("stage,names", ZOO_CASES)
def test_zoo_matches_single_process(zoo_results, stage, names):
    results = zoo_results("eager")
    for rank, ranks in enumerate(results):
        for name in names:
            assert_same(ranks[(name, stage)], _ref(name), f"{name} stage {stage} rank {rank}")
            if stage > 0:  # every parameter a compiled frame touched is sharded (by object)
                assert ranks[(name, stage)][2] > 0, (name, stage, rank)


@pytest.mark.parametrize("stage", [0, 3])
def test_zoo_with_inductor(zoo_results, stage):
    results = zoo_results("inductor")
    (names,) = [names for st, names in INDUCTOR_CASES if st == stage]
    for rank, ranks in enumerate(results):
        for name in names:
            assert_same(ranks[(name, stage)], _ref(name), f"{name} stage {stage} inductor rank {rank}")


# -- the identity's invariants, on hand-built graphs (no process group) -------------------------

def _two_gathers_graph(mark_second_as_same: bool, mark_first: bool = True):
    from torch.fx.experimental.proxy_tensor import make_fx

    c10d = torch.ops._c10d_functional

    def fn(shard_a, shard_b, x):
        a = c10d.wait_tensor(c10d.all_gather_into_tensor(shard_a, 2, "fake"))
        b = c10d.wait_tensor(c10d.all_gather_into_tensor(shard_b, 2, "fake"))
        return (x * a[:4]).sum() + (x * b[:4]).sum()

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(2), torch.randn(2), torch.randn(4))
    first, second = gm.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    if mark_first:
        param_identity.mark(first, 0, "a")
    param_identity.mark(second, 0 if mark_second_as_same else 1, "a" if mark_second_as_same else "b")
    return gm


def test_identity_check_refuses_two_gathers_of_one_parameter():
    param_identity.check_at_most_one_each(_two_gathers_graph(False).graph, "test")   # a and b: fine
    with pytest.raises(param_identity.ParamIdentityError, match="2 all-gathers of parameter 'a'"):
        param_identity.check_at_most_one_each(_two_gathers_graph(True).graph, "test")


def test_identity_check_refuses_a_read_parameter_without_its_gather():
    graph = _two_gathers_graph(False, mark_first=False).graph   # parameter 0's gather lost its identity
    param_identity.check_gathered_where_read(graph, {1: "b"}, "test")
    with pytest.raises(param_identity.ParamIdentityError, match=r"\['a'\] without an all-gather"):
        param_identity.check_gathered_where_read(graph, {0: "a", 1: "b"}, "test")


def test_tag_collectives_ensures_runs_in_the_pipeline():
    """The manager runs a pass's ``ensures`` on the graph it produced."""
    from zerocompile.config import ZeroConfig
    from zerocompile.passes.context import PassContext
    from zerocompile.passes.manager import run_passes
    from zerocompile.runtime.comm import CommGroup
    from zerocompile.runtime.sharded_param import ShardedParam

    group = CommGroup(rank=0, world=2, name="fake")
    params = [ShardedParam(torch.nn.Parameter(torch.randn(4)), n, 3, group, torch.float32) for n in "ab"]
    ctx = PassContext(config=ZeroConfig.from_options({"stage": 3, "inner_compiler": "eager"}), group=group,
                      frame="t", primal_params=params)
    ctx.provided.add("param_collectives")
    run_passes(_two_gathers_graph(False), ctx, "inference")
    assert ctx.results["tag_collectives"] == {"param_gathers": 2, "grad_reduce_scatters": 0}
    with pytest.raises(param_identity.ParamIdentityError):
        run_passes(_two_gathers_graph(True), ctx, "inference")


def test_parameters_are_numbered_by_distinct_state_in_input_order():
    a, b = object(), object()      # stand-ins for two ShardedParams
    # stage 2 hands a parameter as two inputs (shard, replica): one parameter, one number
    assert param_identity.number_parameters([None, a, a, b, None, b]) == [None, 0, 0, 1, None, 1]
    assert param_identity.number_parameters([]) == []
