"""Transfers through a shared-memory segment (runtime/shared_memory.py): the bytes the sockets
would deliver, whatever the sizes, the ring's size and the order of the waits; the point-to-point
ops give the collectives' values bit for bit through it; training with it forced is the
single-process training; nothing is left in /dev/shm; a rank that does not come is an error
naming it, and ranks that cannot share memory are refused with the reason."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from harness import Run, assert_matches, reference, zero_train_many
from zerocompile.runtime import shared_memory

_c10d = torch.ops._c10d_functional


def _expected_gather(n: int, dtype, world: int, seed: int) -> list[torch.Tensor]:
    """What rank ``r`` sends in transfer ``seed``: the same on every rank, to check against."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(1000 * seed + r)
        out.append((torch.randn(n, generator=g) * 100).to(dtype))
    return out


def _ring_traffic(rank, world):
    from zerocompile.runtime import shared_memory

    group = dist.group.WORLD
    # a ring of 4 KiB in records of at most 1 KiB: every transfer but the first wraps the ring,
    # several are larger than it, and five are in flight before the first wait
    channel = shared_memory.make_channel(group, group.group_name, rank, world, capacity=4096, chunk=1024)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    # the segment's file is named after rank 0's process (other tests' may come and go meanwhile)
    leftovers = [f for f in os.listdir("/dev/shm") if f.startswith(f"zerocompile-{pids[0]}-")]
    plan = [(1, torch.int8), (1000, torch.float32), (5000, torch.float64), (777, torch.bfloat16), (3, torch.int64),
            (2048, torch.float32)]
    gathers, scatters, works = [], [], []
    for seed, (n, dtype) in enumerate(plan):
        sent = _expected_gather(n, dtype, world, seed)
        rows = torch.empty(world, n, dtype=dtype)
        rows[rank].copy_(sent[rank])
        works.append(channel.exchange([(lambda peer, x=sent[rank]: x, lambda peer, rows=rows: rows[peer])]))
        gathers.append((rows, sent))
        # a reduce-scatter's traffic: row ``peer`` of this rank's buffer goes to ``peer``
        mine = torch.arange(world * n, dtype=torch.float32).view(world, n) + 10_000 * rank + seed
        got = torch.full((world, n), float("nan"))
        works.append(channel.exchange([(lambda peer, m=mine: m[peer], lambda peer, g=got: g[peer])]))
        scatters.append((got, n, seed))
    for work in reversed(works):           # waited last first: each wait completes the earlier ones
        for w in work:
            w.wait()
    for rows, sent in gathers:
        for r in range(world):
            assert torch.equal(rows[r].view(torch.uint8), sent[r].view(torch.uint8)), r
    for got, n, seed in scatters:
        for peer in range(world):
            if peer != rank:
                expected = torch.arange(world * n, dtype=torch.float32).view(world, n)[rank] + 10_000 * peer + seed
                assert torch.equal(got[peer], expected), (peer, n)
    dist.barrier()
    return {"leftovers": leftovers, "tail": channel._tail, "nbytes": channel.nbytes}


@pytest.mark.parametrize("world", [2, 3])
def test_transfers_flow_through_a_ring_smaller_than_them_in_any_wait_order(world):
    results = run_ranks(_ring_traffic, world)
    assert all(res["leftovers"] == [] for res in results)          # the name went once all had it mapped
    assert len({res["tail"] for res in results}) == 1 and results[0]["tail"] > 4 * 4096
    assert results[0]["nbytes"] == 2 * world * 64 + world * 4096


def _ops_both_ways(rank, world):
    from zerocompile.runtime import bucket_ops, point_to_point  # noqa: F401  (register the ops)
    from zerocompile.runtime.comm import resolve_group

    group = resolve_group()
    ops = torch.ops.zerocompile
    out = {}
    # under a record, over a record (chunked), over the 4 MiB ring (flows through it)
    for numel in (1001, 700_000, 2_300_000):
        torch.manual_seed(rank * 7 + numel)
        shard, bucket = torch.randn(numel), torch.randn(world * numel)
        for shm in (False, True):
            gathered = ops.all_gather_point_to_point(shard, world, group.name, True, shm)
            reduced = ops.reduce_scatter_point_to_point(bucket, "sum", world, group.name, True, shm)
            into = torch.full((world * numel,), float("nan"))
            ops.all_gather_point_to_point_into([shard], [into], world, group.name, shm)
            chunk = torch.empty(numel)
            ops.reduce_scatter_point_to_point_into([bucket], [chunk], world, group.name, shm)
            chunks = [numel // 3, 1, numel - numel // 3 - 1]     # a bucket's members, one of one element
            members = ops.all_gather_point_to_point_unpacked(shard, world, group.name, chunks, True, shm)
            results = [_c10d.wait_tensor(t) for t in (chunk, into, reduced, *members[::-1], gathered)]  # out of order
            out[(numel, shm)] = [t.clone() for t in results[:3]] + [torch.cat(results[3:-1][::-1]), results[-1]]
        reference = [_c10d.wait_tensor(_c10d.reduce_scatter_tensor(bucket, "sum", world, group.name)),
                     _c10d.wait_tensor(_c10d.all_gather_into_tensor_out(shard, world, group.name,
                                                                        out=torch.empty(world * numel)))]
        out[(numel, "collectives")] = reference + [torch.cat(ops.unpack_gathered_bucket(reference[1], world, chunks))]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_point_to_point_ops_through_shared_memory_give_what_the_sockets_give(world):
    """Each op, by sockets and by shared memory, equal bit for bit; on two ranks also the
    collectives' values (the reduce-scatter's one addition), on more the same sums in rank order."""
    for res in run_ranks(_ops_both_ways, world):
        for numel in (1001, 700_000, 2_300_000):
            sockets, shm = res[(numel, False)], res[(numel, True)]
            for a, b in zip(sockets, shm):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), numel
            rs, ag, members = res[(numel, "collectives")]
            assert torch.equal(shm[1], ag) and torch.equal(shm[4], ag) and torch.equal(shm[3], members)
            if world == 2:
                assert torch.equal(shm[0], rs) and torch.equal(shm[2], rs)
            else:
                torch.testing.assert_close(shm[0], rs)


def _a_rank_that_never_comes(rank, world):
    from zerocompile.runtime import shared_memory

    group = dist.group.WORLD
    channel = shared_memory.make_channel(group, group.group_name, rank, world)
    channel.timeout_s = 1.0
    error = None
    if rank == 0:                         # rank 1 never starts the transfer
        x, rows = torch.ones(10), torch.empty(world, 10)
        try:
            for w in channel.exchange([(lambda peer: x, lambda peer: rows[peer])]):
                w.wait()
        except RuntimeError as err:
            error = str(err)
    dist.barrier()
    return error


def _a_rank_that_exited(rank, world):
    import subprocess
    import sys
    import time

    from zerocompile.runtime import shared_memory

    group = dist.group.WORLD
    channel = shared_memory.make_channel(group, group.group_name, rank, world)
    assert channel.pids is not None and channel.pids[rank] == os.getpid()
    error, waited = None, None
    if rank == 0:
        # rank 1 as if its process had died: a process id that no longer exists
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        channel.pids[1] = gone.pid
        x, rows = torch.ones(10), torch.empty(world, 10)
        start = time.monotonic()
        try:
            for w in channel.exchange([(lambda peer: x, lambda peer: rows[peer])]):
                w.wait()
        except RuntimeError as err:
            error, waited = str(err), time.monotonic() - start
    dist.barrier()
    return error, waited


def test_a_rank_that_exited_is_an_error_naming_it_within_a_second():
    """Not after the process group's timeout (90 s here): the wait looks for the ranks it waits for."""
    error, waited = run_ranks(_a_rank_that_exited, 2)[0]
    assert error is not None and "rank 1 of process group" in error and "exited while rank 0 waited" in error, error
    assert waited < 5, waited


def test_a_rank_that_does_not_come_is_an_error_naming_it():
    error = run_ranks(_a_rank_that_never_comes, 2)[0]
    assert error is not None and "waited 1 s for rank(s) [1]" in error and "same graphs" in error, error


def _on_two_hosts(rank, world):
    from zerocompile.errors import ZeroConfigError
    from zerocompile.runtime import shared_memory
    from zerocompile.runtime.comm import resolve_group
    from zerocompile.runtime.reduction_choice import gradient_reduction

    shared_memory.host_identity = lambda: (f"node{rank}", "boot")     # as if each rank were on its own host
    group = resolve_group()
    out = {}
    for option, gather in (("shared_memory", "auto"), ("auto", "shared_memory")):
        try:
            gradient_reduction(option, group, parameter_gather=gather)
        except ZeroConfigError as err:
            out[(option, gather)] = str(err)
    auto = gradient_reduction("auto", group, stage=3)
    out["auto"] = auto.as_dict()
    return out


def test_ranks_on_different_hosts_are_refused_and_auto_measures_without_it():
    for res in run_ranks(_on_two_hosts, 2):
        for option, gather in (("shared_memory", "auto"), ("auto", "shared_memory")):
            message = res[(option, gather)]
            name = "gradient_reduction" if option == "shared_memory" else "parameter_gather"
            assert f"option {name!r} = 'shared_memory' cannot be used" in message, message
            assert "on 2 hosts (node0, node1)" in message and "'point_to_point'" in message, message
        auto = res["auto"]
        assert all(t[-1] == float("inf") for t in auto["ms"]) and "shared_memory" not in auto["kinds"]
        assert all(t[-1] == float("inf") for t in auto["parameter_gather"]["ms"])
        assert "shared_memory n/a" in auto["description"]


def _training_runs(stage, world):
    return [Run(model="tied", stage=stage, opt="adamw", steps=3, accum=2, clip=0.5, batch=4 * world,
                options=(("gradient_reduction", how), ("parameter_gather", how), ("bucket_mb", 2 / 1024)))
            for how in ("point_to_point", "shared_memory")]


@pytest.mark.parametrize("world, stages", [(2, (1, 2, 3)), (3, (3,))])
def test_training_through_shared_memory_is_the_single_process_training(world, stages):
    """Tied weights, 2 micro-batches per step, clipping, small buckets (many transfers in
    flight): forced through shared memory, the single-process reference, and bit for bit the run
    through the sockets; the graphs' collectives became the transfers, stats() counts the
    same bytes and reports the segment. The stages of one world size run in one group of ranks,
    every run through the sockets first (a shared-memory segment, once chosen, stays open)."""
    runs = [_training_runs(st, world)[0] for st in stages] + [_training_runs(st, world)[1] for st in stages]
    results = run_ranks(zero_train_many, world, runs)[0]
    for i, stage in enumerate(stages):
        _check_training(stage, world, _training_runs(stage, world), results[i], results[len(stages) + i])


def _check_training(stage, world, runs, sockets, shm):
    assert_matches(shm, reference(runs[1]))
    assert shm["losses"] == sockets["losses"], stage
    for key, value in sockets["state"].items():
        assert torch.equal(value, shm["state"][key]), (stage, key)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert shm["stats"][kind] == sockets["stats"][kind], kind
    assert shm["stats"]["shared_memory_bytes"] == 2 * world * 64 + world * shared_memory.CAPACITY
    assert sockets["stats"]["shared_memory_bytes"] == 0
    for report in shm["reports"]:
        assert report["results"]["gradient_reduction"]["kinds"] == ["shared_memory"]
    if stage == 3:
        replaced = [r["results"]["point_to_point_collectives"][graph][kind]["replaced"] for r in shm["reports"]
                    for graph, kind in (("forward", "all_gather"), ("backward", "reduce_scatter"))]
        assert all(n > 0 for n in replaced), replaced
        # the bucket gathers land straight in their members (no rows buffer, no copy out of it)
        unpacked = [r["results"]["point_to_point_collectives"][graph]["all_gather"]["unpacked"] for r in shm["reports"]
                    for graph in ("forward", "backward") if graph in r["results"]["point_to_point_collectives"]]
        assert sum(unpacked) > 0, unpacked


def _segment_kept_only_where_chosen(rank, world):
    import gc

    import zerocompile
    from zerocompile.runtime import shared_memory
    from zerocompile.runtime.reduction_choice import _keep_shared_memory_if_chosen, fixed_choice

    name, cpu = dist.group.WORLD.group_name, torch.device("cpu")
    seen = []
    shared_memory.open_channel(name)                       # as the probe opens it
    seen.append(zerocompile.stats().shared_memory_bytes)
    _keep_shared_memory_if_chosen(fixed_choice("point_to_point", "measured"), name, cpu)
    gc.collect()
    seen.append(zerocompile.stats().shared_memory_bytes)   # nothing chose it: let go
    _keep_shared_memory_if_chosen(fixed_choice("reduce_scatter", "measured", gather="shared_memory"), name, cpu)
    _keep_shared_memory_if_chosen(fixed_choice("all_reduce", "measured"), name, cpu)
    gc.collect()
    seen.append(zerocompile.stats().shared_memory_bytes)   # chosen once: kept, whatever comes after
    return seen


def test_the_segment_is_kept_only_where_a_choice_takes_it():
    size = 2 * 2 * 64 + 2 * shared_memory.CAPACITY
    assert run_ranks(_segment_kept_only_where_chosen, 2) == [[size, 0, size]] * 2
