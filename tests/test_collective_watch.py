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


def _compiled(stage: int, **options):
    torch._dynamo.reset()
    model = make_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager",
                                                           "collective_timeout_s": TIMEOUT, **options})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    return model, compiled, opt


def _train_step(compiled, opt, rank: int, world: int, step: int, micro: int = 1) -> float:
    for m in range(micro):
        x, y = make_batch("gpt", 10 * step + m, 2 * world)
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
def _eval_on_rank0(rank: int, world: int, warm: bool) -> dict:
    _, compiled, opt = _compiled(3)
    _train_step(compiled, opt, rank, world, 0)
    if warm:        # evaluated on every rank once: the inference graph is compiled everywhere
        with torch.no_grad():
            x, y = make_batch("gpt", 98, 2 * world)
            compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
    if rank == 0:
        x, y = make_batch("gpt", 99, 2)
        with torch.no_grad():
            return _caught(lambda: compiled(x, y).item())
    try:
        dist.barrier()          # the user's: never met by rank 0, which is stuck in the forward
    except RuntimeError as err:
        return {"barrier": str(err)}
    return {"barrier": "passed"}


@pytest.mark.parametrize("world,warm", [(2, True), (3, True), (2, False)])
def test_eval_on_rank0_only_at_stage3(world, warm):
    records = run_parting_ranks(_eval_on_rank0, world, warm)
    caught = _mismatch(records[0])
    assert caught["seconds"] < TIMEOUT + 15, caught
    text = caught["error"]
    if warm:    # stuck in the inference graph's first gather
        assert "rank 0 waited" in text and "inference graph: all_gather 1 of" in text, text
    else:       # stuck in the compile's own collectives (the first eval compiles the inference graph)
        assert "rank 0 waited" in text and "at compiling frame" in text, text
    for r in range(1, world):
        assert f"\n  {r}     in torch.distributed.barrier()" in text, text
        assert "test_collective_watch.py" in text   # where the user's code is, on each rank
    assert "a forward ran on rank(s) 0 only" in caught["cause"], caught["cause"]
    assert "zerocompile.full_state_dict" in caught["cause"] and "every rank" in caught["cause"]
    assert "What now" in text
