"""What ``ZeroOptimizer.step`` reads once instead of on every walk (one process, no group):
the parameters and their shard states pinned for the step (``OptimizerParams.pinned``), the
inner optimizer's targets checked against the param groups' layout instead of parameter by
parameter (``InnerBinding.bind``), the frames' newest compile order and dump folders computed
again only when a frame is made or freed (``Process.frames_digest``), and the gradients read
in one context (``raw_grads``). Each is checked against what it replaces, including after the
changes that must be seen: parameters sharded, added or replaced after the optimizer bound,
a frame compiled with a dump folder and one freed."""

from __future__ import annotations

import gc

import pytest
import torch

import zerocompile
from zerocompile.optim.params import OptimizerParams
from zerocompile.runtime.raw_grad import raw_grad, raw_grads
from zerocompile.runtime.session import PROCESS, dump_roots, newest_frame_order
from zerocompile.runtime.sharded_param import get_state, states_of

OPTIONS = {"stage": 3, "inner_compiler": "eager"}


def _walked(params: OptimizerParams) -> list:
    """Each parameter once in param-group order, written out as the plain loop it replaces."""
    seen, out = set(), []
    for group in params.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def test_pinned_parameters_are_the_walked_ones_read_once_and_released_on_exit():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    loose = torch.nn.Parameter(torch.ones(3))      # never used by a frame: no shard state
    shared = model[0].weight
    # a parameter listed twice (in two groups) comes once, at its first place
    groups = [{"params": [model[1].weight, shared, loose]}, {"params": [shared, model[0].bias, model[1].bias]}]
    params = OptimizerParams(groups, None)
    torch.compile(model, backend="zero", options=OPTIONS)(torch.ones(2, 4)).sum().backward()
    want = _walked(params)
    assert [id(p) for p in params] == [id(p) for p in want] and len(want) == 5
    assert [(id(p), sp) for p, sp in params.pairs()] == [(id(p), get_state(p)) for p in want]
    assert params.states() == [get_state(p) for p in want if get_state(p) is not None]
    assert len(params.states()) == 4 and get_state(loose) is None
    assert states_of(want) == [get_state(p) for p in want]

    with params.pinned():
        inside = params.columns()
        with params.pinned():                      # nested: the outer one's
            assert params.columns() is inside
        groups[1]["params"].append(torch.nn.Parameter(torch.zeros(1)))   # not seen while pinned
        assert [id(p) for p in params] == [id(p) for p in want]
        assert params.layout_group() is get_state(shared).group
    assert len(list(params)) == 6, "the pin is released on exit: the added parameter is walked again"
    try:
        with params.pinned():
            raise KeyError("inside")
    except KeyError:
        pass
    assert params._pinned is None, "a step that raises leaves the parameters unpinned"


def test_raw_grads_are_each_parameters_own_gradient_past_zero_parameter():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    compiled = torch.compile(model, backend="zero", options={"stage": 0, "inner_compiler": "eager"})
    compiled(torch.ones(2, 4)).sum().backward()
    params = [model.weight, model.bias, torch.nn.Parameter(torch.ones(2))]   # the last without a gradient
    got = raw_grads(params)
    assert [g is None for g in got] == [False, False, True]
    assert all(a is raw_grad(p) for a, p in zip(got, params))


def _step(compiled, opt, x) -> None:
    compiled(x).sum().backward()
    opt.step()
    opt.zero_grad()


def test_parameters_sharded_added_or_replaced_after_binding_are_stepped_as_torchs_adamw_steps_them():
    """The binding skips its parameter-by-parameter check while the param groups' layout (the
    parameters and their shard states, by identity) is unchanged; every change to it is seen:
    parameters first sharded by a frame compiled after the optimizer bound, a param group added
    by ``add_param_group``, a parameter put in another's place in a group (fresh state, as torch
    gives it); a group's list grown by hand is refused. Each step's weights are those of
    torch's AdamW run on the same gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 4)
    tail = torch.nn.Linear(4, 2)
    ref_head, ref_tail = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ref_head.load_state_dict(head.state_dict())
    ref_tail.load_state_dict(tail.state_dict())
    params = list(head.parameters()) + list(tail.parameters())
    opt = zerocompile.ZeroOptimizer(params, torch.optim.AdamW, lr=1e-2)
    ref = torch.optim.AdamW(list(ref_head.parameters()) + list(ref_tail.parameters()), lr=1e-2)
    x = torch.randn(3, 4)

    # the head compiled alone: the tail is stepped whole (no state) by the first step
    chead = torch.compile(head, backend="zero", options=OPTIONS)
    tail(chead(x)).sum().backward()
    ref_tail(ref_head(x)).sum().backward()
    opt.step(), ref.step()
    opt.zero_grad(), ref.zero_grad()
    layout = opt._binding._bound_to
    assert layout is not None and all(get_state(p) is None for p in tail.parameters())
    torch.testing.assert_close(tail.weight.detach(), ref_tail.weight.detach(), rtol=0, atol=0)

    # an unchanged layout: the check is skipped and the targets are those bound
    opt.step()
    assert opt._binding._bound_to is layout

    # now the tail is sharded by a frame of its own: its targets move to the shards
    ctail = torch.compile(tail, backend="zero", options=OPTIONS)
    for _ in range(2):
        ctail(chead(x)).sum().backward()
        ref_tail(ref_head(x)).sum().backward()
        opt.step(), ref.step()
        opt.zero_grad(), ref.zero_grad()
    assert all(get_state(p) is not None for p in tail.parameters())
    assert opt._binding._bound_to != layout
    assert [id(t) for t in opt._binding.bound[0]] == [id(get_state(p).shard) for p in params]
    full = zerocompile.full_state_dict(ctail)
    torch.testing.assert_close(full["weight"], ref_tail.weight.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(zerocompile.full_state_dict(chead)["weight"], ref_head.weight.detach(),
                               rtol=1e-6, atol=1e-7)

    # a param group added after binding: seen, and stepped from fresh state
    extra = torch.nn.Parameter(torch.full((3,), 0.5))
    extra_ref = torch.nn.Parameter(torch.full((3,), 0.5))
    opt.add_param_group({"params": [extra]})
    ref.add_param_group({"params": [extra_ref]})
    for grad in (0.25, -1.0):
        extra.grad = torch.full((3,), grad)
        extra_ref.grad = torch.full((3,), grad)
        opt.step(), ref.step()
    torch.testing.assert_close(extra.detach(), extra_ref.detach(), rtol=0, atol=0)
    assert opt._binding.bound[1] == [extra] and len(opt._binding._bound_to) == 2

    # a parameter put in another's place in a group starts from no state, as in torch's AdamW
    swapped = torch.nn.Parameter(torch.full((3,), 2.0))
    swapped_ref = torch.nn.Parameter(torch.full((3,), 2.0))
    opt.param_groups[1]["params"][0] = swapped
    ref.param_groups[1]["params"][0] = swapped_ref
    for grad in (0.5, 0.125):
        swapped.grad = torch.full((3,), grad)
        swapped_ref.grad = torch.full((3,), grad)
        opt.step(), ref.step()
    torch.testing.assert_close(swapped.detach(), swapped_ref.detach(), rtol=0, atol=0)
    assert opt._binding.bound[1] == [swapped] and extra not in opt.inner.state
    torch.testing.assert_close(opt.state[swapped]["exp_avg"], ref.state[swapped_ref]["exp_avg"], rtol=0, atol=0)

    # a group's list grown by hand (not add_param_group): refused with the fix
    opt.param_groups[1]["params"].append(torch.nn.Parameter(torch.ones(2)))
    with pytest.raises(ValueError, match=r"param group 1 has 2 parameters, but 1 when the optimizer bound .* "
                                         r"opt.add_param_group"):
        opt.step()
    opt.param_groups[1]["params"].pop()
    opt.step()


def test_a_replaced_parameter_is_refused_where_the_inner_optimizer_keeps_state_elsewhere():
    """A whole-parameter optimizer (here Adafactor) keeps its state by owner: a parameter put in
    another's place after binding is refused, naming the group, the place and the fix."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4, bias=False)
    compiled = torch.compile(model, backend="zero", options=OPTIONS)
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.Adafactor, lr=1e-2)
    compiled(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.param_groups[0]["params"][0] = torch.nn.Parameter(torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 was replaced by another after the optimizer "
                                         r"bound .* Build a new ZeroOptimizer"):
        opt.step()


def test_the_frames_digest_follows_frames_made_and_freed(tmp_path):
    """``newest_frame_order`` and ``dump_roots`` (read on every optimizer step) are computed
    again after a frame is made or freed, and equal what walking every frame gives."""
    def walked():
        frames = PROCESS.frames()
        return (max((r.order for r in frames), default=0),
                sorted({r.dump_root for r in frames if getattr(r, "dump_root", None)}))

    torch._dynamo.reset()
    gc.collect()
    before = PROCESS.frames_epoch
    assert (newest_frame_order(), dump_roots()) == walked()
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="zero", options={**OPTIONS, "dump": str(tmp_path)})
    compiled(torch.ones(2, 4)).sum().backward()
    assert PROCESS.frames_epoch > before
    got = (newest_frame_order(), dump_roots())
    assert got == walked() and str(tmp_path) in got[1] and got[0] > 0
    epoch = PROCESS.frames_epoch
    assert (newest_frame_order(), dump_roots()) == got and PROCESS.frames_epoch == epoch   # nothing moved
    del compiled, model
    torch._dynamo.reset()
    gc.collect()
    assert PROCESS.frames_epoch > epoch, "a freed frame moves the epoch"
    assert (newest_frame_order(), dump_roots()) == walked()
    assert str(tmp_path) not in dump_roots()
