"""ZeroOptimizer API (state dict round trip, param groups, LR schedulers, add_param_group,
zero_grad), full_state_dict / gathered_parameters, inference, eager access, dynamic batch."""

from __future__ import annotations

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from harness import rank_slice, train_on_rank_slices
from models import make_batch, make_model


def _train(model, opt, steps, rank, world, start=0, name="gpt", batch=8, scheduler=None):
    batches = (make_batch(name, step, batch) for step in range(start, start + steps))
    return train_on_rank_slices(model, opt, batches, rank, world, scheduler.step if scheduler else None)


def _reference(steps, name="gpt", batch=8, groups=None, scheduler=None):
    model = make_model(name)
    opt = torch.optim.AdamW(groups(model) if groups else model.parameters(), lr=1e-2)
    sched = scheduler(opt) if scheduler else None
    losses = _train(model, opt, steps, 0, 1, name=name, batch=batch, scheduler=sched)
    return model, losses


# ----------------------------------------------------------------------------- resume
def _resume_worker(rank, world, stage, tmpdir):
    opts = {"stage": stage, "inner_compiler": "eager"}
    model = torch.compile(make_model("gpt"), backend="zero", options=opts)
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    first = _train(model, opt, 2, rank, world)
    torch.save(opt.state_dict(), f"{tmpdir}/opt{rank}.pt")
    full = zerocompile.full_state_dict(model, rank0_only=False)
    torch._dynamo.reset()
    # a fresh process would do exactly this: load full weights, compile, load shard state
    fresh = make_model("gpt", seed=123)
    fresh.load_state_dict(full)
    fresh = torch.compile(fresh, backend="zero", options=opts)
    opt2 = zerocompile.ZeroOptimizer(fresh.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    opt2.load_state_dict(torch.load(f"{tmpdir}/opt{rank}.pt", weights_only=False))  # before binding
    second = _train(fresh, opt2, 2, rank, world, start=2)
    errors = []
    bad = opt2.state_dict()
    bad["zerocompile"]["rank"] = 1 - rank
    try:
        opt2.load_state_dict(bad)
    except ValueError as err:
        errors.append(str(err))
    try:
        opt2.load_state_dict({"state": {}, "param_groups": []})
    except ValueError as err:
        errors.append(str(err))
    return first + second, zerocompile.full_state_dict(fresh), errors


def _each_stage(rank, world, worker, stages, *args):
    """``worker`` at each stage in turn, in one spawned group of ranks."""
    out = {}
    for stage in stages:
        torch._dynamo.reset()
        out[stage] = worker(rank, world, stage, *args)
    return out


def test_optimizer_state_dict_round_trip_resumes_exactly(tmp_path):
    """Stages 1 and 3, in one group of ranks (each stage saves its own files)."""
    ref_model, ref_losses = _reference(4)
    for stage, dirname in ((1, "s1"), (3, "s3")):
        (tmp_path / dirname).mkdir()
    results = run_ranks(_each_stage, 2, _resume_worker_in, (1, 3), str(tmp_path))[0]
    for stage in (1, 3):
        losses, state, errors = results[stage]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"stage {stage}: {m}")
        for key, value in ref_model.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m: f"stage {stage} {key}: {m}")
        assert "saved by rank" in errors[0] and "load each rank's own file" in errors[0], stage
        assert "param groups (sizes [])" in errors[1], stage


def _resume_worker_in(rank, world, stage, tmpdir):
    return _resume_worker(rank, world, stage, f"{tmpdir}/s{stage}")


# ----------------------------------------------------------------------------- groups
def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": 5e-3}]


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _groups_worker(rank, world, stage):
    model = torch.compile(make_model("gpt"), backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(_groups(model._orig_mod), optimizer_class=torch.optim.AdamW, lr=1e-2)
    sched = _schedule(opt)
    losses = _train(model, opt, 4, rank, world, scheduler=sched)
    lrs = [g["lr"] for g in opt.inner.param_groups] + [g["lr"] for g in opt.param_groups]
    return losses, zerocompile.full_state_dict(model), lrs


def test_param_groups_and_lr_scheduler():
    """Stages 0, 2 and 3, in one group of ranks."""
    ref_model, ref_losses = _reference(4, groups=_groups, scheduler=_schedule)
    results = run_ranks(_each_stage, 2, _groups_worker, (0, 2, 3))[0]
    for stage in (0, 2, 3):
        losses, state, lrs = results[stage]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"stage {stage}: {m}")
        for key, value in ref_model.state_dict().items():
            torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m: f"stage {stage} {key}: {m}")
        # the inner optimizer ran its last step with the scheduler's lr for that step (1/4); the
        # user-visible groups already hold the next one (1/5)
        assert lrs == pytest.approx([1e-2 / 4, 5e-3 / 4, 1e-2 / 5, 5e-3 / 5]), stage


def _add_group_worker(rank, world):
    model = torch.compile(make_model("mlp"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    inner = model._orig_mod
    opt = zerocompile.ZeroOptimizer(inner.l1.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                                    momentum=0.9)
    losses = _train(model, opt, 2, rank, world, name="mlp")
    opt.add_param_group({"params": list(inner.l2.parameters()), "lr": 0.05})
    losses += _train(model, opt, 2, rank, world, start=2, name="mlp")
    # zero_grad(set_to_none=False) keeps zeroed gradient tensors on the shards
    x, y = make_batch("mlp", 9, 8)
    model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
    opt.zero_grad(set_to_none=False)
    shard_grads = [zerocompile.runtime.sharded_param.get_state(p).shard.grad for p in inner.parameters()]
    zeroed = all(g is not None and not g.any() for g in shard_grads)
    # opt.state is keyed by the user's parameters and holds this rank's shard state
    momentum = opt.state[inner.l1.weight]["momentum_buffer"]
    zeroed = zeroed and momentum.shape == zerocompile.runtime.sharded_param.get_state(inner.l1.weight).shard.shape
    return losses, zerocompile.full_state_dict(model), zeroed


def test_add_param_group_and_zero_grad_keep_tensors():
    model = make_model("mlp")
    opt = torch.optim.SGD(model.l1.parameters(), lr=0.1, momentum=0.9)
    losses = _train(model, opt, 2, 0, 1, name="mlp")
    opt.add_param_group({"params": list(model.l2.parameters()), "lr": 0.05})
    losses += _train(model, opt, 2, 0, 1, start=2, name="mlp")
    got_losses, state, zeroed = run_ranks(_add_group_worker, 2)[0]
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), atol=1e-6, rtol=1e-6)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=1e-6)
    assert zeroed


# ----------------------------------------------------------------------------- inference / eager
def _inference_worker(rank, world, stage):
    eager_model = make_model("gpt")
    model = torch.compile(eager_model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    _train(model, opt, 2, rank, world)
    x, y = make_batch("gpt", 50, 4)
    model.eval()
    with torch.no_grad():
        compiled_eval = model(x, y).item()
        eager_eval = eager_model(x, y).item()      # Dynamo never sees this: gathered on demand
    model.train()
    more = _train(model, opt, 1, rank, world, start=2)   # still trains after the eager pass
    return compiled_eval, eager_eval, more, zerocompile.full_state_dict(model)


def test_no_grad_eval_and_uncompiled_eager_forward():
    """Stages 1 and 3, in one group of ranks."""
    ref_model, ref_losses = _reference(3)
    results = run_ranks(_each_stage, 2, _inference_worker, (1, 3))[0]
    ref_model.load_state_dict(_reference(2)[0].state_dict())
    x, y = make_batch("gpt", 50, 4)
    with torch.no_grad():
        expected = ref_model.eval()(x, y).item()
    for stage in (1, 3):
        compiled_eval, eager_eval, more, state = results[stage]
        assert compiled_eval == pytest.approx(expected, abs=1e-5), stage
        assert eager_eval == pytest.approx(expected, abs=1e-5), stage
        assert more[0] == pytest.approx(ref_losses[2], abs=1e-5), stage


def _gathered_worker(rank, world):
    model = torch.compile(make_model("mlp"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    _train(model, opt, 1, rank, world, name="mlp")
    inner = model._orig_mod
    with zerocompile.gathered_parameters(model):
        seen = inner.l1.weight.detach().clone()
        with torch.no_grad():
            inner.l2.weight.fill_(0.25)
            inner.l2.bias.zero_()
    state = zerocompile.full_state_dict(model, rank0_only=False)
    x, y = make_batch("mlp", 7, 8)
    with torch.no_grad():
        out = model(x, y).item()
    return seen, state, out, inner.l1.weight.untyped_storage().nbytes()


def test_gathered_parameters_reads_full_and_scatters_writes_back():
    results = run_ranks(_gathered_worker, 2)
    seen, state, out, nbytes = results[0]
    assert torch.equal(seen, state["l1.weight"])              # full value inside the block
    assert torch.equal(state["l2.weight"], torch.full((5, 13), 0.25))
    assert torch.equal(state["l2.bias"], torch.zeros(5))
    assert nbytes == 0                                          # freed again on exit
    ref = make_model("mlp")
    ref.load_state_dict(state)
    x, y = make_batch("mlp", 7, 8)
    assert out == pytest.approx(ref(x, y).item(), abs=1e-6)
    assert results[1][2] == out                                 # every rank sees the same model


def test_full_state_dict_rank0_only_world_one_and_tied_keys():
    model = make_model("tied")
    keys = list(model.state_dict())
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    x, y = make_batch("tied", 0, 4)
    compiled(x, y).backward()
    state = zerocompile.full_state_dict(compiled)
    assert list(state) == keys and "head.weight" in state and "scale" in state
    assert state["head.weight"].data_ptr() == state["wte.weight"].data_ptr()  # still tied
    assert model.wte.weight.untyped_storage().nbytes() == 0


# ----------------------------------------------------------------------------- dynamic shapes
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_changing_batch_size_does_not_recompile_every_step(stage):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = make_model("mlp")
    ref = make_model("mlp")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, batch in enumerate([8, 6, 4, 10, 3, 7]):
        x, y = make_batch("mlp", step, batch)
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    # one static graph, one dynamic-batch graph after the first change, then no more
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("stage", [2, 3])
def test_no_full_gradient_is_kept_at_stages_2_and_3(stage):
    from zerocompile.runtime.sharded_param import get_state
    from zerocompile.runtime.zero_parameter import GradientNotGatheredError, raw_grad

    torch._dynamo.reset()
    model = make_model("tied")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    for step in range(2):  # two micro-batches: shard gradients accumulate
        x, y = make_batch("tied", step, 4)
        compiled(x, y).backward()
    for name, p in model.named_parameters():
        state = get_state(p)
        assert raw_grad(p) is None, name
        with pytest.raises(GradientNotGatheredError, match="reduce-scattered into flat shards"):
            p.grad  # noqa: B018 - reading it must not silently give None (issue 8, problem 8)
        assert state.replica is None or state.replica.grad is None, name
        assert state.shard.grad is not None and state.shard.grad.shape == state.shard.shape, name


def test_params_shared_by_models_with_different_options_are_rejected():
    torch._dynamo.reset()
    model = make_model("mlp")
    x, y = make_batch("mlp", 0, 4)
    torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})(x, y)
    other = torch.compile(model, backend="zero", options={"stage": 2, "inner_compiler": "eager"})
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"already sharded with stage 3.*compiled with stage 2"):
        other(x, y)


def _two_groups_worker(rank, world):
    sub = torch.distributed.new_group([0, 1])
    a = torch.compile(make_model("mlp"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    b = torch.compile(make_model("mlp"), backend="zero",
                      options={"stage": 3, "inner_compiler": "eager", "process_group": sub})
    x, y = make_batch("mlp", 0, 2)
    (a(x, y) + b(x, y)).backward()
    opt = zerocompile.ZeroOptimizer(list(a.parameters()) + list(b.parameters()),
                                    optimizer_class=torch.optim.SGD, lr=0.1)
    try:
        opt.step()
    except ValueError as err:
        return str(err)
    return None


def test_one_optimizer_over_two_process_groups_is_rejected():
    msg = run_ranks(_two_groups_worker, 2)[0]
    assert msg is not None and "use one ZeroOptimizer per data-parallel group" in msg


@pytest.mark.parametrize("how", ["dynamic=True", "nn.Module.compile"])
def test_other_ways_to_compile(how):
    """dynamic=True makes Dynamo restart its analysis after the backend ran (the eager-fallback
    hooks must not appear mid-trace); nn.Module.compile compiles in place, without a wrapper."""
    torch._dynamo.reset()
    model, ref = make_model("gpt"), make_model("gpt")
    options = {"stage": 3, "inner_compiler": "eager"}
    if how == "dynamic=True":
        compiled = torch.compile(model, backend="zero", dynamic=True, options=options)
    else:
        model.compile(backend="zero", options=options)
        compiled = model
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    # torch's fused AdamW: the roundings of ZeroOptimizer's default kernel (the for-loop rounds a
    # few elements an ulp apart, which AdamW's lr of 1e-2 makes ~1e-6 after 3 steps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for step, batch in enumerate([4, 6, 2]):
        x, y = make_batch("gpt", step, batch)
        for m, o in ((compiled, opt), (ref, ref_opt)):
            m(x, y).backward()
            o.step()
            o.zero_grad()
    state = zerocompile.full_state_dict(compiled)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=1e-6)


def _fingerprint_worker(rank, world):
    from zerocompile.runtime.comm import resolve_group
    from zerocompile.runtime.fingerprint import check_same_on_all_ranks, fingerprint

    group = resolve_group()
    same = [[("all_gather", "float32", 64)], [("reduce_scatter", "float32", 64)]]
    check_same_on_all_ranks(fingerprint(same), group, "frame A", same)     # equal: passes
    differs = [[("all_gather", "float32", 64), ("all_gather", "float32", 64 if rank == 0 else 128)], []]
    try:
        check_same_on_all_ranks(fingerprint(differs), group, "frame B", differs)
    except RuntimeError as err:
        return str(err)
    return None


def test_ranks_with_different_collective_sequences_fail_loudly():
    messages = run_ranks(_fingerprint_worker, 2)
    for msg in messages:   # every rank raises, none hangs, and says where the sequences part
        assert msg is not None and "different collective sequences for frame B" in msg
        assert "collective #1 differs" in msg
        assert "ranks [0] have all_gather of 64 bytes (float32) in the forward graph" in msg
        assert "ranks [1] have all_gather of 128 bytes (float32) in the forward graph" in msg


def test_parameters_no_compiled_frame_used_get_one_warning(fake_world, caplog):
    """A head applied outside the compiled body (as when Dynamo skips the forward of an
    nn.Linear compiled on its own): its parameters are kept whole on every rank, their
    gradients all-reduced; one warning names how many, their shapes and what to do, once."""

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(6, 6)

        def forward(self, x):
            return torch.relu(self.inner(x))

    body, head = Body(), torch.nn.Linear(6, 3)
    compiled = torch.compile(body, backend="zero", options={"stage": 3, "inner_compiler": "eager",
                                                            "allow_unsharded": True})
    opt = zerocompile.ZeroOptimizer([*body.parameters(), *head.parameters()], torch.optim.AdamW, lr=1e-2)
    with caplog.at_level("WARNING", logger="zerocompile"):
        for _ in range(2):
            head(compiled(torch.randn(4, 6))).sum().backward()
            opt.step()
            opt.zero_grad()
    warnings = [r.getMessage() for r in caplog.records if "used by no frame compiled" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "2 parameter(s) (21 elements; shapes [3, 6], [3];" in warnings[0]
    assert "every rank keeps them whole" in warnings[0]


def test_parameters_used_only_by_eager_code_are_sharded_at_stage_3(fake_world):
    """A submodule run inside a ``torch.compiler.disable``d function (eager code between two
    frames) is used by no compiled frame: the model's frame gives it its shard state all the same,
    and per-module hooks gather it for its eager forward and backward (runtime/eager_regions.py),
    so it is sharded between uses, its gradient reduced into its shard, and the step refuses
    nothing. (Before, it stayed whole and stage 3 raised UnshardedParametersError.)"""
    from zerocompile.runtime.sharded_param import get_state

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(6, 6)
            self.head = torch.nn.Linear(6, 3)

        @torch.compiler.disable
        def _head(self, x):
            return self.head(x)

        def forward(self, x):
            return self._head(torch.relu(self.inner(x))).sum()

    model = Model()
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for _ in range(2):
        compiled(torch.randn(4, 6)).backward()
        opt.step()
        opt.zero_grad()
    for p in model.head.parameters():
        sp = get_state(p)
        assert sp is not None and sp.stage == 3 and sp.values_freed(), "the eager head must be sharded"
    assert opt.state_dict()["state"], "the step must have run"


# ----------------------------------------------------------------------------- step hooks
def test_step_hooks_run_as_on_a_torch_optimizer_and_the_profiler_range_only_while_profiling():
    """torch's step hooks (global and the optimizer's own) run once per step, in torch's order,
    with the arguments torch passes, a pre-hook's new arguments reach the step; the profiler
    range ``Optimizer.step#ZeroOptimizer.step`` is recorded while a profiler runs (and only
    then entered); a subclass overriding ``step`` runs them once; an LR scheduler sees the step."""
    import warnings

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.profiler import profile

    def run(make_opt, model, compiled):
        calls = []
        opt = make_opt(model)
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt, a[1:], dict(k))))
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt, a[1:], dict(k))))
        handles = [register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", o is opt))),
                   register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", o is opt)))]
        try:
            compiled(torch.ones(2, 4)).sum().backward()
            opt.step()
            compiled(torch.ones(2, 4)).sum().backward()
            loss = opt.step(closure=lambda: torch.tensor(3.0))
        finally:
            for h in handles:
                h.remove()
        return calls, loss, opt

    torch.manual_seed(0)
    plain = torch.nn.Linear(4, 4)
    torch.manual_seed(0)
    zmodel = torch.nn.Linear(4, 4)
    zcompiled = torch.compile(zmodel, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    want, want_loss, _ = run(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), plain, plain)
    got, got_loss, opt = run(lambda m: zerocompile.ZeroOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2),
                             zmodel, zcompiled)
    assert [c[:2] for c in got] == [c[:2] for c in want] and len(got) == 8, (got, want)
    def passed(calls):      # the positional arguments after the optimizer, the keyword names
        return [(c[0], c[2], sorted(c[3])) for c in calls if len(c) > 2]

    assert passed(got) == passed(want) == [("pre", (), []), ("post", (), []), ("pre", (), ["closure"]),
                                           ("post", (), ["closure"])], passed(got)
    assert got_loss.item() == want_loss.item() == 3.0
    torch.testing.assert_close(zerocompile.full_state_dict(zcompiled)["weight"], plain.weight.detach())

    # a pre-hook's (args, kwargs) replace the call's: here it adds a closure
    opt.register_step_pre_hook(lambda o, a, k: (a, {**k, "closure": lambda: torch.tensor(7.0)}))
    zcompiled(torch.ones(2, 4)).sum().backward()
    assert opt.step().item() == 7.0
    with pytest.raises(RuntimeError, match="must return None or a tuple"):
        opt.register_step_pre_hook(lambda o, a, k: "not a tuple")
        opt.step()

    # the range: under a profiler once per step, and not entered (no record_function) outside one
    torch.manual_seed(0)
    zmodel = torch.nn.Linear(4, 4)
    zcompiled = torch.compile(zmodel, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(zmodel.parameters(), torch.optim.AdamW, lr=1e-2)
    zcompiled(torch.ones(2, 4)).sum().backward()
    with profile() as prof:
        opt.step()
    assert [e.name for e in prof.events() if e.name.startswith("Optimizer.step#")] == \
        ["Optimizer.step#ZeroOptimizer.step"]
    entered = []
    real = torch.autograd.profiler.record_function.__enter__
    try:
        torch.autograd.profiler.record_function.__enter__ = lambda self: entered.append(self.name) or real(self)
        opt.step()
    finally:
        torch.autograd.profiler.record_function.__enter__ = real
    assert not [n for n in entered if n.startswith("Optimizer.step#")], entered

    # an LR scheduler sees the step (no "lr_scheduler.step() before optimizer.step()" warning)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    zcompiled(torch.ones(2, 4)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)

    # a subclass overriding step: torch wraps its method; the hooks run once a step
    class Sub(zerocompile.ZeroOptimizer):
        def step(self, closure=None, grad_scaler=None):
            return super().step(closure, grad_scaler)

    torch.manual_seed(0)
    zmodel = torch.nn.Linear(4, 4)
    zcompiled = torch.compile(zmodel, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    sub_calls, _, _ = run(lambda m: Sub(m.parameters(), torch.optim.AdamW, lr=1e-2), zmodel, zcompiled)
    assert [c[:2] for c in sub_calls] == [c[:2] for c in want], sub_calls


def test_optimizer_params_follow_every_change_of_the_param_groups():
    """``OptimizerParams`` walks the param groups as they are now: a new group, a parameter
    appended, replaced in place or removed, and a duplicate are all seen at the next walk."""
    from zerocompile.optim.params import OptimizerParams

    a, b, c, d = (torch.nn.Parameter(torch.zeros(2)) for _ in range(4))
    groups = [{"params": [a, b]}]
    params = OptimizerParams(groups, None)
    assert list(params) == [a, b] and list(params) == [a, b]
    groups.append({"params": [c, a]})                 # a new group; a twice: once
    assert [id(p) for p in params] == [id(a), id(b), id(c)]
    groups[0]["params"][1] = d                        # replaced in place
    assert [id(p) for p in params] == [id(a), id(d), id(c)]
    groups[1]["params"].append(b)
    assert [id(p) for p in params] == [id(a), id(d), id(c), id(b)]
    groups[0]["params"] = [b]                         # a new list
    assert [id(p) for p in params] == [id(b), id(c), id(a)]
    del groups[1]
    assert [id(p) for p in params] == [id(b)]
