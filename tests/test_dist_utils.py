"""The multi-rank test helper retries a launch whose port was taken before rank 0 listened on
it (what tests running in parallel can do to each other), and only that failure; its ranks start
from the fork server with the preload list imported."""

from __future__ import annotations

import socket

import pytest

import dist_utils


def _rank_sum(rank, world):
    return rank + world


def test_a_taken_port_is_retried_on_a_new_one(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = dist_utils.free_port
    fresh = []

    def first_taken():
        if ports:
            return ports.pop()
        fresh.append(real())
        return fresh[-1]

    monkeypatch.setattr(dist_utils, "free_port", first_taken)
    try:
        assert dist_utils.run_ranks(_rank_sum, 2) == [2, 3]
    finally:
        taken.close()
    assert not ports and len(fresh) == 1     # the taken port was tried first, then one new port


def _fails(rank, world):
    raise ValueError("not a port problem")


def test_other_failures_are_not_retried():
    with pytest.raises(AssertionError, match="not a port problem"):
        dist_utils.run_ranks(_fails, 2)


def _what_the_rank_started_with(rank, world):
    import gc
    import sys

    import torch._dynamo.funcname_cache

    return {"modules": sorted(m for m in dist_utils._PRELOAD if m in sys.modules), "frozen": gc.get_freeze_count(),
            "traced_files": len(torch._dynamo.funcname_cache.cache)}


def test_ranks_start_from_the_preloaded_fork_server():
    """Every module of the preload list (the test helpers and warm_imports included: Python
    3.11's fork server skips one it cannot import without a word) is in a rank before its
    function runs, with the warm-up's objects frozen and Dynamo's source-line table filled."""
    for got in dist_utils.run_ranks(_what_the_rank_started_with, 2):
        assert got["modules"] == sorted(dist_utils._PRELOAD), got["modules"]
        assert got["frozen"] > 100_000, got["frozen"]
        assert got["traced_files"] >= 16, got["traced_files"]        # warm_imports.TRACED



def _teardown_rank(rank, port, folder):
    """Rank 1 joins the group and leaves at once, without the closing barrier (from rank 0's
    side, a peer that passed the barrier and closed its connections); rank 0 then closes with
    ``rank_teardown`` after work that succeeded, its stderr in ``folder``."""
    import datetime
    import os
    import sys
    import time

    import torch.distributed as dist

    from zerocompile.runtime.rank_exit import rank_teardown

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        os._exit(0)
    sys.stderr = open(os.path.join(folder, "stderr"), "w", buffering=1)
    with rank_teardown():
        time.sleep(1.0)         # the work; rank 1 is gone by its end


def test_a_closing_barrier_whose_peer_left_is_reported_and_the_rank_still_succeeds(tmp_path):
    """``rank_teardown`` (runtime/rank_exit.py): after this rank's work succeeded, a closing
    barrier that fails because a peer has left (gloo: "Connection closed by peer") is reported on
    stderr and the rank exits 0; a launcher learns of a peer that failed from that peer's own exit
    status."""
    port = dist_utils.free_port()
    procs = [dist_utils.start_fresh(_teardown_rank, rank, port, str(tmp_path)) for rank in range(2)]
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert "the closing barrier failed after this rank's work had succeeded" in (tmp_path / "stderr").read_text()
