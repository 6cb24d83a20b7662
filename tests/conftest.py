"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def fake_world():
    """torch's fake process group of 4 ranks (rank 0): graphs for 4 ranks in one process;
    collectives return without communicating."""
    import torch.distributed as dist

    from zerocompile._torch_compat import init_fake_process_group

    init_fake_process_group(4)
    torch.compiler.reset()
    yield
    torch.compiler.reset()
    dist.destroy_process_group()
