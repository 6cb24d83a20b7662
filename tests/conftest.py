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


@pytest.fixture(scope="session", autouse=True)
def built_cpp_kernels():
    """Build the C++ kernels (csrc/) once, before any test: on a machine whose extension cache
    is cold the build takes ~30 s, which must not happen inside ranks waiting on each other."""
    from zerocompile.runtime import cpu_extension

    cpu_extension.load("fused_adam")
