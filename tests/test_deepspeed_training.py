"""DeepSpeed configs' training-loop keys: ``gradient_clipping`` applied by ``ZeroOptimizer.step()``,
``zerocompile.initialize`` (optimizer, DeepSpeed's LR schedules, batch checks, "auto" values), and
the warning for what stays unapplied."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from harness import Run, rank_slice, reference
from models import make_batch, make_model
from test_config import HF_ZERO3
from zerocompile import ZeroConfigError, lr_schedules
from zerocompile.deepspeed_training import optimizer_from_section

CLIP = 0.05
"""Below every step's gradient norm of the runs here (checked against the reference)."""
STEPS = 5
ADAMW = {"lr": 0.01, "weight_decay": 0.1}        # harness.OPTIMIZERS["adamw"]: the reference's
HF_AUTO = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1, "warmup_min_lr": 0.0,
           "warmup_max_lr": 0.01, "warmup_num_steps": 3, "gradient_clipping": CLIP,
           "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8}
"""What HF Trainer would fill into HF's ZeRO-3 example config (its "auto" values)."""


def _batches():
    return [make_batch("mlp", step, 8) for step in range(STEPS)]


def _warmup_factor(epoch: int) -> float:
    """WarmupLR (min 0, log warm-up over 3 steps) as a LambdaLR factor of the peak LR, written
    out from DeepSpeed's formula: torch's epoch e is DeepSpeed's iteration e - 1."""
    iteration = epoch - 1
    if iteration < 0:
        return 0.0
    return min(1.0, (1.0 / math.log(3)) * math.log(iteration + 1))


def _train(model, opt, rank, world, clip=None, scheduler=None) -> list:
    losses = []
    for x, y in _batches():
        loss = model(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _result(model, losses) -> dict:
    return {"losses": losses, "state": zerocompile.full_state_dict(model)}


def _ranks(rank: int, world: int) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):      # a DeepSpeed config's gradient_clipping, nothing else in the loop
        torch._dynamo.reset()
        model = make_model("mlp")
        model.compile(backend="zero", options={"zero_optimization": {"stage": stage}, "gradient_clipping": CLIP,
                                               "inner_compiler": "eager"})
        opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
        out[f"clip{stage}"] = _result(model, _train(model, opt, rank, world))
    # the user's opt.clip_grad_norm_ in a step takes precedence (here one that does not clip)
    torch._dynamo.reset()
    model = make_model("mlp")
    model.compile(backend="zero", options={"zero_optimization": {"stage": 2}, "gradient_clipping": CLIP,
                                           "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    out["user_clip"] = _result(model, _train(model, opt, rank, world, clip=1e9))
    # zerocompile.initialize from HF's ZeRO-3 example config, its "auto" values filled
    torch._dynamo.reset()
    model = make_model("mlp")
    ds = {**copy.deepcopy(HF_ZERO3), "inner_compiler": "eager"}
    model, opt, sched = zerocompile.initialize(model, config=ds, auto_values=HF_AUTO)
    out["init_types"] = (type(opt).__name__, opt.optimizer_class, type(sched).__name__,
                         zerocompile.training_settings(ds, auto_values={k: HF_AUTO[k] for k in (
                             "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")}))
    out["init"] = _result(model, _train(model, opt, rank, world, scheduler=sched))
    out["init_lrs"] = [g["lr"] for g in opt.param_groups]
    # the same by hand: options, ZeroOptimizer, a LambdaLR with WarmupLR's formula, clip_grad_norm_
    torch._dynamo.reset()
    model = make_model("mlp")
    model.compile(backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01,
                                    betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_factor)
    out["hand"] = _result(model, _train(model, opt, rank, world, clip=CLIP, scheduler=sched))
    return out


@pytest.fixture(scope="module")
def two_ranks(once_per_run):
    return once_per_run("test_deepspeed_training.two_ranks", lambda: run_ranks(_ranks, 2)[0])


def _single_process_with_schedule() -> dict:
    """One process, whole batch: torch's AdamW, the warm-up as a LambdaLR, torch's clipping."""
    model = make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_factor)
    losses = []
    for x, y in _batches():
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _assert_close(got: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=1e-5)
    assert set(got["state"]) == set(ref["state"])
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_clipping_of_a_deepspeed_config_clips(two_ranks, stage):
    """``{"gradient_clipping": x}`` as torch.compile options: 2 ranks train as one process that
    calls ``torch.nn.utils.clip_grad_norm_(params, x)`` before every step, whose norms all
    exceeded x; and not as the run without clipping."""
    clipped = reference(Run(model="mlp", opt="adamw", steps=STEPS, clip=CLIP))
    assert min(clipped["norms"]) > 2 * CLIP, clipped["norms"]
    _assert_close(two_ranks[f"clip{stage}"], clipped)
    unclipped = reference(Run(model="mlp", opt="adamw", steps=STEPS))
    assert not torch.allclose(two_ranks[f"clip{stage}"]["state"]["l1.weight"], unclipped["state"]["l1.weight"],
                              atol=1e-4)


def test_the_users_clip_grad_norm_takes_precedence(two_ranks):
    """A step in which the loop calls ``opt.clip_grad_norm_`` (here with a bound no norm
    reaches) is clipped by that call only: the result is the unclipped run's."""
    _assert_close(two_ranks["user_clip"], reference(Run(model="mlp", opt="adamw", steps=STEPS)))


def test_initialize_from_hfs_zero3_config_trains_like_the_hand_built_optimizer(two_ranks):
    """HF's ZeRO-3 example config with its "auto" values filled: ``zerocompile.initialize``
    gives a ``ZeroOptimizer`` (AdamW) and DeepSpeed's WarmupLR, and trains bit for bit like the
    same options, optimizer, LambdaLR and ``clip_grad_norm_`` built by hand, and like one process."""
    name, cls, sched, settings = two_ranks["init_types"]
    assert (name, cls, sched) == ("ZeroOptimizer", torch.optim.AdamW, "WarmupLR")
    assert (settings.train_batch_size, settings.train_micro_batch_size_per_gpu,
            settings.gradient_accumulation_steps, settings.world_size) == (8, 4, 1, 2)
    init, hand = two_ranks["init"], two_ranks["hand"]
    assert init["losses"] == hand["losses"]
    for key, value in hand["state"].items():
        assert torch.equal(init["state"][key], value), key
    assert two_ranks["init_lrs"] == [0.01]      # the warm-up is over: warmup_max_lr
    _assert_close(init, _single_process_with_schedule())


# ------------------------------------------------------------------ LR schedules
def _lrs(schedule: str, params: dict, steps: int, optimizer=None) -> list:
    """The LR (and first beta, where the group has betas) each of ``steps`` optimizer steps uses."""
    if optimizer is None:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    sched = lr_schedules.SCHEDULES[schedule](optimizer, **params)
    seen = []
    for _ in range(steps):
        group = optimizer.param_groups[0]
        seen.append((group["lr"], group["betas"][0]) if schedule == "OneCycle" else group["lr"])
        optimizer.step()
        sched.step()
    return seen


def _log_warmup(i, w):
    return math.log(i + 1) / math.log(w)


# the LR of steps 0, 1, 2, ... (DeepSpeed's iterations -1, 0, 1, ...), from DeepSpeed's documented formulas
_SCHEDULE_CASES = {
    "WarmupLR-log": ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=4),
                     [0.001, 0.001, 0.001 + 0.009 * _log_warmup(1, 4), 0.001 + 0.009 * _log_warmup(2, 4), 0.01, 0.01,
                      0.01]),
    "WarmupLR-linear": ("WarmupLR", dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=4,
                                         warmup_type="linear"),
                        [0.001, 0.001, 0.001 + 0.009 / 4, 0.001 + 0.009 / 2, 0.001 + 0.009 * 3 / 4, 0.01, 0.01]),
    "WarmupLR-default-max": ("WarmupLR", dict(warmup_num_steps=2, warmup_type="linear"), [0.0, 0.0, 0.005, 0.01]),
    "WarmupDecayLR": ("WarmupDecayLR", dict(total_num_steps=10, warmup_max_lr=0.01, warmup_num_steps=4,
                                            warmup_type="linear"),
                      [0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01 * 5 / 6, 0.01 * 4 / 6, 0.01 * 3 / 6, 0.01 * 2 / 6,
                       0.01 / 6, 0.0, 0.0]),
    "WarmupCosineLR": ("WarmupCosineLR", dict(total_num_steps=10, warmup_min_ratio=0.1, warmup_num_steps=4,
                                              cos_min_ratio=0.01, warmup_type="linear"),
                       [0.0] + [0.01 * (0.1 + 0.9 * i / 4) for i in range(4)]
                       + [0.01 * (0.01 + 0.99 * (1 + math.cos(math.pi * k / 6)) / 2) for k in range(1, 7)]
                       + [0.01 * 0.01, 0.01 * 0.01]),
    "OneCycle": ("OneCycle", dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=4,
                                  cycle_second_step_size=2, decay_step_size=2, decay_lr_rate=0.5,
                                  cycle_min_mom=0.85, cycle_max_mom=0.95, decay_mom_rate=0.1),
                 [(0.001, 0.85)]
                 + [(0.001 + 0.009 * s, 0.95 - 0.1 * s) for s in (0.25, 0.5, 0.75, 1.0, 0.5, 0.0)]
                 + [(0.001 / (1 + 0.5 * d / 2), 0.95 * (1 + 0.1 * d / 2)) for d in (1, 2, 3)]),
    "OneCycle-stairs": ("OneCycle", dict(cycle_min_lr=0.0, cycle_max_lr=0.01, cycle_first_step_size=4,
                                         cycle_first_stair_count=2, cycle_momentum=False),
                        [(0.0, 0.9)] + [(0.01 * s, 0.9) for s in (0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0)]),
    "LRRangeTest": ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=2),
                    [0.001 * (1 + i / 2) for i in range(6)]),
    "LRRangeTest-staircase": ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=2,
                                                  lr_range_test_staircase=True),
                              [0.001 * (1 + i // 2) for i in range(6)]),
}


@pytest.mark.parametrize("case", list(_SCHEDULE_CASES))
def test_each_schedule_gives_deepspeeds_formula_values(case):
    schedule, params, expected = _SCHEDULE_CASES[case]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.01, betas=(0.9, 0.999))
    got = _lrs(schedule, params, len(expected), optimizer)
    flat = lambda v: [x for pair in v for x in (pair if isinstance(pair, tuple) else (pair,))]   # noqa: E731
    assert flat(got) == pytest.approx(flat(expected), rel=1e-12, abs=1e-15), (got, expected)
    if schedule == "OneCycle" and params.get("cycle_momentum", True):
        assert optimizer.param_groups[0]["betas"][1] == lr_schedules.ONE_CYCLE_BETA2   # DeepSpeed's 0.99


def test_one_cycle_through_initialize_moves_the_inner_optimizers_betas():
    """One process: ``initialize`` with DeepSpeed's ``Adam`` (decoupled weight decay, DeepSpeed's
    defaults) and OneCycle trains as torch's AdamW under the same schedule."""
    torch._dynamo.reset()
    ds = {"zero_optimization": {"stage": 0}, "inner_compiler": "eager",
          "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
          "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01,
                                                       "cycle_first_step_size": 2}}}
    model, opt, sched = zerocompile.initialize(make_model("mlp"), config=ds)
    ref = make_model("mlp")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    ref_sched = lr_schedules.OneCycle(ref_opt, cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=2)
    used = []
    for step in range(5):
        x, y = make_batch("mlp", step, 8)
        betas = opt.param_groups[0]["betas"]
        for m, o, s in ((model, opt, sched), (ref, ref_opt, ref_sched)):
            m(x, y).backward()
            o.step()
            s.step()
            o.zero_grad()
        assert opt.inner.param_groups[0]["betas"] == betas       # what the step used
        assert opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]
        used.append(betas[0])
    assert len(set(used)) > 2, used       # the momentum did cycle
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("section, cls, expected", [
    ({"type": "AdamW", "params": {"lr": 0.1}}, torch.optim.AdamW,
     {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
    ({"type": "adam", "params": {"adam_w_mode": False, "betas": [0.8, 0.9]}}, torch.optim.Adam,
     {"lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-8, "weight_decay": 0.0}),
    ({"type": "Adam", "params": {"torch_adam": True}}, torch.optim.AdamW,     # torch's own default decay
     {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, torch.optim.SGD,
     {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
])
def test_optimizer_sections_build_what_deepspeed_builds(section, cls, expected):
    assert optimizer_from_section(section) == (cls, expected)


_BASE = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}


@pytest.mark.parametrize("change, pattern", [
    ({"optimizer": {"type": "Lamb", "params": {}}}, r"optimizer type 'Lamb' is DeepSpeed's own kernel"),
    ({"optimizer": {"type": "AdamWW", "params": {}}},
     r"optimizer type 'AdamWW' is not supported \(did you mean 'AdamW'\?\)"),
    ({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}},
     r"DeepSpeed key 'optimizer.params.momentum' is not supported; allowed: lr, betas"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.9]}}},
     r"DeepSpeed key 'optimizer.params.betas' is not supported"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, r"use the top-level key 'gradient_clipping'"),
    ({"scheduler": {"type": "WarmupLinearLR", "params": {}}},
     r"scheduler type 'WarmupLinearLR' is not supported \(did you mean 'Warmup\w*LR'\?\); supported: WarmupLR, "),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}},
     r"DeepSpeed key 'scheduler.params.warmup_steps' is not supported; did you mean 'warmup_num_steps'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, r"warmup_type = 'cosine' is invalid"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, r"total_num_steps"),
    ({"optimizer": None, "scheduler": {"type": "WarmupLR", "params": {}}}, r"'scheduler' needs an 'optimizer' section"),
    ({"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     r"train_batch_size must equal .* = 4 x 2 x 1 = 8, not 12"),
    ({"train_batch_size": 0}, r"DeepSpeed key 'train_batch_size' = 0 is invalid"),
    ({"gradient_clipping": "auto"}, r"DeepSpeed key gradient_clipping is 'auto' .* auto_values=\{'gradient_clipping'"),
    ({"gradient_clipping": -1.0}, r"DeepSpeed key 'gradient_clipping' = -1.0 is invalid"),
])
def test_bad_sections_are_refused_by_name(change, pattern):
    ds = {**copy.deepcopy(_BASE), **change}
    ds = {k: v for k, v in ds.items() if v is not None}
    with pytest.raises(ZeroConfigError, match=pattern):
        zerocompile.initialize(torch.nn.Linear(2, 2), config=ds)


def test_auto_values_fill_only_auto_keys_and_must_all_be_given():
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    with pytest.raises(ZeroConfigError, match=r"optimizer.params.lr, optimizer.params.weight_decay are 'auto'.*"
                                              r"auto_values=\{'lr': \.\.\., 'weight_decay': \.\.\.\}"):
        zerocompile.initialize(torch.nn.Linear(2, 2), config=ds)
    with pytest.raises(ZeroConfigError, match=r"auto_values 'warmup_num_step' fill no 'auto' value"):
        zerocompile.initialize(torch.nn.Linear(2, 2), config=ds,
                               auto_values={"lr": 0.1, "weight_decay": 0.0, "warmup_num_step": 3})
    # "auto" batch sizes without values count as not given: nothing to check
    assert zerocompile.training_settings({"train_batch_size": "auto", "gradient_accumulation_steps": 4},
                                         world_size=2).gradient_accumulation_steps == 4
    assert zerocompile.training_settings({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4},
                                         world_size=2).gradient_accumulation_steps == 4


def test_unapplied_keys_warn_once_in_a_script_without_logging_configuration(tmp_path):
    """A plain script (no logging set up) sees each unapplied key once on stderr, however many
    frames the backend compiles, initialize's batch warning once, and once that its own
    clip_grad_norm_ bound overrides the gradient_clipping option's."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch, zerocompile
        ds = {"zero_optimization": {"stage": 0}, "inner_compiler": "eager", "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
        for _ in range(2):          # two models: two frames, the options translated twice
            model = torch.compile(torch.nn.Linear(3, 3), backend="zero", options=ds)
            model(torch.randn(2, 3)).sum().backward()
        for _ in range(2):
            model, opt, sched = zerocompile.initialize(torch.nn.Linear(3, 3), config=ds)
        model = torch.compile(torch.nn.Linear(3, 3), backend="zero",
                              options={"stage": 0, "inner_compiler": "eager", "gradient_clipping": 0.5})
        opt = zerocompile.ZeroOptimizer(model.parameters(), lr=0.1)
        for _ in range(2):          # the user's own bound differs from the option's
            model(torch.randn(2, 3)).sum().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        print("done")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    err = proc.stderr
    assert err.count("DeepSpeed key 'optimizer' is not applied by the 'zero' backend") == 1, err
    assert err.count("DeepSpeed key 'gradient_accumulation_steps' is not applied") == 1, err
    assert err.count("DeepSpeed key 'train_micro_batch_size_per_gpu' is not applied") == 1, err
    assert err.count("zerocompile.initialize does not apply DeepSpeed's batch settings") == 1, err
    assert "feed 2 samples per rank" in err and "after every 2 backward passes" in err, err
    assert err.count("clip_grad_norm_(1) in a step of a model compiled with gradient_clipping=0.5") == 1, err
