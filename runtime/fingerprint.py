"""Check that every rank compiled the same sequence of collectives for a frame.

A rank whose graph issues collectives in another order or size than its peers hangs the
job (or silently mixes up buffers). At the first run of each compiled frame, the ranks
all-gather a 60-bit hash of the frame's collective sequence (forward then backward) and
compare: a mismatch raises an error naming the frame and the ranks that differ, before
any of the frame's own collectives run.
"""

from __future__ import annotations

import hashlib

import torch

from zerocompile.runtime.accounting import ACCOUNTING
from zerocompile.runtime.comm import CommGroup, all_gather_flat


def fingerprint(sequences) -> int:
    """A rank-independent 60-bit hash of ``[(kind, bytes), ...]`` lists."""
    digest = hashlib.sha256(repr([list(seq) for seq in sequences]).encode()).hexdigest()
    return int(digest[:15], 16)


def check_same_on_all_ranks(value: int, group: CommGroup, what: str) -> None:
    """All-gather ``value`` over ``group``; raise if any rank holds another one."""
    if group.world == 1:
        return
    mine = torch.tensor([value], dtype=torch.int64)
    values = all_gather_flat(mine, group.world, group.name).tolist()
    ACCOUNTING.record("all_gather", 8 * group.world)
    differing = [rank for rank, v in enumerate(values) if v != values[0]]
    if differing:
        raise RuntimeError(
            f"zerocompile: ranks compiled different collective sequences for {what} "
            f"(rank 0 differs from ranks {differing}); every rank must run the same model code "
            "with the same options and input shapes")
