"""Memory safety of what the compiled graphs run.

Gloo all-gathers: in torch 2.13 a functional ``all_gather_into_tensor`` on gloo runs as an
``ALLGATHER_COALESCED`` work, and gloo's two worker threads write each finished work's op
name into one shared ``std::string`` without a lock; a name that long lives on the heap, so
two works finishing together free it twice (heap corruption: the SIGSEGV and the
``malloc(): unaligned tcache chunk detected`` aborts seen at stage 3 with bucketing and
prefetching). zerocompile therefore runs every gloo all-gather as
``all_gather_into_tensor_out`` (runtime/comm.py). These tests check that no op of the
racy kind reaches gloo on the real graphs of a stage-3 bucketed and prefetched model, in
the optimizer step and in the eager paths, with numbers still equal to a single process.

``debug_checks``: reading a storage freed with ``resize_(0)`` and leaving a collective
unwaited raise errors that name the graph node.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_ranks
from harness import Run, assert_matches, reference, zero_train
from zerocompile.inner_compilers import CheckedInterpreter
from zerocompile.runtime.comm import (all_gather_flat, check_collectives_runnable,
                                      lower_collectives_for_backend)

_c10d = torch.ops._c10d_functional


class _CollectiveRecorder(TorchDispatchMode):
    """Counts the functional collective ops that run (compiled graphs included)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self):
        super().__init__()
        self.seen: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (func.namespace == "_c10d_functional" and func.__name__ != "wait_tensor.default") or \
                func.__name__.startswith("watched_"):
            self.seen[func.__name__] = self.seen.get(func.__name__, 0) + 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------- stage 3, 2 gloo ranks
# the collectives themselves (not the point-to-point transfers "auto" may take on gloo instead)
RUN = Run(model="gpt", stage=3, opt="adamw", steps=2, clip=1.0,
          options=(("bucket_mb", 0.01), ("prefetch_mb", 0.1), ("gradient_reduction", "reduce_scatter"),
                   ("parameter_gather", "all_gather"), ("collective_timeout_s", None)))
# the same with the collective watchdog on (the default): every gather starts through
# torch.distributed's all_gather_single (gloo's _allgather_base, an ALLGATHER work)
RUN_WATCHED = Run(model="gpt", stage=3, opt="adamw", steps=2, clip=1.0,
                  options=(("bucket_mb", 0.01), ("prefetch_mb", 0.1), ("gradient_reduction", "reduce_scatter"),
                           ("parameter_gather", "all_gather")))


def _recorded_train(rank, world, run):
    import torch.distributed as dist

    recorder = _CollectiveRecorder()
    with recorder:
        # compile (the cost-model probe and fingerprint check gather eagerly), train, and
        # gather the full state back (eager all-gathers of the shards)
        result = zero_train(rank, world, run)
        gathered = all_gather_flat(torch.full((3,), float(rank)), world, dist.group.WORLD.group_name)
    result["seen"] = recorder.seen
    result["gathered"] = gathered
    return result


@pytest.mark.parametrize("watched", [False, True])
def test_stage3_bucketed_prefetched_gathers_never_run_as_gloo_coalesced_works(watched):
    run = RUN_WATCHED if watched else RUN
    res = run_ranks(_recorded_train, 2, run)
    assert_matches(res[0], reference(run))    # rank 0 holds the full state
    gather, reduce = ("watched_all_gather", "watched_reduce_scatter") if watched else \
        ("all_gather_into_tensor_out", "reduce_scatter_tensor")
    for r in res:
        assert "all_gather_into_tensor.default" not in r["seen"], r["seen"]
        assert r["seen"].get(f"{gather}.default", 0) > 0, r["seen"]
        assert r["seen"].get(f"{reduce}.default", 0) > 0, r["seen"]
        assert torch.equal(r["gathered"], torch.tensor([0.0, 0, 0, 1, 1, 1]))


# ------------------------------------------------------------- the lowering itself
def _gathers(x, y, group_name, world=2):
    a = _c10d.all_gather_into_tensor(x, world, group_name)
    b = _c10d.all_gather_into_tensor(y, world, group_name)    # two in flight at once
    return _c10d.wait_tensor(a) * 2, _c10d.wait_tensor(b).sum(0)


def _lowering_worker(rank, world):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    x, y = torch.arange(5.0) + 10 * rank, torch.ones(3, 4) * (rank + 1)
    gm = make_fx(lambda x, y: _gathers(x, y, name))(x, y)
    for node in gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        node.meta["zerocompile"] = {"role": "param_gather"}   # tags must survive the rewrite
    with pytest.raises(RuntimeError, match="runs all_gather_into_tensor on a gloo group"):
        check_collectives_runnable(gm.graph)
    rewritten = lower_collectives_for_backend(gm.graph)
    gm.recompile()
    check_collectives_runnable(gm.graph)
    outs = gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor_out.default)
    got = [torch.fx.Interpreter(gm).run(x, y) for _ in range(20)]
    return {"rewritten": rewritten, "tags": [n.meta.get("zerocompile") for n in outs],
            "left": len(gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)),
            "got": got, "expected": _gathers(x, y, name)}


def test_lowering_turns_every_gloo_gather_into_the_out_variant_with_the_same_values():
    for res in run_ranks(_lowering_worker, 2):
        assert res["rewritten"] == 2 and res["left"] == 0
        assert res["tags"] == [{"role": "param_gather"}] * 2
        full = torch.cat([torch.arange(5.0), torch.arange(5.0) + 10]) * 2
        assert torch.equal(res["expected"][0], full)
        assert torch.equal(res["expected"][1], torch.full((4,), 9.0))   # 3 rows of 1 + 3 rows of 2
        for a, b in res["got"]:
            assert torch.equal(a, res["expected"][0]) and torch.equal(b, res["expected"][1])


def test_lowering_leaves_other_backends_alone(fake_world):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    gm = make_fx(lambda x, y: _gathers(x, y, name, world=4))(torch.ones(5), torch.ones(3, 4))
    assert lower_collectives_for_backend(gm.graph) == 0
    check_collectives_runnable(gm.graph)


# ------------------------------------------------------------- debug_checks
def test_debug_checks_name_the_node_that_reads_a_freed_storage():
    def step(x, w):
        h = torch.tanh(x)
        return h @ w

    x, w = torch.randn(2, 3), torch.randn(3, 4)
    gm = make_fx(step)(x, w)
    assert torch.equal(CheckedInterpreter(gm).run(x, w), step(x, w))
    w.untyped_storage().resize_(0)            # as a stage-3 parameter's storage is freed
    with pytest.raises(RuntimeError, match=r"node 'mm' .* reads 'w_1' \(shape \(3, 4\).*needs 48 bytes "
                                           r"of storage, but its storage holds 0"):
        CheckedInterpreter(gm).run(x, w)
    view = torch.randn(10)[4:]                # a view at an offset: the bound counts the offset
    assert torch.equal(CheckedInterpreter(make_fx(torch.neg)(view)).run(view), -view)


def test_debug_checks_catch_a_collective_left_unwaited(fake_world):
    import torch.distributed as dist

    name = dist.group.WORLD.group_name

    def leaky(x):
        _c10d.all_reduce(x, "sum", name)    # started, never waited for
        return x + 1

    interpreter = CheckedInterpreter(torch.fx.symbolic_trace(leaky))
    with pytest.raises(RuntimeError, match="1 collective\\(s\\) started and not waited for"):
        interpreter.run(torch.ones(2))
    started = next(v for n, v in interpreter.env.items() if n.target in (_c10d.all_reduce, _c10d.all_reduce.default))
    _c10d.wait_tensor(started)              # leave the registry as we found it
