"""How a process that runs one rank leaves: the default process group torn down on every rank
alike, then, after work that succeeded, an exit without interpreter teardown.

Used by the processes that start local ranks themselves (the multi-rank tests'
``tests/dist_utils.py``, the benchmarks' ``benchmarks/common.py``); nothing in the training
path calls it.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch.distributed as dist

__all__ = ["rank_teardown"]


@contextlib.contextmanager
def rank_teardown():
    """Around the work of a rank that joined the default process group. On leaving, every rank
    meets at a barrier and the group is destroyed (also when the barrier fails). An exception
    of the work then propagates; after work that ended normally the process exits at once with
    status 0, its output flushed: without interpreter teardown, where gloo's background threads
    occasionally abort the process ("terminate called without an active exception") after all
    work is done.

    After work that ended normally, a failure of the closing barrier itself is reported on
    stderr and the exit status stays 0: gloo raises "Connection closed by peer" on a rank whose
    last barrier message was still in flight when a peer that had passed the barrier closed its
    connections and left (seen once, on one of 4 ranks on 2 loaded cores, every rank's result
    already recorded). A peer that crashed instead reports its own failure by its exit
    status, which the launcher checks on every rank."""
    try:
        yield
    except BaseException:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
        raise
    try:
        dist.barrier()
    except RuntimeError as err:
        print(f"rank_teardown: the closing barrier failed after this rank's work had succeeded: {err}",
              file=sys.stderr)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
