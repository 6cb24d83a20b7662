"""A DeepSpeed run moved onto zerocompile from its checkpoint (``load_deepspeed_checkpoint``):
DeepSpeed itself (on CPU over gloo) trains a model at ZeRO stage 2 and 3 on 2 ranks for some
steps and saves (and at stage 1); zerocompile loads that checkpoint (the master weights, AdamW's moments and step,
the hyperparameters, the LR schedule) and goes on, on 2, 1 and 3 ranks, and its losses and final
weights are DeepSpeed's going on from the same checkpoint (read by DeepSpeed's own
``zero_to_fp32``), within float32 tolerance. Unsupported layouts are refused by name."""

from __future__ import annotations

import os

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from models import make_batch, make_model

BATCH = 12          # the global batch: 6 per rank on 2 ranks, 12 on 1, 4 on 3
BEFORE, AFTER = 3, 2
MODEL = "tied"


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def _local(step: int, rank: int, world: int):
    x, y = make_batch(MODEL, step, BATCH)
    rows = BATCH // world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def _global_loss(loss: torch.Tensor, world: int) -> float:
    loss = loss.detach().clone()
    if world > 1:
        torch.distributed.all_reduce(loss)
    return float(loss) / world


def _deepspeed_run(rank: int, world: int, out: str, stage: int) -> dict:
    """DeepSpeed trains BEFORE steps and saves; goes on AFTER steps (the losses) and saves again,
    and its own ``zero_to_fp32`` reads the final weights. DeepSpeed is imported in the ranks only
    (it patches torch when imported)."""
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    model = make_model(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=opt, config=config,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, _schedule))
    losses = []
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            engine.save_checkpoint(os.path.join(out, "saved"))
        loss = engine(*_local(step, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(_global_loss(loss, world))
    engine.save_checkpoint(os.path.join(out, "end"))
    torch.distributed.barrier()
    final = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, "end")) if rank == 0 else None
    return {"losses": losses[BEFORE:], "final": final}


def _zerocompile_run(rank: int, world: int, saved: str, stage: int) -> dict:
    """zerocompile loads DeepSpeed's checkpoint and goes on AFTER steps."""
    torch._dynamo.reset()
    model = make_model(MODEL, seed=7)              # other weights: the checkpoint's must replace them
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1.0, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    info = zerocompile.load_deepspeed_checkpoint(saved, model, opt, lr_scheduler=schedule)
    losses = []
    for step in range(BEFORE, BEFORE + AFTER):
        loss = compiled(*_local(step, rank, world))
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad()
        losses.append(_global_loss(loss, world))
    return {"losses": losses, "state": zerocompile.full_state_dict(model), "info": info,
            "hyper": {k: v for k, v in opt.param_groups[0].items() if k in ("weight_decay", "betas", "eps")}}


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory, once_per_run):
    def compute():
        root = tmp_path_factory.mktemp("deepspeed_checkpoint")
        out = {}
        for stage in (1, 2, 3):
            where = root / f"stage{stage}"
            ranks = run_ranks(_deepspeed_run, 2, str(where), stage)
            assert ranks[0]["losses"] == ranks[1]["losses"]
            out[stage] = {"losses": ranks[0]["losses"], "final": {k: v.detach() for k, v in ranks[0]["final"].items()},
                          "saved": str(where / "saved")}
        return out
    return once_per_run("test_deepspeed_checkpoint.runs", compute)


def _check(run: dict, want: dict) -> None:
    assert run["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6), (run["losses"], want["losses"])
    assert run["info"]["global_steps"] == BEFORE and run["info"]["world_size"] == 2
    assert run["hyper"] == {"weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}   # DeepSpeed's, not ours
    assert set(want["final"]) <= set(run["state"])
    for key, value in want["final"].items():
        torch.testing.assert_close(run["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_deepspeed_run_goes_on_under_zerocompile_as_under_deepspeed(deepspeed_runs, stage):
    """The same stage on the same 2 ranks."""
    want = deepspeed_runs[stage]
    results = run_ranks(_zerocompile_run, 2, want["saved"], stage)
    for r in results:
        assert r["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    _check(results[0], want)


@pytest.mark.parametrize("world, stage, ds_stage", [(1, 3, 2), (3, 2, 3)])
def test_it_goes_on_at_another_world_size_and_stage(deepspeed_runs, world, stage, ds_stage):
    want = deepspeed_runs[ds_stage]
    results = run_ranks(_zerocompile_run, world, want["saved"], stage)
    _check(results[0], want)


def test_what_it_cannot_read_is_refused_by_name(deepspeed_runs, tmp_path):
    from zerocompile import DeepSpeedCheckpointError

    model = make_model(MODEL)
    with pytest.raises(DeepSpeedCheckpointError, match="is not a directory"):
        zerocompile.load_deepspeed_checkpoint(tmp_path / "nothing", model)
    with pytest.raises(DeepSpeedCheckpointError, match="no ZeRO optimizer files"):
        zerocompile.load_deepspeed_checkpoint(tmp_path, model)
    (tmp_path / "zero").mkdir()
    with pytest.raises(DeepSpeedCheckpointError, match="universal checkpoint"):
        zerocompile.load_deepspeed_checkpoint(tmp_path, model)
    with pytest.raises(DeepSpeedCheckpointError, match="are not the model's"):
        zerocompile.load_deepspeed_checkpoint(deepspeed_runs[2]["saved"], make_model("mlp"))
    saved = deepspeed_runs[3]["saved"]
    tag = open(os.path.join(saved, "latest")).read().strip()
    for name, edit, message in (
            ("pipeline", lambda s: s["checkpoint_parallel_dimensions"].update(pp_degree=2), "pipeline- or tensor"),
            ("nvme", lambda s: s["ds_config"]["zero_optimization"].update(
                offload_optimizer={"device": "nvme", "nvme_path": "/x"}), "NVMe")):
        copy = tmp_path / name / tag
        copy.mkdir(parents=True)
        for f in os.listdir(os.path.join(saved, tag)):
            data = open(os.path.join(saved, tag, f), "rb").read()
            (copy / f).write_bytes(data)
        model_file = copy / "zero_pp_rank_0_mp_rank_00_model_states.pt"       # stage 3: one per rank
        state = torch.load(model_file, weights_only=False)
        edit(state)
        torch.save(state, model_file)
        with pytest.raises(DeepSpeedCheckpointError, match=message):
            zerocompile.load_deepspeed_checkpoint(copy, make_model(MODEL))
