"""float16 training: torch.amp.GradScaler, FSDP's ShardedGradScaler and the ``loss_scale``
option with ZeroOptimizer at every stage.

The overflow tests make ONE rank's gradient overflow in ONE element, which the reduction
carries to the other rank's shard (stages 1-3): without an all-reduced overflow flag that
rank would step and the other would not. Every run is compared with a single process on the
whole batch that uses torch's own GradScaler (or skips the same steps), on fp32 compute
exactly, on float16 compute (``param_dtype="float16"``, which CPUs run) within float16
tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import zerocompile
from dist_utils import run_ranks
from harness import Run, assert_matches, reference, zero_train_many
from models import MLP, make_batch
from zerocompile.config import ZeroConfig, ZeroConfigError
from zerocompile.loss_scale import LossScaleError, LossScaler, LossScaleSettings

# torch says it will stop passing itself to optimizers' step, in scaler.step(opt) itself, before
# ZeroOptimizer runs; zerocompile installs no warnings filter (see docs/api.md, loss scaling)
pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")

STEPS = 5
OVERFLOW_STEPS = (1, 2)
INIT_SCALE = 1024.0
# the loss_scale option's scale after each step: DeepSpeed's rules with hysteresis 2, window 1
# (the overflow at step 1 uses up the hysteresis, the one at 2 halves the scale; it doubles at
# step 4, the second clean step after)
LOSS_SCALE_OPTION = {"initial_scale": INIT_SCALE, "window": 1}
EXPECTED_OPTION_SCALES = [1024.0, 1024.0, 512.0, 512.0, 1024.0]


class PoisonMLP(MLP):
    """An MLP whose loss has a term ``sum(l2.bias * poison)``: zero when ``poison`` is zero; a
    huge ``poison[0]`` gives l2.bias[0] (on rank 0's shard) a gradient that overflows once
    scaled, on the rank that feeds it."""

    def forward(self, x, y, poison):
        return super().forward(x, y) + (self.l2.bias * poison).sum()


def _model():
    torch.manual_seed(0)
    return PoisonMLP()


def _make_scaler(kind):
    if kind == "grad_scaler":
        return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    if kind == "sharded_grad_scaler":
        return ShardedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    return None


def _snapshot(opt):
    return {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in opt.state.items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) if isinstance(a[k][n], torch.Tensor)
                                           else a[k][n] == b[k][n] for n in a[k]) for k in a)


def _overflow_worker(rank, world, runs):
    return [_overflow_run(rank, world, *run) for run in runs]


def _overflow_run(rank, world, stage, kind, param_dtype):
    """One rank of a 2-rank run; rank 1 poisons its loss at OVERFLOW_STEPS."""
    torch._dynamo.reset()
    options = {"stage": stage, "inner_compiler": "eager"}
    if param_dtype:
        options["param_dtype"] = param_dtype
    if kind == "loss_scale":
        options["loss_scale"] = LOSS_SCALE_OPTION
    model = torch.compile(_model(), backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01,
                                    weight_decay=0.1)
    scaler = _make_scaler(kind)
    per = 8 // world
    poison_value = 6e4 if param_dtype == "float16" else 1e38   # finite, overflows once scaled
    out = {"losses": [], "norms": [], "scales": [], "skipped": [], "unchanged": []}
    for step in range(STEPS):
        x, y = make_batch("mlp", step, 8)
        poison = torch.zeros(5)
        if rank == 1 and step in OVERFLOW_STEPS:
            poison[0] = poison_value
        before = (zerocompile.full_state_dict(model, rank0_only=False), _snapshot(opt))
        loss = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per], poison)
        skipped = opt.skipped_steps
        if scaler is not None:
            scaler.scale(loss).backward()
            if kind == "grad_scaler":   # ShardedGradScaler: step() unscales by itself
                out["norms"].append(opt.clip_grad_norm_(1.0, grad_scaler=scaler).item())
            scaler.step(opt)
            scaler.update()
            out["scales"].append(scaler.get_scale())
        else:
            loss.backward()
            out["norms"].append(opt.clip_grad_norm_(1.0).item())
            opt.step()
            out["scales"].append(opt.loss_scale)
        opt.zero_grad()
        out["skipped"].append(opt.skipped_steps - skipped)
        after = (zerocompile.full_state_dict(model, rank0_only=False), _snapshot(opt))
        out["unchanged"].append(all(torch.equal(before[0][k], after[0][k]) for k in before[0])
                                and _same_state(before[1], after[1]))
        total = loss.detach().float().clone()
        torch.distributed.all_reduce(total)
        out["losses"].append(total.item() / world)
    out["state"] = zerocompile.full_state_dict(model, rank0_only=False)
    out["adam_steps"] = sorted({int(s["step"]) for s in opt.state.values()})
    return out


def _overflow_reference(kind):
    """One process, whole batch, plain torch: torch's GradScaler (skips and backs off on its
    own), or for the loss_scale option the same steps skipped by hand."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2)
    losses, norms, scales = [], [], []
    for step in range(STEPS):
        x, y = make_batch("mlp", step, 8)
        loss = model(x, y, torch.zeros(5))
        losses.append(loss.item())
        if kind == "loss_scale":
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            if step not in OVERFLOW_STEPS:
                opt.step()
        else:
            scaler.scale(loss * (math.inf if step in OVERFLOW_STEPS else 1.0)).backward()
            if kind == "grad_scaler":
                scaler.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "scales": scales or EXPECTED_OPTION_SCALES,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _check_overflow_runs(runs, results, atol):
    clean = [s for s in range(STEPS) if s not in OVERFLOW_STEPS]
    for i, (stage, kind, _) in enumerate(runs):
        ref = _overflow_reference(kind)
        r0, r1 = results[0][i], results[1][i]
        what = f"stage {stage} {kind}"
        expected_skips = [int(s in OVERFLOW_STEPS) for s in range(STEPS)]
        for r in (r0, r1):
            assert r["skipped"] == expected_skips, what
            # a skipped step leaves parameters and optimizer state (Adam's step count included) bitwise
            assert all(r["unchanged"][s] for s in OVERFLOW_STEPS), what
            assert not any(r["unchanged"][s] for s in clean), what
            assert r["scales"] == ref["scales"], what
            assert r["adam_steps"] == [STEPS - len(OVERFLOW_STEPS)], what
        for key, value in ref["state"].items():
            assert torch.equal(r0["state"][key], r1["state"][key]), (what, key)
            torch.testing.assert_close(r0["state"][key], value, atol=atol, rtol=atol, msg=lambda m: f"{what} {key}: {m}")
        torch.testing.assert_close(torch.tensor([r0["losses"][s] for s in clean]),
                                   torch.tensor([ref["losses"][s] for s in clean]), atol=atol, rtol=atol)
        if kind != "sharded_grad_scaler":
            torch.testing.assert_close(torch.tensor([r0["norms"][s] for s in clean]),
                                       torch.tensor([ref["norms"][s] for s in clean]), atol=atol, rtol=atol)
            assert all(not math.isfinite(r0["norms"][s]) for s in OVERFLOW_STEPS), what


KINDS = ("grad_scaler", "sharded_grad_scaler", "loss_scale")


def test_overflow_on_one_rank_skips_the_step_everywhere_fp32():
    """fp32 compute: scaling by powers of two is exact, so the run equals the reference to
    fp32 tolerance; the scale moves identically on both ranks. Every kind at every stage, in
    one group of ranks (each run names its stage and kind when it fails)."""
    runs = [(stage, kind, None) for kind in KINDS for stage in (0, 1, 2, 3)]
    _check_overflow_runs(runs, run_ranks(_overflow_worker, 2, runs), atol=1e-5)


def test_overflow_on_one_rank_skips_the_step_everywhere_fp16():
    """float16 compute (param_dtype): the same skips and scales; values within float16
    tolerance of the fp32 reference. The option at every stage, the GradScalers two each."""
    runs = [(stage, "loss_scale", "float16") for stage in (0, 1, 2, 3)]
    runs += [(stage, KINDS[stage % 2], "float16") for stage in (0, 1, 2, 3)]
    _check_overflow_runs(runs, run_ranks(_overflow_worker, 2, runs), atol=1e-2)


def test_loss_scale_option_needs_no_change_to_the_loop():
    """``loss.backward(); opt.clip_grad_norm_(...); opt.step()`` with the option on, with
    gradient accumulation: across a graph break (a tied weight in two frames) and with an
    eager head that shares a parameter (its gradient is unscaled, the frames' are scaled),
    each kind of gradient holder (the parameter itself at stages 0/1, shards at 2/3) equals
    the plain single-process run."""
    option = (("loss_scale", "dynamic"),)
    runs = [Run(model="tied", stage=0, opt="adamw", steps=2, accum=2, clip=0.5, options=option),
            Run(model="tied", stage=2, opt="adamw", steps=2, accum=2, clip=0.5, options=option),
            Run(model="eager_head", stage=1, opt="adamw", steps=2, accum=2, clip=0.5, options=option),
            Run(model="eager_head", stage=3, opt="adamw", steps=2, accum=2, clip=0.5, options=option)]
    results = run_ranks(zero_train_many, 2, runs)[0]
    for run, res in zip(runs, results):
        assert_matches(res, reference(run))


class _FloatEagerHead(torch.nn.Linear):
    @torch.compiler.disable
    def forward(self, x):
        return F.linear(x.float(), self.weight)


class EagerHeadFP16(torch.nn.Module):
    """Embedding and body compiled (in float16), an eager float32 head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(37, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = _FloatEagerHead(16, 37, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        h = torch.tanh(self.body(self.wte(idx)))
        return F.cross_entropy(self.head(h).reshape(-1, 37), targets.reshape(-1))


def _eager_fp16_worker(rank, world, stages):
    out = []
    for stage in stages:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.compile(EagerHeadFP16(), backend="zero", options={
            "stage": stage, "inner_compiler": "eager", "param_dtype": "float16",
            "loss_scale": {"initial_scale": 2.0**10}})
        opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
        for step in range(3):
            x, y = make_batch("tied", step, 8)
            model(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]).backward()
            opt.step()
            opt.zero_grad()
        out.append(zerocompile.full_state_dict(model, rank0_only=False))
    return out


def test_loss_scale_float16_gradients_beside_eager_ones():
    """Stage 1 with float16 compute keeps the frames' gradient, scaled, in a float16 replica
    and the eager head's, unscaled, on the parameter; stage 3 in the shard and the parameter.
    Both reach the fp32 reference within float16 tolerance."""
    torch.manual_seed(0)
    ref = EagerHeadFP16()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(3):
        ref(*make_batch("tied", step, 8)).backward()
        opt.step()
        opt.zero_grad()
    for rank, results in enumerate(run_ranks(_eager_fp16_worker, 2, (1, 3))):
        for stage, result in zip((1, 3), results):
            for key, value in ref.state_dict().items():
                assert (result[key] - value).abs().max().item() < 1e-2, (rank, stage, key)


# ----------------------------------------------------------------------------- float16 underflow
class TinyLossMLP(MLP):
    """Its loss is multiplied by 2**-20: the float16 backward underflows without scaling."""

    def forward(self, x, y):
        return super().forward(x, y) * 2.0**-20


def _underflow_worker(rank, world, runs):
    return [_underflow_run(rank, world, *run) for run in runs]


def _underflow_run(rank, world, stage, loss_scale):
    torch._dynamo.reset()
    torch.manual_seed(0)
    options = {"stage": stage, "inner_compiler": "eager", "param_dtype": "float16"}
    if loss_scale is not None:
        options["loss_scale"] = loss_scale
    model = torch.compile(TinyLossMLP(), backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=2.0**20 * 0.05)
    per = 8 // world
    for step in range(3):
        x, y = make_batch("mlp", step, 8)
        model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    return zerocompile.full_state_dict(model, rank0_only=False)


def _underflow_reference():
    torch.manual_seed(0)
    model = TinyLossMLP()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=2.0**20 * 0.05)
    for step in range(3):
        model(*make_batch("mlp", step, 8)).backward()
        opt.step()
        opt.zero_grad()
    return start, model.state_dict()


def _update_error(result, start, ref):
    """Largest error of the update (final - start) relative to the reference update's size."""
    return max(((result[k] - start[k]) - (ref[k] - start[k])).abs().max().item()
               / (ref[k] - start[k]).abs().max().item() for k in ref)


def test_loss_scale_keeps_float16_gradients_from_underflowing():
    """Gradients around 1e-7 are float16 subnormals or zero: unscaled, the SGD update is far
    off; scaled inside the backward (2**14), it is within float16 rounding of the fp32 one."""
    start, ref = _underflow_reference()
    runs = [(stage, scale) for stage in (0, 3) for scale in ({"initial_scale": 2.0**14}, None)]
    for rank, results in enumerate(run_ranks(_underflow_worker, 2, runs)):
        for (stage, scale), result in zip(runs, results):
            error = _update_error(result, start, ref)
            assert error < 5e-3 if scale else error > 0.2, (rank, stage, scale, error)


# ----------------------------------------------------------------------------- one process
def _one_process(stage, options=None, model_cls=PoisonMLP, dtype=None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = model_cls()
    if dtype is not None:
        model = model.to(dtype)
    compiled = torch.compile(model, backend="zero",
                             options={"stage": stage, "inner_compiler": "eager", **(options or {})})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    return compiled, opt


def _batch(step=0, dtype=torch.float32):
    x, y = make_batch("mlp", step, 8)
    return x.to(dtype), y.to(dtype), torch.zeros(5, dtype=dtype)


def test_explicit_unscale_where_the_gradient_is_whole_then_clip():
    """One rank, stage 0: p.grad is the whole gradient, so scaler.unscale_(opt) works as in
    torch; ZeroOptimizer then does not unscale again."""
    model, opt = _one_process(0)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=INIT_SCALE) for _ in range(2))
    for step in range(3):
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            s.scale(m(*_batch(step))).backward()
            s.unscale_(o)
            norm = (o.clip_grad_norm_(0.5) if o is opt else torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            s.step(o)
            s.update()
            o.zero_grad()
            if o is opt:
                zero_norm = norm
        torch.testing.assert_close(zero_norm, norm)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(zerocompile.full_state_dict(model)[key], value)


def test_explicit_unscale_of_sharded_gradients_then_torch_clipping_equals_clip_with_the_scaler():
    """``scaler.unscale_(opt)`` then ``torch.nn.utils.clip_grad_norm_`` (the AMP recipe) reaches
    the shard gradients through p.grad: the same as ``opt.clip_grad_norm_(..., grad_scaler=)``."""
    states = []
    for torch_way in (True, False):
        model, opt = _one_process(3)
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        for step in range(2):
            scaler.scale(model(*_batch(step))).backward()
            if torch_way:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            else:
                opt.clip_grad_norm_(0.5, grad_scaler=scaler)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert opt.skipped_steps == 0 and scaler.get_scale() == INIT_SCALE
        states.append(zerocompile.full_state_dict(model))
    for key, value in states[1].items():
        torch.testing.assert_close(states[0][key], value, msg=key)


def test_clipping_scaled_gradients_without_the_scaler_is_refused():
    model, opt = _one_process(3)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scaler.scale(model(*_batch())).backward()
    opt.clip_grad_norm_(0.5)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm, grad_scaler=scaler\)"):
        scaler.step(opt)


def test_grad_scaler_and_loss_scale_option_together_are_refused():
    model, opt = _one_process(2, {"loss_scale": "dynamic"})
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(*_batch())).backward()
    with pytest.raises(RuntimeError, match="use one of them"):
        scaler.step(opt)


@pytest.mark.parametrize("options", [{}, {"loss_scale": "dynamic"}])
def test_float16_parameters_are_refused_with_the_fix(options):
    """A float16 model has float16 master values; like torch's GradScaler ('Attempting to
    unscale FP16 gradients'), loss scaling refuses it and names param_dtype instead."""
    model, opt = _one_process(1, options, dtype=torch.float16)
    loss = model(*_batch(dtype=torch.float16))
    if options:
        loss.backward()
        with pytest.raises(ValueError, match="param_dtype='float16'"):
            opt.step()
    else:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(loss).backward()
        with pytest.raises(ValueError, match="param_dtype='float16'"):
            scaler.step(opt)


def test_loss_scale_state_round_trips_through_the_state_dict():
    model, opt = _one_process(3, {"loss_scale": {"initial_scale": 8.0, "hysteresis": 1}})
    loss = model(*_batch())
    (loss * math.inf).backward()
    opt.step()
    assert opt.loss_scale == 4.0 and opt.skipped_steps == 1
    saved = opt.state_dict()
    model2, opt2 = _one_process(3, {"loss_scale": {"initial_scale": 8.0, "hysteresis": 1}})
    opt2.load_state_dict(saved)
    model2(*_batch()).backward()
    opt2.step()
    assert opt2.loss_scale == 4.0 and opt2.skipped_steps == 0


def test_loss_scale_state_is_saved_in_checkpoints(tmp_path):
    options = {"loss_scale": {"initial_scale": 8.0, "hysteresis": 1}}
    model, opt = _one_process(3, options)
    (model(*_batch()) * math.inf).backward()
    opt.step()                                   # skipped: the scale halves
    opt.zero_grad()
    model(*_batch(1)).backward()
    opt.step()
    opt.zero_grad()
    assert opt.loss_scale == 4.0 and opt.loss_scaler_state()["iteration"] == 2
    zerocompile.save_checkpoint(tmp_path / "ckpt", model, opt)
    model2, opt2 = _one_process(3, options)
    assert opt2.loss_scale is None and opt2.loss_scaler_state() is None    # no frame has compiled yet
    zerocompile.load_checkpoint(tmp_path / "ckpt", model2, opt2)
    assert opt2.loss_scaler_state() == opt.loss_scaler_state()
    model2(*_batch(2)).backward()
    opt2.step()
    assert opt2.loss_scale == 4.0 and opt2.loss_scaler_state()["iteration"] == 3


def test_loss_scale_option_scales_gradients_kept_in_shards():
    """White box: after backward, the stage-3 shard gradient holds S times the true gradient,
    and after the step's reduction the true one."""
    model, opt = _one_process(3, {"loss_scale": {"initial_scale": 64.0}})
    ref = _model()
    x, y, poison = _batch()
    model(x, y, poison).backward()
    ref(x, y, poison).backward()
    from zerocompile.runtime.sharded_param import get_state

    for p, (name, q) in zip(model.parameters(), ref.named_parameters()):
        shard = get_state(p).shard.grad
        torch.testing.assert_close(shard[: q.numel()], 64.0 * q.grad.reshape(-1), msg=name)
    opt.clip_grad_norm_(1e9)     # reduces (and unscales) without changing anything
    for p, (name, q) in zip(model.parameters(), ref.named_parameters()):
        torch.testing.assert_close(get_state(p).shard.grad[: q.numel()], q.grad.reshape(-1), msg=name)


# ----------------------------------------------------------------------------- scaler rules, config
def _scales(settings, overflows):
    scaler = LossScaler(settings)
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


def test_dynamic_rules_are_deepspeeds():
    defaults = LossScaleSettings()
    assert (defaults.initial_scale, defaults.window, defaults.hysteresis, defaults.min_scale) == (2.0**16, 1000, 2, 1.0)
    s = LossScaleSettings(initial_scale=16.0, window=3, hysteresis=2)
    #               ovf   ovf   ok    ok    ok    ok    ovf   ok    ovf   ovf
    assert _scales(s, [1, 1, 0, 0, 0, 0, 1, 0, 1, 1]) == [16, 8, 8, 8, 8, 16, 16, 16, 8, 4]
    # consecutive hysteresis: refilled after every clean step, so isolated overflows never halve
    c = LossScaleSettings(initial_scale=16.0, window=100, hysteresis=2, consecutive_hysteresis=True)
    assert _scales(c, [1, 0, 1, 0, 1, 1]) == [16, 16, 16, 16, 16, 8]
    # first growth: after `window` clean steps, on the next clean one
    assert _scales(LossScaleSettings(initial_scale=1.0, window=2), [0, 0, 0]) == [1, 1, 2]
    static = LossScaleSettings(dynamic=False, initial_scale=128.0)
    assert _scales(static, [1, 1, 1, 0]) == [128.0] * 4


def test_overflow_at_the_minimum_scale_raises():
    scaler = LossScaler(LossScaleSettings(initial_scale=2.0, hysteresis=1, min_scale=1.0))
    scaler.update(True)
    assert scaler.scale == 1.0
    with pytest.raises(LossScaleError, match="minimum loss scale"):
        scaler.update(True)


def test_loss_scale_option_parsing():
    assert ZeroConfig().step.loss_scale is None
    assert ZeroConfig.from_options({"loss_scale": "dynamic"}).step.loss_scale == LossScaleSettings()
    assert ZeroConfig.from_options({"loss_scale": 128}).step.loss_scale == LossScaleSettings(dynamic=False, initial_scale=128.0)
    assert ZeroConfig.from_options({"loss_scale": {"window": 10}}).step.loss_scale.window == 10
    for bad, pattern in [(0, "is invalid"), ("static", "is invalid"), ({"windw": 1}, "unknown key 'windw'"),
                         ({"hysteresis": 0}, "loss_scale.hysteresis"), (True, "is invalid")]:
        with pytest.raises(ZeroConfigError, match=pattern):
            ZeroConfig.from_options({"loss_scale": bad})


def test_deepspeed_fp16_section_is_translated():
    cfg = ZeroConfig.from_options({"fp16": {"enabled": True}})
    assert cfg.sharding.param_dtype is torch.float16 and cfg.step.loss_scale == LossScaleSettings()
    cfg = ZeroConfig.from_options({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                                            "loss_scale_window": 500, "hysteresis": 4, "min_loss_scale": 2,
                                            "consecutive_hysteresis": True}})
    assert cfg.step.loss_scale == LossScaleSettings(initial_scale=4096.0, window=500, hysteresis=4, min_scale=2,
                                               consecutive_hysteresis=True)
    assert ZeroConfig.from_options({"fp16": {"enabled": True, "loss_scale": 512}}).step.loss_scale == LossScaleSettings(
        dynamic=False, initial_scale=512.0)
    assert ZeroConfig.from_options({"fp16": {"enabled": False, "loss_scale": 512}}).step.loss_scale is None
    with pytest.raises(ZeroConfigError, match="applies to dynamic loss scaling"):
        ZeroConfig.from_options({"fp16": {"enabled": True, "loss_scale": 512, "hysteresis": 2}})
    with pytest.raises(ZeroConfigError, match="fp16.auto_cast"):
        ZeroConfig.from_options({"fp16": {"enabled": True, "auto_cast": True}})


def test_frames_sharing_a_parameter_must_scale_alike():
    torch._dynamo.reset()
    layer = torch.nn.Linear(3, 3)

    def f(x):
        return layer(x).sum()

    torch.compile(f, backend="zero", options={"stage": 0, "inner_compiler": "eager", "loss_scale": "dynamic"})(
        torch.randn(2, 3))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="different loss_scale options"):
        torch.compile(f, backend="zero", options={"stage": 0, "inner_compiler": "eager"})(torch.randn(2, 3))


class _HFStyleNorm(torch.nn.Module):
    """An RMSNorm written as Hugging Face writes it: compute in float32, cast back to the
    input's dtype as read at run time (float32 when Dynamo traces with float32 parameters)."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dtype)


class _NormLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.norm = _HFStyleNorm(16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, ids):
        logits = self.head(self.norm(self.emb(ids)))
        return F.cross_entropy(logits.float().reshape(-1, 32), ids.reshape(-1))


@pytest.mark.parametrize("stage", [0, 3])
def test_dtype_reading_model_code_runs_under_param_dtype(stage):
    """With ``param_dtype`` the graph's parameters become bf16 after Dynamo traced float32 ones,
    so the norm's cast back to its input dtype is missing and the head's ``linear`` meets a
    float32 input: ``align_compute_dtypes`` casts that input, and the step matches the same
    model cast to bf16 (where the norm's cast is there) within bf16 rounding. Disabled, the same
    model fails with torch's mixed-dtype error."""
    torch.manual_seed(0)
    model = _NormLM()
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    want = _NormLM()
    want.load_state_dict(model.state_dict())
    want = want.to(torch.bfloat16)
    want_loss = want(ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager",
                                                             "param_dtype": "bfloat16"})
    loss = compiled(ids)
    loss.backward()
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-2)
    report = zerocompile.frame_reports()[-1]["results"]["align_compute_dtypes"]
    assert report["casts"] >= 1 and "skipped" not in report, report
    torch._dynamo.reset()
    plain = torch.compile(_NormLM(), backend="zero", options={
        "stage": stage, "inner_compiler": "eager", "param_dtype": "bfloat16", "disabled_passes": ["align_compute_dtypes"]})
    with pytest.raises(Exception, match="same dtype|dtype"):
        plain(ids).backward()
