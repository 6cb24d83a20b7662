"""Fixtures shared by the test modules."""

from __future__ import annotations

import fcntl
import functools
import os

import pytest
import torch


if "PYTEST_XDIST_WORKER" in os.environ:
    # ``make test`` runs one pytest worker per core, and most tests start ranks of one thread
    # each: a second intra-op thread in a worker only competes with the other worker's ranks
    # for the same cores (8% of the wall time of the single-process tests, measured). A test
    # that is about threads sets its own count.
    torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Once the test modules are imported (torch, transformers, zerocompile, pytest's own objects),
    ``gc.freeze()`` them, as ``warm_imports`` does for the ranks' fork server: the full collections
    of each step that compiled (``collect_compile_garbage``) then walk what the tests made, not the
    half a million objects of those modules. What is frozen is alive for the whole run anyway;
    what a test makes is collected as in any process."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """Each test function runs from ``zerocompile.deep_stack.on_a_deep_stack``, as the ranks'
    functions do (``dist_utils``): on Python 3.11 a call that crosses the end of a 16 KiB stack
    chunk maps and unmaps a chunk every time (CPython issue gh-142183), and Dynamo's tracing, deep
    in pytest's stack, spent a fifth of the suite's CPU time so (``perf record -a``). The backend's
    compile runs on a deep stack whatever calls it; this puts Dynamo's tracing there too. Nothing
    but the stack's layout changes: the same call, arguments and exceptions."""
    from zerocompile.deep_stack import on_a_deep_stack

    test = pyfuncitem.obj
    pyfuncitem.obj = functools.wraps(test)(lambda *args, **kwargs: on_a_deep_stack(test, *args, **kwargs))
    try:
        yield
    finally:
        pyfuncitem.obj = test


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


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory):
    """``once_per_run(key, compute)``: ``compute()``, computed once per pytest run and shared by
    the pytest-xdist workers. A module-scoped fixture runs once per worker that runs one of its
    tests, and ``--dist worksteal`` often splits a module's tests across the two workers: an
    expensive multi-rank run then ran twice, the two copies competing for the same cores. The
    first worker to ask computes under a file lock and saves the result (``torch.save``, as
    ``run_ranks`` results are) in the run's shared temporary folder; the others wait for it and
    load it. A ``compute`` that raises saves nothing: the next worker to ask tries again. Without
    xdist this is ``compute()``."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return lambda key, compute: compute()
    folder = tmp_path_factory.getbasetemp().parent / "once_per_run"   # the run's, not the worker's
    folder.mkdir(exist_ok=True)

    def shared(key: str, compute):
        path = folder / f"{key}.pt"
        with open(folder / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                return torch.load(path, weights_only=False)
            result = compute()
            torch.save(result, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            return result

    return shared


@pytest.fixture(scope="session")
def ranks_in_folder(once_per_run, tmp_path_factory):
    """``ranks_in_folder(key, worker, *subfolders)``: ``(root, run_ranks(worker, 2, str(root)))``,
    once per pytest run (``once_per_run``), ``root`` a fresh folder with ``subfolders`` made in it,
    kept until the run ends (the tests read the files the ranks left there)."""
    from dist_utils import run_ranks

    def run(key: str, worker, *subfolders: str):
        def compute():
            root = tmp_path_factory.mktemp(key.replace(".", "_"))
            for name in subfolders:
                (root / name).mkdir()
            return root, run_ranks(worker, 2, str(root))
        return once_per_run(key, compute)

    return run
