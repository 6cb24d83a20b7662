"""torch's own gradient clipping in nanoGPT's training loop, on 2 gloo ranks at every stage.

The loop as nanoGPT writes it: two param groups (weight decay for matrices, none for vectors),
the learning rate written into ``param_groups`` every iteration, gradient accumulation
(``loss / accum`` and a backward per micro-batch), ``torch.nn.utils.clip_grad_norm_`` over
``model.parameters()``, ``opt.step()``, ``opt.zero_grad(set_to_none=True)``. Losses, clip
norms and parameters equal one process running the same loop on the whole batch."""

from __future__ import annotations

import math

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from harness import rank_slice
from models import GPT, make_batch

STEPS, BATCH, MAX_NORM = 3, 4, 0.5
LOOPS = [  # (stage, accumulation, how it clips, reads gradients after each micro-batch)
    *[(stage, 2, "clip_grad_norm_", False) for stage in range(4)],
    (0, 1, "get_total_norm", False),
    (3, 1, "get_total_norm", False),
    (0, 2, "clip_grad_norm_", True),     # reduced at the read, reduced again after the next backward
    (1, 2, "clip_grad_norm_", True),
]
LR = 1e-3   # nanoGPT's for small models; with 1e-2 Adam turns the rounding of near-zero gradients into
            # 2e-5 differences, the same between two plain-torch processes summing in another order


def _model():
    torch.manual_seed(0)
    return GPT(vocab=96, d=32, layers=1, heads=2, seq=16)


def _optimizer(model, make):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return make([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])


def _lr(it):
    warmup, top = 1, LR
    if it < warmup:
        return top * (it + 1) / warmup
    return 0.1 * top + 0.45 * top * (1 + math.cos(math.pi * (it - warmup) / STEPS))


def _clip(model, how):
    if how == "clip_grad_norm_":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), MAX_NORM, norm)
    return norm


def _loop(model, opt, accum, how, read_each, rank, world):
    """nanoGPT's loop on this rank's slice of each micro-batch; returns the losses (averaged
    over ranks), clip norms, norms read after the first micro-batch, and the gradients' types."""
    losses, norms, early, kinds = [], [], [], set()
    for it in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = _lr(it)
        total = torch.zeros(())
        for micro in range(accum):
            x, y = make_batch("gpt", it * accum + micro, BATCH)
            loss = model(rank_slice(x, rank, world), rank_slice(y, rank, world)) / accum
            loss.backward()
            total += loss.detach()
            if read_each and micro == 0:    # a gradient monitor between micro-batches
                early.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        kinds |= {type(p.grad).__name__ for p in model.parameters()}
        norms.append(float(_clip(model, how)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return {"losses": losses, "norms": norms, "early": early, "kinds": sorted(kinds)}


def _reference(accum, how, read_each):
    model = _model()
    opt = _optimizer(model, lambda groups: torch.optim.AdamW(groups, lr=LR))
    out = _loop(model, opt, accum, how, read_each, 0, 1)
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _ranks(rank, world):
    results = []
    for stage, accum, how, read_each in LOOPS:
        torch._dynamo.reset()
        model = torch.compile(_model(), backend="zero", options={"stage": stage, "inner_compiler": "eager"})
        opt = _optimizer(model, lambda groups: zerocompile.ZeroOptimizer(groups, torch.optim.AdamW, lr=LR))
        out = _loop(model, opt, accum, how, read_each, rank, world)
        out["state"] = zerocompile.full_state_dict(model, rank0_only=False)
        results.append(out)
    return results


@pytest.fixture(scope="module")
def runs(once_per_run):
    """Every rank's results: the losses are averaged over ranks, the clip norms and the early
    norms are each rank's own reading of the global gradient, and ``full_state_dict(rank0_only=
    False)`` gives every rank the full state, so each must equal the one process."""
    return once_per_run("test_torch_clipping.runs", lambda: run_ranks(_ranks, 2))


@pytest.mark.parametrize("index", range(len(LOOPS)), ids=[f"stage{s}-accum{a}-{h}{'-read_each' if r else ''}"
                                                        for s, a, h, r in LOOPS])
def test_nanogpt_loop_with_torch_clipping_equals_one_process(runs, index):
    stage, accum, how, read_each = LOOPS[index]
    want = _reference(accum, how, read_each)
    assert min(want["norms"]) > MAX_NORM                      # it really clips
    for rank, per_rank in enumerate(runs):
        got = per_rank[index]
        for name in ("norms", "early", "losses"):
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, name=name: f"rank {rank}, {name}: {m}")
        assert sorted(got["state"]) == sorted(want["state"])
        for key, value in want["state"].items():
            torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, key=key: f"rank {rank}, {key}: {m}")
        # what p.grad is: the averaged gradient itself at stage 0, this rank's shard as a DTensor above
        assert got["kinds"] == (["Tensor"] if stage == 0 else ["DTensor"]), rank
