"""Stage 1's ``overlap_reduction`` (``zerocompile/optim/early_reduction.py``): the full gradients
reduced into the shards during the last backward before the step. On 2 gloo ranks, every rank
checked: the model bit for bit what the step's own reduction gives (the option off), and within
float32 rounding of one process on the whole batch; the reduction really starts inside the
backward when the model runs as pieces; a wrong guess (more micro-batches than the last step,
a gradient changed in place, a gradient read and clipped) reduces again in the step, exactly."""

from __future__ import annotations

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from harness import ranks_of, runs_apart
from models import GPT, make_batch
from zerocompile.errors import ZeroConfigError
from zerocompile.runtime.sharded_param import get_state
from zerocompile.runtime.zero_parameter import raw_grad

STEPS = 6


def _model():
    torch.manual_seed(0)
    return GPT(layers=4)


def _schedule(name: str) -> list[int]:
    """Micro-batches per step: the same every step, or a change the guess gets wrong twice."""
    return {"one": [1] * STEPS, "two": [2] * STEPS, "changing": [1, 1, 1, 2, 2, 1]}[name]


def _train(rank: int, world: int, schedule: str, overlap: bool, blocks=2, extra: dict | None = None,
           meddle: str | None = None) -> dict:
    """The 4-block tied GPT at stage 1 with AdamW, compiled whole (as pieces with ``blocks=2``),
    this rank's slice of each micro-batch."""
    torch._dynamo.reset()
    zerocompile.reset_stats()
    model = _model()
    options = {"stage": 1, "inner_compiler": "eager", "repeated_blocks": blocks, "bucket_mb": 0.02,
               "overlap_reduction": overlap, **(extra or {})}
    compiled = torch.compile(model, backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-2)
    per = 4 // world
    losses, norms = [], []
    for step, micro in enumerate(_schedule(schedule)):
        total = torch.zeros(())
        for m in range(micro):
            x, y = make_batch("gpt", 10 * step + m, 4)
            loss = compiled(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]) / micro
            loss.backward()
            total += loss.detach()
        if meddle == "scale" and step == 3 and rank == 0:
            # an in-place change of a local gradient after its reduction, on one rank only (as a
            # user's gradient hook may make): same values, a new version
            raw_grad(get_state(model.blocks[1].fc.bias).replica).mul_(1.0)
        if meddle == "clip":
            norms.append(opt.clip_grad_norm_(0.05).item())
        if meddle == "read" and step >= 2:
            grad = model.blocks[0].fc.weight.grad         # p.grad reduces before the step: a DTensor
            norms.append(float(grad.full_tensor().norm()))
        opt.step()
        opt.zero_grad()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    early = opt._reducer.early
    return {"losses": losses, "norms": norms, "state": zerocompile.full_state_dict(compiled, rank0_only=False),
            "launches": early.launches, "early_buckets": early.started_in_backward, "used": early.used,
            "buckets": len(early.plan.buckets) if early.plan is not None else 0,
            "stats": {k: v for k, v in zerocompile.stats(compiled).as_dict().items() if k != "compile_seconds"}}


def _reference(schedule: str, meddle: str | None = None) -> dict:
    """One process, the whole batch, plain PyTorch AdamW."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step, micro in enumerate(_schedule(schedule)):
        total = 0.0
        for m in range(micro):
            x, y = make_batch("gpt", 10 * step + m, 4)
            loss = model(x, y) / micro
            loss.backward()
            total += loss.item()
        if meddle == "clip":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        if meddle == "read" and step >= 2:
            norms.append(float(model.blocks[0].fc.weight.grad.norm()))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


CASES = {
    # key: (schedule, blocks, extra options, meddle)
    "one": ("one", 2, None, None),
    "two": ("two", 2, None, None),
    "changing": ("changing", 2, None, None),
    "one-graph": ("one", "off", None, None),
    "bf16": ("one", 2, {"param_dtype": "bfloat16"}, None),
    "clip": ("one", 2, None, "clip"),
    "read": ("one", 2, None, "read"),
    "scale": ("one", 2, None, "scale"),
}


def _all(rank, world):
    runs = []
    for key, (schedule, blocks, extra, meddle) in CASES.items():
        for overlap in (True, False):
            runs.append(((key, overlap), _train, (schedule, overlap, blocks, extra, meddle)))
    return runs_apart(rank, world, runs)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_gives_the_steps_numbers_bit_for_bit_and_one_process_s(results, case):
    schedule, _, extra, meddle = CASES[case]
    on, off = ranks_of(results, (case, True)), ranks_of(results, (case, False))
    ref = _reference(schedule, meddle)
    # AdamW turns float32 rounding of a near-zero gradient into up to lr-sized steps: 1e-4 here
    tol = dict(atol=5e-2, rtol=5e-2) if extra and "param_dtype" in extra else dict(atol=1e-4, rtol=1e-4)
    for rank, (a, b) in enumerate(zip(on, off)):
        assert a["losses"] == b["losses"], f"rank {rank}"
        assert a["norms"] == b["norms"], f"rank {rank}"
        for key, value in b["state"].items():
            assert torch.equal(a["state"][key], value), f"rank {rank}: {key} differs from the step's reduction"
        torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(ref["losses"]), **tol)
        torch.testing.assert_close(torch.tensor(a["norms"]), torch.tensor(ref["norms"]), **tol)
        for key, value in ref["state"].items():
            torch.testing.assert_close(a["state"][key], value, **tol, msg=lambda m, key=key: f"rank {rank} {key}: {m}")
        assert b["launches"] == 0 and b["buckets"] == 0          # the option off launches nothing
        # the same collectives and bytes as the step's reduction, plus the check's small all-reduce
        for kind in ("reduce_scatter", "all_gather"):
            assert a["stats"][kind] == b["stats"][kind] or a["used"] < a["buckets"] * a["launches"], (kind, rank)


def test_the_reduction_starts_inside_the_backward_and_the_step_uses_it(results):
    for rank, r in enumerate(ranks_of(results, ("one", True))):
        # steps 1-2 bind and count; every later backward launches all buckets, some before it ends
        assert r["launches"] == STEPS - 2, rank
        assert r["buckets"] >= 4, rank
        assert r["used"] == r["launches"] * r["buckets"], rank
        assert 0 < r["early_buckets"] <= r["used"], rank
    for rank, r in enumerate(ranks_of(results, ("two", True))):
        assert r["launches"] == STEPS - 2 and r["used"] == r["launches"] * r["buckets"], rank


def test_a_wrong_guess_or_a_changed_gradient_falls_back_to_the_step(results):
    # 1,1,1,2,2,1 micro-batches: step 4 (2 after 1) launches in its first backward, which its second
    # invalidates; step 5 launches in its second; step 6 (1 after 2) never reaches its guess
    changing = ranks_of(results, ("changing", True))
    for rank, r in enumerate(changing):
        assert r["launches"] == 3 and r["used"] == 2 * r["buckets"], rank
    # a gradient changed in place on rank 0 only: both ranks reduce that bucket again in the step
    scale = ranks_of(results, ("scale", True))
    assert scale[0]["used"] == scale[1]["used"] == scale[0]["launches"] * scale[0]["buckets"] - 1


def test_one_graph_launches_at_its_end(results):
    for rank, r in enumerate(ranks_of(results, ("one-graph", True))):
        assert r["launches"] == STEPS - 2 and r["used"] == r["launches"] * r["buckets"], rank


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_values_are_refused(value):
    with pytest.raises(ZeroConfigError, match="overlap_reduction"):
        zerocompile.ZeroConfig.from_options({"overlap_reduction": value})


def test_default_is_off_and_deepspeed_overlap_comm_turns_it_on():
    assert zerocompile.ZeroConfig.from_options({}).step.overlap_reduction is False
    cfg = zerocompile.ZeroConfig.from_options({"zero_optimization": {"stage": 1, "overlap_comm": True}})
    assert cfg.step.overlap_reduction is True and cfg.sharding.stage == 1
