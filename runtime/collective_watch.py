"""The collective watchdog: a zerocompile collective that waits longer than
``collective_timeout_s`` makes the ranks compare where they are, and ends in a
``CollectiveMismatchError`` that says which rank is where, instead of a silent hang.

How it works, per rank:

- Every collective zerocompile issues, in compiled graphs (``passes/lowerings/watch_collectives.py``)
  and in eager code (``start`` below), is started through ``torch.distributed`` with
  ``async_op=True``; its ``Work`` is wrapped in a ``WatchedWork`` and registered for the
  result tensor in c10d's registry, so the ``wait_tensor`` that graphs and eager code already
  call runs ``WatchedWork.wait``. That wait polls the ``Work`` (gloo's ``wait(timeout)``
  returns control while the operation goes on) and, past the timeout, asks every rank where
  it is through the default group's store (``runtime/position_exchange.py``), never through
  the transport that is stuck.
- Where it is: the collective's *site* (frame, graph, index, kind, bytes and parameters,
  fixed when the graph was compiled; or the eager call's label), the optimizer steps taken,
  and the forwards and backwards run since the last one. These are plain attribute writes on
  ``RankBoard``: no collective and no store traffic while nothing hangs.
- A peer that is computing (any code outside a blocking collective: a compiled graph, a
  compile, the optimizer step, the user's code) is *busy*, and the wait starts again; a peer
  blocked at another collective, in ``torch.distributed``'s own collectives, finished, or
  gone is a mismatch: ``runtime/mismatch_report.py`` builds the table and the likely cause.

CUDA collectives (NCCL) do not block the host: there the wait only orders the streams, a CUDA
event marks the collective's end, and a monitor thread checks the oldest unfinished one
(``_CudaMonitor``); past the timeout it runs the same exchange, logs the table and aborts the
process group so that the stuck kernels end, and the next zerocompile collective on the
training thread raises the error. That path is written for NCCL and has not run on a GPU here.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist

from zerocompile import _torch_compat
from zerocompile.errors import CollectiveMismatchError
from zerocompile.runtime import mismatch_report
from zerocompile.runtime.position_exchange import PositionExchange

log = logging.getLogger("zerocompile")

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
              "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}
"""The ``torch.distributed`` reduction of each ``reduce_op`` name functional collectives take."""


class RankBoard:
    """Where this rank is, written by the training thread, read by the exchange's responder."""

    def __init__(self) -> None:
        self.waiting: str | None = None
        """The site of the collective the training thread waits for now (None: not waiting)."""
        self.waiting_since = 0.0
        self.last: str | None = None
        """The site of the last zerocompile collective that finished."""
        self.last_at = 0.0
        self.steps = 0
        """Training steps taken (``Process.step_ended``, ``runtime/session.py``)."""
        self.scopes: list[str] = []
        """Labels of the eager code running now (``CollectiveWatch.scope``), innermost last."""
        self.inflight: list = []
        """CUDA only: ``(event, site, started)`` of collectives the streams have not finished."""
        self.counts = None
        """A function returning the forward and backward runs per frame since the last step."""
        self.running: tuple[str, str] = ("a compiled graph", "forward")
        """The compiled frame and graph that started last (``CollectiveWatch.running``)."""


class _Scope:
    """``CollectiveWatch.scope``'s context: ``label`` on the board's stack of scopes while inside."""

    __slots__ = ("scopes", "label")

    def __init__(self, scopes: list, label: str) -> None:
        self.scopes, self.label = scopes, label

    def __enter__(self) -> None:
        self.scopes.append(self.label)

    def __exit__(self, *exc) -> None:
        self.scopes.pop()


class CollectiveWatch:
    """The watchdog's settings and this rank's board; one per process (``PROCESS.watch``, ``runtime/session.py``)."""

    def __init__(self) -> None:
        self.timeout_s: float | None = None
        """``collective_timeout_s`` of the frames compiled so far (None: off until one is)."""
        self.busy_limit_s: float | None = None
        """``collective_busy_limit_s``: how long a busy peer may keep the others waiting."""
        self.board = RankBoard()
        self.failed: CollectiveMismatchError | None = None
        """A mismatch the CUDA monitor found; raised by the next watched collective."""
        self._exchange: PositionExchange | None = None
        self._exchange_group = None
        self._monitor: _CudaMonitor | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ settings
    def configure(self, timeout_s: float | None, busy_limit_s: float | None) -> None:
        """The options of a frame being compiled; the watchdog is process-wide, so where two
        models ask for different settings the newer one applies (with a warning)."""
        if self.timeout_s is not None and (timeout_s, busy_limit_s) != (self.timeout_s, self.busy_limit_s):
            log.warning("collective_timeout_s=%s, collective_busy_limit_s=%s replace %s, %s for every model of "
                        "this process (the collective watchdog is process-wide)", timeout_s, busy_limit_s,
                        self.timeout_s, self.busy_limit_s)
        self.timeout_s, self.busy_limit_s = timeout_s, busy_limit_s
        if timeout_s is not None:
            self.exchange()          # its responder answers the other ranks from now on

    @property
    def on(self) -> bool:
        return self.timeout_s is not None

    def exchange(self) -> PositionExchange | None:
        """The position exchange of the current default process group (made on first use, again
        after the group was destroyed and made anew), or None without one."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
        with self._lock:
            if self._exchange is None or self._exchange_group is not group:
                if self._exchange is not None:
                    self._exchange.close()
                self._exchange = PositionExchange.for_default_group(self.board)
                self._exchange_group = group
            return self._exchange

    # ------------------------------------------------------------------ positions
    def scope(self, label: str) -> "_Scope":
        """Eager collectives inside are reported as ``label``'s (e.g. ``"full_state_dict"``): a
        context (a plain class, not a generator: every optimizer step enters one)."""
        return _Scope(self.board.scopes, label)

    def eager_site(self, kind: str, nbytes: int, label: str | None = None) -> str:
        """The site string of an eager collective (``mismatch_report.site``)."""
        where = label or (self.board.scopes[-1] if self.board.scopes else "eager code")
        return mismatch_report.site(where, "eager", -1, -1, kind, nbytes, ())

    def step_ended(self) -> None:
        self.board.steps += 1

    def running(self, frame: str, graph: str) -> None:
        """A compiled frame's ``graph`` (forward, inference, backward) starts: the context of the
        point-to-point transfers it starts (``register``), whose ops carry no site."""
        self.board.running = (frame, graph)

    # ------------------------------------------------------------------ collectives
    def start(self, kind: str, x: torch.Tensor, group_name: str, site: str, *, world: int = 1,
              reduce_op: str = "sum", out: torch.Tensor | None = None, out_splits=None, in_splits=None
              ) -> torch.Tensor:
        """Start collective ``kind`` (``all_gather``, ``reduce_scatter``, ``all_reduce``,
        ``all_to_all``) of ``x`` on the group named ``group_name`` and return its result,
        to be read after ``torch.ops._c10d_functional.wait_tensor``, which waits through
        ``WatchedWork``. ``out``: the result's buffer (default: a new one)."""
        if self.failed is not None:
            raise self.failed
        pg = _torch_compat.process_group_named(group_name)
        x = x.contiguous()
        if kind == "all_gather":
            out = x.new_empty((world * x.shape[0], *x.shape[1:])) if out is None else out
            work = dist.all_gather_single(out, x, group=pg, async_op=True)
        elif kind == "reduce_scatter":
            out = x.new_empty((x.shape[0] // world, *x.shape[1:])) if out is None else out
            work = dist.reduce_scatter_single(out, x, op=REDUCE_OPS[reduce_op], group=pg, async_op=True)
        elif kind == "all_reduce":
            out = x.clone() if out is None else out.copy_(x)
            work = dist.all_reduce(out, op=REDUCE_OPS[reduce_op], group=pg, async_op=True)
        elif kind == "all_to_all":
            rows = sum(out_splits) if out_splits else x.shape[0]
            out = x.new_empty((rows, *x.shape[1:])) if out is None else out
            work = dist.all_to_all_single(out, x, list(out_splits) or None, list(in_splits) or None,
                                          group=pg, async_op=True)
        else:
            raise ValueError(f"unknown collective kind {kind!r}")
        _torch_compat.register_work(out, WatchedWork(work, site, self, out.device))
        return out

    def register(self, outs, works: list, then=None, kind: str = "all_gather", nbytes: int = 0) -> None:
        """Point-to-point transfers (``runtime/point_to_point.py``) filling ``outs`` (a tensor or
        a list), then ``then()``: ``wait_tensor`` of any of ``outs`` waits for all of them,
        watched where the watchdog is on."""
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        if not self.on or not outs:
            _torch_compat.register_pending_works(outs, works, then)
            return
        frame, graph = self.board.running if not self.board.scopes else (self.board.scopes[-1], "eager")
        site = mismatch_report.site(frame, graph, -1, -1, kind, nbytes, ())
        watched = WatchedWork(PollableWorks(works, then), site, self, outs[0].device)
        for out in outs:
            _torch_compat.register_work(out, watched)

    def wait(self, work, site: str, device: torch.device) -> None:
        """Wait for ``work`` (the collective at ``site``), as ``WatchedWork.wait``."""
        if self.failed is not None:
            raise self.failed
        if device.type == "cuda":
            work.wait()                     # orders the streams; the host goes on
            self._cuda_monitor().add(site)
            return
        board = self.board
        started = time.monotonic()
        board.waiting, board.waiting_since = site, time.time()
        try:
            self._wait_blocking(work, site, started)
        finally:
            board.waiting = None
            board.last, board.last_at = site, time.time()

    def _wait_blocking(self, work, site: str, started: float) -> None:
        timeout = self.timeout_s
        if timeout is None:
            work.wait()
            return
        deadline = started + timeout
        since = time.time()
        missed = 0
        while True:
            try:        # in slices of a second at most: a mismatch another rank found ends the wait early
                work.wait(datetime.timedelta(seconds=min(1.0, max(0.001, deadline - time.monotonic()))))
                return
            except RuntimeError as err:
                if work.is_completed() or "timed out" not in str(err).lower():
                    # the transport failed (a peer died, a shared-memory peer exited): not our timeout.
                    # A peer that found a mismatch and left: its table, not a dead peer
                    waited = time.monotonic() - started
                    raise (self._from_peer(site, waited, since, wait=True)
                           or self.diagnose(site, waited, missed, transport_error=err).error) from err
            error = self._from_peer(site, time.monotonic() - started, since, wait=False)
            if error is not None:
                raise error
            if time.monotonic() < deadline:
                continue
            verdict = self.diagnose(site, time.monotonic() - started, missed)
            if verdict.error is not None and not verdict.error.reports:
                # no table: the store went away while this rank asked (rank 0 raised and left);
                # the verdict rank 0 published before it left has one
                error = self._from_peer(site, time.monotonic() - started, since, wait=True)
                if error is not None:
                    raise error
            if verdict.error is not None:
                # one more short wait: a collective that ended meanwhile is no mismatch
                with contextlib.suppress(RuntimeError):
                    if work.wait(datetime.timedelta(seconds=0.5)):
                        return
                raise verdict.error
            missed = verdict.unanswered
            deadline = time.monotonic() + timeout

    def _from_peer(self, site: str, waited: float, since: float, wait: bool) -> CollectiveMismatchError | None:
        """The error of a wait ended by a mismatch another rank found since ``since`` (with
        ``wait``, giving this rank's responder the time to read one: a rank whose transport or
        store went away because that rank raised and left), or None; rank 0 logs it (it logs
        every mismatch it raises)."""
        exchange = self._exchange
        if exchange is None:
            return None
        peer = exchange.await_peer_verdict(since) if wait else exchange.await_peer_verdict(since, 0.0)
        if peer is None:
            return None
        error = mismatch_report.found_by_peer(site, waited, peer)
        if exchange.rank == 0:
            log.error("%s", error)
        return error

    def diagnose(self, site: str, waited: float, missed: int = 0, transport_error=None) -> "mismatch_report.Verdict":
        """Ask every rank where it is and judge (``mismatch_report.judge``); logs what it finds."""
        exchange = self.exchange()
        reports = exchange.ask(min(5.0, max(1.0, self.timeout_s or 5.0))) if exchange is not None else None
        verdict = mismatch_report.judge(site, waited, reports, exchange.rank if exchange else 0,
                                        missed=missed, transport_error=transport_error,
                                        busy_limit_s=self.busy_limit_s)
        if exchange is not None:
            exchange.publish(verdict)
        if verdict.error is not None:
            if exchange is None or exchange.rank == 0:
                log.error("%s", verdict.text)
        else:
            log.warning("%s", verdict.text)
        return verdict

    def _cuda_monitor(self) -> "_CudaMonitor":
        with self._lock:
            if self._monitor is None:
                self._monitor = _CudaMonitor(self)
            return self._monitor


class WatchedWork(torch._C._distributed_c10d.Work):
    """A c10d ``Work`` whose ``wait`` (called by ``wait_tensor``) is the watchdog's."""

    def __init__(self, work, site: str, watch: CollectiveWatch, device: torch.device):
        super().__init__()
        self.work, self.site, self.watch, self.device = work, site, watch, device

    def wait(self, timeout=None) -> bool:
        work, self.work = self.work, None
        if work is not None:             # a second wait finds it done
            self.watch.wait(work, self.site, self.device)
        return True


class PollableWorks:
    """Several ``Work`` handles (point-to-point transfers, gloo's or a shared-memory channel's),
    then ``then()``, as one work that ``CollectiveWatch.wait`` can poll: ``wait(timeout)``
    raises ``RuntimeError("Operation timed out!")`` past ``timeout``, the transfers going on.

    gloo's send and receive handles cannot be polled (a ``wait(timeout)`` that expires fails the
    transfer), so a thread waits for them without a timeout and the poll waits for that thread;
    a shared-memory channel's are progressed by the polling thread itself."""

    def __init__(self, works: list, then=None):
        c10d = torch._C._distributed_c10d.Work
        self.blocking = [w for w in works if isinstance(w, c10d)]
        self.works = [w for w in works if not isinstance(w, c10d)]
        self.then = then
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = None

    def _wait_blocking_ones(self) -> None:
        try:
            for work in self.blocking:
                work.wait()
        except BaseException as err:      # noqa: BLE001 - raised by the polling wait
            self._error = err
        self._done.set()

    def wait(self, timeout=None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while self.works:
            if deadline is None:
                self.works[0].wait()
            else:
                self.works[0].wait(datetime.timedelta(seconds=max(0.0, deadline - time.monotonic())))
            self.works.pop(0)
        if self.blocking:
            if deadline is None:
                self._wait_blocking_ones()
            else:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._wait_blocking_ones, daemon=True,
                                                    name="zerocompile-transfer-wait")
                    self._thread.start()
                if not self._done.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("Operation timed out!")
            if self._error is not None:
                raise self._error
            self.blocking = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        """Done, or failed (a transfer ended with an error)."""
        if self.works:
            return self.works[0].is_completed()
        return not self.blocking or self._done.is_set()


class _CudaMonitor:
    """CUDA: a thread that checks the oldest collective the streams have not finished.
    ``new_event``: makes a recorded event (``query()``: finished?); ``abort``: ends the stuck
    collectives (the default group's ``abort()``); ``period_s``: how often it looks."""

    def __init__(self, watch: CollectiveWatch, new_event=None, abort=None, period_s: float = 1.0):
        self.watch, self.period_s = watch, period_s
        self.new_event = new_event or _recorded_cuda_event
        self.abort = abort or (lambda: dist.group.WORLD.abort())
        threading.Thread(target=self._run, name="zerocompile-collective-monitor", daemon=True).start()

    def add(self, site: str) -> None:
        self.watch.board.inflight.append((self.new_event(), site, time.monotonic()))

    def _run(self) -> None:
        board = self.watch.board
        while True:
            time.sleep(self.period_s)
            while board.inflight and board.inflight[0][0].query():
                board.inflight.pop(0)
            timeout = self.watch.timeout_s
            if not board.inflight or timeout is None or self.watch.failed is not None:
                continue
            _, site, started = board.inflight[0]
            if time.monotonic() - started < timeout:
                continue
            verdict = self.watch.diagnose(site, time.monotonic() - started)
            if verdict.error is None:
                board.inflight[0] = (board.inflight[0][0], site, time.monotonic())
                continue
            log.error("%s", verdict.text)
            self.watch.failed = verdict.error
            with contextlib.suppress(Exception):
                self.abort()                # NCCL: the stuck kernels end; the next collective raises
            return


def _recorded_cuda_event():
    event = torch.cuda.Event()
    event.record()
    return event
