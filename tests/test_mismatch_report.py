"""The collective watchdog's judgement (``runtime/mismatch_report.py``) on made-up reports, one
case per rule and per likely cause; the watchdog lowering (``passes/lowerings/watch_collectives.py``) on a
graph; the option's checks; the watched wait's plumbing in one process (a peer's verdict ends it
early). The multi-rank cases, with real hangs, are in ``test_collective_watch.py``."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch

import zerocompile
from zerocompile.config import ZeroConfig
from zerocompile.errors import CollectiveMismatchError, ZeroConfigError
from zerocompile.runtime import mismatch_report
from zerocompile.runtime.mismatch_report import describe, judge, site

FWD = site("frame 0/0", "forward", 2, 6, "all_gather", 3 * 1024 * 1024, ["h.0.w", "h.1.w", "h.2.w", "h.3.w"])
BWD = site("frame 0/0", "backward", 0, 4, "reduce_scatter", 2048, ["h.0.w"])
INF = site("frame 0/1", "inference", 0, 3, "all_gather", 2048, ["h.0.w"])
STEP = site("optimizer step", "eager", -1, -1, "all_reduce", 16, ())
FSD = site("full_state_dict", "eager", -1, -1, "all_gather", 4096, ())


def rep(state, s=None, since=5.0, steps=1, calls=(1, 1), **extra):
    out = {"state": state, "steps": steps, "calls": {"0": list(calls)}, "where": "train.py:42 in main",
           "last": BWD, "last_ago": 1.5, **extra}
    if state == "waiting":
        out.update(site=s, since=since)
    return out


def test_describe_names_frame_graph_index_kind_bytes_and_parameters():
    assert describe(FWD) == "frame 0/0 forward graph: all_gather 3 of 6 (3.0 MiB; h.0.w, h.1.w, h.2.w and 1 more)"
    assert describe(STEP) == "optimizer step: all_reduce (16 B)"
    assert describe(site("frame 1/0", "backward", -1, -1, "reduce_scatter", 1536, ())) == \
        "frame 1/0 backward graph: reduce_scatter by point-to-point transfers (1.5 KiB)"
    assert describe(site("a|b", "eager", -1, -1, "all_gather", 8, ())).startswith("a/b: ")   # the separator escaped


def test_a_busy_peer_means_waiting_again_and_the_limit_ends_it():
    reports = {0: rep("waiting", FWD), 1: rep("running")}
    verdict = judge(FWD, 61.0, reports, 0)
    assert verdict.error is None and "rank(s) 1 are busy" in verdict.text and "waiting again" in verdict.text
    limited = judge(FWD, 61.0, reports, 0, busy_limit_s=60.0)
    assert isinstance(limited.error, CollectiveMismatchError)
    assert "longer than collective_busy_limit_s = 60 s" in limited.error.cause


def test_every_rank_at_the_same_collective_is_a_slow_transport():
    verdict = judge(FWD, 61.0, {0: rep("waiting", FWD), 1: rep("waiting", FWD), 2: rep("waiting", FWD)}, 1)
    assert verdict.error is None and "the transport is slow" in verdict.text


def test_a_peer_that_just_moved_on_is_not_blocked_yet():
    verdict = judge(FWD, 61.0, {0: rep("waiting", FWD), 1: rep("waiting", BWD, since=0.2)}, 0)
    assert verdict.error is None


def test_no_answer_once_waits_again_twice_is_an_error():
    reports = {0: rep("waiting", FWD), 1: None}
    first = judge(FWD, 61.0, reports, 0)
    assert first.error is None and first.unanswered == 1
    second = judge(FWD, 122.0, reports, 0, missed=first.unanswered)
    assert second.error.cause.startswith("rank(s) 1 gave no answer twice: the process has died")
    assert "\n  1     no answer" in str(second.error)


def test_a_lost_connection_with_no_answer_is_a_dead_rank_at_once():
    error = judge(FWD, 0.2, {0: rep("waiting", FWD), 1: None}, 0, transport_error=RuntimeError("Connection closed")).error
    assert error.cause.startswith("rank(s) 1 gave no answer and the transport reports a lost connection")
    assert "Transport error: Connection closed" in str(error)


def test_the_store_gone_names_rank_0():
    error = judge(FWD, 61.0, {"store": "DistNetworkError: Broken pipe"}, 1).error
    assert "rank 0 has exited or died" in error.cause and "Broken pipe" in error.cause


@pytest.mark.parametrize("reports,me,expected", [
    # evaluation on rank 0 only, rank 1 in the user's barrier
    ({0: rep("waiting", INF), 1: rep("collective", call="torch.distributed.barrier()")}, 0,
     "a forward ran on rank(s) 0 only (without autograd"),
    # a compile on rank 0 only (the first evaluation)
    ({0: rep("waiting", site("compiling frame 0/1", "eager", -1, -1, "all_gather", 8, ())),
      1: rep("collective", call="torch.distributed.barrier()")}, 0, "a forward ran on rank(s) 0 only: it was compiling"),
    ({0: rep("waiting", FSD), 1: rep("collective", call="torch.distributed.barrier()")}, 0,
     "full_state_dict ran on rank(s) 0 only"),
    ({0: rep("waiting", STEP, steps=3), 1: rep("waiting", FWD, steps=2)}, 0, "the ranks are at different optimizer steps"),
    # rank 0 waits in the forward of a third micro-batch, rank 1 in the step after two
    ({0: rep("waiting", FWD, calls=(2, 2)), 1: rep("waiting", STEP, calls=(2, 2))}, 1,
     "different numbers of forward passes since the last step (rank 0: step 1, 3 forward"),
    # rank 1 skipped a backward and runs the next forward: two forwards, no backward
    ({0: rep("waiting", BWD, calls=(1, 1)), 1: rep("waiting", FWD, calls=(1, 0))}, 0,
     "rank(s) 1 ran a forward without its backward"),
    ({0: rep("waiting", FWD), 1: rep("exited", ago=3.0)}, 0, "rank(s) 1 finished while the others"),
    ({0: rep("waiting", FWD), 1: rep("waiting", site("frame 3/0", "forward", 0, 2, "all_gather", 8, ()))}, 0,
     "set_leaf_modules"),
    ({0: rep("waiting", FWD), 1: rep("collective", call="torch.distributed.all_reduce()")}, 0,
     "rank(s) 1 wait in a torch.distributed collective of their own"),
])
def test_each_known_cause_is_named_with_its_fix(reports, me, expected):
    error = judge(reports[me]["site"], 61.0, reports, me).error
    assert isinstance(error, CollectiveMismatchError)
    assert expected in error.cause, error.cause
    text = str(error)
    assert text.startswith(f"zerocompile: rank {me} waited 61.0 s at ")
    assert "\n  rank  state" in text and "Likely cause: " in text and "What now: " in text
    assert error.reports is reports


def test_the_option_takes_seconds_or_none():
    assert ZeroConfig().sharding.collective_timeout_s == 60.0 and ZeroConfig().sharding.collective_busy_limit_s is None
    assert ZeroConfig.from_options({"collective_timeout_s": None}).sharding.collective_timeout_s is None
    assert ZeroConfig.from_options({"collective_timeout_s": 5, "collective_busy_limit_s": 600.0}).sharding.collective_busy_limit_s == 600
    for name in ("collective_timeout_s", "collective_busy_limit_s"):
        for bad in (0, -1.0, True, "60", float("inf"), float("nan")):
            with pytest.raises(ZeroConfigError, match=f"option '{name}' = .* is invalid; allowed: a number of seconds"):
                ZeroConfig.from_options({name: bad})


def test_the_error_is_exported():
    assert zerocompile.CollectiveMismatchError is CollectiveMismatchError and issubclass(CollectiveMismatchError, RuntimeError)


def test_the_lowering_puts_watched_ops_with_their_sites():
    from zerocompile.passes.lowerings.watch_collectives import watch_collectives
    from zerocompile.runtime import watched_collectives  # noqa: F401

    c10d = torch.ops._c10d_functional
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    ag = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"))
    ag.meta["val"] = torch.empty(8)
    ag.meta["zerocompile"] = {"role": "param_gather", "params": ["w"]}
    w1 = graph.call_function(c10d.wait_tensor.default, (ag,))
    w1.meta["val"] = torch.empty(8)
    rs = graph.call_function(c10d.reduce_scatter_tensor.default, (w1, "sum", 2, "0"))
    rs.meta["val"] = torch.empty(4)
    w2 = graph.call_function(c10d.wait_tensor.default, (rs,))
    graph.output(w2)
    assert watch_collectives(graph, "backward", frame="frame 7/0") == 2
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.zerocompile.watched_all_gather.default, c10d.wait_tensor.default,
                       torch.ops.zerocompile.watched_reduce_scatter.default, c10d.wait_tensor.default]
    gather, _, reduce, _ = [n for n in graph.nodes if n.op == "call_function"]
    assert describe(gather.args[-1]) == "frame 7/0 backward graph: all_gather 1 of 2 (32 B; w)"
    assert describe(reduce.args[-1]) == "frame 7/0 backward graph: reduce_scatter 2 of 2 (32 B)"
    assert gather.meta["zerocompile"]["role"] == "param_gather"     # the node's metadata kept


class _Pending(torch._C._distributed_c10d.Work):
    """A work that ends when ``done`` is set (a gloo collective's polled wait, in one process)."""

    def __init__(self):
        super().__init__()
        self.done = threading.Event()

    def wait(self, timeout=None):
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self):
        return self.done.is_set()


def test_the_watched_wait_returns_when_the_work_ends_and_raises_a_peers_verdict(caplog):
    from zerocompile.runtime.collective_watch import CollectiveWatch, WatchedWork

    watch = CollectiveWatch()
    watch.timeout_s = 30.0
    out = torch.zeros(2)
    work = _Pending()
    zerocompile._torch_compat.register_work(out, WatchedWork(work, FWD, watch, out.device))
    threading.Timer(0.3, work.done.set).start()
    started = time.monotonic()
    torch.ops._c10d_functional.wait_tensor(out)           # through WatchedWork.wait
    assert 0.25 < time.monotonic() - started < 5
    assert watch.board.waiting is None and watch.board.last == FWD

    from zerocompile.runtime.position_exchange import PositionExchange

    class Exchange:     # what the responder keeps when another rank found a mismatch
        peer_verdict = None
        rank = 0        # rank 0 also logs it
        await_peer_verdict = PositionExchange.await_peer_verdict

    watch._exchange = Exchange()
    out = torch.zeros(2)
    zerocompile._torch_compat.register_work(out, WatchedWork(_Pending(), BWD, watch, out.device))

    def found():
        Exchange.peer_verdict = {"asker": 1, "text": "the table", "cause": "the cause", "reports": {0: None},
                                 "at": time.time()}
    threading.Timer(0.3, found).start()
    with pytest.raises(CollectiveMismatchError, match="rank 1 found that the ranks' collectives parted") as err, \
            caplog.at_level("ERROR", logger="zerocompile"):
        torch.ops._c10d_functional.wait_tensor(out)
    assert err.value.cause == "the cause" and "the table" in str(err.value)
    assert any("the table" in r.getMessage() for r in caplog.records)
    assert watch.board.waiting is None


def test_poll_timeouts_of_gloo_style_works_are_not_transport_errors():
    from zerocompile.runtime.collective_watch import PollableWorks

    work = _Pending()
    polled = PollableWorks([work])
    with pytest.raises(RuntimeError, match="timed out"):
        polled.wait(datetime.timedelta(seconds=0.05))
    assert not polled.is_completed()
    work.done.set()
    then = []
    polled = PollableWorks([work], then=lambda: then.append(1))
    assert polled.wait(datetime.timedelta(seconds=1)) and polled.is_completed() and then == [1]


def test_mismatch_report_rules_cover_every_state():
    # the states the responder reports (position_exchange.report) each have a row
    for state in ("waiting", "collective", "running", "finished", "exited"):
        extra = {"call": "torch.distributed.barrier()"} if state == "collective" else {"ago": 1.0}
        row = mismatch_report._row(rep(state, FWD, **extra))
        assert row[0] and row[1]


def test_the_cuda_monitor_reports_a_collective_the_streams_never_finish():
    """NCCL's path (no GPU here): a collective's wait only orders the streams, so a thread looks
    at an event recorded after each; past the timeout it asks (here: a stand-in judgement), keeps
    the error for the training thread's next collective, and aborts the group. Events and the
    abort are stand-ins; the logic is the one that runs with CUDA."""
    from zerocompile.runtime.collective_watch import CollectiveWatch, _CudaMonitor
    from zerocompile.runtime.mismatch_report import Verdict
    from zerocompile.runtime.position_exchange import report

    watch = CollectiveWatch()
    watch.timeout_s = 0.3
    error = CollectiveMismatchError("the ranks parted", {}, "the cause")
    asked, aborted = [], []

    def diagnose(site, waited, missed=0, transport_error=None):
        asked.append((site, waited))
        return Verdict(None, "busy: waiting again") if len(asked) == 1 else Verdict(error, "the ranks parted")

    watch.diagnose = diagnose

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    events = iter([Event(True), Event(False)])
    monitor = _CudaMonitor(watch, new_event=lambda: next(events), abort=lambda: aborted.append(1), period_s=0.05)
    monitor.add(FWD)        # finished at once: dropped at the next look
    monitor.add(BWD)        # never finishes
    state = report(watch.board, threading.current_thread())
    assert state["state"] == "waiting" and state["site"] in (FWD, BWD)    # what the other ranks are told
    deadline = time.monotonic() + 10
    while watch.failed is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.failed is error and aborted == [1]
    assert [s for s, _ in asked] == [BWD, BWD] and all(w >= 0.3 for _, w in asked)   # a busy verdict: asked again
    with pytest.raises(CollectiveMismatchError, match="the ranks parted"):
        watch.start("all_gather", torch.ones(2), "0", STEP, world=2)    # the training thread's next collective
