"""The C++ fused Adam kernel over many tensors in one call (``csrc/fused_adam.cpp``): the
tensors are one virtual flat range cut into work items that span tensors, taken by the threads
from a shared counter; the direct call ``runtime/fused_adam.py`` makes outside dispatch modes.

References: ``torch.optim.AdamW`` / ``Adam`` (``fused=True``, and the single-tensor path) on
copies of the same tensors, within the tolerances of ``tests/test_fused_adam.py``; and the
kernel itself on the same elements laid out as one tensor, bit for bit (an element's result
must not depend on which tensor or work item holds it, nor on the thread count)."""

from __future__ import annotations

import pytest
import torch

from zerocompile.runtime import cpu_extension, fused_adam
from harness import torch_optimizer_steps

BLOCK = 1 << 15                 # the kernel's work item (kBlock)
# odd sizes (tails not a multiple of any vector width), empty tensors, tensors that cross
# work-item boundaries, many small tensors sharing one work item
SIZES = (3, 0, 1, 17, BLOCK - 5, 9, BLOCK + 11, 0, 2 * BLOCK + 1, *([257] * 40), 31, 100_003)
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2)}


@pytest.fixture
def threads(request):
    """Run with ``request.param`` torch threads; restore the count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _module():
    module = cpu_extension.load("fused_adam")
    assert module is not None, "the C++ kernel did not build on this machine (see the warning logged)"
    return module


def _random(sizes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    grads = [((torch.rand(n, generator=g) + 0.5) * torch.randn(n, generator=g).sign()).to(dtype) for n in sizes]
    return params, grads


def _kernel(params, grads, steps, *, copy_dtype=None, **hyper):
    """``steps`` kernel calls over all the tensors at once; returns params, moments, steps, copies."""
    ps = [p.clone() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    st = [torch.zeros((), dtype=torch.float32) for _ in params]
    copies = [torch.empty(p.shape, dtype=copy_dtype) for p in params] if copy_dtype else []
    h = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True, maximize=False,
             grad_scale=1.0) | hyper
    for _ in range(steps):
        _module().adam_step(ps, grads, ms, vs, st, copies, h["lr"], h["beta1"], h["beta2"], h["eps"],
                            h["weight_decay"], h["decoupled"], h["maximize"], h["grad_scale"])
    return ps, ms, vs, st, copies


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,hyper", [
    (torch.optim.AdamW, dict(weight_decay=0.05)),
    (torch.optim.AdamW, dict(weight_decay=0.01, maximize=True, betas=(0.8, 0.95), eps=1e-6)),
    (torch.optim.Adam, dict(weight_decay=0.1)),
])
def test_one_call_over_many_tensors_matches_torch(threads, dtype, cls, hyper):
    """All tensors of a group in one call (work items spanning tensors, threads taking items
    as they come) give torch's numbers for every tensor, whatever its size."""
    params, grads = _random(SIZES, dtype, seed=threads)
    ref, opt = torch_optimizer_steps(cls, params, grads, 3, lr=1e-2, fused=True, **hyper)
    kernel_hyper = dict(weight_decay=hyper["weight_decay"], decoupled=cls is torch.optim.AdamW,
                        maximize=hyper.get("maximize", False), eps=hyper.get("eps", 1e-8))
    if "betas" in hyper:
        kernel_hyper.update(beta1=hyper["betas"][0], beta2=hyper["betas"][1])
    ps, ms, vs, st, _ = _kernel(params, grads, 3, **kernel_hyper)
    for p, m, v, s, r in zip(ps, ms, vs, st, ref):
        torch.testing.assert_close(p, r.detach(), **TOL[dtype])
        torch.testing.assert_close(m, opt.state[r]["exp_avg"], **TOL[dtype])
        torch.testing.assert_close(v, opt.state[r]["exp_avg_sq"], **TOL[dtype])
        assert s.item() == 3.0
    # float32: also the default single-tensor path, which rounds each operation as the kernel does
    if dtype == torch.float32:
        single, _ = torch_optimizer_steps(cls, params, grads, 3, lr=1e-2, foreach=False, **hyper)
        for p, r in zip(ps, single):
            torch.testing.assert_close(p, r.detach(), **TOL[dtype])


@pytest.mark.parametrize("dtype,copy_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, None),
                                              (torch.float16, torch.float32)])
def test_results_do_not_depend_on_the_split_into_tensors_or_the_thread_count(dtype, copy_dtype):
    """The same elements stepped as one tensor on one thread, and cut into tensors of odd
    sizes on two threads, come out bit for bit equal: the vector body and the scalar tail
    round alike, and a work item's bounds change nothing."""
    sizes = [n for n in SIZES if n]
    params, grads = _random([sum(sizes)], dtype, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = _kernel(params, grads, 2, weight_decay=0.1, decoupled=False, maximize=True, grad_scale=0.5,
                        copy_dtype=copy_dtype)
        torch.set_num_threads(2)
        split = _kernel(list(params[0].split(sizes)), list(grads[0].split(sizes)), 2, weight_decay=0.1,
                        decoupled=False, maximize=True, grad_scale=0.5, copy_dtype=copy_dtype)
    finally:
        torch.set_num_threads(before)
    for which in (0, 1, 2, 4):          # params, exp_avgs, exp_avg_sqs, copies
        if not whole[which]:
            continue
        assert torch.equal(_bits(whole[which][0]), _bits(torch.cat(split[which]))), which


def test_the_direct_call_equals_the_op_and_bumps_versions():
    """Outside dispatch modes ``FusedAdam`` calls the extension directly: the same bits as
    the ``zerocompile::fused_adam_step`` op, and the version counters of what it writes move
    as the op moves them (autograd sees the in-place update)."""
    params, grads = _random((5, 40_000, 33), torch.float32, seed=3)
    results = []
    for direct in (True, False):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = fused_adam.FusedAdam(ps, lr=1e-2, weight_decay=0.01, decoupled_weight_decay=True)
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        assert fused_adam._direct_cpu_kernel(ps) is not None
        if direct:
            opt.step()
            opt.step()
        else:
            for _ in range(2):
                with _PassThrough():           # a dispatch mode: the op path
                    assert fused_adam._direct_cpu_kernel(ps) is None
                    opt.step()
        versions = [(p._version, opt.state[p]["exp_avg"]._version, opt.state[p]["step"]._version) for p in ps]
        results.append(([p.detach().clone() for p in ps], versions))
    (direct_p, direct_v), (op_p, op_v) = results
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(direct_p, op_p))
    assert direct_v == op_v and all(v[0] >= 2 and v[2] >= 1 for v in direct_v)


def test_no_direct_call_for_fake_or_traced_tensors():
    """Fake tensors (``zerocompile plan``) take the op, whose fake kernel computes nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(8))
    assert fused_adam._direct_cpu_kernel([fake]) is None
    assert fused_adam._direct_cpu_kernel([]) is None
    assert fused_adam._direct_cpu_kernel([torch.ones(3)]) is not None


class _PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that only runs each op (as the memory tracker does, minus the counting)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
