"""The multi-rank test helper retries a launch whose port was taken before rank 0 listened on
it (what tests running in parallel can do to each other), and only that failure."""

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
