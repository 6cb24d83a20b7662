"""Activation offload (``offload_activations``; runtime/activation_offload.py, passes
offload_activations and plan_activations): bitwise the numbers of the run without it, at every
stage, under gradient accumulation, across graph breaks and around the user's own checkpoint
regions; less memory; the files gone at exit; bad input refused early."""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocompile
from dist_utils import run_ranks
from harness import Run, zero_train_many
from models import make_batch, make_model
from zerocompile.config import ZeroConfig
from zerocompile.deepspeed_config import translate_deepspeed
from zerocompile.errors import SwapFileError, ZeroConfigError
from zerocompile.passes.analyses.cost_model import CostModel
from zerocompile.passes.graph_utils import tensor_nbytes
from zerocompile.runtime import activation_offload
from zerocompile.runtime.activation_offload import FileStore, dense_span, offload_activation, reload_activation

_WAIT = torch.ops._c10d_functional.wait_tensor


# ------------------------------------------------------------------------------ options
@pytest.mark.parametrize("value, message", [
    ({"device": "nvme"}, "needs 'offload_activations.nvme_path'"),
    ({"device": "disk", "nvme_path": "/x"}, "'offload_activations.device' = 'disk' is invalid"),
    ({"device": "nvme", "nvme_path": "/x", "budget": 3}, "unknown key 'offload_activations.budget'"),
    ({"device": "nvme", "nvme_path": "/x", "budget_mb": -1}, "'offload_activations.budget_mb' = -1 is invalid"),
    ({"device": "nvme", "nvme_path": "/x", "budget_mb": "auto"}, "needs 'memory_limit_mb'"),
    ({"device": "nvme", "nvme_path": "/x", "min_kb": "big"}, "'offload_activations.min_kb' = 'big' is invalid"),
    ({"device": "nvme", "nvme_path": "/x", "memory_limit_mb": 3}, "the memory limit is the option memory_limit_mb"),
    ("nvme", "option 'offload_activations' = 'nvme' is invalid"),
    ({"budget_mb": 5}, "gives no 'device' to offload to"),
    ({"device": "nvme", "nvme_path": "/x", "pin_memory": False}, "unknown key 'offload_activations.pin_memory'"),
])
def test_bad_options_are_refused_with_the_fix(value, message):
    with pytest.raises(ZeroConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ZeroConfig.from_options({"offload_activations": value})


def test_options_parse_with_their_defaults():
    settings = ZeroConfig.from_options({"offload_activations": {"device": "nvme", "nvme_path": "/x", "budget_mb": "auto"},
                                        "memory_limit_mb": 100}).passes.offload_activations
    assert (settings.device, settings.nvme_path, settings.budget_mb, settings.min_kb, settings.memory_limit_mb) == (
        "nvme", "/x", "auto", 64.0, 100.0)
    assert not ZeroConfig().passes.offload_activations.enabled


def test_deepspeed_cpu_checkpointing_maps_onto_the_option_and_unknown_keys_are_refused():
    out = translate_deepspeed({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                                            "contiguous_memory_optimization": False,
                                                            "number_checkpoints": 4, "profile": False}})
    assert out == {"offload_activations": {"device": "cpu"}}
    assert translate_deepspeed({"activation_checkpointing": {"cpu_checkpointing": False}}) == {}
    with pytest.raises(ZeroConfigError, match="did you mean 'activation_checkpointing.cpu_checkpointing'"):
        translate_deepspeed({"activation_checkpointing": {"cpu_checkpointng": True}})
    with pytest.raises(ZeroConfigError, match="'activation_checkpointing.cpu_checkpointing' = 'yes' is invalid"):
        translate_deepspeed({"activation_checkpointing": {"cpu_checkpointing": "yes"}})


# ------------------------------------------------------------------------------ the ops
def test_dense_span():
    assert dense_span([2, 3], [3, 1]) == 6
    assert dense_span([2, 3], [1, 2]) == 6          # a transpose: dense in another order
    assert dense_span([4, 1, 5], [5, 99, 1]) == 20  # a size-1 dimension's stride is free
    assert dense_span([2, 3], [6, 1]) is None       # a slice with gaps
    assert dense_span([2, 3], [0, 1]) is None       # an expand (overlapping)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_copy_reloads_bitwise_in_its_own_strides_and_its_region_is_reused(tmp_path, dtype):
    t = (torch.randn(5, 300, 7) * 100).to(dtype).transpose(0, 2)        # dense, not contiguous
    token = offload_activation(t, "nvme", str(tmp_path))
    store = activation_offload.stores().get("nvme", str(tmp_path))
    size = store.file.size
    out = reload_activation(token, "nvme", str(tmp_path), list(t.shape), list(t.stride()), t.dtype, t.device)
    out = _WAIT(out)
    assert out.stride() == t.stride() and out.dtype == dtype and torch.equal(out, t)
    assert store.live_slots() == 1                  # kept while the token lives (a second backward)
    del token
    assert store.live_slots() == 0
    again = offload_activation(t + 1, "nvme", str(tmp_path))
    assert store.file.size == size                  # the released region took the next copy
    back = _WAIT(reload_activation(again, "nvme", str(tmp_path), list(t.shape), list(t.stride()), t.dtype, t.device))
    assert torch.equal(back, t + 1)


def test_a_token_dropped_without_reload_releases_its_copy(tmp_path):
    store = FileStore(str(tmp_path))
    token = torch.tensor([store.offload(torch.randn(1000))])
    activation_offload._release_later(token, store, int(token))
    assert store.live_slots() == 1
    del token
    assert store.live_slots() == 0


def test_a_full_disk_is_a_clear_error_at_the_first_copy(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    store = FileStore(str(tmp_path))
    with pytest.raises(SwapFileError, match=f"not enough space in nvme_path '{tmp_path}'"):
        store.offload(torch.randn(4096))
    store.file.close()


def test_the_files_are_removed_at_exit(tmp_path):
    code = textwrap.dedent(f"""
        import os, torch
        from zerocompile.runtime.activation_offload import offload_activation
        token = offload_activation(torch.randn(100000), "nvme", {str(tmp_path)!r})
        print(len(os.listdir({str(tmp_path)!r})))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"                # the swap file existed while it ran
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------ one process
def _train(options: dict | None, model_name: str = "gpt", inner: str = "eager", steps: int = 2, accum: int = 2):
    torch._dynamo.reset()
    model = make_model(model_name)
    opts = {"stage": 3, "inner_compiler": inner, **(options or {})}
    compiled = torch.compile(model, backend="zero", options=opts)
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    losses = []
    for step in range(steps):
        for micro in range(accum):
            x, y = make_batch(model_name, step * accum + micro, 8)
            loss = compiled(x, y) / accum
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in zerocompile.full_state_dict(compiled).items()}
    return losses, state, zerocompile.frame_reports()[-1]


def _bitwise(a, b):
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert set(a[1]) == set(b[1]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _block_of(node: torch.fx.Node) -> str | None:
    """``blocks.N`` for a node the forward ran inside the model's ``blocks[N]`` (read off the
    module paths on its ``nn_module_stack``, not with the passes' own helpers), else None."""
    for path, *_ in (node.meta.get("nn_module_stack") or {}).values():
        tokens = re.findall(r"[A-Za-z_]\w*|\d+", str(path))
        for name, index in zip(tokens, tokens[1:]):
            if name == "blocks" and index.isdigit():
                return f"blocks.{index}"
    return None


def _forward_census(graph: torch.fx.Graph, num_fwd_outputs: int) -> dict:
    """What a forward graph saves for backward, per block: each storage once (the fake values'
    storages: a view shares its base's), attributed to the block of the node that made it, graph
    inputs left out; ``saved``: bytes kept in memory, ``moved``/``storages``: bytes and storages
    whose saved place holds an ``offload_activation`` token instead."""
    from torch.multiprocessing.reductions import StorageWeakRef

    maker = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            maker.setdefault(StorageWeakRef(val.untyped_storage()), node)
    out = {"saved": collections.Counter(), "moved": collections.Counter(), "storages": collections.Counter()}
    seen = set()
    outputs = next(iter(graph.find_nodes(op="output"))).args[0]
    for node in outputs[num_fwd_outputs:]:
        if not isinstance(node, torch.fx.Node):
            continue
        token = node.target is torch.ops.zerocompile.offload_activation.default
        val = (node.args[0] if token else node).meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue                                    # a saved SymInt
        storage = StorageWeakRef(val.untyped_storage())
        made_by = maker[storage]
        if made_by.op == "placeholder" or (token, storage) in seen:
            continue
        seen.add((token, storage))
        block = _block_of(made_by)
        if token:
            out["moved"][block] += val.untyped_storage().nbytes()
            out["storages"][block] += 1
        else:
            out["saved"][block] += val.untyped_storage().nbytes()
    return out


@contextlib.contextmanager
def _forward_censuses(patch):
    """Each frame compiled inside: the census of its forward graph as the partitioner made it
    (``before``) and after the forward passes (``after``), in a list."""
    import zerocompile.partitioner as partitioner

    censuses, run_passes = [], partitioner.run_passes

    def spy(gm, ctx, graph_kind, **inputs):
        if graph_kind != "forward":
            return run_passes(gm, ctx, graph_kind, **inputs)
        before = _forward_census(gm.graph, ctx.num_fwd_outputs)
        gm = run_passes(gm, ctx, graph_kind, **inputs)
        censuses.append({"before": before, "after": _forward_census(gm.graph, ctx.num_fwd_outputs)})
        return gm

    patch.setattr(partitioner, "run_passes", spy)
    yield censuses
    patch.undo()


@pytest.fixture(scope="module")
def plain_step():
    """The run without offload (one step of two micro-batches) several tests compare with, and
    its forward's census, computed once."""
    with pytest.MonkeyPatch.context() as patch, _forward_censuses(patch) as censuses:
        plain = _train(None, steps=1)
    return plain, censuses[-1]["before"]


def test_the_graphs_hold_the_offload_nodes_and_the_numbers_are_bitwise(tmp_path):
    plain = _train(None)
    offloaded = _train({"offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0}})
    _bitwise(plain, offloaded)
    result = offloaded[2]["results"]["offload_activations"]
    assert result["offloaded"] and result["offloaded_bytes"] > 0
    # most of what the forward saves moves: the rest are graph inputs and views of them, and
    # strided views with gaps (q, k and v of one projection), which stay
    assert result["offloaded_bytes"] >= 0.5 * offloaded[2]["results"]["saved_activation_bytes"]
    # the strided q, k and v views of one projection move too: as views of their storage
    assert {k["why"] for k in result["kept"]} <= {"a graph input or a view of one", "a forward output"}
    store = activation_offload.stores().get("nvme", str(tmp_path))
    assert store.live_slots() == 0                   # every copy read back and released
    assert store.held_bytes() == 0                   # between steps nothing waits for a backward
    assert store.buffer_bytes() == 0                 # the staging buffers freed when the backward began
    stats = zerocompile.stats()                      # every store of the process (other tests' too)
    assert stats.offloaded_activation_bytes == sum(s.held_bytes() for s in activation_offload.stores().all())
    assert stats.activation_buffer_bytes == sum(s.buffer_bytes() for s in activation_offload.stores().all())


def _reload_chain(reads: list, groups: dict) -> tuple:
    """A backward graph that multiplies the gradient by each saved storage in ``reads`` order (4x4
    each; ``groups``: each storage's reload group), passed through ``reload_saved``: the groups in
    reload order, each call's ``role:saved`` (or ``name:``) in graph order, and the placeholders."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerocompile.passes.offload_activations import reload_saved

    graph = torch.fx.Graph()
    saved = {name: graph.placeholder(name) for name in groups}
    g = graph.placeholder("g")
    with FakeTensorMode():
        for node in (*saved.values(), g):
            node.meta["val"] = torch.empty(4, 4)
    h = g
    for name in reads:
        h = graph.call_function(torch.ops.aten.mul.Tensor, (h, saved[name]))
        h.meta["val"] = g.meta["val"]
    graph.output((h,))
    entries = [{"root": n, "group": groups[n], "root_layout": ([4, 4], [4, 1]), "view": None} for n in groups]
    order = reload_saved(graph, list(saved.values()), entries, "nvme", "/unused")
    graph.lint()
    calls = [n.meta.get("zerocompile", {}).get("role", n.name) + ":" + n.meta.get("zerocompile", {}).get("saved", "")
             for n in graph.nodes if n.op == "call_function"]
    return order, calls, saved


def test_reloads_start_half_way_through_the_next_blocks_backward_and_wait_at_the_first_use():
    # the head's backward, then block 1's (two reads), then block 0's
    groups, order, saved = _reload_chain(["c", "b1", "b2", "a"],
                                         {"a": "blocks.0", "b1": "blocks.1", "b2": "blocks.1", "c": "#c"})
    assert groups == [["c"], ["b1", "b2"], ["a"]]
    # the head's and block 1's reloads start first thing; block 0's half way through block 1's
    # backward (at its second read), so they overlap that compute; each wait comes right
    # before the first use
    assert order.index("activation_reload:b1") < order.index("mul_tensor:")
    assert order.index("mul_tensor_1:") < order.index("activation_reload:a") < order.index("mul_tensor_2:")
    assert order.index("activation_reload_wait:a") == order.index("mul_tensor_3:") - 1
    assert order.index("mul_tensor_1:") < order.index("activation_reload_wait:b2") < order.index("mul_tensor_2:")
    assert saved["a"].meta["val"].dtype == torch.int64 and saved["a"].meta["zerocompile"]["role"] == "activation_token"


def test_a_storage_used_before_its_groups_start_is_reloaded_before_that_use():
    """The groups' first uses interleave (inductor's partitioner moves ops): block 0's storage is
    first read between block 1's first and middle reads, before the point where block 0's group
    would start. Its reload goes right before that read, and the graph is in order (a reload
    after its wait failed the graph's lint in 2 of 15 runs of an inductor GPT test)."""
    groups, order, _ = _reload_chain(["b1", "a", "b2", "b3"],      # block 0's storage between block 1's reads
                                     {"a": "blocks.0", "b1": "blocks.1", "b2": "blocks.1", "b3": "blocks.1"})
    assert groups == [["b1", "b2", "b3"], ["a"]]
    assert order.index("mul_tensor:") < order.index("activation_reload:a") < order.index("activation_reload_wait:a")
    assert order.index("activation_reload_wait:a") == order.index("mul_tensor_1:") - 1


def test_a_storage_saved_as_itself_and_as_a_view_is_reloaded_once():
    """The forward saves one token per storage; each saved view of it is that view of the one
    reloaded copy (an ``as_strided`` after the wait), so the bytes move once."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerocompile.passes.offload_activations import reload_saved

    graph = torch.fx.Graph()
    a, at, g = graph.placeholder("a"), graph.placeholder("a_t"), graph.placeholder("g")
    with FakeTensorMode():
        a.meta["val"] = torch.empty(4, 8)
        at.meta["val"] = torch.empty(4, 8).t()
        g.meta["val"] = torch.empty(8, 4)
    h1 = graph.call_function(torch.ops.aten.mul.Tensor, (g, at))
    h1.meta["val"] = g.meta["val"]
    h2 = graph.call_function(torch.ops.aten.mm.default, (h1, a))
    graph.output((h2,))
    entries = [{"root": "a", "root_layout": ([4, 8], [8, 1]), "view": None},
               {"root": "a", "root_layout": ([4, 8], [8, 1]), "view": ([8, 4], [1, 8], 0)}]
    assert reload_saved(graph, [a, at], entries, "nvme", "/unused") == [["a"]]
    reloads = [n for n in graph.nodes if n.target is torch.ops.zerocompile.reload_activation.default]
    views = [n for n in graph.nodes if n.target is torch.ops.aten.as_strided.default]
    assert len(reloads) == 1 and reloads[0].args[0] is a and reloads[0].args[3:5] == ([4, 8], [8, 1])
    assert len(views) == 1 and views[0].args[1:] == ([8, 4], [1, 8]) and h1.args[1] is views[0]
    assert h2.args[1] is views[0].args[0] and h2.args[1].args[0] is reloads[0]      # the wait
    assert at.meta["zerocompile"]["role"] == "activation_token" and not at.users


def test_view_layout_is_the_view_of_a_dense_copy_of_its_base():
    from zerocompile.passes.offload_activations import view_layout

    base = torch.arange(24.0).view(2, 3, 4)
    for view in (base[1], base.transpose(0, 2), base[:, 1:, ::2], base.view(6, 4)[2:5]):
        size, stride, offset = view_layout(view, base)
        copy = torch.empty(24)
        copy.copy_(base.reshape(-1))
        assert torch.equal(copy.as_strided(size, stride, offset), view)
    assert view_layout(torch.empty(30)[2:], torch.empty(30)[:10]) is None       # past its base's end


def _joint_graph_of_gpt() -> torch.fx.Graph:
    """The joint forward/backward graph AOTAutograd traces for the tests' GPT (one process)."""
    from zerocompile import _torch_compat, inner_compilers

    captured = {}

    def partition(joint, joint_inputs, **kwargs):
        copy = torch.fx.Graph()
        copy.output(copy.graph_copy(joint.graph, {}))
        captured["graph"] = copy
        return _torch_compat.min_cut_partition(joint, joint_inputs, **kwargs)

    torch.compiler.reset()
    compiled = torch.compile(make_model("gpt"), fullgraph=True,
                             backend=lambda gm, inputs: inner_compilers.compile_with_aot_eager(gm, inputs, partition))
    compiled(*make_batch("gpt", 0, 8)).backward()
    return captured["graph"]


def test_the_probe_times_the_disk_and_leaves_no_file(tmp_path):
    from zerocompile.passes.analyses.cost_model import probe_offload
    from zerocompile.runtime.comm import CommGroup
    from zerocompile.runtime.offload_settings import parse_activation_offload

    settings = parse_activation_offload({"device": "nvme", "nvme_path": str(tmp_path)})
    measured = probe_offload(CostModel(), CommGroup(rank=0, world=1, name=""), settings)
    assert measured.offload_bandwidth != CostModel().offload_bandwidth and measured.offload_bandwidth > 1e6
    assert measured.flops_per_s == CostModel().flops_per_s          # only the offload rate is measured
    assert os.listdir(tmp_path) == []
    cpu = parse_activation_offload({"device": "cpu"})
    assert probe_offload(CostModel(), CommGroup(rank=0, world=1, name=""), cpu) == CostModel()   # nothing moves


def test_the_planner_offloads_when_transfers_hide_and_recomputes_when_they_do_not():
    from zerocompile.passes.plan_activations import choose

    graph = _joint_graph_of_gpt()
    fast = choose(graph, 0, CostModel(offload_bandwidth=1e15), 0)
    assert fast["recomputed"] == set() and fast["offloaded"]
    assert {f["choice"] for f in fast["per_block"]} == {"offload"}
    slow = choose(graph, 0, CostModel(offload_bandwidth=1.0, flops_per_s=1e15, memory_bandwidth=1e15), 0)
    assert slow["recomputed"] == {0, 1}
    assert {f["choice"] for f in slow["per_block"]} == {"recompute"}
    roomy = choose(graph, fast["baseline"], CostModel(), 0)
    assert roomy["recomputed"] == set() and roomy["offloaded"] == [] and roomy["estimate"] == roomy["baseline"]
    # a CPU model's transfers take the cores the compute needs: none of their time is hidden
    from zerocompile.passes.plan_activations import exposed_transfer_seconds

    assert exposed_transfer_seconds(1.0, 10.0) == 0.0
    assert exposed_transfer_seconds(1.0, 0.25) == 0.75 + 0.75
    assert exposed_transfer_seconds(1.0, 10.0, overlap=False) == 2.0


def test_the_planner_offloads_single_tensors_until_the_budget_fits():
    """Per saved tensor, not per block: a budget just under the baseline is met by offloading
    the fewest bytes (the largest tensor first, since every tensor costs its bytes over the
    rate), and the estimate is the baseline less exactly those bytes."""
    from zerocompile.passes.plan_activations import choose

    graph = _joint_graph_of_gpt()
    cost = CostModel(offload_bandwidth=1e9, flops_per_s=1.0, memory_bandwidth=1.0)     # recompute: hopeless
    everything = choose(graph, 0, cost, 0, overlap=False)
    sizes = {r: tensor_nbytes(r.meta["val"]) for r in everything["offloaded"]}
    largest = max(sizes.values())
    one = choose(graph, everything["baseline"] - 1, cost, 0, overlap=False)
    assert len(one["offloaded"]) == 1 and sizes[one["offloaded"][0]] == largest
    assert one["estimate"] == one["baseline"] - largest
    assert sum(f["offloaded_tensors"] for f in one["per_block"]) + len(one["outside"]) == 1
    # with overlap, what a block's forward hides is free: a block's tensors go before the ones
    # outside every block, whose transfers nothing hides
    hidden = choose(graph, everything["baseline"] - 1, CostModel(offload_bandwidth=1e9), 0, overlap=True)
    assert hidden["outside"] == [] and len(hidden["offloaded"]) == 1
    # measured transfer times replace the rate: a size measured as slow is offloaded last
    from zerocompile.passes.analyses.profiler import ProfiledCostModel

    slow_largest = ProfiledCostModel(offload_bandwidth=1e9, flops_per_s=1.0, memory_bandwidth=1.0,
                                     offload_seconds={largest: 1e3})
    measured = choose(graph, everything["baseline"] - 1, slow_largest, 0, overlap=False)
    assert sizes[measured["offloaded"][0]] < largest


def test_at_stage_3_over_several_ranks_the_planner_still_sees_the_blocks(fake_world, tmp_path):
    """Resharding tags every block's parameter re-gathers for recompute; the planner must not
    take those blocks as recomputed already (4 fake ranks: the gathers are in the graph)."""
    torch.manual_seed(0)
    compiled = torch.compile(make_model("gpt"), backend="zero", options={
        "stage": 3, "inner_compiler": "eager",
        "offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0, "budget_mb": 0}})
    compiled(*make_batch("gpt", 0, 8)).backward()
    plan = zerocompile.frame_reports()[-1]["results"]["plan_activations"]
    assert not any(b["already_recomputed"] for b in plan["per_block"])
    assert sorted(plan["offloaded"] + plan["recomputed"]) == ["blocks.0", "blocks.1"]


def test_a_budget_plans_blocks_and_keeps_the_numbers(tmp_path, plain_step):
    plain = plain_step[0]
    planned = _train({"offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0,
                                              "budget_mb": 0.5}}, steps=1)
    _bitwise(plain, planned)
    plan = planned[2]["results"]["plan_activations"]
    assert plan["budget_bytes"] == 0.5 * 2**20
    assert plan["estimated_saved_bytes"] <= plan["budget_bytes"] < plan["estimated_saved_bytes_before"]
    assert plan["offloaded"] or plan["recomputed"]


@pytest.mark.parametrize("fraction", [0.3, 0.7])
def test_a_partial_plan_keeps_what_it_planned_after_partitioning(tmp_path, fraction, plain_step, monkeypatch):
    """The planner picks single tensors; the partitioner must then save those very tensors (not
    recompute them from inputs it saves instead, which nothing would offload): what stays in
    memory after partitioning is within the budget, and the bytes offloaded are the planned ones,
    block by block: each block's figures (what it saves, what the plan offloads of it, what it
    keeps) are those of the forward graph's own saved tensors, counted per block from the
    graph (so a plan with the right total in the wrong blocks fails)."""
    plain, plain_census = plain_step
    baseline = plain[2]["results"]["saved_activation_bytes"]
    budget_mb = fraction * baseline / 2**20
    # recompute priced out, so the plan is offload only
    with _forward_censuses(monkeypatch) as censuses:
        planned = _train({"cost_model": {"flops_per_s": 1.0, "memory_gbps": 1e-9},
                          "offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0,
                                                  "budget_mb": budget_mb}}, steps=1)
    _bitwise(plain, planned)
    results = planned[2]["results"]
    plan = results["plan_activations"]
    assert plan["recomputed"] == [] and plan["offloaded_tensors"]
    inside = sum(f["offloaded_bytes"] for f in plan["per_block"])
    outside = plan["estimated_saved_bytes_before"] - plan["estimated_saved_bytes"] - inside
    moved = results["offload_activations"]["offloaded_bytes"]
    assert moved == inside + outside
    assert results["saved_activation_bytes"] - moved <= plan["budget_bytes"] < results["saved_activation_bytes"]
    assert results["saved_activation_bytes"] - moved <= plan["estimated_saved_bytes"]

    # block by block, against the forward graph: what the partitioner saves (as without the
    # plan: an offload-only plan changes nothing it saves), what the offload pass moved, what stays
    before, after = censuses[-1]["before"], censuses[-1]["after"]
    assert before["saved"] == plain_census["saved"]
    blocks = [f["name"] for f in plan["per_block"]]
    assert sorted(blocks) == sorted(b for b in before["saved"] if b is not None) == ["blocks.0", "blocks.1"]
    for f in plan["per_block"]:
        block = f["name"]
        assert f["offload_bytes"] == before["saved"][block], f            # what the block saves
        assert f["offloaded_bytes"] == after["moved"][block], f            # planned = offloaded
        assert f["offloaded_tensors"] == after["storages"][block], f
        assert f["offload_bytes"] - f["offloaded_bytes"] == after["saved"][block], f     # kept
        assert f["choice"] == ("offload" if after["moved"][block] else "keep"), f
    assert after["moved"][None] == outside
    assert after["storages"][None] == len(plan["offloaded_outside_blocks"])
    assert sum(after["saved"].values()) == results["saved_activation_bytes"] - moved


def test_a_plan_that_recomputes_one_block_frees_that_blocks_bytes(tmp_path, plain_step, monkeypatch):
    """Offload priced out and a budget one byte under what the forward saves: the plan recomputes
    one block, and the bytes it says that block frees are what that block's saved tensors in the
    forward graph fall by; the other block keeps all it saved."""
    plain, plain_census = plain_step
    baseline = plain[2]["results"]["saved_activation_bytes"]
    with _forward_censuses(monkeypatch) as censuses:
        planned = _train({"cost_model": {"offload_gbps": 1e-9},
                          "offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0,
                                                  "budget_mb": (baseline - 1) / 2**20}}, steps=1)
    _bitwise(plain, planned)
    results = planned[2]["results"]
    plan = results["plan_activations"]
    assert len(plan["recomputed"]) == 1 and plan["offloaded_tensors"] == []
    assert results["offload_activations"]["offloaded_bytes"] == 0
    saved = censuses[-1]["after"]["saved"]
    assert saved[None] == plain_census["saved"][None]
    for f in plan["per_block"]:
        block = f["name"]
        if block in plan["recomputed"]:
            assert f["choice"] == "recompute" and 0 < f["recompute_freed_bytes"] <= plain_census["saved"][block], f
            assert saved[block] == plain_census["saved"][block] - f["recompute_freed_bytes"], f
        else:
            assert f["choice"] == "keep" and f["offloaded_bytes"] == 0, f
            assert saved[block] == plain_census["saved"][block], f
    assert sum(saved.values()) == results["saved_activation_bytes"] == plan["estimated_saved_bytes"]


def test_what_inductor_saves_in_place_of_a_planned_tensor_is_offloaded(tmp_path):
    """Inductor decomposes the loss's log-softmax; its partitioner then saves ``exp`` of the
    planned output (the backward's first op, moved into the forward) instead of the output: that
    tensor is offloaded in its place, so what stays in memory is at most the plan's estimate. Its
    decomposed LayerNorm saves ``(x - mean) * rstd`` (a forward op) where the plan chose ``x``,
    ``mean`` and ``rstd``: offloaded too. A fast disk (the cost model's ``offload_gbps``) makes the
    plan offload both blocks rather than recompute them, whatever this machine's disk measured
    (the plan took one or the other from run to run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        planned = _train({"cost_model": {"offload_gbps": 1e3},
                          "offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0,
                                                  "budget_mb": 0}}, inner="inductor", steps=1, accum=1)
    finally:
        torch.set_num_threads(threads)      # the worker's own count, which later tests compare under
    results = planned[2]["results"]
    plan, moved = results["plan_activations"], results["offload_activations"]["offloaded_bytes"]
    assert plan["offloaded"] == ["blocks.0", "blocks.1"] and plan["recomputed"] == [], plan
    assert plan["offloaded_outside_blocks"] and moved > 0
    assert results["saved_activation_bytes"] - moved <= plan["estimated_saved_bytes"], results["offload_activations"]["kept"]


def test_profile_feeds_the_planner_measured_transfer_times(tmp_path, plain_step):
    plain = plain_step[0]
    planned = _train({"profile": True, "offload_activations": {"device": "nvme", "nvme_path": str(tmp_path),
                                                               "min_kb": 0, "budget_mb": 0}}, steps=1)
    _bitwise(plain, planned)
    results = planned[2]["results"]
    assert results["profile"]["offload_sizes"] >= 2 and results["profile"]["offload_gbps"] > 0
    assert results["plan_activations"]["measured"] is True
    plain_plan = _train({"offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0,
                                                 "budget_mb": 0}}, steps=1)[2]["results"]
    assert plain_plan["plan_activations"]["measured"] is False and "profile" not in plain_plan


def test_offload_lowers_the_peak_of_a_step(tmp_path):
    from zerocompile.runtime.memory_tracker import AllocatorPeak

    def peak(options):
        torch._dynamo.reset()
        model = make_model("gpt")
        compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager", **options})
        x, y = make_batch("gpt", 0, 64)
        compiled(x, y).backward()                       # compile outside the measurement
        rises = []
        # the copies' staging buffers wait for the I/O threads and count until written (up to
        # IN_FLIGHT_BYTES): on a machine busy with other work a write can lag behind the forward
        # (1 run in ~3 full suites measured 0.92x): the lowest of three steps
        for _ in range(3):
            with AllocatorPeak() as alloc:
                compiled(x, y).backward()
            rises.append(alloc.rise)
        return min(rises)

    without = peak({})
    with_offload = peak({"offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0}})
    # a 2-block model: the backward holds one block's reloads and the head's gradients, so the
    # step's peak falls by less than the saved bytes (measured 0.83x)
    assert with_offload < 0.9 * without, (with_offload, without)


def test_a_second_backward_reads_the_copies_again(tmp_path):
    def grads(options):
        torch._dynamo.reset()
        model = make_model("gpt")
        compiled = torch.compile(model, backend="zero", options={"stage": 0, "inner_compiler": "eager", **options})
        loss = compiled(*make_batch("gpt", 0, 8))
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads({})
    twice = grads({"offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0}})
    assert all(torch.equal(a, b) for a, b in zip(plain, twice))
    assert activation_offload.stores().get("nvme", str(tmp_path)).live_slots() == 0


def test_cpu_on_a_cpu_model_is_a_logged_no_op(caplog):
    caplog.set_level("INFO", logger="zerocompile.passes")
    plain = _train(None, steps=1, accum=1)
    same = _train({"offload_activations": {"device": "cpu"}}, steps=1, accum=1)
    _bitwise(plain, same)
    assert "the model is on the CPU already; nothing to offload" in caplog.text


# ------------------------------------------------------------------------ several ranks
class CheckpointedGPT(nn.Module):
    """The tests' GPT with its blocks under the user's own ``torch.utils.checkpoint``."""

    def __init__(self):
        super().__init__()
        self.inner = make_model("gpt")

    def forward(self, idx, targets):
        m = self.inner
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = m.wte(idx) + m.wpe(pos)
        for block in m.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = m.head(m.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _ranks_worker(rank, world, path):
    offload = (("offload_activations", {"device": "nvme", "nvme_path": path, "min_kb": 0}),)
    runs = []
    for stage, model, accum in ((1, "gpt", 2), (2, "gpt", 1), (3, "gpt", 2), (3, "eager_head", 2), (3, "tied", 1)):
        base = Run(model=model, stage=stage, steps=2, accum=accum, batch=8)
        runs += [base, Run(model=model, stage=stage, steps=2, accum=accum, batch=8, options=offload)]
    results = zero_train_many(rank, world, runs)
    out = []
    for plain, offloaded in zip(results[::2], results[1::2]):
        out.append({"plain": (plain["losses"], plain["state"]), "offloaded": (offloaded["losses"], offloaded["state"]),
                    "moved": sum(r["results"].get("offload_activations", {}).get("offloaded_bytes", 0)
                                 for r in offloaded["reports"])})
    out.append({"live_slots": [s.live_slots() for s in activation_offload.stores().all()]})
    return out


def test_two_ranks_every_stage_accumulation_and_graph_breaks_are_bitwise(tmp_path):
    results = run_ranks(_ranks_worker, 2, str(tmp_path))
    for rank_result in results:
        *cases, leaks = rank_result
        assert leaks["live_slots"] and not any(leaks["live_slots"])
        for case in cases:
            assert case["moved"] > 0
            assert case["plain"][0] == case["offloaded"][0]
            for k, v in case["plain"][1].items():
                assert torch.equal(v, case["offloaded"][1][k]), k


def test_the_users_checkpoint_regions_are_left_alone(tmp_path):
    torch.manual_seed(0)

    def train(options):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = CheckpointedGPT()
        compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager", **options})
        opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        losses = []
        for step in range(2):
            x, y = make_batch("gpt", step, 8)
            loss = compiled(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses, {k: v.clone() for k, v in zerocompile.full_state_dict(compiled).items()}, \
            zerocompile.frame_reports()[-1]

    plain = train({})
    offloaded = train({"offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0}})
    _bitwise(plain, offloaded)
    # the regions still recompute: only their inputs (and the head's tensors) are saved, and moved
    assert offloaded[2]["results"]["saved_activation_bytes"] == plain[2]["results"]["saved_activation_bytes"]
    assert offloaded[2]["results"]["offload_activations"]["offloaded_bytes"] > 0


def test_inductor_stage_3_is_bitwise(tmp_path):
    # one thread: inductor's parallel kernels (the embedding's backward) sum in a run-dependent
    # order on several, so two runs without offload differ in the last bit already
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _inductor_stage_3_is_bitwise(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _inductor_stage_3_is_bitwise(tmp_path):
    # the MLP: one small frame, so two inductor compiles stay short; its saved tensors (the
    # hidden layer's input and tanh output) go through the generated code's buffer reuse
    options = {"offload_activations": {"device": "nvme", "nvme_path": str(tmp_path), "min_kb": 0}}
    plain = _train(None, model_name="mlp", inner="inductor", steps=1)
    offloaded = _train(options, model_name="mlp", inner="inductor", steps=1)
    _bitwise(plain, offloaded)
    assert offloaded[2]["results"]["offload_activations"]["offloaded_bytes"] > 0
