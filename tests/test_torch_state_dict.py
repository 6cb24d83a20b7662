"""torch's own distributed state-dict API (``torch.distributed.checkpoint.state_dict``) on a
zerocompile model and ZeroOptimizer, torchtitan's way: ``get_state_dict`` + ``dcp.save``; then a
fresh model and optimizer, ``get_state_dict`` as the template, ``dcp.load``, ``set_state_dict``,
and training on. At every stage on 2 gloo ranks, against an uninterrupted run and one process."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
import zerocompile
from dist_utils import run_ranks
from harness import train_on_rank_slices
from models import make_batch, make_model

MODEL = "tied"          # tied embedding / head, a buffer, a graph break; shards cut rows
LR = 1e-2


def _batches(start, stop):
    return (make_batch(MODEL, step, 8) for step in range(start, stop))


def _build(stage, seed=0, **options):
    model = torch.compile(make_model(MODEL, seed=seed), backend="zero",
                          options={"stage": stage, "inner_compiler": "eager", **options})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return model, opt


def _load(model, opt, path):
    """torchtitan's resume: the model's and optimizer's own state dicts as the template."""
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _kinds(state: dict) -> dict:
    return {key: type(value).__name__ for key, value in state.items()}


def _worker(rank, world, root):
    out = {}
    for stage in range(4):
        path = os.path.join(root, f"stage{stage}")
        model, opt = _build(stage)
        first = train_on_rank_slices(model, opt, _batches(0, 2), rank, world)
        msd, osd = get_state_dict(model, opt)
        kinds = {"model": _kinds(msd), "optim": _kinds(osd["state"]["wte.weight"])}
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        saved = zerocompile.full_state_dict(model)
        if stage == 3:
            try:
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
                kinds["full_state_dict"] = "no error"
            except NotImplementedError as err:
                kinds["full_state_dict"] = str(err)
        uninterrupted = train_on_rank_slices(model, opt, _batches(2, 4), rank, world)
        final = zerocompile.full_state_dict(model)
        # back to step 2 in the trained model: its state dicts hold the shards (DTensors) now
        _load(model, opt, path)
        again = train_on_rank_slices(model, opt, _batches(2, 4), rank, world)
        torch._dynamo.reset()
        fresh, fresh_opt = _build(stage, seed=123)          # torchtitan: load before the first forward
        _load(fresh._orig_mod if stage % 2 else fresh, fresh_opt, path)    # the original module works too
        resumed = train_on_rank_slices(fresh, fresh_opt, _batches(2, 4), rank, world)
        out[stage] = {"first": first, "uninterrupted": uninterrupted, "again": again, "resumed": resumed,
                      "final": final, "resumed_final": zerocompile.full_state_dict(fresh), "saved": saved,
                      "kinds": kinds}
        torch._dynamo.reset()
    # stage 2 with a param_dtype: the parameters' storage is freed too, so they come as DTensors,
    # and loading one back all-gathers the bfloat16 replica
    model, opt = _build(2, param_dtype="bfloat16")
    train_on_rank_slices(model, opt, _batches(0, 2), rank, world)
    path = os.path.join(root, "stage2-bf16")
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    uninterrupted = train_on_rank_slices(model, opt, _batches(2, 4), rank, world)
    final = zerocompile.full_state_dict(model)
    _load(model, opt, path)
    again = train_on_rank_slices(model, opt, _batches(2, 4), rank, world)
    out["bf16"] = {"kinds": _kinds(msd), "uninterrupted": uninterrupted, "again": again, "final": final,
                   "again_final": zerocompile.full_state_dict(model)}
    torch._dynamo.reset()
    return out


def _one_rank_worker(rank, world, path, stage):
    """The 2-rank checkpoint resumed on one rank (DCP reshards), at another stage."""
    model, opt = _build(stage, seed=7)
    _load(model, opt, path)
    return train_on_rank_slices(model, opt, _batches(2, 4), rank, world), zerocompile.full_state_dict(model)


def _reference():
    model = make_model(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = train_on_rank_slices(model, opt, _batches(0, 2), 0, 1)
    at_save = ({k: v.clone() for k, v in model.state_dict().items()},
               {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in model.named_parameters()})
    losses += train_on_rank_slices(model, opt, _batches(2, 4), 0, 1)
    return losses, at_save, model.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, once_per_run):
    def compute():
        root = str(tmp_path_factory.mktemp("torch_state_dict"))      # kept until the run ends
        results = run_ranks(_worker, 2, root)
        one_rank = run_ranks(_one_rank_worker, 1, os.path.join(root, "stage2"), 3)[0]
        return root, results, one_rank, _reference()

    return once_per_run("test_torch_state_dict.runs", compute)


def _close(a, b):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stage", range(4))
def test_save_and_resume_through_torch_state_dict_api(runs, stage):
    _, results, _, (ref_losses, _, ref_final) = runs
    for rank_result in results:
        r = rank_result[stage]
        _close(r["first"] + r["uninterrupted"], ref_losses)
        assert r["resumed"] == r["uninterrupted"], "a fresh model resumed from the checkpoint"
        assert r["again"] == r["uninterrupted"], "the trained model loaded back to step 2"
    r = results[0][stage]
    for key, value in ref_final.items():
        assert torch.equal(r["resumed_final"][key], r["final"][key]), key
        torch.testing.assert_close(r["final"][key], value, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stage", range(4))
def test_saved_values_are_the_full_model_and_optimizer_state(runs, stage):
    """What DCP wrote, read in one process into plain tensors: the full parameters and the full
    optimizer state in the parameters' shapes, as a single process has them after 2 steps."""
    root, results, _, (_, (ref_params, ref_optim), _) = runs
    model = make_model(MODEL)
    plain = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()},
             "optim": {"state": {name: {"step": torch.tensor(0.0), "exp_avg": torch.empty_like(p),
                                        "exp_avg_sq": torch.empty_like(p)}
                                 for name, p in model.named_parameters()}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "assuming the intent is to load in a single process"
        dcp.load(plain, checkpoint_id=os.path.join(root, f"stage{stage}"), no_dist=True)
    saved = results[0][stage]["saved"]
    for key, value in plain["model"].items():
        assert torch.equal(value, saved[key]), key
        torch.testing.assert_close(value, ref_params[key], atol=1e-5, rtol=1e-5)
    for name, values in plain["optim"]["state"].items():
        for k, v in values.items():
            torch.testing.assert_close(v, ref_optim[name][k].to(v.dtype), atol=1e-5, rtol=1e-5, msg=f"{name}.{k}")


def test_state_dict_values_are_dtensors_where_state_is_sharded(runs):
    _, results, _, _ = runs
    kinds = {stage: results[0][stage]["kinds"] for stage in range(4)}
    # parameters: whole where each rank holds them (stages 0-2), the shards as DTensors at stage 3
    assert set(kinds[0]["model"].values()) == {"Tensor"}
    assert set(kinds[2]["model"].values()) == {"Tensor"}
    assert kinds[3]["model"]["wte.weight"] == "DTensor" and kinds[3]["model"]["scale"] == "Tensor"
    # optimizer state: sharded at stages 1-3 (the step count stays a plain tensor)
    assert kinds[0]["optim"] == {"step": "Tensor", "exp_avg": "Tensor", "exp_avg_sq": "Tensor"}
    for stage in (1, 2, 3):
        assert kinds[stage]["optim"] == {"step": "Tensor", "exp_avg": "DTensor", "exp_avg_sq": "DTensor"}
    assert "zerocompile.full_state_dict(model)" in kinds[3]["full_state_dict"]


def test_a_param_dtype_model_reloads_its_dtensors_exactly(runs):
    _, results, _, _ = runs
    for rank_result in results:
        r = rank_result["bf16"]
        assert r["kinds"]["wte.weight"] == "DTensor"
        assert r["again"] == r["uninterrupted"]
    r = results[0]["bf16"]
    for key, value in r["final"].items():
        assert torch.equal(r["again_final"][key], value), key


def test_a_two_rank_checkpoint_resumes_on_one_rank_at_another_stage(runs):
    _, results, (losses, final), (ref_losses, _, ref_final) = runs
    _close(results[0][2]["first"] + losses, ref_losses)
    for key, value in ref_final.items():
        torch.testing.assert_close(final[key], value, atol=1e-5, rtol=1e-5)
