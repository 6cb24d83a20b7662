"""Helpers for multi-rank tests: start N gloo ranks on a free port, collect their results.

Ranks are forked from a fork server that imported torch, zerocompile, transformers and these
helpers once (``forkserver`` start method with a preload list). With ``spawn`` every rank of
every test imported them afresh: about 2 s of wall time per multi-rank test on 2 cores, with
test modules that import transformers more. Each rank gets the parent's environment and
working directory as they are when the test starts it (the fork server's are those of its
own start), so the ranks see what spawned ranks saw. ``run_cli`` and ``run_script_ranks`` run
``python -m zerocompile ...`` and a torchrun-style script the same way, in children of the fork
server instead of new interpreters."""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerocompile.deep_stack import on_a_deep_stack
from zerocompile.runtime.rank_exit import rank_teardown


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


def _adopt(environ: dict, cwd: str) -> None:
    """In a child of the fork server: the environment and working directory of the test that
    started it (the fork server's are those of its own start)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, outdir, environ, cwd):
    faulthandler.enable()  # a rank that dies on a signal prints its Python stack
    _adopt(environ, cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    with rank_teardown():   # a barrier, the group destroyed; after success os._exit(0)
        try:
            result = on_a_deep_stack(fn, rank, world, *args)     # as the tests' own calls (conftest.py)
            torch.save({"ok": True, "result": result}, os.path.join(outdir, f"{rank}.pt"))
        except BaseException:  # noqa: BLE001 - report to the parent
            torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
            raise


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


def _in_child(run, out_path: str, err_path: str, environ: dict, cwd: str) -> None:
    """In a child of the fork server: the given environment and working directory, stdout and
    stderr into files, ``run()``'s return value (an int, or None for 0) or its ``SystemExit``
    code as the process's exit code; any other exception's traceback on stderr and exit code 1."""
    _adopt(environ, cwd)
    code = 1
    with open(out_path, "w") as out, open(err_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = on_a_deep_stack(run) or 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the traceback is the parent's error message
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def cli_child(argv: list, out_path: str, err_path: str, environ: dict, cwd: str) -> None:
    """In a child of the fork server: ``zerocompile ARGV`` by ``main(argv)`` (``_in_child``)."""
    from zerocompile.cli import main

    def run():
        sys.argv = ["zerocompile", *argv]
        return main(argv)

    _in_child(run, out_path, err_path, environ, cwd)


def start_cli(argv: list, out_path, err_path, cwd, environ: dict | None = None) -> multiprocessing.Process:
    """``python -m zerocompile ARGV`` as a child of the fork server (``main(argv)``, stdout and
    stderr into the given files): what the CLI does in a new interpreter without the ~4-5 s of
    CPU of importing torch, transformers and zerocompile again. ``join()`` it, read ``exitcode``."""
    return start_fresh(cli_child, [str(a) for a in argv], str(out_path), str(err_path),
                       dict(os.environ if environ is None else environ), str(cwd))


def _finish(procs: list, outputs: list, timeout: float) -> subprocess.CompletedProcess:
    """Wait for the processes; once one fails (as torchrun does) or ``timeout`` passes, kill
    those still running 10 s later instead of waiting for their collectives to time out."""
    deadline = time.monotonic() + timeout
    running = list(procs)
    while running and time.monotonic() < deadline:
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
        running = [p for p in running if p.exitcode is None]
        if any(p.exitcode for p in procs):
            deadline = min(deadline, time.monotonic() + 10)
    for proc in running:
        proc.kill()
        proc.join()
    codes = [proc.exitcode for proc in procs]
    read = [(Path(out).read_text(), Path(err).read_text()) for out, err in outputs]
    return subprocess.CompletedProcess(args=None, returncode=next((c for c in codes if c), 0),
                                       stdout="".join(o for o, _ in read), stderr="".join(e for _, e in read))


def run_cli(argv: list, cwd, environ: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``start_cli`` and wait: a ``CompletedProcess`` with the exit code, stdout and stderr."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        return _finish([start_cli(argv, out, err, cwd, environ)], [(out, err)], timeout)


def _script_rank(script: str, args: list, out_path: str, err_path: str, environ: dict, cwd: str) -> None:
    import runpy

    def run():
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")

    _in_child(run, out_path, err_path, environ, cwd)


def run_script_ranks(script, args: list, world: int, cwd, environ: dict | None = None,
                     timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node WORLD SCRIPT ARGS``, each rank a child of the fork server
    running the script as ``__main__`` with the environment torchrun gives it (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): the
    script creates its own process group from them. The exit code is the first failing rank's
    (0 when all succeed); stdout and stderr are the ranks' in rank order."""
    base = dict(os.environ if environ is None else environ)
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        procs, outputs = [], []
        for rank in range(world):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            out, err = Path(folder) / f"{rank}.out", Path(folder) / f"{rank}.err"
            procs.append(start_fresh(_script_rank, str(script), [str(a) for a in args], str(out), str(err), env,
                                     str(cwd)))
            outputs.append((out, err))
        return _finish(procs, outputs, timeout)


def _parting_entry(rank, world, port, fn, args, outdir, environ, cwd, group_timeout_s):
    faulthandler.enable()
    _adopt(environ, cwd)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=group_timeout_s))
    started = time.monotonic()
    try:
        record = {"ok": True, "result": fn(rank, world, *args)}
    except BaseException as err:  # noqa: BLE001 - the parent checks what each rank raised
        record = {"ok": False, "type": type(err).__name__, "error": str(err), "traceback": traceback.format_exc()}
    record["seconds"] = time.monotonic() - started
    torch.save(record, os.path.join(outdir, f"{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)      # no barrier, no teardown: the ranks' collectives may have parted


def run_parting_ranks(fn, world: int, *args, group_timeout_s: float = 60, deadline_s: float = 90) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks whose collectives may part (the
    collective watchdog's tests): each rank records what ``fn`` returned or raised and leaves at
    once, with no barrier. Returns per rank ``{"ok", "result"}`` or ``{"ok": False, "type",
    "error"}``, with ``seconds`` (how long ``fn`` ran), or None for a rank that recorded nothing
    (it died, or was still running at ``deadline_s`` and was killed)."""
    _ensure_fork_server()
    ctx = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        procs = [ctx.Process(target=_parting_entry, args=(r, world, port, fn, args, outdir, dict(os.environ),
                                                          os.getcwd(), group_timeout_s)) for r in range(world)]
        for proc in procs:
            proc.start()
        end = time.monotonic() + deadline_s
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        out = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.pt")
            out.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return out
