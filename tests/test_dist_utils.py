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
