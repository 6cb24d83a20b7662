"""Where every rank is, exchanged through the default process group's store when a collective
hangs (``runtime/collective_watch.py``): not through the transport that is stuck.

Each rank runs a *responder*, a daemon thread with a store client of its own, that waits for
requests and answers each with this rank's report (``report``): its board (the collective it
waits for, since when, the last one that finished, steps, forwards and backwards), and what
its training thread is doing, read from that thread's Python stack: blocked in one of
``torch.distributed``'s own collectives (the user's ``dist.barrier()``), running code (busy),
or ended. A rank that asks (``ask``) adds to a counter to get a request number ``n``, writes
``ask/n``, and reads ``answer/n/<rank>`` of every rank, each within the answer timeout; then
it writes its verdict to ``verdict/n``, which the responders of ranks that are not waiting in
a zerocompile collective (and so raise nothing themselves) log.

Ranks whose process ended normally leave a record (``exit/<rank>``: the last collective and
when) from an ``atexit`` handler. The store lives in rank 0's process: when that is gone, no
rank can ask, and the error says so.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import sysconfig
import threading
import time

import torch
import torch.distributed as dist

from zerocompile import _torch_compat, errors

log = logging.getLogger("zerocompile")

_NAMESPACE = "zerocompile/collective-watch"
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_PACKAGE_DIR = os.path.dirname(os.path.abspath(errors.__file__))
_RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))
# not the user's code: zerocompile's three source folders (as installed, or in a checkout),
# installed packages (torch, transformers, ...) and the standard library
_LIBRARY_DIRS = tuple(d + os.sep for d in {
    _PACKAGE_DIR, _RUNTIME_DIR, os.path.join(_PACKAGE_DIR, "passes"), os.path.join(os.path.dirname(_RUNTIME_DIR), "passes"),
    _TORCH_DIR, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], sysconfig.get_paths()["stdlib"]})
_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")
_POLL_S = 1.0
"""How often a responder looks for a request (one store round trip)."""
_CONNECT_S = 5.0
"""How long a new store client may take to connect (the store's host may be gone)."""


class PositionExchange:
    """This rank's responder and the asking side; one per default process group."""

    def __init__(self, board, rank: int, world: int, client, client_factory):
        self.board, self.rank, self.world = board, rank, world
        self._new_client = client_factory
        self._closed = threading.Event()
        self._client = client_factory()     # the asking (training or monitor) thread's, made while the store is up
        self._asked = 0
        self._ask_lock = threading.Lock()
        self.main = threading.main_thread()
        self._group = dist.group.WORLD
        self.peer_verdict: dict | None = None
        """The last mismatch another rank found while asking this one: ``{"asker", "text",
        "cause", "reports", "at"}`` (``at``: this process's ``time.time()`` when it came)."""
        self._answered: list[int] = []      # the ranks that answered the last ask
        threading.Thread(target=self._respond_forever, args=(client,), name="zerocompile-collective-watch",
                         daemon=True).start()
        atexit.register(self._leave_record)

    @classmethod
    def for_default_group(cls, board) -> "PositionExchange | None":
        """The exchange over the default process group's store, or None where that store is not
        a ``TCPStore`` (the watchdog then reports this rank only)."""
        client = _torch_compat.new_default_store_client()
        if client is None:
            log.info("collective watchdog: the default process group's store is not a TCPStore; a hang will be "
                     "reported with this rank's position only")
            return None
        return cls(board, dist.get_rank(), dist.get_world_size(), client, _torch_compat.new_default_store_client)

    def close(self) -> None:
        self._closed.set()

    def await_peer_verdict(self, since: float, seconds: float = 1.5 * _POLL_S) -> dict | None:
        """A mismatch another rank found (``peer_verdict``) since ``since`` (``time.time()``),
        waiting up to ``seconds`` for the responder to read one: a rank whose transport failed
        because a peer raised and left reports that peer's table, not a dead peer."""
        deadline = time.monotonic() + seconds
        while True:
            peer = self.peer_verdict
            if peer is not None and peer["at"] >= since:
                return peer
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _group_alive(self) -> bool:
        """The default group this exchange serves is still there (not destroyed by the user)."""
        return not self._closed.is_set() and dist.is_initialized() and dist.group.WORLD is self._group

    # ------------------------------------------------------------------ asking
    def ask(self, answer_timeout_s: float) -> dict:
        """Every rank's report (``report``), None for a rank that gave none within
        ``answer_timeout_s``; ``{"store": error text}`` alone when the store cannot be reached."""
        with self._ask_lock:
            try:
                client = self._client
                n = client.add(f"{_NAMESPACE}/asks", 1)
                self._asked = n
                client.set(f"{_NAMESPACE}/ask/{n}", str(self.rank))
            except Exception as err:   # noqa: BLE001 - the store's host (rank 0) is gone
                return {"store": f"{type(err).__name__}: {err}"}
            out = {self.rank: report(self.board, self.main)}
            waiting = [r for r in range(self.world) if r != self.rank]
            deadline = time.monotonic() + answer_timeout_s
            try:
                while waiting:
                    for r in list(waiting):
                        key = f"{_NAMESPACE}/answer/{n}/{r}"
                        if client.check([key]):
                            out[r] = json.loads(client.get(key))
                            waiting.remove(r)
                    if not waiting or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            except Exception as err:   # noqa: BLE001 - the store's host went away meanwhile
                return {"store": f"{type(err).__name__}: {err}"}
            self._answered = [r for r in out if r != self.rank]
            for r in waiting:           # no answer in time: an exit record, or None
                out[r] = _exit_record(client, r)
            return out

    def publish(self, verdict) -> None:
        """The verdict of the last ``ask`` (``mismatch_report.Verdict``), for the ranks that
        answered it: they log it, and those waiting in a zerocompile collective raise it. Rank 0
        hosts the store, which ends with its process: with a mismatch, it waits (up to
        ``2 * _POLL_S``) until the others have read it before its caller raises."""
        error = verdict.error
        payload = {"text": verdict.text if error is not None else "", "cause": getattr(error, "cause", ""),
                   "reports": {str(r): rep for r, rep in (getattr(error, "reports", None) or {}).items()}}
        with self._ask_lock, contextlib.suppress(Exception):
            n = self._asked
            self._client.set(f"{_NAMESPACE}/verdict/{n}", json.dumps(payload))
            if error is None or self.rank != 0:
                return
            deadline = time.monotonic() + 2 * _POLL_S + 0.5
            keys = [f"{_NAMESPACE}/verdict-read/{n}/{r}" for r in self._answered]
            while keys and time.monotonic() < deadline and not self._client.check(keys):
                time.sleep(0.05)

    # ------------------------------------------------------------------ answering
    def _respond_forever(self, client) -> None:
        """Poll for requests (``check`` every ``_POLL_S``: a blocking ``wait`` on the store would
        log a warning at each expiry, and a stack trace when the group's store closes at the end
        of a run); stop when the group is destroyed or its store is gone."""
        try:
            n = int(client.add(f"{_NAMESPACE}/asks", 0)) + 1
        except Exception:              # noqa: BLE001 - the group went away before we started
            return
        verdicts = []                  # (request, asker, until): verdicts this rank logs once they come
        while True:
            time.sleep(_POLL_S)
            if not self._group_alive():
                return
            try:
                if client.check([f"{_NAMESPACE}/ask/{n}"]):
                    asker = int(client.get(f"{_NAMESPACE}/ask/{n}"))
                    if asker != self.rank:
                        client.set(f"{_NAMESPACE}/answer/{n}/{self.rank}", json.dumps(report(self.board, self.main)))
                        verdicts.append((n, asker, time.monotonic() + 60))
                    n += 1
                verdicts = [v for v in verdicts if not self._logged(client, *v)]
            except Exception:          # noqa: BLE001 - the store went away: the group is gone
                return

    def _logged(self, client, n: int, asker: int, until: float) -> bool:
        """The verdict of request ``n``, once it came: a mismatch is kept (``peer_verdict``: a
        wait of this rank's raises it) and, where this rank waits in no zerocompile collective
        (so raises nothing itself), logged. True once read, or given up."""
        key = f"{_NAMESPACE}/verdict/{n}"
        if not client.check([key]):
            return time.monotonic() > until
        payload = json.loads(client.get(key))
        if payload["text"]:
            self.peer_verdict = {**payload, "asker": asker, "at": time.time(),
                                 "reports": {int(r): rep for r, rep in payload["reports"].items()}}
            if self.board.waiting is None:
                log.error("rank %d found a collective mismatch:\n%s", asker, payload["text"])
        client.set(f"{_NAMESPACE}/verdict-read/{n}/{self.rank}", "1")
        return True

    def _leave_record(self) -> None:
        """At exit (``atexit``), where the group still exists: the last collective, for ranks
        that ask later (this rank finished while they still wait)."""
        if not self._group_alive():
            return
        board = self.board
        with contextlib.suppress(Exception):
            client = self._new_client(_CONNECT_S)
            client.set(f"{_NAMESPACE}/exit/{self.rank}",
                       json.dumps({"state": "exited", "at": time.time(), "last": board.last,
                                   "last_at": board.last_at, "steps": board.steps}))


def _exit_record(client, rank: int) -> dict | None:
    try:
        record = json.loads(client.get(f"{_NAMESPACE}/exit/{rank}")) if client.check(
            [f"{_NAMESPACE}/exit/{rank}"]) else None
    except Exception:                  # noqa: BLE001
        return None
    if record is not None:
        record["ago"] = time.time() - record.pop("at")
        record["last_ago"] = time.time() - record.pop("last_at") if record.get("last") else None
    return record


def report(board, main: threading.Thread) -> dict:
    """This rank's position: the board, and what the training thread's stack says."""
    now = time.time()
    out = {"steps": board.steps, "last": board.last,
           "last_ago": now - board.last_at if board.last is not None else None,
           "calls": {str(k): list(v) for k, v in board.counts().items()} if board.counts else {}}
    frame = sys._current_frames().get(main.ident) if main.is_alive() else None
    stack = _stack(frame)
    out["where"] = _user_line(stack)
    if board.waiting is not None:
        out.update(state="waiting", site=board.waiting, since=now - board.waiting_since)
    elif board.inflight:
        _, site, started = board.inflight[0]
        out.update(state="waiting", site=site, since=time.monotonic() - started)
    elif not main.is_alive():
        out.update(state="finished")
    elif (call := _c10d_call(stack)) is not None:
        out.update(state="collective", call=call)
    else:
        out.update(state="running", scope=board.scopes[-1] if board.scopes else None)
    return out


def _stack(frame) -> list:
    """``(filename, line, function)`` of ``frame`` and its callers, innermost first."""
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out


def _c10d_call(stack: list) -> str | None:
    """The outermost public function of ``torch.distributed`` the stack is in, if any."""
    call = None
    for filename, _, function in stack:
        if filename.endswith(_C10D_FILES) and _TORCH_DIR in filename and not function.startswith("_") \
                and function != "wrapper":
            call = f"torch.distributed.{function}()"
    return call


def _user_line(stack: list) -> str | None:
    """``file:line in function`` of the innermost frame of the user's code (not torch's, not
    zerocompile's, not the standard library's)."""
    for filename, line, function in stack:
        if filename.startswith("<") or os.path.abspath(filename).startswith(_LIBRARY_DIRS):
            continue
        return f"{os.path.basename(filename)}:{line} in {function}"
    return None
