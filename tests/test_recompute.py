"""The activation-recompute pass (``passes/recompute.py``).

Most tests compile a small 4-block transformer with Dynamo and AOTAutograd (eager
inner compiler, world size 1, no process group), run the pass on the joint graph in
their own partitioner, call the min-cut partitioner, and measure what the forward
graph saves for backward (``liveness.saved_activation_bytes``). Each compiled run is
compared with eager PyTorch: loss and gradients must be bitwise equal. The last tests
go through the real ``"zero"`` backend (world size 1, and torch's fake process group
for 4 ranks).
"""

from __future__ import annotations

import copy
import logging
import operator

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from zerocompile import _torch_compat, inner_compilers
from zerocompile.config import ZeroConfig
from zerocompile.passes.context import PassContext
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.passes.analyses.liveness import saved_activation_bytes
from zerocompile.passes.recompute import find_blocks, module_path, recompute
from zerocompile.runtime.comm import CommGroup

aten = torch.ops.aten
MUST_RECOMPUTE, MUST_SAVE = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE
BATCH, SEQ, D, HEADS, VOCAB, LAYERS = 8, 16, 32, 4, 64, 4
BOUNDARY = BATCH * SEQ * D * 4  # bytes of one block input (fp32)


# ------------------------------------------------------------------------ test model
class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (z.view(b, s, HEADS, d // HEADS).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        att = ((q @ k.transpose(-2, -1)) * (d // HEADS) ** -0.5).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyLM(nn.Module):
    """Embeddings, ``layers`` numbered blocks (``blocks.0`` ...), final norm, head, loss."""

    def __init__(self, layers=LAYERS, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.02)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx, targets):
        x = self.emb(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def batch(step=0):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


# ------------------------------------------------------------------- compiled runs
class RecordingPartitioner:
    """Runs the pass (unless ``recompute="none"``), then the min-cut partitioner; keeps
    the context, the joint graph's nodes with the tags the pass left on them (the
    partitioner changes some of them afterwards) and the forward's saved bytes.

    For each option in ``also`` it first does the same on a copy of the joint graph and
    keeps the outcome in ``others[i]`` (measurements without a compile and run each)."""

    def __init__(self, recompute_option, also=()):
        self.option = recompute_option
        self.also = also
        self.others = []
        self.ctx = None
        self.tags = {}
        """``{node: (meta["recompute"], meta["ac_graph_id"])}`` right after the pass."""
        self.saved_bytes = None

    def __call__(self, joint, joint_inputs, **kwargs):
        for option in self.also:
            other = RecordingPartitioner(option)
            other.partition(_copy(joint), joint_inputs, **kwargs)
            self.others.append(other)
        return self.partition(joint, joint_inputs, **kwargs)

    def partition(self, joint, joint_inputs, **kwargs):
        self.ctx = PassContext(config=ZeroConfig.from_options({"recompute": self.option, "inner_compiler": "eager"}),
                               group=CommGroup(rank=0, world=1, name=""), frame="t",
                               num_fwd_outputs=kwargs["num_fwd_outputs"])
        if self.option != "none":
            joint = recompute(joint, self.ctx, recompute=self.ctx.config.passes.recompute)
        self.tags = {n: (n.meta.get("recompute"), n.meta.get("ac_graph_id")) for n in joint.graph.nodes}
        fw, bw = _torch_compat.min_cut_partition(joint, joint_inputs, **kwargs)
        self.saved_bytes = saved_activation_bytes(fw.graph, kwargs["num_fwd_outputs"])
        return fw, bw


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a graph module whose nodes have their own (shallow-copied) meta dicts."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def compiled_step(option, layers=LAYERS, dropout=0.0, also=()) -> RecordingPartitioner:
    """Compile TinyLM with the pass, run one forward/backward and check it against eager."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = TinyLM(layers, dropout)
    reference = copy.deepcopy(model)
    part = RecordingPartitioner(option, also)
    compiled = torch.compile(model, fullgraph=True,
                             backend=lambda gm, inputs: inner_compilers.compile_with_aot_eager(gm, inputs, part))
    idx, targets = batch()
    torch.manual_seed(1)
    loss = compiled(idx, targets)
    loss.backward()
    torch.manual_seed(1)
    expected = reference(idx, targets)
    expected.backward()
    assert torch.equal(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    return part


@pytest.fixture(scope="module")
def measured():
    """Saved bytes without recompute, with full recompute, and of the model without blocks;
    the outcome of budgets of 0 and 1e6 MiB (measured on the joint graph of the first)."""
    none = compiled_step("none", also=({"memory_budget_mb": 0}, {"memory_budget_mb": 1e6}))
    return {"none": none.saved_bytes, "zero": none.others[0], "huge": none.others[1],
            "full": compiled_step("full"), "no_blocks": compiled_step("none", layers=0).saved_bytes}


# ---------------------------------------------------------------------- full / budget
def test_full_recompute_saves_only_block_inputs(measured):
    full = measured["full"]
    # the forward keeps the input of each block (the first one is the embedding output,
    # which the model without blocks saves too) and what the part outside the blocks saves
    expected = measured["no_blocks"] + (LAYERS - 1) * BOUNDARY
    assert full.saved_bytes == pytest.approx(expected, rel=0.05)
    assert full.saved_bytes * 5 < measured["none"]
    result = full.ctx.results["recompute"]
    assert result["mode"] == "full" and result["budget_bytes"] is None
    assert result["blocks"] == result["recomputed"] == [f"blocks.{i}" for i in range(LAYERS)]
    assert result["estimated_saved_bytes"] >= full.saved_bytes


def test_full_recompute_tags_block_nodes_only_with_increasing_ids(measured):
    ids = []
    for node, (policy, ac_id) in measured["full"].tags.items():
        stack = node.meta.get("nn_module_stack") or {}
        in_block = any(".blocks." in str(v[0]) for v in stack.values())
        if node.op != "call_function" or node.meta.get("partitioner_tag") != "is_forward" or not in_block:
            assert policy is None, node.name
            continue
        assert policy == MUST_RECOMPUTE, node.name
        ids.append(ac_id)
    assert ids == sorted(ids) and len(set(ids)) == LAYERS


def test_budget_between_none_and_full_is_respected(measured):
    budget = (measured["none"] + measured["full"].saved_bytes) // 2
    part = compiled_step({"memory_budget_mb": budget / 2**20})
    result = part.ctx.results["recompute"]
    assert part.saved_bytes <= result["estimated_saved_bytes"] <= budget
    assert result["estimated_saved_bytes"] <= result["budget_bytes"] == pytest.approx(budget)
    assert 0 < len(result["recomputed"]) < LAYERS
    # identical blocks free the same bytes per second: graph order decides
    assert result["recomputed"] == result["blocks"][:len(result["recomputed"])]
    assert part.saved_bytes < measured["none"]


def test_budget_zero_recomputes_every_block(measured):
    part = measured["zero"]
    assert part.ctx.results["recompute"]["recomputed"] == [f"blocks.{i}" for i in range(LAYERS)]
    assert part.saved_bytes == measured["full"].saved_bytes


def test_budget_that_cannot_be_met_warns(caplog):
    gm, _ = _joint_graph([["blocks.0"], ["blocks.1"], ["head"]])
    caplog.set_level(logging.INFO, logger="zerocompile.passes")
    result = _run(gm, {"memory_budget_mb": 0})
    assert result["recomputed"] == ["blocks.0", "blocks.1"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "over the budget" in r.message]
    assert len(warnings) == 1 and "MiB" in warnings[0].message
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert any("recompute (budget): 2 of 2 blocks" in r.message for r in infos)


def test_huge_budget_recomputes_nothing(measured):
    part = measured["huge"]
    result = part.ctx.results["recompute"]
    assert result["recomputed"] == [] and result["blocks"] == [f"blocks.{i}" for i in range(LAYERS)]
    assert part.saved_bytes == measured["none"]
    assert not any(policy for policy, _ in part.tags.values())


def test_dropout_is_saved_not_recomputed():
    part = compiled_step("full", dropout=0.25)  # gradients match eager under the same seed
    dropouts = [n for n in part.tags if n.target is aten.native_dropout.default]
    assert len(dropouts) == LAYERS
    for node in dropouts:
        assert part.tags[node][0] == MUST_SAVE
        assert all(part.tags[u][0] == MUST_SAVE for u in node.users if u.target is operator.getitem)


# ------------------------------------------------------------- hand-built joint graphs
def _joint_graph(stacks, preset=None):
    """A chain of forward ``sin`` nodes, one per entry of ``stacks`` (its module paths, or
    None), and a backward that reads every one of them. ``preset`` maps an index of
    ``stacks`` to (policy, ac_graph_id) tags set before the pass."""
    graph = torch.fx.Graph()

    def node(op, target, args, tag):
        n = graph.create_node(op, target, args, name=target if op == "placeholder" else None)
        n.meta["val"] = torch.empty(4, 8)
        n.meta["partitioner_tag"] = tag
        return n

    prev = node("placeholder", "primals_1", (), "is_forward")
    tangent = node("placeholder", "tangents_1", (), "is_backward")
    forward = []
    for i, paths in enumerate(stacks):
        prev = node("call_function", aten.sin.default, (prev,), "is_forward")
        if paths:
            prev.meta["nn_module_stack"] = {f"m{j}": (p, nn.Module) for j, p in enumerate(paths)}
        if preset and i in preset:
            prev.meta["recompute"], prev.meta["ac_graph_id"] = preset[i]
        forward.append(prev)
    grad = tangent
    for n in reversed(forward):
        grad = node("call_function", aten.mul.Tensor, (grad, n), "is_backward")
    graph.output((prev, grad))
    return torch.fx.GraphModule(nn.Module(), graph), forward


def _run(gm, option="full", cost_model=None):
    ctx = PassContext(config=ZeroConfig.from_options({"recompute": option, "inner_compiler": "eager"}),
                      group=CommGroup(rank=0, world=1, name=""), frame="t", cost_model=cost_model)
    recompute(gm, ctx, recompute=ctx.config.passes.recompute)
    return ctx.results["recompute"]


def test_module_path_spellings():
    for spelling in ("L['self'].blocks.0.ln1", "L['self'].blocks[0].ln1", "blocks.0.ln1",
                     "L['self']._modules['blocks']._modules['0'].ln1", "getattr(L['self'].blocks, '0').ln1",
                     "L['model'].blocks.0.ln1", "L['args'][0].blocks[0].ln1"):
        assert module_path(spelling) == ("blocks", "0", "ln1"), spelling
    assert module_path("L['self']") == ()


def test_blocks_are_the_outermost_numbered_modules():
    gm, nodes = _joint_graph([
        ["L['self'].model.embed_tokens"],
        ["L['self'].model.layers[0]", "L['self'].model.layers[0].self_attn"],
        ["L['self'].model.layers[0]", "L['self'].model.layers[0].mlp.experts.3"],
        None,  # top-level code between blocks (e.g. a residual outside the block)
        ["L['self'].model.layers[1]"],
        ["L['self'].transformer.h.5", "L['self'].transformer.h.5.mlp"],
        ["L['self'].encoder.layer.2"],
        ["L['self'].lm_head"],
    ])
    result = _run(gm)
    assert result["blocks"] == ["model.layers.0", "model.layers.1", "transformer.h.5", "encoder.layer.2"]
    tags = [(n.meta.get("recompute"), n.meta.get("ac_graph_id")) for n in nodes]
    assert tags == [(None, None), (MUST_RECOMPUTE, 1), (MUST_RECOMPUTE, 1), (None, None),
                    (MUST_RECOMPUTE, 2), (MUST_RECOMPUTE, 3), (MUST_RECOMPUTE, 4), (None, None)]


def test_without_numbered_modules_top_level_children_are_blocks():
    gm, nodes = _joint_graph([["L['self'].embed"], ["L['self'].encoder", "L['self'].encoder.attn"],
                              ["L['self'].encoder"], ["L['self'].decoder.mlp"], None])
    result = _run(gm)
    assert result["blocks"] == ["embed", "encoder", "decoder"]
    assert [n.meta.get("ac_graph_id") for n in nodes] == [1, 2, 2, 3, None]


def test_a_module_called_twice_is_two_blocks():
    gm, nodes = _joint_graph([["blocks.0"], ["blocks.1"], ["blocks.0"]])
    result = _run(gm)
    assert result["blocks"] == ["blocks.0", "blocks.1", "blocks.0#2"]
    assert [n.meta["ac_graph_id"] for n in nodes] == [1, 2, 3]


def test_tagged_nodes_and_collectives_are_left_alone():
    gm, nodes = _joint_graph([["blocks.0"], ["blocks.0"], ["blocks.1"]],
                             preset={1: (MUST_SAVE, 7), 2: (MUST_RECOMPUTE, 100000)})
    graph = gm.graph
    with graph.inserting_after(nodes[0]):  # a collective inside block 0
        ar = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (nodes[0], "sum", "0"))
    ar.meta.update(val=torch.empty(4, 8), partitioner_tag="is_forward",
                   nn_module_stack=nodes[0].meta["nn_module_stack"])
    nodes[1].replace_input_with(nodes[0], ar)
    _run(gm)
    assert "recompute" not in ar.meta
    assert (nodes[1].meta["recompute"], nodes[1].meta["ac_graph_id"]) == (MUST_SAVE, 7)
    assert (nodes[2].meta["recompute"], nodes[2].meta["ac_graph_id"]) == (MUST_RECOMPUTE, 100000)
    # new block ids start above the user's region ids (7), below the parameter gathers' id
    assert (nodes[0].meta["recompute"], nodes[0].meta["ac_graph_id"]) == (MUST_RECOMPUTE, 8)


def test_budget_recomputes_the_cheapest_bytes_first():
    """Two blocks free the same bytes; the one whose op costs more FLOPs (a matmul, with a
    cost model of 1 FLOP/s) is recomputed only if the other is not enough."""
    gm, nodes = _joint_graph([["blocks.0"], ["blocks.1"], ["head"]])
    with gm.graph.inserting_before(nodes[0]):
        weight = gm.graph.placeholder("primals_2")
    weight.meta.update(val=torch.empty(8, 8), partitioner_tag="is_forward")
    nodes[0].target, nodes[0].args = aten.mm.default, (nodes[0].args[0], weight)
    one_block_freed = 4 * 8 * 4  # each block's output is read by backward; its input is saved anyway
    without = 3 * one_block_freed
    slow_flops = CostModel(flops_per_s=1.0)
    result = _run(gm, {"memory_budget_mb": (without - one_block_freed) / 2**20}, slow_flops)
    assert result["recomputed"] == ["blocks.1"]
    assert result["estimated_saved_bytes"] == without - one_block_freed
    assert [f["freed_bytes"] for f in result["per_block"]] == [one_block_freed, one_block_freed]
    gm2, _ = _joint_graph([["blocks.0"], ["blocks.1"], ["head"]])
    result = _run(gm2, {"memory_budget_mb": (without - one_block_freed) / 2**20}, slow_flops)
    assert result["recomputed"] == ["blocks.0"]  # equal cost: graph order


def test_budget_mode_records_its_decision():
    gm, _ = _joint_graph([["blocks.0"], ["blocks.1"], ["head"]])
    result = _run(gm, {"memory_budget_mb": 1e6})
    assert set(result) >= {"mode", "blocks", "recomputed", "estimated_saved_bytes", "budget_bytes"}
    assert result["mode"] == "budget" and result["recomputed"] == [] and result["budget_bytes"] == 1e6 * 2**20
    assert [b.name for b in find_blocks(gm.graph)] == ["blocks.0", "blocks.1"]


# ------------------------------------------------------------------ the "zero" backend
def test_zero_backend_stage3_full_recompute_trains_like_eager(caplog):
    import zerocompile

    caplog.set_level(logging.INFO, logger="zerocompile.passes")
    torch.compiler.reset()
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="zero",
                             options={"stage": 3, "inner_compiler": "eager", "recompute": "full"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        idx, targets = batch(step)
        loss = compiled(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected = reference(idx, targets)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(loss, expected), step
    state = zerocompile.full_state_dict(compiled)
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    assert any("recompute (full): 4 of 4 blocks" in r.message for r in caplog.records)


def test_zero_backend_stage3_four_ranks_keeps_the_collectives(fake_world, caplog):
    """With parameter all-gathers in the graph (4 fake ranks), full recompute partitions
    and runs; forward gathers and gradient reduce-scatters are one per parameter."""
    import zerocompile

    caplog.set_level(logging.INFO, logger="zerocompile.passes")
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    compiled = torch.compile(model, backend="zero", options={
        "stage": 3, "inner_compiler": "eager", "recompute": "full", "bucket_mb": 0, "prefetch": False})
    idx, targets = batch()
    zerocompile.reset_stats()
    loss = compiled(idx, targets)
    forward = zerocompile.stats()
    zerocompile.reset_stats()
    loss.backward()
    backward = zerocompile.stats()
    n_params = len(list(model.parameters()))
    assert forward.all_gather.count == backward.reduce_scatter.count == n_params
    # every block parameter is gathered again, for the recompute or the gradient; the
    # embedding weight is not needed in backward (its gradient is a scatter of the input)
    assert 0 < backward.all_gather.count < n_params
    assert any("recompute (full): 2 of 2 blocks" in r.message for r in caplog.records)
