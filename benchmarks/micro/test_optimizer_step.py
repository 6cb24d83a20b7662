"""Optimizer-step throughput: ``zerocompile.ZeroOptimizer`` against plain AdamW.

All variants update the same parameter shapes (8 tensors of 512 x 1024 = 4,194,304 fp32
elements in total) with the same gradients, which stay set across steps so that every
timed call is one full ``opt.step()``. World size is 1 (no process group), so no
collective moves data; the figures show the overhead of the ZeroOptimizer wrapper
around its inner ``torch.optim.AdamW``:

- ``torch_foreach`` / ``torch_fused``: ``torch.optim.AdamW(foreach=True)`` / ``(fused=True)``.
- ``zero_plain[foreach|fused]``: ``ZeroOptimizer(..., optimizer_class=torch.optim.AdamW,
  foreach=True)`` (or ``fused=True``, passed to the inner AdamW) on ordinary
  (never compiled) parameters. zerocompile treats those like stage 0: the gradients are
  averaged over the (single) rank and the inner AdamW updates the full parameters.
- ``zero_plain[auto]``, ``zero_stage1[auto]``: ZeroOptimizer's default kernel choice, which
  for AdamW on CPU tensors is zerocompile's fused C++ kernel (``opt.kernel == "cpp"``).
- ``zero_stage1[foreach|fused|auto]``: the same, on the parameters of a model compiled with
  ``backend="zero"`` at stage 1. Each step also reduce-scatters the full gradients into
  the master shards and all-gathers the updated shards into the replicas (both trivial
  at world size 1, but the copies are real).

``extra_info["elements_per_s"]`` is parameter elements updated per second (mean time).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zerocompile
from micro_gpt import FIXED_COST_MODEL

NUM_TENSORS = 8
ROWS, COLS = 512, 1024
NUMEL = NUM_TENSORS * ROWS * COLS   # 4,194,304
LR = 1e-4


class LinearStack(nn.Module):
    """8 bias-free linear layers alternating 1024 -> 512 and 512 -> 1024: its weights
    have exactly the benchmark's parameter shapes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(COLS, ROWS, bias=False) if i % 2 == 0 else nn.Linear(ROWS, COLS, bias=False)
            for i in range(NUM_TENSORS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _set_gradients(params) -> None:
    """Give every parameter the same deterministic small gradient in every variant."""
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3


def _plain_params() -> list[torch.Tensor]:
    """Fresh parameters of the benchmark's shapes, with gradients set."""
    torch.manual_seed(0)
    params = [p for p in LinearStack().parameters()]
    _set_gradients(params)
    return params


def _record(benchmark) -> None:
    benchmark.extra_info["elements"] = NUMEL
    benchmark.extra_info["tensors"] = NUM_TENSORS
    benchmark.extra_info["elements_per_s"] = NUMEL / benchmark.stats.stats.mean


@pytest.fixture(autouse=True)
def _no_process_group():
    """These benchmarks run at world size 1: make sure no group is left initialised."""
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized()), "a process group is still initialised"
    yield


GROUP = "optimizer step: AdamW, 4.2M fp32 elements in 8 tensors"


@pytest.mark.benchmark(group=GROUP)
def test_torch_foreach(benchmark):
    opt = torch.optim.AdamW(_plain_params(), lr=LR, foreach=True)
    opt.step()   # create the optimizer state outside the timed calls
    benchmark(opt.step)
    _record(benchmark)


@pytest.mark.benchmark(group=GROUP)
def test_torch_fused(benchmark):
    try:
        opt = torch.optim.AdamW(_plain_params(), lr=LR, fused=True)
        opt.step()
    except (RuntimeError, ValueError) as err:
        pytest.skip(f"fused AdamW is not available on CPU here: {err}")
    benchmark(opt.step)
    _record(benchmark)


# The inner AdamW of ZeroOptimizer gets the same implementation flag as the torch baseline
# it is compared with (on CPU, AdamW's default is the slower per-tensor loop); "auto" is
# ZeroOptimizer's default: zerocompile's fused C++ kernel (csrc/fused_adam.cpp).
INNER_KINDS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "auto": {}}


def _make_zero_optimizer(params, kind: str):
    """A ZeroOptimizer around AdamW(``INNER_KINDS[kind]``) that has stepped once (state created)."""
    opt = zerocompile.ZeroOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR, **INNER_KINDS[kind])
    try:
        opt.step()
    except (RuntimeError, ValueError) as err:
        pytest.skip(f"AdamW({INNER_KINDS[kind]}) is not available on CPU here: {err}")
    return opt


@pytest.mark.benchmark(group=GROUP)
@pytest.mark.parametrize("kind", list(INNER_KINDS))
def test_zero_plain(benchmark, kind):
    opt = _make_zero_optimizer(_plain_params(), kind)
    benchmark(opt.step)
    _record(benchmark)


@pytest.mark.benchmark(group=GROUP)
@pytest.mark.parametrize("kind", list(INNER_KINDS))
def test_zero_stage1(benchmark, kind):
    torch.compiler.reset()
    torch.manual_seed(0)
    model = LinearStack()
    compiled = torch.compile(model, backend="zero",
                             options={"stage": 1, "inner_compiler": "eager", "cost_model": FIXED_COST_MODEL})
    compiled(torch.randn(4, COLS)).backward()   # shards the parameters; leaves full gradients
    opt = _make_zero_optimizer(model.parameters(), kind)
    benchmark(opt.step)
    _record(benchmark)
    torch.compiler.reset()
