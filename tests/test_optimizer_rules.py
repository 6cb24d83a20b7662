"""ZeroOptimizer runs element-wise optimizers on flat shards: every allow-listed torch class
(with its notable options: amsgrad, foreach, fused, nesterov, centered, decoupled weight decay)
matches plain torch on the whole model, at world size 1 and on 2 ranks; LBFGS and SparseAdam
are refused with their reason; Muon and Adafactor run on whole parameters (their tests:
test_whole_parameter_optimizers.py) and are refused as element-wise; an unknown class needs
an opt-in."""

from __future__ import annotations

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from harness import train_on_rank_slices
from models import make_batch, make_model
from zerocompile.optimizer_rules import ELEMENTWISE, NOT_ELEMENTWISE, REFUSED, WHOLE_PARAMETER

O = torch.optim
STEPS = 6    # RAdam (betas 0.9, 0.99) rectifies from step 6 on, ASGD (t0=2) averages from step 3

CASES = {
    "SGD": (O.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "SGD-fused": (O.SGD, {"lr": 0.05, "momentum": 0.9, "fused": True}),
    "Adam-amsgrad-foreach": (O.Adam, {"lr": 0.01, "amsgrad": True, "foreach": True}),
    "Adam-fused": (O.Adam, {"lr": 0.01, "weight_decay": 0.1, "fused": True}),
    "AdamW-single-tensor": (O.AdamW, {"lr": 0.01, "weight_decay": 0.1, "foreach": False}),
    "Adamax": (O.Adamax, {"lr": 0.01, "weight_decay": 0.01}),
    "NAdam-decoupled": (O.NAdam, {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    "RAdam": (O.RAdam, {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.01}),
    "Adagrad-fused": (O.Adagrad, {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1,
                                  "fused": True}),
    "Adadelta": (O.Adadelta, {"lr": 1.0, "weight_decay": 0.01}),
    "RMSprop-centered": (O.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    "Rprop": (O.Rprop, {"lr": 0.01}),
    "ASGD": (O.ASGD, {"lr": 0.01, "t0": 2}),
}


def _reference(cls, kw):
    """Plain torch, one process, whole batch, unsharded model."""
    model = make_model("mlp")
    opt = cls(model.parameters(), **kw)
    losses = []
    for step in range(STEPS):
        x, y = make_batch("mlp", step, 8)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero(rank, world, stage, cls, kw, **zero_kw):
    torch._dynamo.reset()
    model = torch.compile(make_model("mlp"), backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=cls, **zero_kw, **kw)
    losses = train_on_rank_slices(model, opt, (make_batch("mlp", step, 8) for step in range(STEPS)), rank, world)
    return losses, zerocompile.full_state_dict(model, rank0_only=False)


def _assert_same(got, ref, tol):
    (losses, state), (ref_losses, ref_state) = got, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=tol, rtol=tol)
    assert set(state) == set(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, atol=tol, rtol=tol, msg=lambda m: f"{key}: {m}")


def test_every_allow_listed_class_has_a_case():
    assert {cls for cls, _ in CASES.values()} == set(ELEMENTWISE)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_allow_listed_optimizer_matches_plain_torch_world_one(case, stage):
    """One rank: the shard is the whole flattened parameter, so with the class exactly as
    configured (kernel="torch") the result is bitwise equal; with the default kernel choice
    (zerocompile's fused Adam, torch's fused / foreach) equal within float32 rounding."""
    cls, kw = CASES[case]
    ref = _reference(cls, kw)
    _assert_same(_zero(0, 1, stage, cls, kw, kernel="torch"), ref, tol=0)
    _assert_same(_zero(0, 1, stage, cls, kw), ref, tol=1e-6)


TWO_RANK_CASES = ["Adagrad-fused", "RMSprop-centered", "NAdam-decoupled"]


def _two_rank_worker(rank, world):
    return {(case, stage): _zero(rank, world, stage, *CASES[case]) for case in TWO_RANK_CASES for stage in (1, 3)}


def test_allow_listed_optimizers_match_plain_torch_two_ranks():
    results = run_ranks(_two_rank_worker, 2)
    for case in TWO_RANK_CASES:
        ref = _reference(*CASES[case])
        for stage in (1, 3):
            for rank in range(2):
                _assert_same(results[rank][(case, stage)], ref, tol=1e-5)


# ----------------------------------------------------------------------------- refused
PARAMS = [torch.nn.Parameter(torch.zeros(3, 4))]


@pytest.mark.parametrize("cls, reason", [
    (O.LBFGS, "needs a closure"),
    (O.SparseAdam, "only takes sparse gradients"),
])
@pytest.mark.parametrize("assume", [False, True])
def test_optimizers_that_couple_parameters_are_refused_even_with_the_opt_in(cls, reason, assume):
    assert cls in REFUSED and cls in NOT_ELEMENTWISE
    with pytest.raises(ValueError, match=f"torch.optim.{cls.__name__} cannot run on sharded parameters") as err:
        zerocompile.ZeroOptimizer(PARAMS, optimizer_class=cls, assume_elementwise=assume)
    assert reason in str(err.value) and "AdamW" in str(err.value) and "Muon" in str(err.value)


@pytest.mark.parametrize("cls, reason", [(O.Adafactor, "rows and columns"), (O.Muon, "orthogonalizes")])
def test_whole_parameter_optimizers_are_accepted_but_not_as_elementwise(cls, reason):
    assert cls in WHOLE_PARAMETER and reason in WHOLE_PARAMETER[cls]
    zerocompile.ZeroOptimizer(PARAMS, optimizer_class=cls)           # runs on whole parameters
    with pytest.raises(ValueError, match=f"{cls.__name__} is not element-wise.*{reason}.*drop assume_elementwise"):
        zerocompile.ZeroOptimizer(PARAMS, optimizer_class=cls, assume_elementwise=True)


def test_a_subclass_of_a_refused_class_is_refused_too():
    class MyLBFGS(O.LBFGS):
        pass

    with pytest.raises(ValueError, match="a subclass of torch.optim.LBFGS.*needs a closure"):
        zerocompile.ZeroOptimizer(PARAMS, optimizer_class=MyLBFGS, assume_elementwise=True)


class CountingAdamW(O.AdamW):
    """A user subclass: it overrides ``step``, so it is not allow-listed."""

    steps = 0

    def step(self, closure=None):
        CountingAdamW.steps += 1
        return super().step(closure)


def test_unknown_subclass_needs_the_opt_in_and_then_matches_plain_torch():
    with pytest.raises(ValueError, match="CountingAdamW is not known to be element-wise") as err:
        zerocompile.ZeroOptimizer(PARAMS, optimizer_class=CountingAdamW, lr=0.01)
    assert "assume_elementwise=True" in str(err.value) and "not subclasses" in str(err.value)
    assert "whole_parameter=True" in str(err.value)

    kw = {"lr": 0.01, "weight_decay": 0.1}
    ref = _reference(CountingAdamW, kw)
    CountingAdamW.steps = 0
    got = _zero(0, 1, 3, CountingAdamW, kw, assume_elementwise=True)
    assert CountingAdamW.steps == STEPS          # the user's class itself ran on the shards, as
    # configured: neither zerocompile's kernel nor torch's fused/foreach flags replace a subclass
    _assert_same(got, ref, tol=0)
