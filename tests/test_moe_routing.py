"""A mixture of experts written the common eager way (``nonzero`` per expert, experts no token
reaches skipped) on 2 gloo ranks whose data routes differently: rank 1's tokens never reach
expert 2, and no token reaches expert 3. Against one process on the whole batch:

- stages 0-2 are exact with no option (a gradient missing on one rank reduces as zeros; the
  expert no rank used keeps no gradient, as in one process);
- stage 3 is exact with ``zerocompile.set_leaf_modules(model, [MoEBlock])``, with the experts
  sharded between steps;
- stage 3 without it raises, on every rank, an error naming the module and the fix (before,
  one rank died in gloo: "Received data size doesn't match expected size").

Experts of their own class (Dynamo compiles each one's forward as a frame) are run too: in a
leaf at stage 3 (exact), and without one at stages 0 and 1 (exact).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocompile
from dist_utils import run_ranks
from harness import rank_slice

D, E, H, STEPS, BATCH = 8, 4, 16, 3, 8


class Expert(nn.Module):
    """An expert of your own class: Dynamo compiles its forward as a frame of its own (unlike
    an ``nn.Sequential``'s), which then runs on the ranks whose tokens reach the expert only."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class MoEBlock(nn.Module):
    def __init__(self, own_experts: bool = False):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() if own_experts else nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
                                     for _ in range(E))
        self.used: set[int] = set()       # experts some token reached, over all forwards

    def forward(self, x):
        logits = self.router(x)
        probs = logits.softmax(-1)
        choice = logits.argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            sel = (choice == i).nonzero().squeeze(-1)
            if sel.numel() == 0:
                continue
            self.used.add(i)
            out[sel] += probs[sel, i:i + 1] * expert(x[sel])
        return x + out


class MoENet(nn.Module):
    def __init__(self, own_experts: bool = False):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoEBlock(own_experts)
        self.head = nn.Linear(D, 3)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.moe(x + self.inp(x))), y)


def _model(own_experts: bool = False) -> MoENet:
    torch.manual_seed(0)
    model = MoENet(own_experts)
    with torch.no_grad():
        model.moe.router.weight.copy_(torch.eye(E, D) * 4)   # expert i <- feature i
        model.moe.router.weight[3] = 0.0                      # expert 3: logit 0
        model.inp.weight.mul_(0.1)
    return model


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, D, generator=g)
    x[:, 0] = x[:, 0].abs() + 1.0          # logit 0 > 0: expert 3 is never chosen
    x[0, 2] = 10.0                          # rank 0's first token goes to expert 2
    x[BATCH // 2:, 2] = -10.0               # rank 1's tokens never do
    return x, torch.randn(BATCH, 3, generator=g)


def _optimizer(params, zero: bool):
    kw = {"lr": 0.01, "weight_decay": 0.1}
    return zerocompile.ZeroOptimizer(params, optimizer_class=torch.optim.AdamW, **kw) if zero \
        else torch.optim.AdamW(params, **kw)


def _reference(own_experts: bool = False) -> dict:
    model = _model(own_experts)
    opt = _optimizer(model.parameters(), zero=False)
    losses = []
    for step in range(STEPS):
        loss = model(*_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _train(rank: int, world: int, stage: int, leaf: bool, own_experts: bool) -> dict:
    from zerocompile.runtime.sharded_param import get_state

    torch._dynamo.reset()
    model = _model(own_experts)
    if leaf:
        assert zerocompile.set_leaf_modules(model, [MoEBlock]) == ["moe"]
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = _optimizer(compiled.parameters(), zero=True)
    losses, expert_freed = [], []
    try:
        for step in range(STEPS):
            x, y = _batch(step)
            loss = compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            losses.append(total.item() / world)
            expert_freed.append(all(get_state(p) is not None and get_state(p).values_freed()
                                    for p in model.moe.parameters()))
    except RuntimeError as err:
        return {"error": str(err), "used": sorted(model.moe.used)}
    return {"losses": losses, "state": zerocompile.full_state_dict(compiled, rank0_only=False),
            "used": sorted(model.moe.used), "expert_freed": expert_freed}


# (stage, set_leaf_modules, experts of their own class)
CONFIGS = [(0, False, False), (1, False, False), (2, False, False), (3, True, True), (3, False, False),
           (0, False, True), (1, False, True)]


def _all_configs(rank: int, world: int) -> dict:
    return {config: _train(rank, world, *config) for config in CONFIGS}


@pytest.fixture(scope="module")
def runs(once_per_run):
    return once_per_run("test_moe_routing.runs", lambda: (run_ranks(_all_configs, 2),
                                                          {own: _reference(own) for own in (False, True)}))


def _assert_routing(result: dict, rank: int) -> None:
    """The routing the test is about: expert 2 on rank 0 only, expert 3 on no rank."""
    assert (2 in result["used"]) == (rank == 0) and 3 not in result["used"], result["used"]


def _assert_exact(result: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=1e-5)
    assert set(result["state"]) == set(ref["state"])
    for key, value in ref["state"].items():
        torch.testing.assert_close(result["state"][key], value, atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_to_2_are_exact_without_options(runs, stage):
    per_rank, ref = runs
    for rank, results in enumerate(per_rank):
        result = results[(stage, False, False)]
        assert "error" not in result, result.get("error")
        _assert_routing(result, rank)
        _assert_exact(result, ref[False])


def test_stage3_with_leaf_modules_is_exact_and_sharded(runs):
    """With experts of their own class: nothing inside the leaf compiles, so no expert frame
    issues collectives on some ranks only."""
    per_rank, ref = runs
    for rank, results in enumerate(per_rank):
        result = results[(3, True, True)]
        assert "error" not in result, result.get("error")
        _assert_routing(result, rank)
        assert all(result["expert_freed"]), "the leaf's parameters must be sharded again after each step"
        _assert_exact(result, ref[True])


def test_stage3_without_leaf_modules_names_the_module_and_the_fix_on_every_rank(runs):
    per_rank, _ = runs
    for results in per_rank:
        error = results[(3, False, False)].get("error")
        assert error is not None, "stage 3 with rank-dependent routing must refuse"
        assert "module 'moe' (MoEBlock)" in error
        assert "zerocompile.set_leaf_modules(model, [MoEBlock])" in error
        assert "'moe.experts.2.0.weight' (ranks [0])" in error


def test_experts_compiled_as_frames_of_their_own(runs):
    """Stages 0 and 1: an expert frame that runs on some ranks only issues no collective in its
    forward (it has none, so it is not checked either). The model's first compiled frame gives
    every parameter of the model its shard state on every rank (runtime/eager_regions.py), so
    the experts are sharded alike everywhere and the step reduces a missing gradient as zeros:
    exact. (Before, the expert frames sharded their parameters on the ranks they ran on only,
    and stage 1 had to refuse.)"""
    per_rank, ref = runs
    for rank, results in enumerate(per_rank):
        for stage in (0, 1):
            result = results[(stage, False, True)]
            assert "error" not in result, result.get("error")
            _assert_routing(result, rank)
            _assert_exact(result, ref[True])


def test_set_leaf_modules_refuses_what_it_cannot_mark():
    model = _model()
    with pytest.raises(TypeError, match="expected a list of nn.Module classes"):
        zerocompile.set_leaf_modules(model, ["MoEBlock"])
    with pytest.raises(ValueError, match="no module of MoENet is a Expert"):
        zerocompile.set_leaf_modules(model, [Expert])
    assert zerocompile.set_leaf_modules(model, [MoEBlock, nn.Sequential]) == [
        "moe", "moe.experts.0", "moe.experts.1", "moe.experts.2", "moe.experts.3"]
    # one process: the leaf's forward runs (eagerly) and computes what it did before
    x, y = _batch(0)
    torch.testing.assert_close(model(x, y), _model()(x, y))
