"""Training runs for the equivalence tests: a single-process reference on the whole
global batch, and the same run under ``backend="zero"`` on each rank's slice."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import pytest

import torch

import zerocompile
from models import make_batch, make_model

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


def built_or_skipped(module, name: str):
    """``module`` (``cpu_extension.load(name)``'s result): a kernel that did not build is skipped only
    where this machine has no C++ compiler (or no ninja); where it has them, a failed build is a
    failure, not a skip that hides a broken build (the C++ source, or its build flags)."""
    if module is not None:
        return module
    tools = [os.environ.get("CXX", "c++"), "ninja"]
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the C++ kernel '{name}' cannot be built here: no {' or '.join(missing)}")
    pytest.fail(f"the C++ kernel '{name}' did not build although {' and '.join(tools)} are here: see the build's "
                "warning in the log (zerocompile.runtime.cpu_extension)")


def torch_optimizer_steps(cls, params, grads, steps: int, **hyper):
    """The reference for optimizer kernels: ``steps`` steps of torch optimizer ``cls`` on
    copies of ``params`` with the same ``grads`` every step; returns the stepped copies (the
    keys of ``opt.state``) and the optimizer."""
    ref = [p.clone().requires_grad_() for p in params]
    opt = cls(ref, **hyper)
    for _ in range(steps):
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
    return ref, opt


@dataclass(frozen=True)
class Run:
    model: str = "mlp"
    stage: int = 3
    opt: str = "adamw"
    steps: int = 5
    batch: int = 8
    accum: int = 1
    clip: float | None = None
    param_dtype: str | None = None
    inner: str = "eager"
    seed: int = 0
    options: tuple = ()
    """Extra backend options as ``((key, value), ...)``."""


def rank_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of the global batch ``t`` (along dim 0)."""
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def train_on_rank_slices(model, opt, batches, rank: int, world: int, after_step=None) -> list:
    """Train on this rank's slice of each global ``(x, y)`` batch: forward, backward,
    ``opt.step()``, ``after_step()`` (e.g. a scheduler's step), ``opt.zero_grad()``. Returns each
    step's loss averaged over ranks, which is the loss one process computes on the whole batch."""
    losses = []
    for x, y in batches:
        loss = model(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _micro_batches(run: Run, step: int):
    for micro in range(run.accum):
        yield make_batch(run.model, step * run.accum + micro, run.batch)


def reference(run: Run) -> dict:
    """One process, whole global batch, plain PyTorch."""
    model = make_model(run.model, run.seed)
    cls, kw = OPTIMIZERS[run.opt]
    opt = cls([p for p in model.parameters()], **kw)
    losses, norms = [], []
    for step in range(run.steps):
        total = 0.0
        for x, y in _micro_batches(run, step):
            loss = model(x, y) / run.accum
            loss.backward()
            total += loss.item()
        if run.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def zero_train(rank: int, world: int, run: Run) -> dict:
    """The same run with ``backend="zero"``; this rank trains on its slice of each batch."""
    torch._dynamo.reset()
    zerocompile.reset_stats()
    started = time.monotonic_ns()
    model = make_model(run.model, run.seed)
    options = {"stage": run.stage, "inner_compiler": run.inner}
    if run.param_dtype:
        options["param_dtype"] = run.param_dtype
    options.update(dict(run.options))
    compiled = torch.compile(model, backend="zero", options=options)
    cls, kw = OPTIMIZERS[run.opt]
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=cls, **kw)
    per_rank = run.batch // world
    losses, norms = [], []
    for step in range(run.steps):
        total = torch.zeros(())
        for x, y in _micro_batches(run, step):
            sl = slice(rank * per_rank, (rank + 1) * per_rank)
            loss = compiled(x[sl], y[sl]) / run.accum
            loss.backward()
            total += loss.detach().float()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        if run.clip is not None:
            norms.append(opt.clip_grad_norm_(run.clip).item())
        opt.step()
        opt.zero_grad()
    stats = zerocompile.stats().as_dict()
    del stats["compile_seconds"]       # a timing: two runs that compiled alike differ in it
    return {"losses": losses, "norms": norms, "stats": stats,
            "state": zerocompile.full_state_dict(compiled),
            "reports": [r for r in zerocompile.frame_reports() if r["compiled_at_ns"] > started]}


def zero_train_many(rank: int, world: int, runs: list) -> list:
    return [zero_train(rank, world, run) for run in runs]


def assert_matches(result: dict, ref: dict, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Losses, clip norms and every final parameter/buffer equal the reference."""
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), atol=atol, rtol=rtol)
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]), atol=atol, rtol=rtol)
    assert set(result["state"]) == set(ref["state"]), "state dict keys differ from model.state_dict()"
    for key, value in ref["state"].items():
        got = result["state"][key]
        assert got.dtype == value.dtype, f"{key}: dtype {got.dtype} != {value.dtype}"
        torch.testing.assert_close(got, value, atol=atol, rtol=rtol, msg=lambda m: f"{key}: {m}")


def runs_apart(rank: int, world: int, runs) -> dict:
    """Several runs in one group of ranks (one start, one process group): ``runs`` gives
    ``(key, fn, args)`` and each ``fn(rank, world, *args)`` runs in turn; a run that raises is
    recorded as its traceback, so only the tests that read it (through ``ranks_of``) fail."""
    import traceback

    out = {}
    for key, fn, args in runs:
        try:
            out[key] = fn(rank, world, *args)
        except Exception:  # noqa: BLE001 - reported by the tests that read it
            out[key] = traceback.format_exc()
    return out


def ranks_of(results: list, key) -> list:
    """Every rank's result of the run ``key`` of ``runs_apart``; fails with a rank's traceback."""
    for r in results:
        assert not isinstance(r[key], str), r[key]
    return [r[key] for r in results]
