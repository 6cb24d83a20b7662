"""Fixtures shared by the micro-benchmarks."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def fake_world_8():
    """torch's fake process group of 8 ranks (this process is rank 0) for one module.

    Graphs are built for 8 ranks (shard shapes, collective sizes) in one process; the
    collectives return without communicating. The group is destroyed afterwards so that
    other modules run at world size 1.
    """
    import torch.distributed as dist

    from zerocompile._torch_compat import init_fake_process_group

    init_fake_process_group(8)
    torch.compiler.reset()
    yield 8
    torch.compiler.reset()
    dist.destroy_process_group()
