"""The ``gradient_reduction`` option (runtime/reduction_choice.py, passes/all_reduce_gradients.py):
at stages 1 and 2 a reduce-scatter or an all-reduce of which each rank keeps its slice, the same
training as one process on the whole batch, bitwise the same on 2 ranks, the bytes counted as
the collective that ran, and ``"auto"`` the same choice on every rank."""

from __future__ import annotations

import dataclasses
import operator
import os
import time

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from dist_utils import run_ranks
from harness import Run, assert_matches, reference, zero_train_many
from zerocompile.config import ZeroConfig
from zerocompile.errors import ZeroConfigError
from zerocompile.passes.all_reduce_gradients import reduce_scatters_as_all_reduces
from zerocompile.passes.graph_utils import set_tag
from zerocompile.runtime.comm import CommGroup
from zerocompile.runtime.reduction_choice import ReductionChoice, fixed_choice, gradient_reduction

_c10d = torch.ops._c10d_functional


@pytest.mark.parametrize("stage", [1, 2])
def test_each_mode_trains_as_one_process_and_the_modes_agree_bitwise(stage):
    """Tied weights over two frames, 2 micro-batches per step, clipping, 2 KiB buckets (many
    buckets: each stepped while the previous one's gather travels, update.step_pipelined):
    each forced mode matches the single-process reference; on 2 ranks the two modes give
    bitwise equal losses and parameters; stats() counts the gradient bytes as the collective
    that ran. The second run also gathers the updated shards point to point (``parameter_gather``):
    the same parameters, the same bytes."""
    runs = [Run(model="tied", stage=stage, opt="adamw", steps=3, accum=2, clip=0.5,
                options=(("gradient_reduction", mode), ("parameter_gather", gather), ("bucket_mb", 2 / 1024)))
            for mode, gather in (("reduce_scatter", "all_gather"), ("all_reduce", "point_to_point"),
                                 ("point_to_point", "all_gather"))]
    scattered, reduced, sent = run_ranks(zero_train_many, 2, runs)[0]
    ref = reference(runs[0])
    for res in (scattered, reduced, sent):
        assert_matches(res, ref)
        assert res["losses"] == scattered["losses"]
        for key, value in scattered["state"].items():
            assert torch.equal(value, res["state"][key]), key
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):   # the transfers count as what they replace
        assert sent["stats"][kind] == scattered["stats"][kind], kind
    rs, ar = scattered["stats"], reduced["stats"]
    # the same gradient bytes move, as a reduce-scatter in one run and as an all-reduce in the other
    assert rs["reduce_scatter"]["bytes"] > 0 and ar["reduce_scatter"]["bytes"] == 0, (rs, ar)
    assert ar["all_reduce"]["bytes"] - rs["all_reduce"]["bytes"] == rs["reduce_scatter"]["bytes"]
    assert ar["all_gather"] == rs["all_gather"]
    for res, mode, gather in ((scattered, "reduce_scatter", "all_gather"), (reduced, "all_reduce", "point_to_point"),
                              (sent, "point_to_point", "all_gather")):
        chosen = {r["results"]["gradient_reduction"]["kinds"][0] for r in res["reports"]}
        assert chosen == {mode}
        assert {r["results"]["gradient_reduction"]["parameter_gather"]["kinds"][0] for r in res["reports"]} == {gather}
        if stage == 2:
            replaced = [r["results"].get("all_reduce_gradients", {}).get("replaced", 0) for r in res["reports"]]
            assert (sum(replaced) > 0) == (mode == "all_reduce"), replaced
            sent_p2p = [r["results"].get("point_to_point_collectives", {}).get("backward", {}).get(
                "reduce_scatter", {}).get("replaced", 0) for r in res["reports"]]
            assert (sum(sent_p2p) > 0) == (mode == "point_to_point"), sent_p2p


def _probe_twice(rank, world):
    from zerocompile.runtime.comm import resolve_group

    group = resolve_group()
    first = gradient_reduction("auto", group)
    again = gradient_reduction("auto", group)
    return {"choice": first.as_dict(), "cached": again is first,
            "forced": gradient_reduction("all_reduce", group, parameter_gather="auto").as_dict(),
            "stage3": first.without_all_reduce().as_dict(),
            "forced_gather": gradient_reduction("auto", group, parameter_gather="all_gather").as_dict(),
            "stage2": gradient_reduction("auto", group, stage=2).as_dict(),
            "stage1": gradient_reduction("auto", group, stage=1).as_dict()}


def test_auto_is_measured_once_and_the_same_on_every_rank():
    results = run_ranks(_probe_twice, 2)
    assert results[0]["choice"] == results[1]["choice"]      # the max-reduced times, so the same kinds
    for res in results:
        choice = res["choice"]
        assert res["cached"] and choice["source"] == "measured"
        assert len(choice["ms"]) == len(choice["sizes"]) and all(t > 0 for pair in choice["ms"] for t in pair)
        # the fastest of the four at each size (the ranks of this test share a host: the
        # shared-memory transfers are timed too)
        names = ("reduce_scatter", "all_reduce", "point_to_point", "shared_memory")
        gathers = ("all_gather", "point_to_point", "shared_memory")
        assert all(len(t) == 4 for t in choice["ms"])
        assert choice["kinds"] == [names[t.index(min(t))] for t in choice["ms"]]
        gather = choice["parameter_gather"]
        assert len(gather["ms"]) == len(choice["sizes"]) and all(0 < t < float("inf") for ms in gather["ms"] for t in ms)
        assert gather["kinds"] == [gathers[t.index(min(t))] for t in gather["ms"]]
        # collectives the step runs (stages 1-2's gathers, stage 1's reductions) timed as the step
        # runs them: packing and copy-out against in place
        for stage in ("stage1", "stage2"):
            step = res[stage]["parameter_gather"]
            assert len(step["ms"]) == len(choice["sizes"]) and step["ms"] != gather["ms"]
            assert step["kinds"] == [gathers[t.index(min(t))] for t in step["ms"]]
        assert res["stage1"]["ms"] != choice["ms"]
        assert res["stage1"]["kinds"] == [names[t.index(min(t))] for t in res["stage1"]["ms"]]
        # stage 3 has no all-reduce path: the fastest of the other three
        assert res["stage3"]["kinds"] == [min((t[i], names[i]) for i in (0, 2, 3))[1] for t in choice["ms"]]
    # an option given is kept, the other measured
    forced = results[0]["forced"]
    assert forced["kinds"] == ["all_reduce"] and forced["source"] == "option"
    assert forced["parameter_gather"]["kinds"] == results[0]["choice"]["parameter_gather"]["kinds"]
    assert results[0]["forced_gather"]["parameter_gather"]["kinds"] == ["all_gather"]
    assert results[0]["forced_gather"]["kinds"] == results[0]["choice"]["kinds"]


def _gather_both_ways(rank, world):
    from census import CollectiveCounter
    from zerocompile.runtime.comm import resolve_group
    from zerocompile.runtime.session import PROCESS
    from zerocompile.runtime.step_collectives import all_gather_concat

    group = resolve_group()
    torch.manual_seed(rank)
    # under and over point_to_point.PACK_BELOW (64 KiB): packed together, and sent in place
    sizes = (5, 1, 700, 33, 4096, 20000, 3, 40000)
    out = {}
    for how in ("all_gather", "point_to_point", "point_to_point in place", "shared_memory", "shared_memory in place"):
        # a replica per shard, this rank's row the shard itself (stages 1-2 without a compute dtype)
        replicas = [torch.full((world * n,), float("nan")) for n in sizes]
        shards = [r.view(world, -1)[rank] for r in replicas]
        torch.manual_seed(rank)
        for t in shards:
            t.copy_(torch.randn(t.shape))
        rows = {}
        kind = how.removesuffix(" in place")
        with CollectiveCounter() as counter:
            # 64 KiB buckets: several buckets, two in flight at a time
            all_gather_concat(shards, group, 65536, lambda i, r: rows.__setitem__(i, r.clone()),
                              choose=lambda nbytes: kind,
                              places=replicas if how.endswith("in place") else None, session=PROCESS.outside)
        out[how] = (rows, dict(counter.count), counter.point_to_point,
                    [r.clone() for r in replicas] if how.endswith("in place") else None)
    return out, [s.clone() for s in shards]


@pytest.mark.parametrize("world", [2, 3])
def test_point_to_point_gathers_give_the_all_gathers_values(world):
    """``all_gather_concat`` with ``"point_to_point"`` and ``"shared_memory"`` buckets, through
    bucket buffers or straight into each shard's replica (``places``, the optimizer step's
    refresh): every rank's shards, rank order, bit for bit those of the all-gather, the same
    count of gathers, none of them the collective."""
    results = run_ranks(_gather_both_ways, world)
    shards = [s for _, s in results]
    for res, _ in results:
        gathered, counts, none, _ = res["all_gather"]
        assert counts["all_gather"] >= 2 and none == 0, res
        for how in ("point_to_point", "shared_memory"):
            sent, p2p_counts, p2p, _ = res[how]
            in_place, place_counts, place_p2p, replicas = res[f"{how} in place"]
            assert counts == p2p_counts and p2p == counts["all_gather"], res
            assert place_counts == counts and place_p2p == p2p
            assert sorted(gathered) == sorted(sent) == sorted(in_place) == list(range(len(shards[0])))
            for i in gathered:
                for rank in range(world):
                    expected = shards[rank][i].view(torch.int32)
                    for got in (sent[i][rank], gathered[i][rank], in_place[i][rank], replicas[i].view(world, -1)[rank]):
                        assert torch.equal(got.view(torch.int32), expected)


def test_auto_measures_nothing_on_one_rank_and_the_options_are_checked():
    one = gradient_reduction("auto", CommGroup(rank=0, world=1, name=""))
    assert one.kinds == ("reduce_scatter",) and "world size 1" in one.source
    assert gradient_reduction("all_reduce", CommGroup(rank=0, world=1, name="")).kind_for(1 << 30) == "all_reduce"
    assert ZeroConfig.from_options({"stage": 2}).sharding.gradient_reduction == "auto"
    with pytest.raises(ZeroConfigError, match="'gradient_reduction' = 'allreduce' is invalid; allowed: 'auto', "
                                              "'reduce_scatter', 'all_reduce', 'point_to_point'"):
        ZeroConfig.from_options({"stage": 2, "gradient_reduction": "allreduce"})
    with pytest.raises(ZeroConfigError, match="'gradient_reduction' = None is invalid"):
        ZeroConfig.from_options({"stage": 1, "gradient_reduction": None})
    assert one.gather_kinds == ("all_gather",) and one.gather_kind_for(1 << 30) == "all_gather"
    assert gradient_reduction("auto", CommGroup(rank=0, world=1, name=""), parameter_gather="point_to_point").gather_kinds \
        == ("point_to_point",)
    assert ZeroConfig.from_options({"stage": 2}).sharding.parameter_gather == "auto"
    with pytest.raises(ZeroConfigError, match="'parameter_gather' = 'p2p' is invalid; allowed: 'auto', 'all_gather', "
                                              "'point_to_point'"):
        ZeroConfig.from_options({"stage": 2, "parameter_gather": "p2p"})


def _probe_with_a_busy_moment(rank, world):
    """``_timed`` of two scripted kinds: ``"fast"`` takes 1 ms a run, except two runs on rank 0
    that another process slowed to 60 ms; ``"steady"`` 20 ms every run."""
    from zerocompile.runtime.comm import resolve_group
    from zerocompile.runtime.reduction_choice import _fastest, _timed

    script = {"fast": [1.0, 1.0, 60.0, 60.0] if rank == 0 else [1.0] * 4, "steady": [20.0] * 4}  # warm-up first

    def run(kind, n):
        return lambda: time.sleep(script[kind].pop(0) / 1e3)

    (ms,) = _timed(("fast", "steady"), run, resolve_group().name, torch.device("cpu"), (1024,), repeats=3)
    return {"ms": ms, "kind": _fastest(("fast", "steady"), ms), "left": script}


def test_a_run_slowed_by_other_work_does_not_decide_the_choice():
    """The probe counts each collective's fastest run (``probe_figure``): other work on the machine
    only adds time to the runs it meets. With the median, two slowed runs out of three on one rank
    chose the slower collective (the max over ranks carries one rank's figure to all)."""
    results = run_ranks(_probe_with_a_busy_moment, 2)
    assert results[0]["ms"] == results[1]["ms"]                 # every rank the same figures
    for res in results:
        fast, steady = res["ms"]
        assert res["kind"] == "fast", res
        assert 1.0 <= fast < 20.0 and steady >= 20.0, res      # the slowest rank's fastest run of each
        assert res["left"] == {"fast": [], "steady": []}        # a warm-up and three timed runs each


def test_a_bucket_takes_the_choice_of_the_nearest_probed_size():
    choice = ReductionChoice(sizes=(1 << 18, 1 << 22, 1 << 24), kinds=("reduce_scatter", "all_reduce", "all_reduce"),
                             source="measured", ms=((1.0, 2.0), (3.0, 2.0), (9.0, 6.0)))
    assert [choice.kind_for(n) for n in (1, 1 << 18, 1 << 20, 1 << 21, 1 << 22, 1 << 30)] == [
        "reduce_scatter", "reduce_scatter", "reduce_scatter", "all_reduce", "all_reduce", "all_reduce"]
    assert "256 KiB reduce_scatter: reduce_scatter 1.00 ms, all_reduce 2.00 ms" in choice.describe()


def _bucket_graph(world: int, numel: int):
    """A backward-like graph: one tagged bucket reduce-scatter, its wait, the division by the world."""
    graph = torch.fx.Graph()
    flat = graph.placeholder("flat")
    with FakeTensorMode():
        flat.meta["val"] = torch.empty(numel)
    rs = graph.call_function(_c10d.reduce_scatter_tensor.default, (flat, "sum", world, "g"))
    set_tag(rs, role="bucket_reduce_scatter", params=["a", "b"], bucket="bw.reduce_scatter.0")
    wait = graph.call_function(_c10d.wait_tensor.default, (rs,))
    div = graph.call_function(torch.ops.aten.div.Tensor, (wait, world))
    graph.output(div)
    return graph


def test_the_pass_replaces_a_bucket_the_choice_all_reduces_by_an_all_reduce_and_this_ranks_slice():
    graph = _bucket_graph(world=4, numel=64)
    assert reduce_scatters_as_all_reduces(graph, fixed_choice("all_reduce", "option"), rank=2) == [256]
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert _c10d.reduce_scatter_tensor.default not in targets
    assert targets[:3] == [_c10d.all_reduce.default, _c10d.wait_tensor.default, torch.ops.aten.slice.Tensor]
    sliced = next(n for n in graph.nodes if n.target is torch.ops.aten.slice.Tensor)
    assert sliced.args[1:] == (0, 32, 48) and tuple(sliced.meta["val"].shape) == (16,)   # rank 2's chunk of 16
    assert sliced.meta["zerocompile"]["bucket"] == "bw.reduce_scatter.0"
    kept = _bucket_graph(world=4, numel=64)
    assert reduce_scatters_as_all_reduces(kept, fixed_choice("reduce_scatter", "option"), rank=2) == []
    assert _c10d.reduce_scatter_tensor.default in [n.target for n in kept.nodes]


@pytest.mark.parametrize("copy_input", [True, False])
@pytest.mark.parametrize("kind", ["point_to_point", "shared_memory"])
def test_the_transfers_copy_their_input_only_where_inductor_may_reuse_it(copy_input, kind):
    """``collectives_as_point_to_point`` swaps the bucket's reduce-scatter for the transfers in
    place, through the sockets or the shared-memory segment as chosen; they send a copy of the
    bucket for inductor's graphs (which may reuse its memory as soon as the op returns), the
    bucket itself for graphs run op by op."""
    from zerocompile.passes.point_to_point_collectives import collectives_as_point_to_point

    graph = _bucket_graph(world=2, numel=64)
    replaced = collectives_as_point_to_point(graph, fixed_choice(kind, "option"), "g", copy_input=copy_input)
    assert replaced == {"all_gather": [], "reduce_scatter": [256], "unpacked": 0}
    (node,) = graph.find_nodes(op="call_function", target=torch.ops.zerocompile.reduce_scatter_point_to_point.default)
    assert node.args[1:] == ("sum", 2, "g", copy_input, kind == "shared_memory")
    assert node.meta["zerocompile"]["bucket"] == "bw.reduce_scatter.0"
    assert next(iter(node.users)).target is _c10d.wait_tensor.default


def _bucket_gather_graph(world: int, chunks: list[int]):
    """A forward-like graph: a bucket's shards packed, gathered, waited for and unpacked (what the
    bucketing pass makes), each member read by an op."""
    from zerocompile.passes.graph_utils import call
    from zerocompile.runtime import bucket_ops  # noqa: F401  (registers the ops)

    graph, mode = torch.fx.Graph(), FakeTensorMode()
    shards = []
    for i, chunk in enumerate(chunks):
        shards.append(graph.placeholder(f"shard{i}"))
        with mode:
            shards[-1].meta["val"] = torch.empty(chunk)
    with mode:
        packed = call(graph, torch.ops.zerocompile.pack_shards.default, (shards,), role="bucket_pack")
        gathered = call(graph, _c10d.all_gather_into_tensor.default, (packed, world, "g"), role="bucket_gather",
                        params=[f"p{i}" for i in range(len(chunks))])
        waited = call(graph, _c10d.wait_tensor.default, (gathered,), role="bucket_gather_wait")
        unpacked = call(graph, torch.ops.zerocompile.unpack_gathered_bucket.default, (waited, world, chunks),
                        role="bucket_unpack")
        members = [call(graph, operator.getitem, (unpacked, i), role="bucket_unpack", param=f"p{i}")
                   for i in range(len(chunks))]
        sums = [call(graph, torch.ops.aten.sum.default, (m,)) for m in members]
    graph.output(sums)
    return graph


@pytest.mark.parametrize("kind", ["point_to_point", "shared_memory"])
def test_a_bucket_gather_through_shared_memory_lands_in_its_members(kind):
    """Through shared memory the bucket's gather, its wait and the copy out of its rows become one
    ``all_gather_point_to_point_unpacked`` with a wait per member, where the bucket's wait was;
    over the sockets it stays one message per peer, unpacked as before."""
    from zerocompile.passes.point_to_point_collectives import collectives_as_point_to_point

    chunks = [8, 3, 5]
    graph = _bucket_gather_graph(world=2, chunks=chunks)
    replaced = collectives_as_point_to_point(graph, fixed_choice("reduce_scatter", "option", gather=kind), "g",
                                             copy_input=True)
    graph.lint()
    assert replaced == {"all_gather": [2 * 16 * 4], "reduce_scatter": [], "unpacked": int(kind == "shared_memory")}
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    if kind == "point_to_point":
        assert torch.ops.zerocompile.unpack_gathered_bucket.default in targets
        assert torch.ops.zerocompile.all_gather_point_to_point.default in targets
        return
    assert torch.ops.zerocompile.unpack_gathered_bucket.default not in targets
    assert _c10d.all_gather_into_tensor.default not in targets
    (fused,) = graph.find_nodes(op="call_function", target=torch.ops.zerocompile.all_gather_point_to_point_unpacked.default)
    assert fused.args[1:] == (2, "g", chunks, True, True) and fused.meta["zerocompile"]["role"] == "bucket_gather"
    assert [tuple(v.shape) for v in fused.meta["val"]] == [(16,), (6,), (10,)]
    waits = graph.find_nodes(op="call_function", target=_c10d.wait_tensor.default)
    assert len(waits) == 3 and all(w.args[0].args == (fused, i) for i, w in enumerate(waits))
    # every member's wait comes before any read of a member
    order = {n: i for i, n in enumerate(graph.nodes)}
    reads = graph.find_nodes(op="call_function", target=torch.ops.aten.sum.default)
    assert max(order[w] for w in waits) < min(order[r] for r in reads)
    assert [r.args[0] for r in reads] == waits


def test_a_saved_choice_round_trips_and_a_damaged_one_is_ignored(tmp_path):
    """What a restart reuses (``SavedChoices``: beside the compile caches, so that a choice near a
    tie does not flip and miss AOTAutograd's cache, which keys on it)."""
    from zerocompile.runtime.reduction_choice import SavedChoices

    saved = SavedChoices(str(tmp_path / "choices"))
    choice = ReductionChoice(sizes=(1 << 18, 1 << 24), kinds=("all_reduce", "reduce_scatter"), source="measured",
                             ms=((0.5, 0.25), (4.0, 6.0)), gather_kinds=("all_gather", "point_to_point"),
                             gather_ms=((0.3, 0.4), (9.0, 3.0)))
    assert saved.load(2, "gloo", "cpu") is None
    saved.save(choice, 2, "gloo", "cpu")
    assert saved.load(2, "gloo", "cpu") == choice
    assert saved.load(4, "gloo", "cpu") is None and saved.load(2, "nccl", "cuda:0") is None
    # collectives the optimizer step runs are timed as it runs them: a choice of their own
    assert saved.load(2, "gloo", "cpu", ("graph", "step")) is None
    saved.save(dataclasses.replace(choice, gather_kinds=("point_to_point",) * 2), 2, "gloo", "cpu", ("graph", "step"))
    assert saved.load(2, "gloo", "cpu", ("graph", "step")).gather_kinds == ("point_to_point",) * 2
    assert saved.load(2, "gloo", "cpu") == choice
    # a rank whose compile caches are off reads and writes nothing (but still takes part in the
    # ranks' agreement, which then fails, so every rank measures)
    off = SavedChoices(saved.directory, enabled=False)
    assert off.load(2, "gloo", "cpu") is None
    off.save(choice, 4, "gloo", "cpu")
    assert not os.path.exists(saved.path(4, "gloo", "cpu"))
    with open(saved.path(2, "gloo", "cpu"), "w") as f:
        f.write("{not json")
    assert saved.load(2, "gloo", "cpu") is None


def _one_step_choice(rank, world):
    """One step of the test GPT at stage 3 with the eager inner compiler: the frame's gradient
    reduction choice (where it came from, what it chose) and the loss."""
    import zerocompile
    from models import make_batch, make_model

    torch._dynamo.reset()
    model = torch.compile(make_model("gpt"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    x, y = make_batch("gpt", 0, 4)
    loss = model(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
    loss.backward()
    opt.step()
    (choice,) = [r["results"]["gradient_reduction"] for r in zerocompile.frame_reports()]   # the one frame
    return {"choice": choice, "loss": loss.item()}


def test_an_eager_restart_takes_the_saved_choice_without_timing(tmp_path, monkeypatch):
    """With the eager inner compiler too, the first process times ``"auto"`` and saves the
    choice beside the compile caches; a restart takes it ("measured (saved)": no timing) and runs
    the same collectives, so the same loss bit for bit."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    first = run_ranks(_one_step_choice, 2)
    again = run_ranks(_one_step_choice, 2)
    assert os.listdir(tmp_path / "cache" / "zerocompile" / "choices")
    for a, b in zip(first, again):
        assert a["choice"]["source"] == "measured" and b["choice"]["source"] == "measured (saved)", (a, b)
        assert a["choice"]["kinds"] == b["choice"]["kinds"] and a["loss"] == b["loss"]


def _overwrite_while_in_flight(rank, world, shared_memory):
    from zerocompile.runtime import bucket_ops, point_to_point  # noqa: F401  (register the ops)
    from zerocompile.runtime.comm import resolve_group

    group = resolve_group()
    wait = torch.ops._c10d_functional.wait_tensor
    torch.manual_seed(rank)
    # through shared memory 3 MiB per row: the reduce-scatter's fits the 4 MiB ring when it
    # starts, the gather's only in part (the rest is sent from a copy)
    n = (768 << 10) if shared_memory else (1 << 20)
    x = torch.randn(world * n)
    expected_sum = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(x, "sum", world, group.name)).clone()
    shard = x[:n].clone()
    expected_rows = _c10d.wait_tensor(_c10d.all_gather_into_tensor_out(
        shard, world, group.name, out=torch.empty(world * n))).clone()
    if shared_memory:
        from zerocompile.runtime.shared_memory import open_channel

        open_channel(group.name)     # opening is a collective: done before rank 1 falls behind
        if rank == 1:
            time.sleep(0.5)          # rank 0 finds the ring full (nothing read yet): it must copy the rest
    chunks = [n // 4, n // 2, n - n // 4 - n // 2]      # a bucket of three parameters' shards
    expected_members = torch.ops.zerocompile.unpack_gathered_bucket(expected_rows, world, chunks)
    bucket = shard.clone()
    reduced = torch.ops.zerocompile.reduce_scatter_point_to_point(x, "sum", world, group.name, True, shared_memory)
    gathered = torch.ops.zerocompile.all_gather_point_to_point(shard, world, group.name, True, shared_memory)
    members = torch.ops.zerocompile.all_gather_point_to_point_unpacked(bucket, world, group.name, chunks, True,
                                                                        shared_memory)
    for t in (x, shard, bucket):
        t.fill_(float("nan"))   # what a compiled graph reusing the inputs' memory would do
    return (torch.equal(wait(reduced), expected_sum), torch.equal(wait(gathered), expected_rows),
            all(torch.equal(wait(m), e) for m, e in zip(members[::-1], expected_members[::-1])))


def _inputs_held_until_the_wait(rank, world):
    import gc
    import weakref

    from zerocompile.runtime import bucket_ops, point_to_point  # noqa: F401  (register the ops)
    from zerocompile.runtime.comm import resolve_group

    group = resolve_group()
    held = []
    ops = torch.ops.zerocompile
    for op in (ops.reduce_scatter_point_to_point, ops.all_gather_point_to_point, ops.all_gather_point_to_point_unpacked):
        x = torch.randn(world * (1 << 20))
        storage = weakref.ref(x.untyped_storage())
        args = {ops.reduce_scatter_point_to_point: (x, "sum", world, group.name),
                ops.all_gather_point_to_point: (x, world, group.name),
                ops.all_gather_point_to_point_unpacked: (x, world, group.name, [1 << 20, x.numel() - (1 << 20)])}[op]
        result = op(*args, copy_input=False)
        del x
        gc.collect()
        alive_in_flight = storage() is not None
        for t in result if isinstance(result, list) else [result]:
            _c10d.wait_tensor(t)
        held.append(alive_in_flight)
    return held


def test_without_the_copy_the_input_stays_alive_until_the_wait():
    """Graphs run op by op send the input itself (``copy_input=False``): dropped by the graph
    right after the op (the generated code frees each value after its last use), its memory
    must stay allocated, and so unchanged, until the wait; the transfers hold it."""
    assert run_ranks(_inputs_held_until_the_wait, 2) == [[True, True, True], [True, True, True]]


@pytest.mark.parametrize("shared_memory", [False, True])
def test_point_to_point_ops_do_not_read_their_inputs_after_returning(shared_memory):
    """The transfers send copies (through shared memory: what did not fit the segment when they
    started): inputs overwritten right after the ops return (inductor may reuse their memory for
    the next buffer) change nothing of the results, which are the collectives' bit for bit (4
    MiB per rank, large enough to be in flight)."""
    assert run_ranks(_overwrite_while_in_flight, 2, shared_memory) == [(True, True, True), (True, True, True)]


def test_a_bucket_gather_with_an_unread_member_keeps_its_rows():
    """A member no op reads would get no wait of its own: such a bucket keeps the gather of rows."""
    from zerocompile.passes.point_to_point_collectives import collectives_as_point_to_point

    graph = _bucket_gather_graph(world=2, chunks=[8, 3, 5])
    unread = next(n for n in graph.nodes if n.target is operator.getitem and n.args[1] == 1)
    for user in list(unread.users):
        output = next(iter(graph.find_nodes(op="output")))
        output.args = ([a for a in output.args[0] if a is not user],)
        graph.erase_node(user)
    graph.erase_node(unread)
    replaced = collectives_as_point_to_point(graph, fixed_choice("reduce_scatter", "option", gather="shared_memory"),
                                             "g", copy_input=True)
    assert replaced["unpacked"] == 0 and len(replaced["all_gather"]) == 1
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.ops.zerocompile.all_gather_point_to_point.default in targets
    assert torch.ops.zerocompile.unpack_gathered_bucket.default in targets
