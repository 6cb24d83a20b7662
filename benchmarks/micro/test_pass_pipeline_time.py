"""Compile cost of zerocompile against graph size.

For a GPT-like model of 2, 4, 8, 16 and 32 blocks, each round times one training step
from a cold start: ``torch.compile(model, backend="zero")`` followed by one forward and
one backward. The first call is what triggers Dynamo tracing, AOTAutograd, zerocompile's
pass pipeline and the (eager) inner compiler, so the figure is dominated by compile cost,
not by the arithmetic of the tiny model. ZeRO stage 3 runs on torch's fake process group
of 8 ranks, so the graphs are those of an 8-rank job.

zerocompile reports no per-pass timings, so each result's ``extra_info`` records what
the pipeline worked on instead (from ``zerocompile.frame_reports()``): the number of
parameter all-gathers it tagged, how many collectives bucketing left per graph, and the
bytes saved for backward. The benchmark table shows how compile time grows with them.
"""

from __future__ import annotations

import pytest
import torch

import zerocompile
from micro_gpt import FIXED_COST_MODEL, gpt, make_batch

LAYER_COUNTS = [2, 4, 8, 16, 32]

OPTIONS = {"stage": 3, "inner_compiler": "eager", "cost_model": FIXED_COST_MODEL}


def _fresh_model(layers: int):
    """Setup of one round: forget every compiled frame, build an unsharded model.

    A new model is needed each round because compiling shards the parameters in place.
    Returns ``(args, kwargs)`` as ``benchmark.pedantic`` expects from ``setup``.
    """
    torch._dynamo.reset()
    torch.manual_seed(0)
    return (gpt(layers), make_batch()), {}


def _compile_and_step(model, batch) -> float:
    """Compile ``model`` with the zero backend and run one forward and backward."""
    compiled = torch.compile(model, backend="zero", options=OPTIONS)
    loss = compiled(*batch)
    loss.backward()
    return loss.item()


def _latest_frame_report() -> dict | None:
    """The report of the frame compiled last (older frames may not be collected yet)."""
    reports = zerocompile.frame_reports()
    return max(reports, key=lambda r: r["compiled_at_ns"]) if reports else None


def _collective_counts(report: dict, graph: str) -> dict:
    """``{kind: count}`` of the collectives one run of ``graph`` issues."""
    return {kind: totals["count"] for kind, totals in report[graph].items() if totals["count"]}


@pytest.fixture(scope="module", autouse=True)
def _warm_up(fake_world_8):
    """Compile a 1-block model once so that no measured round pays for one-time costs
    (lazy imports of Dynamo/AOTAutograd modules, first-use initialisation)."""
    _compile_and_step(*_fresh_model(1)[0])
    torch._dynamo.reset()


@pytest.mark.benchmark(group="pass pipeline: compile + first step, ZeRO-3, 8 fake ranks")
@pytest.mark.parametrize("layers", LAYER_COUNTS)
def test_compile_one_step(benchmark, fake_world_8, layers):
    """Time compile + one forward/backward of a ``layers``-block GPT (3 cold rounds)."""
    loss = benchmark.pedantic(_compile_and_step, setup=lambda: _fresh_model(layers), rounds=3, iterations=1)
    assert torch.isfinite(torch.tensor(loss))

    report = _latest_frame_report()
    assert report is not None, "no compiled frame was reported"
    results = report["results"]
    tagged = results.get("tag_collectives", {})
    bucketing = results.get("bucketing", {})
    benchmark.extra_info.update({
        "layers": layers,
        "parameters": sum(p.numel() for p in gpt(layers).parameters()),
        "world_size": fake_world_8,
        "frames": len(zerocompile.frame_reports()),
        "param_gathers_tagged": tagged.get("param_gathers"),
        "grad_reduce_scatters_tagged": tagged.get("grad_reduce_scatters"),
        "forward_all_gathers_before_bucketing": bucketing.get("forward", {}).get("all_gather", {}).get("before"),
        "backward_all_gathers_before_bucketing": bucketing.get("backward", {}).get("all_gather", {}).get("before"),
        "forward_collectives": _collective_counts(report, "forward"),
        "backward_collectives": _collective_counts(report, "backward"),
        "saved_activation_bytes": results.get("saved_activation_bytes"),
    })
