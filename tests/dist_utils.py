"""Helpers for multi-rank tests: start N gloo ranks on a free port, collect their results.

Ranks are forked from a fork server that imported torch, zerocompile, transformers and these
helpers once (``forkserver`` start method with a preload list). With ``spawn`` every rank of
every test imported them afresh: about 2 s of wall time per multi-rank test on 2 cores, with
test modules that import transformers more. Each rank gets the parent's environment and
working directory as they are when the test starts it (the fork server's are those of its
own start), so the ranks see what spawned ranks saw."""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "transformers", "zerocompile", "dist_utils",
            "harness", "models", "zoo", "warm_imports"]   # modules missing here are skipped by the fork server
multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
_TESTS = os.path.dirname(os.path.abspath(__file__))


def _ensure_fork_server() -> None:
    """Start the fork server if it is not running, with this folder on its ``PYTHONPATH``:
    Python 3.11's fork server does not apply the parent's ``sys.path`` before importing the
    preload list, and skips a module it cannot import without a word, so without this the test
    helpers and ``warm_imports`` were imported again in every rank. The parent's environment is
    restored at once (each rank gets the test's own environment from ``_entry``)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, old) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, outdir, environ, cwd):
    faulthandler.enable()  # a rank that dies on a signal prints its Python stack
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:  # noqa: BLE001 - report to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
        raise
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    # Leave without interpreter teardown: gloo's background threads occasionally abort the
    # process there ("terminate called without an active exception") after all work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_fresh(fn, *args) -> multiprocessing.Process:
    """Start ``fn(*args)`` in a process forked from the fork server: torch, transformers and
    zerocompile imported, nothing run, so as fresh as a new interpreter without the ~4-5 s of
    CPU that importing them again costs. The parent's environment and working directory are
    not applied (``fn`` sets what it needs); ``join()`` the process and read its ``exitcode``."""
    _ensure_fork_server()
    proc = multiprocessing.get_context("forkserver").Process(target=fn, args=args)
    proc.start()
    return proc


def run_ranks(fn, world: int, *args) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    A free port can be taken by another process between ``free_port()`` and rank 0's store
    listening on it (tests running in parallel, gloo's own connections): a launch whose ranks
    fail with "address already in use" (EADDRINUSE) is retried on a new port, twice at most."""
    for attempt in range(3):
        try:
            return _run_ranks_once(fn, world, args)
        except AssertionError as err:
            text = str(err).lower()
            if attempt == 2 or not ("address already in use" in text or "eaddrinuse" in text):
                raise


def _run_ranks_once(fn, world: int, args: tuple) -> list:
    _ensure_fork_server()
    with tempfile.TemporaryDirectory() as outdir:
        try:
            mp.start_processes(_entry, args=(world, free_port(), fn, args, outdir, dict(os.environ), os.getcwd()),
                               nprocs=world, join=True, start_method="forkserver")
        except Exception as err:  # noqa: BLE001 - show the rank's own traceback
            errors = []
            for r in range(world):
                path = os.path.join(outdir, f"{r}.pt")
                if os.path.exists(path):
                    rec = torch.load(path, weights_only=False)
                    if not rec["ok"]:
                        errors.append(f"rank {r}:\n{rec['error']}")
            finished = [r for r in range(world) if os.path.exists(os.path.join(outdir, f"{r}.pt"))]
            raise AssertionError("\n".join(errors) or f"{err} (ranks that had finished: {finished})") from None
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False)["result"] for r in range(world)]
