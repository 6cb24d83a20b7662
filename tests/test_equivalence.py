"""Every stage trains exactly as one process on the whole global batch would (gloo, eager inner compiler).

Each test runs all of its cases (stages, optimizers) in one spawned group of ranks and checks
every case against its own single-process reference; a failure names the case."""

from __future__ import annotations

import pytest

from dist_utils import run_ranks
from harness import Run, assert_matches, reference, zero_train, zero_train_many


def _check_each(runs, results, label, **tol):
    assert len(results) == len(runs)
    for run, res in zip(runs, results):
        try:
            assert_matches(res, reference(run), **tol)
        except AssertionError as err:
            raise AssertionError(f"{label} stage {run.stage} {run.opt}: {err}") from None


def test_stage_matches_single_process_sgd_and_adamw():
    runs = [Run(model="mlp", stage=stage, opt=opt, steps=5) for stage in (0, 1, 2, 3) for opt in ("sgd", "adamw")]
    _check_each(runs, run_ranks(zero_train_many, 2, runs)[0], "mlp")


def test_tied_weights_graph_break_buffer_accumulation_and_clipping():
    """Tied embedding/head used by two frames, a buffer, 3 micro-batches per step, clipping."""
    runs = [Run(model="tied", stage=stage, opt="adamw", steps=5, accum=3, clip=0.5) for stage in (0, 1, 2, 3)]
    _check_each(runs, run_ranks(zero_train_many, 2, runs)[0], "tied")


def test_frozen_parameter_stays_unchanged():
    runs = [Run(model="frozen", stage=stage, opt="adamw", steps=4) for stage in (1, 3)]
    _check_each(runs, run_ranks(zero_train_many, 2, runs)[0], "frozen")


def test_four_ranks_gpt():
    runs = [Run(model="gpt", stage=stage, opt="adamw", steps=4, clip=1.0) for stage in (0, 3)]
    _check_each(runs, run_ranks(zero_train_many, 4, runs)[0], "gpt on 4 ranks", atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_size_one_without_process_group(stage):
    run = Run(model="tied", stage=stage, opt="adamw", steps=3, clip=1.0)
    assert_matches(zero_train(0, 1, run), reference(run))


def test_bf16_within_bf16_tolerance():
    runs = [Run(model="gpt", stage=stage, opt="adamw", steps=4, param_dtype="bfloat16") for stage in (2, 3)]
    for run, res in zip(runs, run_ranks(zero_train_many, 2, runs)[0]):
        stage = run.stage
        ref = reference(run)
        # bf16 has 8 mantissa bits: relative error ~4e-3 per op; losses of a few units
        assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) < 5e-2, stage
        for key, value in ref["state"].items():
            assert res["state"][key].dtype == value.dtype, (stage, key)  # master weights stay fp32
            assert (res["state"][key] - value).abs().max().item() < 5e-2, (stage, key)
        if stage == 3:  # the cast happens before the all-gather: 2 bytes per gathered element
            padded = sum(-(-v.numel() // 2) * 2 for k, v in ref["state"].items() if k != "head.weight")
            # forward gathers every parameter once (2 bytes/elem), backward re-gathers a subset;
            # fp32 gathers would be at least 4 bytes/elem in forward alone
            assert run.steps * 2 * padded <= res["stats"]["all_gather"]["bytes"] < run.steps * 4 * padded


def test_eager_module_sharing_a_sharded_parameter():
    """A torch.compiler.disable'd head tied to the compiled embedding: the stage-3 weight is
    gathered on demand for the eager code, and its eager gradient reaches the shard."""
    runs = [Run(model="eager_head", stage=stage, opt="adamw", steps=4, clip=1.0) for stage in (0, 1, 2, 3)]
    _check_each(runs, run_ranks(zero_train_many, 2, runs)[0], "eager_head")


def test_bf16_casts_float_inputs_at_every_stage():
    """An MLP fed float32 inputs: with param_dtype bf16 the inputs are cast, like FSDP2's
    cast_forward_inputs; every stage stays within bf16 tolerance of the fp32 reference."""
    runs = [Run(model="mlp", stage=stage, opt="sgd", steps=3, param_dtype="bfloat16") for stage in (0, 1, 2, 3)]
    results = run_ranks(zero_train_many, 2, runs)[0]
    for run, res in zip(runs, results):
        ref = reference(run)
        assert max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])) < 3e-2, run.stage
        for key, value in ref["state"].items():
            assert (res["state"][key] - value).abs().max().item() < 3e-2, (run.stage, key)


def test_three_ranks_every_sharded_stage():
    """World size 3: the tied LM across a graph break, and the MLP, none of whose parameter
    sizes (91, 13, 65, 5) divides by 3, so every one of its shards is padded."""
    runs = [Run(model="tied", stage=stage, opt="adamw", steps=3, batch=9, accum=2, clip=1.0) for stage in (1, 2, 3)]
    runs += [Run(model="mlp", stage=stage, opt="adamw", steps=3, batch=9, clip=1.0) for stage in (2, 3)]
    _check_each(runs, run_ranks(zero_train_many, 3, runs)[0], "3 ranks")
