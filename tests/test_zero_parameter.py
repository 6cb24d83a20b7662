"""Eager code touching a sharded parameter gets the right value or a clear error, never a
crash or a silent wrong answer (issue 8, problems 7 and 8): reads, writes, ``state_dict``,
``p.grad``, ``torch.nn.utils.clip_grad_norm_`` and ``zero_grad``, at every stage."""

from __future__ import annotations

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from models import make_batch, make_model
from zerocompile.runtime.zero_parameter import (GradientNotGatheredError, ParameterNotGatheredError,
                                                ZeroParameter)

OPT = dict(optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)


# -- one process ---------------------------------------------------------------------------------

def _compiled(stage, model_name="mlp"):
    torch._dynamo.reset()
    model = make_model(model_name)
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    return model, compiled


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_eager_read_gives_the_value_or_names_gathered_parameters(stage):
    model, compiled = _compiled(stage)
    opt = zerocompile.ZeroOptimizer(model.parameters(), **OPT)
    x, y = make_batch("mlp", 0, 4)
    compiled(x, y).backward()
    opt.step()
    w = model.l1.weight
    assert isinstance(w, ZeroParameter) and isinstance(w, torch.nn.Parameter)
    assert w.shape == (13, 7) and w.dtype == torch.float32 and w.requires_grad   # metadata always
    full = zerocompile.full_state_dict(model)["l1.weight"]
    if stage == 3:
        for read in (lambda: w.sum(), lambda: w.norm(), lambda: repr(w), lambda: w.detach().clone(),
                     lambda: w.data, lambda: w * 2):
            with pytest.raises(ParameterNotGatheredError, match="gathered_parameters.*full_state_dict"):
                read()
        # model.state_dict() gives the shard (on one rank: the whole value, a view of the shard)
        torch.testing.assert_close(model.state_dict()["l1.weight"], full, rtol=0, atol=0)
        with zerocompile.gathered_parameters(model):
            torch.testing.assert_close(w.detach().clone(), full, rtol=0, atol=0)
    else:
        torch.testing.assert_close(w.detach().clone(), full, rtol=0, atol=0)
        assert w.norm().item() == pytest.approx(full.norm().item())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_copy_and_load_state_dict_write_exactly(stage):
    model, compiled = _compiled(stage)
    x, y = make_batch("mlp", 0, 4)
    compiled(x, y)
    new = {k: torch.randn_like(v) for k, v in make_model("mlp", seed=5).state_dict().items()}
    model.load_state_dict(new)
    with torch.no_grad():
        model.l2.bias.copy_(torch.full((5,), 0.5))
    new["l2.bias"] = torch.full((5,), 0.5)
    got = zerocompile.full_state_dict(model)
    for key, value in new.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    ref = make_model("mlp")
    ref.load_state_dict(new)
    assert compiled(x, y).item() == pytest.approx(ref(x, y).item(), abs=1e-6)   # the graphs see it too


def test_changing_a_sharded_parameter_is_refused():
    model, compiled = _compiled(3)
    compiled(*make_batch("mlp", 0, 4))
    with pytest.raises(ParameterNotGatheredError, match="cannot set `.data`"):
        model.l1.weight.data = torch.zeros(13, 7)
    with pytest.raises(ParameterNotGatheredError, match="freeze parameters before the first compiled forward"):
        model.l1.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="in-place operation"):
        model.l1.weight.copy_(torch.zeros(13, 7))     # as torch: a leaf that requires grad, grad mode on


@pytest.mark.parametrize("model_name", ["loop_break_every", "hook_breaks"])
def test_eager_forward_of_blocks_sharded_through_another_blocks_frame(model_name):
    """With a graph break in the layer loop, one block's compiled code runs every block, and the
    other blocks' parameters are sharded at their first call: an uncompiled forward of the
    model afterwards gathers them too (the gather-on-demand hook), with the trained values."""
    import zoo

    torch._dynamo.reset()
    model = zoo.make(model_name)
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), **OPT)
    x, y = zoo.batch(0)
    compiled(x, y).backward()
    opt.step()
    opt.zero_grad()
    states = [zerocompile.runtime.sharded_param.get_state(p) for p in model.blocks.parameters()]
    assert len(states) >= 4 and all(sp is not None and sp.storage_freed for sp in states)
    ref = zoo.make(model_name)
    ref.load_state_dict(zerocompile.full_state_dict(model))
    x, y = zoo.batch(1)
    with torch.no_grad():
        assert model(x, y).item() == pytest.approx(ref(x, y).item(), abs=1e-6)


@pytest.mark.parametrize("model_name", ["gpt", "loop_break_every", "hook_breaks"])
def test_the_class_change_compiles_no_frame_twice(model_name):
    """A parameter becomes a ZeroParameter before Dynamo builds the frame's guards (which
    record each parameter's class): the second step recompiles nothing, also when a graph
    break makes every layer's forward its own frame that later layers reuse."""
    from torch._dynamo.utils import counters

    import zoo

    torch._dynamo.reset()
    counters.clear()
    if model_name == "gpt":
        model = make_model("gpt")
        batches = [make_batch("gpt", s, 4) for s in range(3)]
    else:
        model = zoo.make(model_name)
        batches = [zoo.batch(s) for s in range(3)]
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    graphs = []
    for x, y in batches:
        compiled(x, y).backward()
        model.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 2, graphs
    assert all(type(p) is ZeroParameter for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 1])
def test_torch_clip_grad_norm_matches_one_process_on_one_rank(stage):
    model, compiled = _compiled(stage)
    ref = make_model("mlp")
    x, y = make_batch("mlp", 0, 8)
    compiled(x, y).backward()
    ref(x, y).backward()
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_torch_clip_grad_norm_of_sharded_gradients_needs_the_optimizer(stage):
    """Without a ZeroOptimizer nothing averages a sharded gradient: p.grad raises, naming the
    fix. With one, torch's clipping on one rank matches one process (p.grad is the whole
    gradient in the parameter's shape)."""
    model, compiled = _compiled(stage)
    ref = make_model("mlp")
    x, y = make_batch("mlp", 0, 4)
    compiled(x, y).backward()
    ref(x, y).backward()
    with pytest.raises(GradientNotGatheredError, match=r"zerocompile\.ZeroOptimizer\(model\.parameters\(\)"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt = zerocompile.ZeroOptimizer(model.parameters(), **OPT)  # noqa: F841 - p.grad asks it to reduce
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_module_and_optimizer_zero_grad_clear_every_gradient(stage, set_to_none):
    """``model.zero_grad()`` (HF Trainer calls it) must clear the shard gradients too, or the
    next step would add the old gradient in."""
    model, compiled = _compiled(stage)
    ref = make_model("mlp")
    opt = zerocompile.ZeroOptimizer(model.parameters(), **OPT)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = make_batch("mlp", step, 4)
        compiled(x, y).backward()
        ref(x, y).backward()
        opt.step()
        ref_opt.step()
        model.zero_grad(set_to_none=set_to_none)
        ref.zero_grad(set_to_none=set_to_none)
    got = zerocompile.full_state_dict(model)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(got[key], value, msg=key)


# -- two ranks -----------------------------------------------------------------------------------

def _clip_worker(rank, world, stage):
    torch._dynamo.reset()
    model = make_model("mlp")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    x, y = make_batch("mlp", 0, 8)
    compiled(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]).backward()
    try:    # no optimizer averages the gradients yet
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        error = None
    except GradientNotGatheredError as err:
        error = str(err)
    opt = zerocompile.ZeroOptimizer(model.parameters(), **OPT)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    # stage 0: after the step p.grad holds the gradient averaged over ranks, and reads work
    grads = {n: p.grad.clone() for n, p in model.named_parameters()} if stage == 0 else None
    return error, norm, grads


def _clip_every_stage(rank, world):
    return {stage: _clip_worker(rank, world, stage) for stage in (0, 1, 2, 3)}


def test_torch_clip_grad_norm_on_two_ranks_is_global_and_raises_without_an_optimizer():
    """Stages 0-3 in one group of ranks (each stage on its own model)."""
    ref = make_model("mlp")
    ref(*make_batch("mlp", 0, 8)).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item()
    for results in run_ranks(_clip_every_stage, 2):
        for stage, (error, norm, grads) in results.items():
            assert error is not None and "zerocompile.ZeroOptimizer(model.parameters()" in error, stage   # never a local norm
            assert norm == pytest.approx(want, rel=1e-5), stage
            assert (grads is not None) == (stage == 0)
            if grads is not None:
                for name, g in grads.items():
                    scale = min(1.0, 1.0 / (want + 1e-6))
                    torch.testing.assert_close(g, ref_grads[name] * scale, msg=f"stage {stage} {name}")
