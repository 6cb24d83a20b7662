"""The collective watchdog (``collective_timeout_s``): when the ranks' collectives part, every
rank that waits in a zerocompile collective raises ``CollectiveMismatchError`` within about the
timeout, with every rank's position and the likely cause; a rank that is only slow is not an
error. Each case runs the mistake as a user writes it, on gloo ranks that leave without a
barrier (``run_parting_ranks``), with a process-group timeout (60 s) far above the watchdog's
(3 s): a case that hangs is killed at its deadline and fails, a case that raises the
transport's error instead of ours fails on its text.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import zerocompile
from dist_utils import run_parting_ranks
from harness import rank_slice
from models import make_batch, make_model

TIMEOUT = 3.0
"""The watchdog's timeout in these tests; every case must end well inside the 60 s process group timeout."""
MODEL = "mlp"
"""The smallest of the tests' models (two linear layers, 4 parameters, each sharded unevenly): the
watchdog's reports are about the ranks' positions in the collectives, not the model, and the GPT's
compile (about 4x the MLP's) was most of each case's time."""
THREE = 3
"""The world size of the cases where one rank differs from the others (or is killed): with two
others the report must name the one and give each other's state, which two ranks would not show.
Each such case runs on 3 ranks only; the watchdog's 2-rank paths run in the eval, the stage-2
extra micro-batch, the experts and the on/off cases."""


def _compiled(stage: int, **options):
    torch._dynamo.reset()
    model = make_model(MODEL)
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager",
                                                           "collective_timeout_s": TIMEOUT, **options})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    return model, compiled, opt


def _train_step(compiled, opt, rank: int, world: int, step: int, micro: int = 1) -> float:
    for m in range(micro):
        x, y = make_batch(MODEL, 10 * step + m, 2 * world)
        loss = compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _caught(fn):
    """Run ``fn``; what it raised, as the record the test reads, or its result."""
    started = time.monotonic()
    try:
        return {"result": fn(), "seconds": time.monotonic() - started}
    except zerocompile.CollectiveMismatchError as err:
        return {"error": str(err), "cause": err.cause, "seconds": time.monotonic() - started,
                "states": {r: (rep or {}).get("state") for r, rep in err.reports.items()}}


def _mismatch(record: dict) -> dict:
    """The rank's CollectiveMismatchError record (the test fails with the rank's own text otherwise)."""
    assert record is not None, "the rank recorded nothing: it hung past the deadline or died"
    assert record["ok"], f"rank failed with {record['type']}: {record['error']}\n{record['traceback']}"
    caught = record["result"]
    assert "error" in caught, f"no CollectiveMismatchError: {caught}"
    return caught


# ------------------------------------------------------------------ eval on rank 0 only
def _eval_on_rank0(rank: int, world: int, warm: bool, gather: str) -> dict:
    _, compiled, opt = _compiled(3, parameter_gather=gather)
    _train_step(compiled, opt, rank, world, 0)
    if warm:        # evaluated on every rank once: the inference graph is compiled everywhere
        with torch.no_grad():
            x, y = make_batch(MODEL, 98, 2 * world)
            compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
    if rank == 0:
        x, y = make_batch(MODEL, 99, 2)
        with torch.no_grad():
            return _caught(lambda: compiled(x, y).item())
    try:
        dist.barrier()          # the user's: never met by rank 0, which is stuck in the forward
    except RuntimeError as err:
        return {"barrier": str(err)}
    return {"barrier": "passed"}


@pytest.mark.parametrize("world,warm,gather", [(2, True, "all_gather"), (3, True, "shared_memory"),
                                               (2, False, "auto")])
def test_eval_on_rank0_only_at_stage3(world, warm, gather):
    records = run_parting_ranks(_eval_on_rank0, world, warm, gather)
    caught = _mismatch(records[0])
    assert caught["seconds"] < TIMEOUT + 15, caught
    text = caught["error"]
    if warm and gather == "all_gather":    # stuck in the inference graph's first gather
        assert "rank 0 waited 3.0 s at frame 0/1 inference graph: all_gather 1 of " in text, text
    elif warm:      # the gathers' point-to-point transfers: the graph is known, not their place in it
        assert "rank 0 waited 3.0 s at frame 0/1 inference graph: all_gather by point-to-point" in text, text
    else:       # stuck in the compile's own collectives (the first eval compiles the inference graph)
        assert "rank 0 waited" in text and "at compiling frame" in text, text
    for r in range(1, world):
        assert f"\n  {r}     in torch.distributed.barrier()" in text, text
        assert "test_collective_watch.py" in text   # where the user's code is, on each rank
    assert caught["cause"].startswith("a forward ran on rank(s) 0 only"), caught["cause"]
    assert "zerocompile.full_state_dict" in caught["cause"] and "every rank" in caught["cause"]
    assert "What now" in text


# ------------------------------------------------------------------ one more micro-batch on rank 0
def _extra_micro_batch(rank: int, world: int, stage: int) -> dict:
    # through shared memory: gloo would abort a rank on the first transfers of different sizes
    # (see _skipped_step)
    _, compiled, opt = _compiled(stage, parameter_gather="shared_memory", gradient_reduction="shared_memory")
    _train_step(compiled, opt, rank, world, 0)

    def uneven():   # an uneven last batch: rank 0 gets 3 micro-batches, the others 2
        _train_step(compiled, opt, rank, world, 1, micro=3 if rank == 0 else 2)
        _train_step(compiled, opt, rank, world, 2)
    return _caught(uneven)


# stage 3 on 3 ranks only: rank 0 against two others checks all that 2 ranks check, and more
@pytest.mark.parametrize("stage,world", [(2, 2), (3, 3)])
def test_extra_micro_batch_on_one_rank(stage, world):
    records = run_parting_ranks(_extra_micro_batch, world, stage)
    for rank, record in enumerate(records):
        caught = _mismatch(record)
        assert caught["seconds"] < 3 * TIMEOUT + 15, caught
        cause = caught["cause"]
        assert "different numbers of forward passes" in cause and "rank(s) 0 ran one more" in cause, caught["error"]
        assert "rank 0: step 1, 3 forward" in cause and re.search(r"rank [12]: step 1, 2 forward", cause), cause
        assert "different numbers of micro-batches" in cause and "drop_last=True" in cause
        assert caught["error"].startswith((f"zerocompile: rank {rank} waited", "zerocompile: this rank waited"))


# ------------------------------------------------------------------ full_state_dict on rank 0 only
def _state_dict_on_rank0(rank: int, world: int) -> dict:
    _, compiled, opt = _compiled(3)
    _train_step(compiled, opt, rank, world, 0)
    if rank == 0:
        return _caught(lambda: len(zerocompile.full_state_dict(compiled)))
    try:
        dist.barrier()
    except RuntimeError as err:
        return {"barrier": str(err)}
    return {"barrier": "passed"}


def test_full_state_dict_on_rank0_only():
    world = THREE
    records = run_parting_ranks(_state_dict_on_rank0, world)
    caught = _mismatch(records[0])
    assert caught["seconds"] < TIMEOUT + 15, caught
    assert "at full_state_dict: all_gather" in caught["error"], caught["error"]
    assert caught["cause"].startswith("full_state_dict ran on rank(s) 0 only"), caught["cause"]
    assert "call it on every rank" in caught["cause"]
    assert caught["states"] == {0: "waiting", **{r: "collective" for r in range(1, world)}}


# ------------------------------------------------------------------ a step skipped on one rank
def _skipped_step(rank: int, world: int) -> dict:
    # the graphs' gathers and reductions through the shared-memory segment: gloo aborts a process
    # whose paired transfers differ in size ("Received data size doesn't match expected size"),
    # before any watchdog can speak (see docs/sharding-and-errors.md)
    _, compiled, opt = _compiled(3, parameter_gather="shared_memory", gradient_reduction="shared_memory")
    _train_step(compiled, opt, rank, world, 0)

    def loop():
        for step in (1, 2):
            x, y = make_batch(MODEL, step, 2 * world)
            loss = compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
            if step == 1 and rank == world - 1:     # "if not torch.isfinite(loss): continue", true here only
                continue
            loss.backward()
            opt.step()
            opt.zero_grad()
    return _caught(loop)


def test_step_skipped_on_one_rank():
    world = THREE
    records = run_parting_ranks(_skipped_step, world)
    for record in records:
        caught = _mismatch(record)
        assert caught["seconds"] < 3 * TIMEOUT + 15, caught
        cause = caught["cause"]
        # the rank that skipped ran one forward more than its backwards: the skipped step is named
        assert f"rank(s) {world - 1} ran" in cause and "skipped on some ranks only" in cause, caught["error"]
        assert "isfinite" in cause and "all-reduce the condition" in cause


# ------------------------------------------------------------------ experts as frames of their own, no leaf
def _experts_without_leaf(rank: int, world: int) -> dict:
    from test_moe_routing import MoENet, _batch

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MoENet(own_experts=True)
    with torch.no_grad():
        model.moe.router.weight.copy_(torch.eye(4, 8) * 4)
        model.moe.router.weight[3] = 0.0
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager",
                                                           "collective_timeout_s": TIMEOUT})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)

    def loop():
        for step in range(2):
            x, y = _batch(step)
            compiled(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    return _caught(loop)


def test_experts_as_frames_without_leaf_modules():
    records = run_parting_ranks(_experts_without_leaf, 2)
    caught = _mismatch(records[0])          # rank 0 runs expert 2, which rank 1's tokens never reach
    assert caught["seconds"] < 3 * TIMEOUT + 15, caught
    assert "set_leaf_modules" in caught["cause"], caught["error"]


# ------------------------------------------------------------------ a slow rank is not a hang
def _slow_rank(rank: int, world: int) -> dict:
    import logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("zerocompile").addHandler(Keep())
    _, compiled, opt = _compiled(3)
    losses = []
    for step in range(3):
        x, y = make_batch(MODEL, step, 2 * world)
        loss = compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
        if step == 1 and rank == 1:
            time.sleep(2 * TIMEOUT)         # inside the step, between the forward and the backward
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return {"losses": losses, "busy": [m for m in seen if "busy" in m]}


def test_a_rank_busy_past_the_timeout_is_not_an_error():
    world = THREE
    records = run_parting_ranks(_slow_rank, world)
    for record in records:
        assert record is not None and record["ok"], record and record.get("traceback")
    results = [r["result"] for r in records]
    assert all(r["losses"] == results[0]["losses"] for r in results)     # the same step on every rank
    busy = [m for r in results for m in r["busy"]]
    # the sleeping rank is named (a rank still compiling on a loaded machine may be too)
    assert any("rank(s) 1 are busy" in m for m in busy), busy
    assert all("are busy (computing, compiling or in their own code): waiting again" in m for m in busy), busy


# ------------------------------------------------------------------ a rank killed mid-step
def _killed_rank(rank: int, world: int) -> dict:
    import signal

    _, compiled, opt = _compiled(3)
    _train_step(compiled, opt, rank, world, 0)

    def step():
        x, y = make_batch(MODEL, 1, 2 * world)
        loss = compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
    return _caught(step)


def test_a_rank_killed_mid_step_is_reported():
    world = THREE
    records = run_parting_ranks(_killed_rank, world)
    assert records[1] is None           # killed: it recorded nothing
    for rank in [0, *range(2, world)]:
        caught = _mismatch(records[rank])
        assert caught["seconds"] < TIMEOUT + 15, caught
        assert caught["cause"].startswith("rank(s) 1 gave no answer and the transport reports a lost connection"), \
            caught["error"]
        assert caught["states"][1] is None


# ------------------------------------------------------------------ on or off, the same numbers
def _train_on_or_off(rank: int, world: int, timeout, inner: str) -> dict:
    from zerocompile.runtime.session import PROCESS

    torch._dynamo.reset()
    model = make_model(MODEL)
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": inner,
                                                           "collective_timeout_s": timeout})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    losses = [_train_step(compiled, opt, rank, world, step, micro=2) for step in range(3)]
    return {"losses": losses, "state": zerocompile.full_state_dict(compiled, rank0_only=False),
            "watched": PROCESS.watch.board.last}


def _train_off_then_on(rank: int, world: int, inner: str) -> tuple:
    """The run without the watchdog first, in the rank's fresh process (so that its board's
    ``last`` can only have been set by that run), then the same run with it."""
    off = _train_on_or_off(rank, world, None, inner)
    return off, _train_on_or_off(rank, world, TIMEOUT, inner)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_the_watchdog_changes_no_number_and_none_turns_it_off(inner):
    from dist_utils import run_ranks

    records = run_ranks(_train_off_then_on, 2, inner)
    for off, on in records:
        assert on["losses"] == off["losses"]                   # bit for bit, every rank
        assert all(torch.equal(on["state"][k], off["state"][k]) for k in on["state"])
        assert on["watched"] is not None and off["watched"] is None   # off: no collective went through the watchdog
    on = records[0][1]
    assert "graph" in on["watched"] or "full_state_dict" in on["watched"]
