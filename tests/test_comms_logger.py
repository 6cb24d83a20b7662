"""The comms logger (``runtime/comms_log.py``, ``passes/lowerings/comm_timers.py``, ``zerocompile.log_summary``):
DeepSpeed's ``comms_logger`` key. On 2 ranks every collective the step issues is timed once: the
timed count and bytes per kind equal a dispatch-mode count of the collective ops that ran
(``census.CollectiveCounter``, independent of zerocompile's accounting) and what ``stats()``
counts, under both inner compilers, blocking or not, with eager parts, and the losses are those
of the same run without the logger."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from pathlib import Path

import pytest
import torch

import zerocompile
from census import CollectiveCounter
from dist_utils import run_ranks
from zerocompile.config import ZeroConfig
from zerocompile.errors import ZeroConfigError
from zerocompile.runtime.comms_log import CommsLoggerSettings, bus_factor, parse_comms_logger

STEPS = 3
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def _run(rank: int, world: int, options: dict, optimizer=torch.optim.AdamW, eager_parts: bool = False) -> dict:
    """Train a GPT for one step (compiles it, checks fingerprints), reset the counters, then
    ``STEPS`` more; return the losses, ``stats()``'s counts and the logger's rows. ``eager_parts``:
    the GPT with a graph break inside its block loop (``test_eager_regions.BreakGPT``), whose
    forward runs eagerly around compiled blocks (its gathers, position checks and gradient
    reductions are eager collectives)."""
    from models import make_batch, make_model
    from test_eager_regions import BreakGPT

    torch.manual_seed(0)
    model = BreakGPT() if eager_parts else make_model("gpt")
    compiled = torch.compile(model, backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer, lr=1e-3)
    printed = io.StringIO()
    losses = []
    # an independent count of what ran: a dispatch mode over the steps, which sees every collective
    # op the graphs and the eager call sites run (not zerocompile's accounting, which starts the
    # timers and counts in one call)
    counter = CollectiveCounter()
    with contextlib.redirect_stdout(printed):
        for step in range(STEPS + 1):
            if step == 1:
                zerocompile.reset_stats()       # from here on: the steps' collectives only
                printed.seek(0)
                printed.truncate()
                counter.__enter__()
            x, y = make_batch("gpt", step * world + rank, 4)
            loss = compiled(x, y)
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        counter.__exit__(None, None, None)
    now = zerocompile.stats()
    out = io.StringIO()
    rows = zerocompile.log_summary(show_straggler=True, file=out)
    torch._dynamo.reset()
    return {"losses": losses, "counted": {k: (getattr(now, k).count, getattr(now, k).bytes) for k in KINDS},
            "census": {k: (counter.count[k], counter.bytes[k]) for k in KINDS if counter.count[k]},
            "rows": rows, "stats_rows": now.comm_latency, "printed": out.getvalue(),
            "verbose": [line for line in printed.getvalue().splitlines() if line.startswith("comm op:")]}


_RUNS_NOTHING = re.compile(r"(buf\d+ = buf\d+\[\d+\]|buf\d+ = buf\d+|del buf\d+|assert_size_stride\(.*|"
                           r"assert_alignment\(.*|torch\.ops\._c10d_functional\.wait_tensor\.default\(buf\d+\))(; .*)?$")


def _check_blocking_order(code: str) -> int:
    """In inductor's generated code, between each ``comm_timer_start`` and its ``comm_timer_end``
    run the collective and its waits only (no kernel: with ``blocking`` nothing overlaps the
    collective). Returns how many timed collectives the code has."""
    site, collective, timed = None, None, 0
    for line in (ln.strip() for ln in code.splitlines()):
        start = re.match(r"torch\.ops\.zerocompile\.comm_timer_start\.default\(buf\d+, (\d+)\)", line)
        end = re.match(r"torch\.ops\.zerocompile\.comm_timer_end\.default\(\[.*\], (\d+)\)", line)
        if start:
            assert site is None, line
            site, collective = start.group(1), None
        elif end:
            assert end.group(1) == site and collective is not None, line
            site, timed = None, timed + 1
        elif site is not None and line and not line.startswith("#") and not _RUNS_NOTHING.match(line):
            assert collective is None, f"{line!r} runs between the collective {collective!r} and its end timer"
            collective = line
    assert site is None
    return timed


def test_the_order_check_sees_a_kernel_inside_a_timed_collective():
    ok = """
        torch.ops.zerocompile.comm_timer_start.default(buf1, 0)
        buf4 = torch.ops.zerocompile.all_gather_point_to_point_unpacked.default(buf1, 2, '0', [4, 4])
        buf5 = buf4[0]
        assert_size_stride(buf5, (8, ), (1, ), 'x')
        del buf4
        torch.ops._c10d_functional.wait_tensor.default(buf5)
        torch.ops.zerocompile.comm_timer_end.default([buf5], 0)
        cpp_fused_add_0(buf5, buf6)
    """
    assert _check_blocking_order(ok) == 1
    late = ok.replace("        torch.ops._c10d_functional.wait", "        cpp_fused_add_0(buf2, buf3)\n"
                      "        torch.ops._c10d_functional.wait")
    with pytest.raises(AssertionError, match="cpp_fused_add_0.* runs between"):
        _check_blocking_order(late)


def _timed(rows: list) -> dict:
    out = {}
    for row in rows:
        count, nbytes = out.get(row["kind"], (0, 0))
        out[row["kind"]] = (count + row["count"], nbytes + row["count"] * row["msg_bytes"])
    return out


def _check_rows(rows: list) -> None:
    for row in rows:
        assert row["count"] > 0 and row["msg_bytes"] > 0
        assert 0 < row["min_ms"] <= row["avg_ms"] <= row["max_ms"]
        assert row["total_ms"] == pytest.approx(row["avg_ms"] * row["count"])
        assert row["algbw_gbps"] == pytest.approx(row["msg_bytes"] * row["count"] / (row["total_ms"] / 1e3) / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * bus_factor(row["kind"], row["group_size"]))


@pytest.fixture(scope="module")
def plain(once_per_run):
    return once_per_run("test_comms_logger.plain", lambda: run_ranks(_run, 2, {"stage": 3, "inner_compiler": "eager"}))


@pytest.mark.parametrize("stage,inner,logger,eager_parts", [
    (3, "eager", {"enabled": True, "debug": True, "verbose": True}, False),
    (3, "eager", {"enabled": True, "blocking": False}, False),
    (3, "inductor", {"enabled": True, "debug": True}, False),
    (1, "eager", {"enabled": True, "debug": True}, False),
    (3, "eager", {"enabled": True, "debug": True}, True),
], ids=["stage3-blocking-verbose", "stage3-overlapped", "stage3-inductor", "stage1-optimizer-step",
        "stage3-eager-parts"])
def test_every_collective_is_timed_once_and_the_values_do_not_change(plain, stage, inner, logger, eager_parts,
                                                                    monkeypatch, tmp_path):
    if inner == "inductor":     # a cache folder of its own: the code inductor generated is read below
        cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", tmp_path)) / "comms_logger"
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    ranks = run_ranks(_run, 2, {"stage": stage, "inner_compiler": inner, "comms_logger": logger},
                      torch.optim.AdamW, eager_parts)
    if inner == "inductor":
        checked = [_check_blocking_order(path.read_text()) for path in cache.rglob("*.py")
                   if "comm_timer_start" in path.read_text()]
        # the forward's gather, the backward's gather and reduce-scatter (one bucket each here)
        assert len(checked) >= 2 and sum(checked) >= 3
    if stage == 3 and inner == "eager" and not eager_parts:
        assert [r["losses"] for r in ranks] == [r["losses"] for r in plain]
    for r in ranks:
        # every collective that ran was timed once, with its bytes: against the dispatch-mode count
        assert _timed(r["rows"]) == r["census"], (r["rows"], r["census"])
        assert _timed(r["rows"]) == {k: v for k, v in r["counted"].items() if v[0]}
        assert r["counted"]["all_gather"][0] > 0 and r["counted"]["all_reduce"][0] > 0
        _check_rows(r["rows"])
        assert [{k: v for k, v in row.items() if k != "straggler_ms"} for row in r["rows"]] == r["stats_rows"]
        sites = {row["site"] for row in r["rows"]}
        if logger.get("debug"):
            assert "optimizer step scalars" in sites       # the clipping norm's all-reduce
            if eager_parts:     # the eager forward's gathers, its backward's, the gradients' reduction
                assert {"eager forward gather", "eager backward gather", "eager gradients",
                        "eager position check"} <= sites, sites
            if stage == 3:
                assert any(s.startswith("frame ") and "gather" in s for s in sites)
                assert any(s.startswith("frame ") and "reduce_scatter" in s for s in sites)
            else:
                assert "optimizer step" in sites           # stage 1's bucketed reduction and gather
        else:
            assert sites == {""}
    if logger.get("verbose"):      # rank 0 prints each collective as it completes
        assert len(ranks[0]["verbose"]) == sum(row["count"] for row in ranks[0]["rows"]) and not ranks[1]["verbose"]
    # straggler: per row, this rank's total over the fastest rank's; the fastest reads 0
    for i, row in enumerate(ranks[0]["rows"]):
        spread = [r["rows"][i]["straggler_ms"] for r in ranks]
        assert min(spread) == 0 and all(s >= 0 for s in spread)
    assert "zerocompile comms logger" in ranks[0]["printed"] and ranks[1]["printed"] == ""


@pytest.mark.parametrize("blocking", [True, False])
def test_a_whole_parameter_optimizers_all_to_alls_are_timed(blocking):
    """Adafactor updates whole parameters at their owners: the gradients' pieces travel there and
    the updated pieces back with all-to-alls the optimizer step issues in eager code (waited for at
    once with ``blocking``, else where the step waits for them)."""
    options = {"stage": 2, "inner_compiler": "eager",
               "comms_logger": {"enabled": True, "debug": True, "blocking": blocking}}
    for r in run_ranks(_run, 2, options, torch.optim.Adafactor):
        assert r["counted"]["all_to_all"][0] > 0
        assert _timed(r["rows"]) == {k: v for k, v in r["counted"].items() if v[0]}
        assert {row["site"] for row in r["rows"] if row["kind"] == "all_to_all"} == {"optimizer step"}


def test_prof_ops_times_only_the_kinds_named_with_deepspeeds_names():
    options = {"stage": 3, "inner_compiler": "eager", "parameter_gather": "all_gather",
               "gradient_reduction": "reduce_scatter",
               "comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["reduce_scatter_tensor"]}}
    for r in run_ranks(_run, 2, options):
        assert _timed(r["rows"]) == {"reduce_scatter": r["counted"]["reduce_scatter"]}
        assert r["counted"]["all_gather"][0] > 0


def test_without_the_logger_nothing_is_timed_and_log_summary_says_why(plain, caplog):
    for r in plain:
        assert r["rows"] == [] and r["stats_rows"] == []
    with caplog.at_level(logging.WARNING, logger="zerocompile"):
        assert zerocompile.log_summary(file=io.StringIO()) == []
    assert "comms logger is off" in caplog.text


def test_settings_and_bad_input():
    assert parse_comms_logger(None) is None
    assert parse_comms_logger({"enabled": False, "verbose": True}) is None
    assert parse_comms_logger(True) == CommsLoggerSettings()
    got = parse_comms_logger({"enabled": True, "prof_all": False, "prof_ops": ["all_gather_into_tensor", "all_reduce"],
                              "debug": True})
    assert got.prof_ops == ("all_gather", "all_reduce") and got.profiles("all_gather")
    assert not got.profiles("reduce_scatter") and got.debug and got.blocking
    with pytest.raises(ZeroConfigError, match="unknown key"):
        parse_comms_logger({"enabled": True, "prof_al": True})
    with pytest.raises(ZeroConfigError, match="verbose"):
        parse_comms_logger({"enabled": True, "verbose": "yes"})
    with pytest.raises(ZeroConfigError, match="unknown op name"):
        parse_comms_logger({"enabled": True, "prof_all": False, "prof_ops": ["allgather"]})
    with pytest.raises(ZeroConfigError, match="nothing would be profiled"):
        parse_comms_logger({"enabled": True, "prof_all": False})
    with pytest.raises(ZeroConfigError, match="comms_logger"):
        ZeroConfig.from_options({"comms_logger": "on"})
    # DeepSpeed's key translates to the option
    cfg = ZeroConfig.from_options({"zero_optimization": {"stage": 2},
                                   "comms_logger": {"enabled": True, "verbose": False, "prof_all": True,
                                                    "debug": False}})
    assert cfg.observability.comms_logger == CommsLoggerSettings()
    assert ZeroConfig.from_options({"comms_logger": {"enabled": False}}).observability.comms_logger is None


def test_bus_bandwidth_factors():
    assert bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(1 / 2)
    assert bus_factor("all_reduce", 4) == pytest.approx(2 * 3 / 4)
    assert bus_factor("all_gather", 1) == 0.0
    assert bus_factor("all_to_all", 4) == 1.0        # its size is already what it sends to the others


def test_the_timer_ops_change_no_version_counter():
    """The timers only say they write what they are given: a parameter (or a view of one) given to
    one keeps its version, so a backward that saved it in eager code still runs."""
    from zerocompile.runtime import timer_ops  # noqa: F401  (registers the ops)

    weight = torch.nn.Parameter(torch.randn(3, 3))
    before = weight._version
    torch.ops.zerocompile.module_mark.default([weight, weight.t()], 0)
    assert weight._version == before
    loss = (weight.t() @ weight).sum()      # saves weight for its backward
    torch.ops.zerocompile.module_mark.default([weight], 0)
    loss.backward()                          # "modified by an inplace operation" if the mark bumped it
    assert weight.grad is not None


def _zoo_monitored(rank: int, world: int, name: str, stage: int, out: str):
    import zoo
    from harness import train_on_rank_slices

    torch._dynamo.reset()
    model = zoo.make(name)
    options = {"stage": stage, "inner_compiler": "eager", "allow_unsharded": True,
               "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
               "comms_logger": {"enabled": True},
               "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(Path(out) / "p.txt")}}
    compiled = torch.compile(model, backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05)
    losses = train_on_rank_slices(compiled, opt, (zoo.batch(step, 4) for step in range(3)), rank, world)
    return losses, zerocompile.full_state_dict(compiled, rank0_only=False)


@pytest.mark.parametrize("stage", [1, 3])
def test_every_timer_on_a_model_sharing_a_parameter_across_blocks_is_exact(stage, tmp_path):
    """The zoo's model whose blocks share one weight (used by eager code and by two frames), with
    the CSV monitor, the comms logger and the flops profiler on: the losses and weights of one
    process training on the whole batch. The timers' first version bumped that weight's version
    counter, and the eager backward that had saved it refused to run."""
    import zoo

    model = zoo.make("shared_across_blocks")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    want = []
    for step in range(3):
        loss = model(*zoo.batch(step, 4))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for losses, state in run_ranks(_zoo_monitored, 2, "shared_across_blocks", stage, str(tmp_path)):
        assert losses == pytest.approx(want, rel=1e-5, abs=1e-5)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-5)
    assert (tmp_path / "p.txt").exists()
