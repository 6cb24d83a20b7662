"""The fused Adam / AdamW kernels (``csrc/fused_adam.cpp``, ``runtime/triton_adam.py``) and how
``ZeroOptimizer`` picks its kernel.

References: ``torch.optim.Adam`` / ``AdamW`` with ``fused=True`` (float32 arithmetic for every
dtype, as the kernels) on copies of the same tensors; for float32 also the default
single-tensor path. The kernels may contract a multiply and an add into one FMA, so float32
results agree within a few float32 ulps, 16-bit ones within one ulp of their dtype."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zerocompile
from zerocompile import env
from zerocompile.runtime import cpu_extension, fused_adam
from harness import torch_optimizer_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (1, 7, 2 * 32768 + 5, 1000)       # one element, odd sizes, a tensor spanning 3 work blocks
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),
       torch.float16: dict(atol=1e-5, rtol=2e-3)}


def _module():
    module = cpu_extension.load("fused_adam")
    assert module is not None, "the C++ kernel did not build on this machine (see the warning logged)"
    return module


def _tensors(dtype, seed=0):
    """Parameters and gradients whose moments stay representable in 16 bits (|g| in [0.5, 1.5])."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
    grads = [((torch.rand(n, generator=g) + 0.5) * torch.randn(n, generator=g).sign()).to(dtype) for n in SIZES]
    return params, grads


def _kernel_run(run, params, grads, steps, *, decoupled, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.0, maximize=False, grad_scale=1.0, copy_dtype=None):
    ps = [p.clone() for p in params]
    ms = [torch.zeros_like(p) for p in params]
    vs = [torch.zeros_like(p) for p in params]
    st = [torch.zeros((), dtype=torch.float32) for _ in params]
    copies = [torch.empty(p.shape, dtype=copy_dtype) for p in params] if copy_dtype else []
    for _ in range(steps):
        run(ps, grads, ms, vs, st, copies, lr, betas[0], betas[1], eps, weight_decay, decoupled, maximize,
            grad_scale)
    return ps, ms, vs, st, copies


def _cpp(*args):
    _module().adam_step(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls,weight_decay", [(torch.optim.AdamW, 0.01), (torch.optim.Adam, 0.1),
                                              (torch.optim.Adam, 0.0)])
def test_cpp_kernel_matches_torch_fused(dtype, cls, weight_decay):
    params, grads = _tensors(dtype)
    ref, opt = torch_optimizer_steps(cls, params, grads, 3, lr=1e-2, weight_decay=weight_decay, fused=True)
    ps, ms, vs, st, _ = _kernel_run(_cpp, params, grads, 3, decoupled=cls is torch.optim.AdamW,
                                    weight_decay=weight_decay)
    for p, r, m, v, s, ref_p in zip(ps, ref, ms, vs, st, opt.param_groups[0]["params"]):
        torch.testing.assert_close(p, r, **TOL[dtype])
        torch.testing.assert_close(m, opt.state[ref_p]["exp_avg"], **TOL[dtype])
        torch.testing.assert_close(v, opt.state[ref_p]["exp_avg_sq"], **TOL[dtype])
        assert s.item() == 3.0 and p.dtype == m.dtype == v.dtype == dtype


def test_cpp_kernel_matches_torch_default_float32_path_maximize_and_betas():
    params, grads = _tensors(torch.float32, seed=1)
    hyper = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, maximize=True)
    ref, _ = torch_optimizer_steps(torch.optim.AdamW, params, grads, 4, foreach=False, **hyper)
    ps, *_ = _kernel_run(_cpp, params, grads, 4, decoupled=True, **hyper)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p, r, **TOL[torch.float32])


def test_cpp_kernel_grad_scale_and_copy_out():
    """grad_scale multiplies every gradient as it is read; the copies hold the updated
    parameters in their own dtype (the all-gather's input)."""
    params, grads = _tensors(torch.float32, seed=2)
    scaled = [g * 4 for g in grads]
    ps, ms, *_ = _kernel_run(_cpp, params, scaled, 2, decoupled=True, weight_decay=0.01, grad_scale=0.25)
    qs, ns, *_, copies = _kernel_run(_cpp, params, grads, 2, decoupled=True, weight_decay=0.01,
                                     copy_dtype=torch.bfloat16)
    for p, q, m, n, c in zip(ps, qs, ms, ns, copies):
        assert torch.equal(p, q) and torch.equal(m, n)      # x4 then x0.25 is exact in binary
        assert c.dtype == torch.bfloat16 and torch.equal(c, q.to(torch.bfloat16))


def test_cpp_kernel_non_finite_gradient_propagates_as_in_torch():
    p, g = torch.ones(5), torch.tensor([1.0, float("inf"), float("nan"), -1.0, 0.0])
    ref, _ = torch_optimizer_steps(torch.optim.AdamW, [p], [g], 1, lr=1e-2, fused=True)
    ps, *_ = _kernel_run(_cpp, [p], [g], 1, decoupled=True, weight_decay=0.01)
    torch.testing.assert_close(ps[0], ref[0], equal_nan=True)
    assert ps[0][1:3].isnan().all() and ps[0][[0, 3, 4]].isfinite().all()


def test_cpp_kernel_rejects_bad_tensors_with_a_clear_error():
    m = _module()
    p = torch.zeros(4, 4)

    def call(**kw):
        args = dict(params=[p], grads=[torch.zeros(4, 4)], exp_avgs=[torch.zeros(4, 4)],
                    exp_avg_sqs=[torch.zeros(4, 4)], steps=[torch.zeros(())])
        args.update(kw)
        m.adam_step(args["params"], args["grads"], args["exp_avgs"], args["exp_avg_sqs"], args["steps"], [],
                    1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, 1.0)

    with pytest.raises(RuntimeError, match=r"grads\[0\] is not contiguous"):
        call(grads=[torch.zeros(4, 4).t()])
    with pytest.raises(RuntimeError, match=r"exp_avgs\[0\] has 3 elements"):
        call(exp_avgs=[torch.zeros(3)])
    with pytest.raises(RuntimeError, match="parameter's dtype"):
        call(exp_avg_sqs=[torch.zeros(4, 4, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 only"):
        call(params=[torch.zeros(4, 4, dtype=torch.float64)])
    with pytest.raises(RuntimeError, match="same length"):
        call(steps=[])
    with pytest.raises(RuntimeError, match=r"steps\[0\] must be a 1-element float32"):
        call(steps=[torch.zeros((), dtype=torch.int64)])
    assert m.vector_isa() in ("AVX512", "AVX2", "SSE2", "NEON", "scalar")


# ---------------------------------------------------------------- Triton, on the CPU
@pytest.fixture
def triton_interpreter(monkeypatch):
    pytest.importorskip("triton")
    from zerocompile.runtime import triton_adam

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # read when the kernel is jitted: build it afresh
    triton_adam._kernel.cache_clear()
    yield triton_adam
    triton_adam._kernel.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_triton_kernel_under_the_interpreter_matches_cpp_and_torch(triton_interpreter, dtype, decoupled):
    def triton_run(ps, gs, ms, vs, st, copies, lr, b1, b2, eps, wd, dec, maximize, scale):
        triton_interpreter.adam_step(ps, gs, ms, vs, st, copies, lr=lr, beta1=b1, beta2=b2, eps=eps,
                                     weight_decay=wd, decoupled=dec, maximize=maximize, grad_scale=scale)

    params, grads = _tensors(dtype, seed=3)
    hyper = dict(decoupled=decoupled, weight_decay=0.05, maximize=not decoupled, grad_scale=0.5,
                 copy_dtype=torch.bfloat16)
    tp, tm, tv, tst, tc = _kernel_run(triton_run, params, grads, 3, **hyper)
    cp, cm, cv, _, cc = _kernel_run(_cpp, params, grads, 3, **hyper)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref, _ = torch_optimizer_steps(cls, params, [g * 0.5 for g in grads], 3, lr=1e-2, weight_decay=0.05,
                              maximize=not decoupled, fused=True)
    for a, b, r in zip(tp, cp, ref):
        torch.testing.assert_close(a, b, **TOL[dtype])
        torch.testing.assert_close(a, r, **TOL[dtype])
    for a, b in zip(tm + tv, cm + cv):
        torch.testing.assert_close(a, b, **TOL[dtype])
    for c, p in zip(tc, tp):
        torch.testing.assert_close(c, p.to(torch.bfloat16), **TOL[torch.bfloat16])
    assert [s.item() for s in tst] == [3.0] * len(SIZES)


# ---------------------------------------------------------------- ZeroOptimizer's choice
def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1))


def _train(stage, cls=torch.optim.AdamW, steps=4, **opt_kw):
    """Train _tiny() compiled at ``stage`` (world size 1) and, from the same weights, a plain
    torch model with ``cls``; return (zero optimizer, max parameter difference)."""
    torch.compiler.reset()
    model, ref = _tiny(), _tiny()
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), cls, lr=1e-2, **opt_kw)
    torch_kw = {k: v for k, v in opt_kw.items() if k != "kernel"}
    ref_opt = cls(ref.parameters(), lr=1e-2, **torch_kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=g)
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = zerocompile.full_state_dict(compiled)
    diff = max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    torch.compiler.reset()
    return opt, diff


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_optimizer_uses_the_cpp_kernel_for_adamw_and_matches_torch(stage, caplog):
    with caplog.at_level("INFO", logger="zerocompile"):
        opt, diff = _train(stage, weight_decay=0.1)
    assert opt.kernel == "cpp"
    assert isinstance(opt.inner, fused_adam.FusedAdam)
    assert "AdamW steps with zerocompile's fused C++ kernel" in caplog.text
    assert diff < 1e-6


@pytest.mark.parametrize("kwargs,kernel", [
    (dict(cls=torch.optim.Adam, weight_decay=0.1), "cpp"),                  # L2 penalty
    (dict(amsgrad=True), "torch_fused"),                                     # not in the kernel
    (dict(fused=True), "torch_fused"),                                       # your choice
    (dict(foreach=False), "torch"),                                          # your choice
    (dict(kernel="torch"), "torch"),
    (dict(cls=torch.optim.SGD, momentum=0.9), "torch_foreach"),             # fused: no late gradients
    (dict(cls=torch.optim.SGD), "torch_fused"),
    (dict(cls=torch.optim.RMSprop), "torch_foreach"),                        # no fused RMSprop
])
def test_zero_optimizer_kernel_choice(kwargs, kernel):
    opt, diff = _train(3, **kwargs)
    assert opt.kernel == kernel
    assert diff < 1e-6


def test_sgd_with_momentum_steps_a_parameter_whose_first_gradient_comes_late():
    """torch's fused SGD with momentum fails on a parameter with no momentum buffer after the
    first step (an expert no token reached at first), so "auto" takes foreach for it: the
    same update as torch.optim.SGD."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt = zerocompile.ZeroOptimizer(params, torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for step in range(3):
        for p in (params, ref):
            p[0].grad = torch.full((3,), 1.0 + step)
            p[1].grad = torch.full((3,), 2.0) if step else None     # no gradient in the first step
        opt.step()
        ref_opt.step()
    assert opt.kernel == "torch_foreach"
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)


def test_float16_parameters_take_torch_fused_under_auto():
    """The C++ kernel converts float16 with scalar code (4x torch's fused kernel here), so
    "auto" leaves float16 parameters to torch's fused AdamW; "fused" still forces it."""
    for kernel, expected in (("auto", "torch_fused"), ("fused", "cpp")):
        p = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
        opt = zerocompile.ZeroOptimizer([p], torch.optim.AdamW, lr=0.1, kernel=kernel)
        p.grad = torch.ones(8, dtype=torch.float16)
        opt.step()
        assert opt.kernel == expected


def test_zero_optimizer_kernel_errors():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="kernel='fast' is invalid; allowed: 'auto', 'fused', 'torch'"):
        zerocompile.ZeroOptimizer([p], torch.optim.AdamW, kernel="fast")
    opt = zerocompile.ZeroOptimizer([p], torch.optim.SGD, lr=0.1, kernel="fused")
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"kernel='fused'\): SGD is not torch.optim.Adam or AdamW"):
        opt.step()
    opt = zerocompile.ZeroOptimizer([p], torch.optim.AdamW, lr=0.1)
    opt.step()
    assert opt.kernel == "cpp"
    q = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"cannot update this group \(param group 0 sets amsgrad=True\); "
                                         r"build the ZeroOptimizer with kernel='torch'"):
        opt.add_param_group({"params": [q], "amsgrad": True})
    assert len(opt.param_groups) == 1 and len(opt.inner.param_groups) == 1
    opt.param_groups[0]["amsgrad"] = True          # changed after binding: refused at the step
    with pytest.raises(RuntimeError, match="FusedAdam: param group 0 sets amsgrad=True"):
        opt.step()


def test_state_dicts_move_between_the_fused_kernel_and_torch():
    """A ZeroOptimizer state saved with the fused kernel resumes in one on torch's kernel and
    the other way round, continuing as an uninterrupted torch.optim.AdamW run."""
    model = _tiny()
    ref = _tiny()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opts = [zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, kernel=k)
            for k in ("auto", "torch", "auto")]
    g = torch.Generator().manual_seed(4)
    for i, opt in enumerate(opts):
        if i:
            opt.load_state_dict(opts[i - 1].state_dict())
        for _ in range(2):
            x = torch.randn(5, 6, generator=g)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            ref(x).sum().backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert [o.kernel for o in opts] == ["cpp", "torch", "cpp"]
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    state = opts[-1].state_dict()["state"][0]
    assert state["step"].dtype == torch.float32 and state["step"].item() == 6.0


@pytest.mark.parametrize("env", [{"CXX": "/nonexistent/c++"}, {"ZEROCOMPILE_CPP_KERNELS": "0"}])
def test_without_the_cpp_kernel_zero_optimizer_falls_back_to_torch_fused(tmp_path, env):
    """No compiler (or the kernels switched off): one log line, then torch's fused AdamW."""
    script = textwrap.dedent("""
        import json, logging, torch, zerocompile
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        p = torch.nn.Parameter(torch.ones(4)); q = p.detach().clone().requires_grad_()
        opt = zerocompile.ZeroOptimizer([p], torch.optim.AdamW, lr=0.1)
        ref = torch.optim.AdamW([q], lr=0.1)
        for _ in range(2):
            p.grad = torch.arange(4.0); q.grad = torch.arange(4.0)
            opt.step(); ref.step()
        print(json.dumps({"kernel": opt.kernel, "equal": torch.allclose(p, q)}))
    """)
    run_env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), **env}   # no finished build to import
    out = subprocess.run([sys.executable, "-c", script], env=run_env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"kernel": "torch_fused", "equal": True}
    if "CXX" in env:
        assert out.stderr.count("could not build the C++ kernel csrc/fused_adam.cpp") == 1, out.stderr
        assert "Install a C++ compiler and ninja" in out.stderr
    else:
        assert "C++ kernels disabled by ZEROCOMPILE_CPP_KERNELS=0" in out.stderr


def test_the_kernel_is_a_torch_op_that_dispatch_modes_and_fake_tensors_see():
    """The memory tracker and communication counters are dispatch modes: they must see the
    tensors the fused step reads and writes (a bare call into the extension would hide the
    optimizer state from them); under fake tensors the step allocates and computes nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((str(func), args))
            return func(*args, **(kwargs or {}))

    p = torch.nn.Parameter(torch.ones(6))
    opt = fused_adam.FusedAdam([p], lr=0.1, decoupled_weight_decay=True)
    p.grad = torch.ones(6)
    opt.step()
    with Seen() as seen:
        opt.step()
    (args,) = [a for name, a in seen.calls if name.startswith("zerocompile.fused_adam_step")]
    assert args[0][0] is p and args[2][0] is opt.state[p]["exp_avg"] and args[3][0] is opt.state[p]["exp_avg_sq"]
    with FakeTensorMode() as mode:
        q = torch.nn.Parameter(mode.from_tensor(torch.ones(1 << 20)))
        q.grad = torch.ones(1 << 20)
        fake_opt = fused_adam.FusedAdam([q], lr=0.1)
        fake_opt.step()
    assert type(fake_opt.state[q]["exp_avg"]).__name__ == "FakeTensor"


class _KernelScales(torch.utils._python_dispatch.TorchDispatchMode):
    """The grad_scale of every fused Adam kernel call, and whether any op multiplied a
    gradient in place (what clipping without the kernel does)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:      # compiled code runs compiled under it
        return True

    def __init__(self):
        super().__init__()
        self.scales, self.in_place_muls = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.zerocompile.fused_adam_step.default:
            self.scales.append(args[-1])
        if func in (torch.ops.aten.mul_.Tensor, torch.ops.aten._foreach_mul_.Tensor,
                    torch.ops.aten._foreach_mul_.ScalarList, torch.ops.aten._foreach_mul_.List):
            self.in_place_muls += 1
        return func(*args, **(kwargs or {}))


def _clipped_run(stage, apply_now, accumulate_after_clip=None, steps=3):
    """Train a small model with clipping; ``apply_now``: multiply the gradients by the clipping
    coefficient at once (what happens where the coefficient cannot be left to the kernel);
    ``accumulate_after_clip``: "forward" (another forward and backward between clipping and the
    step) or "retain" (another backward of the same graph)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    spy = _KernelScales()
    norms = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(5, 6, generator=g)
        loss = compiled(x).square().mean() * 50
        loss.backward(retain_graph=accumulate_after_clip == "retain")
        norms.append(opt.clip_grad_norm_(0.5).item())
        if apply_now:
            opt._apply_deferred()
        if accumulate_after_clip == "forward":
            compiled(x * 2).square().mean().backward()
        elif accumulate_after_clip == "retain":
            loss.backward()
        with spy:
            opt.step()
        opt.zero_grad()
    state = zerocompile.full_state_dict(compiled)
    torch.compiler.reset()
    return norms, state, spy


@pytest.mark.parametrize("after", [None, "forward", "retain"])
def test_clipping_coefficient_is_applied_by_the_kernel_bitwise(after):
    """At stage 3 the clipping coefficient is passed to the fused kernel instead of multiplying
    the gradients first: one pass over them fewer, the same numbers bit for bit as multiplying at
    once, also when a backward adds to the clipped gradients before the step (the coefficient is
    applied to them first, as clipping in place would have)."""
    norms, state, spy = _clipped_run(3, apply_now=False, accumulate_after_clip=after)
    ref_norms, ref_state, ref_spy = _clipped_run(3, apply_now=True, accumulate_after_clip=after)
    assert norms == ref_norms and all(n > 0.5 for n in norms)      # every step clipped
    for key, value in ref_state.items():
        assert torch.equal(state[key], value), key
    assert all(s == 1.0 for s in ref_spy.scales)
    if after is None:
        assert spy.in_place_muls == 0 and len(spy.scales) == 3 and all(0 < s < 1 for s in spy.scales)
    else:   # the second backward applied it: the kernel had nothing left to scale
        assert all(s == 1.0 for s in spy.scales)


def test_clipping_coefficient_stays_eager_where_gradients_are_readable():
    """Stage 0 on one process: ``p.grad`` is the gradient and readable between clipping and the
    step, so it is clipped in place; the result matches torch's clip_grad_norm_ and AdamW."""
    norms, state, spy = _clipped_run(0, apply_now=False)
    assert all(s == 1.0 for s in spy.scales)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        (ref(torch.randn(5, 6, generator=g)).square().mean() * 50).backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item() == pytest.approx(norms[step], rel=1e-6)
        ref_opt.step()
        ref_opt.zero_grad()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6)


def test_a_group_is_checked_again_when_it_changes():
    """FusedAdam checks a param group's tensors once, and again when its parameters or a
    hyperparameter other than the learning rate change."""
    p = torch.zeros(4, requires_grad=True)
    opt = fused_adam.FusedAdam([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["lr"] = 0.05          # a schedule: no new check needed, still steps
    opt.step()
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(RuntimeError, match="param group 0 sets amsgrad=True"):
        opt.step()
    opt.param_groups[0]["amsgrad"] = False
    q = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    q.grad = torch.ones(3, dtype=torch.float64)
    opt.param_groups[0]["params"].append(q)
    with pytest.raises(RuntimeError, match="a parameter has dtype torch.float64"):
        opt.step()


def test_the_compiler_gets_the_source_at_a_path_named_by_its_content(tmp_path, monkeypatch):
    """torch's build file records the source's path: the copy the extension is built from lives
    at a path that depends only on the source's bytes, so another checkout of the same code on
    the same environment reuses the build instead of compiling again."""
    import hashlib
    import importlib.resources

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    text = (importlib.resources.files("zerocompile.csrc") / "fused_adam.cpp").read_bytes()
    path = cpu_extension.stable_source("fused_adam")
    assert path == tmp_path / "zerocompile" / "csrc" / hashlib.sha256(text).hexdigest()[:16] / "fused_adam.cpp"
    assert path.read_bytes() == text
    path.write_bytes(b"// damaged")               # a damaged copy is rewritten, at the same path
    assert cpu_extension.stable_source("fused_adam") == path and path.read_bytes() == text


def test_a_finished_build_is_imported_by_a_fresh_process_without_building(monkeypatch):
    """Builds live in a folder named by the source, flags, torch, Python and CPU; a fresh process
    (another checkout or virtual environment of the same code) imports the finished build
    without going through torch's builder, which would compile again. Changing any input of the
    binary names another folder."""
    module = cpu_extension.load("fused_adam")
    assert module is not None, "the C++ kernel could not be built here"
    folder = env.cache_root() / "build" / cpu_extension.build_key("fused_adam")
    assert Path(module.__file__).parent == folder
    assert (folder / "complete").read_text().strip() == Path(module.__file__).name
    # a fresh process whose torch builder would fail: it is never called
    code = ("import torch.utils.cpp_extension as ce\n"
            "def refuse(*a, **k): raise RuntimeError('the builder was called')\n"
            "ce.load = refuse\n"
            "from zerocompile.runtime import cpu_extension\n"
            "m = cpu_extension.load('fused_adam')\n"
            "print(m.__file__ if m is not None else 'None')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == module.__file__, done.stderr[-3000:]
    key = cpu_extension.build_key("fused_adam")
    assert cpu_extension.build_key("fused_adam") == key
    monkeypatch.setattr(cpu_extension, "CFLAGS", cpu_extension.CFLAGS + ("-DOTHER",))
    assert cpu_extension.build_key("fused_adam") != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert cpu_extension.build_key("fused_adam") != key
