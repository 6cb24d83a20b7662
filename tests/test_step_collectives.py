"""The optimizer step's bucketed collectives (``runtime/step_collectives.py``) against the same
reductions computed in one process from every rank's tensors: many buckets (two buffers taking
turns), sizes that need padding, a tensor larger than the bucket cap, and a cast to the reduce
dtype."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist_utils import run_ranks

SIZES = [7, 1, 30, 5, 64, 3, 11]
WORLD = 3


def _tensors(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


def _worker(rank, world):
    from zerocompile.runtime.comm import resolve_group
    from zerocompile.runtime.session import PROCESS
    from zerocompile.runtime.step_collectives import all_gather_concat, all_reduce_mean_, reduce_scatter_mean

    group = resolve_group(dist.group.WORLD)
    session = PROCESS.outside      # what counts them: no model here
    out = {}
    for cap in (1, 40 * 4, 10**9):                     # bytes: one tensor per bucket, several, one bucket
        grads = _tensors(rank, torch.bfloat16)
        padded = [-(-n // world) * world for n in SIZES]
        out[("rs", cap)] = reduce_scatter_mean(list(zip(grads, padded)), group, cap, torch.float32, session=session)
        shards = [torch.full((n // world,), float(rank * 100 + i)) for i, n in enumerate(padded)]
        seen = {}
        all_gather_concat(shards, group, cap, lambda i, rows: seen.__setitem__(i, rows.clone()), session=session)
        out[("ag", cap)] = [seen[i] for i in range(len(shards))]
        full = _tensors(rank, torch.float32)
        all_reduce_mean_(full, group, cap, torch.float32, session=session)
        out[("ar", cap)] = full
    return out


def test_bucketed_step_collectives_match_a_one_process_reduction():
    results = run_ranks(_worker, WORLD)
    every = [_tensors(r, torch.bfloat16) for r in range(WORLD)]
    for rank, res in enumerate(results):
        for cap in (1, 40 * 4, 10**9):
            for i, n in enumerate(SIZES):
                chunk = -(-n // WORLD)
                total = torch.stack([torch.nn.functional.pad(t[i].float(), (0, chunk * WORLD - n)) for t in every])
                mean = total.sum(0) / WORLD
                assert torch.equal(res[("rs", cap)][i], mean[rank * chunk:(rank + 1) * chunk]), (cap, i)
                rows = res[("ag", cap)][i]
                assert rows.shape == (WORLD, chunk)
                assert torch.equal(rows, torch.tensor([[float(r * 100 + i)] * chunk for r in range(WORLD)])), (cap, i)
                full = torch.stack([_tensors(r, torch.float32)[i] for r in range(WORLD)]).sum(0) / WORLD
                assert torch.allclose(res[("ar", cap)][i], full, rtol=0, atol=1e-6), (cap, i)


# float32 gradients needing no padding travel from their own memory; those over
# point_to_point.PACK_BELOW (64 KiB) one by one, the smaller ones packed; 7 needs padding
P2P_SIZES = [3 * 20000, 6, 3 * 9000, 7, 3 * 40000, 3]


def _p2p_worker(rank, world):
    from census import CollectiveCounter
    from zerocompile.runtime.comm import resolve_group
    from zerocompile.runtime.session import PROCESS
    from zerocompile.runtime.step_collectives import reduce_scatter_mean

    group = resolve_group(dist.group.WORLD)
    g = torch.Generator().manual_seed(7 + rank)
    grads = [torch.randn(n, generator=g) for n in P2P_SIZES]
    kept = [t.clone() for t in grads]
    padded = [-(-n // world) * world for n in P2P_SIZES]
    out = {}
    for kind in ("point_to_point", "shared_memory"):
        for cap in (1, 200 * 1024, 10**9):
            with CollectiveCounter() as counter:
                chunks = reduce_scatter_mean(list(zip(grads, padded)), group, cap, torch.float32,
                                             choose=lambda nbytes: kind, session=PROCESS.outside)
            out[(kind, cap)] = (chunks, counter.point_to_point, dict(counter.count), dict(counter.bytes))
    return out, all(torch.equal(a, b) for a, b in zip(grads, kept))


def test_point_to_point_step_reduction_sums_in_rank_order():
    """Stage 1's step reduction point to point (``reduce_scatter_point_to_point_into`` where no cast
    or padding is needed, the bucket buffer elsewhere), through the sockets and through shared
    memory: each rank's chunk of the mean, summed in rank order, bit for bit; one collective
    counted per bucket with the bucket's bytes; the gradients themselves unchanged."""
    results = run_ranks(_p2p_worker, WORLD)
    every = []
    for r in range(WORLD):
        g = torch.Generator().manual_seed(7 + r)
        every.append([torch.randn(n, generator=g) for n in P2P_SIZES])
    padded_bytes = sum(-(-n // WORLD) * WORLD * 4 for n in P2P_SIZES)
    for rank, (res, unchanged) in enumerate(results):
        assert unchanged
        for (_, cap), (chunks, p2p, count, nbytes) in res.items():
            assert p2p == count["reduce_scatter"] >= (1 if cap == 10**9 else 2), (cap, count)
            assert nbytes["reduce_scatter"] == padded_bytes
            for i, n in enumerate(P2P_SIZES):
                chunk = -(-n // WORLD)
                rows = [torch.nn.functional.pad(every[r][i], (0, chunk * WORLD - n)).view(WORLD, chunk)[rank]
                        for r in range(WORLD)]
                total = rows[0].clone()
                for row in rows[1:]:
                    total += row
                assert torch.equal(chunks[i], total / WORLD), (cap, i)
