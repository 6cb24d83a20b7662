"""A CPU gradient bucket reduce-scattered in its own memory (``passes/reduce_scatter_in_place.py``,
``runtime/in_place_reduction.py``): the rewrite of the graph, the op against the reduce-scatter
it replaces on every rank, training bit for bit what it was without the pass, the bytes counted as
the reduce-scatter's, and the copy of the bucket gone from the allocator's peak."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import pytest

from dist_utils import run_ranks
from zerocompile.passes.graph_utils import call, set_tag
from zerocompile.passes.reduce_scatter_in_place import reduce_scatters_in_place
from zerocompile.runtime import bucket_ops, in_place_reduction, point_to_point  # noqa: F401  (register the ops)

_c10d = torch.ops._c10d_functional
_zc = torch.ops.zerocompile


def _bucket_graph(world: int, numel: int, *, reader: str = "divide", second_reader: bool = False,
                  device: str = "cpu", kind: str = "reduce_scatter"):
    """A backward-like graph: two gradients packed into a bucket (as ``bucketing`` makes it),
    reduce-scattered (the collective, or the transfers ``point_to_point_collectives`` puts in its
    place), waited for, then read: divided (``"divide"``) or added to something (``"add"``)."""
    graph = torch.fx.Graph()
    with FakeTensorMode():
        grads = []
        for name in ("ga", "gb"):
            grads.append(graph.placeholder(name))
            grads[-1].meta["val"] = torch.empty(numel // 2, device=device)
        flat = call(graph, _zc.pack_gradients.default, (grads, world), role="bucket_pack", bucket="b0")
        if kind == "reduce_scatter":
            rs = call(graph, _c10d.reduce_scatter_tensor.default, (flat, "sum", world, "g"))
        else:
            rs = call(graph, _zc.reduce_scatter_point_to_point.default,
                      (flat, "sum", world, "g", True, kind == "shared_memory"))
        set_tag(rs, role="bucket_reduce_scatter", params=["a", "b"], bucket="b0")
        wait = call(graph, _c10d.wait_tensor.default, (rs,), role="bucket_reduce_scatter_wait", bucket="b0")
        if reader == "divide":
            out = call(graph, _zc.divide_reduced.default, (wait, float(world)), role="bucket_unpack")
        else:
            out = call(graph, torch.ops.aten.add.Tensor, (wait, wait))
        outputs = [out]
        if second_reader:
            outputs.append(call(graph, torch.ops.aten.sum.default, (flat,)))
    graph.output(tuple(outputs))
    return graph


def _targets(graph: torch.fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kind", ["reduce_scatter", "point_to_point", "shared_memory"])
def test_a_bucket_is_reduced_in_place_and_its_row_read_after_the_wait(kind):
    graph = _bucket_graph(world=4, numel=64, kind=kind)
    assert reduce_scatters_in_place(graph, "g", rank=2, collective_backend="gloo") == {
        "replaced": 1, "bytes": 256, "copied": 0}
    assert _targets(graph) == [_zc.pack_gradients.default, _zc.reduce_scatter_in_place.default,
                               _c10d.wait_tensor.default, torch.ops.aten.slice.Tensor, _zc.divide_reduced.default]
    pack, started, waited, row, _ = [n for n in graph.nodes if n.op == "call_function"]
    assert started.args == (pack, "sum", 4, "g", kind)
    assert started.meta["zerocompile"]["role"] == "bucket_reduce_scatter"
    assert started.meta["zerocompile"]["params"] == ["a", "b"]
    assert waited.args == (pack,)
    assert row.args == (waited, 0, 32, 48) and tuple(row.meta["val"].shape) == (16,)   # rank 2's chunk
    graph.lint()


def test_a_stage2_bucket_all_reduced_is_all_reduced_in_place():
    """``all_reduce_gradients``' form (the functional all-reduce, its wait, this rank's slice)
    becomes torch's in-place all-reduce of the bucket, the slice read after the bucket's wait."""
    from zerocompile.passes.all_reduce_gradients import reduce_scatters_as_all_reduces
    from zerocompile.passes.reduce_scatter_in_place import all_reduces_in_place
    from zerocompile.runtime.reduction_choice import fixed_choice

    graph = _bucket_graph(world=2, numel=64)
    assert reduce_scatters_as_all_reduces(graph, fixed_choice("all_reduce", "option"), rank=1) == [256]
    assert all_reduces_in_place(graph, "g") == {"replaced": 1, "bytes": 256}
    assert _targets(graph) == [_zc.pack_gradients.default, _c10d.all_reduce_.default, _c10d.wait_tensor.default,
                               torch.ops.aten.slice.Tensor, _zc.divide_reduced.default]
    pack, started, waited, row, _ = [n for n in graph.nodes if n.op == "call_function"]
    assert started.args == (pack, "sum", "g") and not started.users
    assert started.meta["zerocompile"]["role"] == "grad_all_reduce"
    assert waited.args == (pack,) and row.args == (waited, 0, 32, 64)
    graph.lint()
    other = _bucket_graph(world=2, numel=64, device="meta")
    reduce_scatters_as_all_reduces(other, fixed_choice("all_reduce", "option"), rank=1)
    assert all_reduces_in_place(other, "g") == {"replaced": 0, "bytes": 0}      # not a CPU bucket


def test_a_reader_that_is_not_a_division_reads_a_copy_of_the_row():
    """A reduced gradient not divided into a new tensor could keep a view of the whole bucket
    alive (a graph output, a shard gradient): it reads a copy of its row instead."""
    graph = _bucket_graph(world=2, numel=64, reader="add")
    assert reduce_scatters_in_place(graph, "g", rank=1, collective_backend="gloo")["copied"] == 1
    row = next(n for n in graph.nodes if n.target is torch.ops.aten.slice.Tensor)
    (copy,) = row.users
    assert copy.target is torch.ops.aten.clone.default
    assert [u.target for u in copy.users] == [torch.ops.aten.add.Tensor]


@pytest.mark.parametrize("case", ["nccl", "second reader", "not cpu", "other group", "avg"])
def test_what_is_left_as_it_was(case):
    """NCCL's reduce-scatter takes no copy; a bucket read elsewhere may not be written; CUDA
    tensors, other groups' reduce-scatters (hpZ) and other reductions stay."""
    graph = _bucket_graph(world=2, numel=64, second_reader=case == "second reader",
                          device="meta" if case == "not cpu" else "cpu")
    if case == "avg":
        rs = next(n for n in graph.nodes if n.target is _c10d.reduce_scatter_tensor.default)
        rs.args = (rs.args[0], "avg", *rs.args[2:])
    before = _targets(graph)
    result = reduce_scatters_in_place(graph, "other" if case == "other group" else "g", rank=0,
                                      collective_backend="nccl" if case == "nccl" else "gloo")
    assert result == {"replaced": 0, "bytes": 0, "copied": 0}
    assert _targets(graph) == before
    # the transfers are zerocompile's own whatever the backend: they are reduced in place
    p2p = _bucket_graph(world=2, numel=64, kind="point_to_point")
    assert reduce_scatters_in_place(p2p, "g", rank=0, collective_backend="nccl")["replaced"] == 1


def _op_against_reduce_scatter(rank, world):
    from zerocompile.runtime.comm import resolve_group
    from zerocompile.runtime.shared_memory import open_channel

    from census import CollectiveCounter

    group = resolve_group()
    open_channel(group.name)
    torch.manual_seed(rank)
    n = 3 * (1 << 16) + 5                       # rows not a multiple of anything convenient
    out = {}
    for kind in in_place_reduction.KINDS:
        x = torch.randn(world * n)
        # what the op replaces: gloo's reduce-scatter, or the transfers from a copy (on more than two
        # ranks they add in rank order, gloo in its own: the same terms, not the same roundings)
        if kind == "reduce_scatter":
            expected = _c10d.reduce_scatter_tensor(x.clone(), "sum", world, group.name)
        else:
            expected = _zc.reduce_scatter_point_to_point(x.clone(), "sum", world, group.name, True,
                                                         kind == "shared_memory")
        expected = _c10d.wait_tensor(expected)
        with CollectiveCounter() as counter:
            _zc.reduce_scatter_in_place(x, "sum", world, group.name, kind)
        _c10d.wait_tensor(x)
        out[kind] = (torch.equal(x.view(world, -1)[rank], expected), dict(counter.count), dict(counter.bytes),
                     counter.point_to_point)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_op_gives_the_reduce_scatter_bit_for_bit_on_every_rank(world):
    """Against what it replaces, on the same buffer: gloo's all-reduce in place against gloo's
    reduce-scatter, the transfers through the sockets and through shared memory against the same
    transfers from a copy (on three ranks the row of rank 2 is summed after rank 0's and 1's, into
    a received row first); counted as one reduce-scatter of the bucket's bytes, the transfers as
    point-to-point."""
    nbytes = world * (3 * (1 << 16) + 5) * 4
    for results in run_ranks(_op_against_reduce_scatter, world):
        for kind, (equal, count, counted_bytes, p2p) in results.items():
            assert equal, kind
            assert count == {"reduce_scatter": 1} and counted_bytes == {"reduce_scatter": nbytes}, kind
            assert p2p == (0 if kind == "reduce_scatter" else 1), kind


def test_bad_arguments_are_refused():
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="kind 'ring'"):
        _zc.reduce_scatter_in_place(x, "sum", 2, "0", "ring")
    with pytest.raises(ValueError, match="flat, contiguous and of world equal rows"):
        _zc.reduce_scatter_in_place(torch.zeros(9), "sum", 2, "0", "reduce_scatter")


class _Wide(nn.Module):
    """Two 512 x 512 layers and a tiny batch: the gradient bucket (2 MiB) dominates the backward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(512, 512, bias=False)
        self.b = nn.Linear(512, 512, bias=False)

    def forward(self, x, y):
        return F.mse_loss(self.b(torch.tanh(self.a(x))), y)


def _train(rank, world, stage, inner, reduction, in_place):
    import zerocompile
    from zerocompile.runtime.memory_tracker import AllocatorPeak

    import time

    torch.set_num_threads(1)
    torch._dynamo.reset()
    zerocompile.reset_stats()
    started = time.monotonic_ns()
    torch.manual_seed(0)
    model = _Wide()
    options = {"stage": stage, "inner_compiler": inner, "gradient_reduction": reduction}
    if not in_place:
        options["passes"] = {"disable": ["reduce_scatter_in_place"]}
    compiled = torch.compile(model, backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    peaks = []
    for step in range(3):
        x, y = torch.randn(4, 512, generator=g), torch.randn(4, 512, generator=g)
        loss = compiled(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
        with AllocatorPeak() as alloc:
            loss.backward()
        peaks.append(alloc.rise)
        opt.step()
        opt.zero_grad()
    results = [r["results"].get("reduce_scatter_in_place", {}).get("backward", {})
               for r in zerocompile.frame_reports() if r["compiled_at_ns"] > started]
    results += [r["all_reduce"] for r in results if "all_reduce" in r]     # stage 2's all-reduced buckets
    replaced = sum(r.get("replaced", 0) for r in results)
    return {"state": zerocompile.full_state_dict(compiled), "rise": peaks[-1], "replaced": replaced,
            "bucket": sum(r.get("bytes", 0) for r in results) / max(replaced, 1),
            "collectives": {k: zerocompile.stats().as_dict()[k] for k in ("reduce_scatter", "all_reduce")}}


def _reference() -> dict:
    """One process, the whole batch, plain torch: what every run must end at."""
    torch.manual_seed(0)
    model = _Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 512, generator=g), torch.randn(4, 512, generator=g)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pairs(rank, world, cases):
    return [(_train(rank, world, *case, True), _train(rank, world, *case, False)) for case in cases]


CASES = [(3, "eager", "reduce_scatter"), (3, "inductor", "point_to_point"), (2, "eager", "shared_memory"),
         (2, "inductor", "all_reduce")]


def test_training_is_bit_for_bit_what_it_was_and_the_bucket_copy_is_gone():
    """Stages 2 and 3, graphs run op by op and by inductor, each reduction (stage 2's all-reduced
    buckets too, whose functional all-reduce cloned the bucket): the final parameters
    equal those of the same run with the pass disabled, bit for bit, on both ranks, with the same
    reduce-scatters counted. The backward's allocator peak: with the pass, where the bucket is
    packed (its gradients and the bucket: 2 buckets); without it, at the reduction (the bucket,
    the copy gloo's reduce-scatter, or the transfers under inductor, make of it, and the row
    received or reduced: 2.5-3 buckets); shared memory under op-by-op graphs copied only this
    rank's row, and stage 2's all-reduce's clone (2 buckets with the bucket) did not rise above
    the pack's moment either: there no higher. And all of them within float error of one process
    on the whole batch."""
    ref = _reference()
    for rank_results in run_ranks(_pairs, 2, CASES):
        for (stage, inner, reduction), (on, off) in zip(CASES, rank_results):
            case = f"stage {stage}, {inner}, {reduction}"
            assert on["replaced"] >= 1 and off["replaced"] == 0, case
            assert set(on["state"]) == set(off["state"]), case
            for key, value in off["state"].items():
                assert torch.equal(on["state"][key], value), f"{case}: {key}"
                torch.testing.assert_close(value, ref[key], atol=1e-5, rtol=1e-5)
            assert on["collectives"] == off["collectives"], case
            assert on["bucket"] >= 2**20, case           # the gradients of at least one 512 x 512 layer
            # with the pass the backward peaks where the bucket is packed (its gradients and it)
            assert on["rise"] <= 2 * on["bucket"] + 65536, (case, on["rise"], on["bucket"])
            if reduction in ("reduce_scatter", "point_to_point"):   # without it, at the reduction: bucket, copy, row(s)
                assert off["rise"] >= on["rise"] + on["bucket"] / 2, (case, on["rise"], off["rise"])
            else:
                assert off["rise"] >= on["rise"], (case, on["rise"], off["rise"])
