"""HF Trainer and Accelerate with zerocompile (``zerocompile.integrations``), on 2 gloo ranks
against the same training in one process: ``ZeroTrainer`` at stages 2 and 3 (gradient
accumulation, clipping, a linear schedule with warmup, evaluation, checkpoint and resume) and
a hand-written Accelerate loop with ``ZeroAccelerator`` at stages 0, 2 and 3 (and its
``save_state`` / ``load_state`` resume against the run that went on, and ``save_model`` read back
by ``from_pretrained``, also on 3 ranks); both refuse an Accelerate state without the CPU flag."""

from __future__ import annotations

import csv
import importlib.metadata
import os
import re
import sys

import pytest
import torch

import zerocompile
from dist_utils import run_ranks

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

# one decoder layer: what these tests check is the Trainer / Accelerate plumbing (data sharding,
# accumulation, clipping, schedules, checkpoints, saving), the same whatever the depth, and each
# run compiles the model (twice with a resume); the decoder-layer loop under checkpointing and
# sharding is test_gradient_checkpointing.py's and test_eager_regions.py's (2 layers)
LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 3):
        self.ids = torch.randint(0, 128, (n, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _args(out: str, per_device: int, **extra):
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=1e-2, lr_scheduler_type="linear",
        warmup_steps=1, max_steps=4, logging_steps=1, save_strategy="steps", save_steps=2, use_cpu=True,
        report_to=[], seed=0, disable_tqdm=True, **extra)


def _train_losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _distributed_env(rank: int, world: int) -> None:
    # what torchrun sets, and Accelerate reads to know it runs on several processes
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def _trainer_runs(rank, world, out):
    from zerocompile.integrations.transformers import ZeroTrainer

    _distributed_env(rank, world)
    results = {}
    for stage in (2, 3):
        torch._dynamo.reset()
        where = os.path.join(out, f"stage{stage}")
        # a DeepSpeed config's csv_monitor: rank 0 writes each optimizer step's figures
        monitor = {"csv_monitor": {"enabled": True, "output_path": where, "job_name": "monitor"}}
        trainer = ZeroTrainer(model=_llama(), args=_args(where, 2, ddp_backend="gloo"), train_dataset=Tokens(32),
                              eval_dataset=Tokens(8, seed=4),
                              zero_options={"stage": stage, "inner_compiler": "eager", **monitor})
        trainer.train()
        evaluated = trainer.evaluate()["eval_loss"]
        trained = zerocompile.full_state_dict(trainer.model)
        torch._dynamo.reset()
        resumed = ZeroTrainer(model=_llama(), args=_args(where, 2, ddp_backend="gloo"), train_dataset=Tokens(32),
                              zero_options={"stage": stage, "inner_compiler": "eager"})
        resumed.train(resume_from_checkpoint=os.path.join(where, "checkpoint-2"))
        results[stage] = {"losses": _train_losses(trainer), "eval": evaluated, "trained": trained,
                          "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
                          "resumed": _train_losses(resumed), "resumed_state": zerocompile.full_state_dict(resumed.model)}
    return results


def test_zero_trainer_matches_a_single_process_trainer(tmp_path):
    """Per-step training losses and the eval loss of ``ZeroTrainer`` on 2 ranks (2 samples each
    per micro-step) equal a plain ``Trainer``'s in one process (4 per micro-step) at stages 2
    and 3; the checkpoint of step 2 holds an HF model ``from_pretrained`` reads, and resuming
    from it gives the same losses for steps 3-4 and the same final weights."""
    reference = transformers.Trainer(model=_llama(), args=_args(str(tmp_path / "ref"), 4), train_dataset=Tokens(32),
                                     eval_dataset=Tokens(8, seed=4))
    reference.train()
    want, want_eval = _train_losses(reference), reference.evaluate()["eval_loss"]
    assert len(want) == 4
    results = run_ranks(_trainer_runs, 2, str(tmp_path / "zero"))
    for rank, r in enumerate(results):
        for stage, run in r.items():
            assert run["losses"] == pytest.approx(want, rel=1e-5), (rank, stage, run["losses"], want)
            assert run["eval"] == pytest.approx(want_eval, rel=1e-5), (rank, stage, run["eval"], want_eval)
            assert run["resumed"] == pytest.approx(want, rel=1e-5), (rank, stage, run["resumed"])
    for stage, run in results[0].items():
        # the monitor's gradient norms are the ones the Trainer logged (its clipping's, before clipping)
        with open(tmp_path / "zero" / f"stage{stage}" / "monitor" / "Train_Samples_grad_norm.csv") as f:
            rows = list(csv.reader(f))[1:]
        assert [int(x) for x, _ in rows] == [1, 2, 3, 4]
        assert [float(v) for _, v in rows] == pytest.approx(run["grad_norms"], rel=1e-5) and len(rows) == 4
        assert run["trained"]
        for key, value in run["trained"].items():
            assert torch.equal(run["resumed_state"][key], value), (stage, key)
        saved = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "zero" / f"stage{stage}" / "checkpoint-4"))
        for key, value in saved.state_dict().items():
            assert torch.equal(value, run["trained"][key]), (stage, key)


def _refusals(rank, world, out: str) -> dict:
    """What ZeroTrainer and ZeroAccelerator say when built without their CPU flag on 2 gloo
    ranks (Accelerate then sets itself up with distributed_type NO): nothing is trained first."""
    from accelerate.state import AcceleratorState
    from zerocompile.integrations.accelerate import ZeroAccelerator
    from zerocompile.integrations.transformers import ZeroTrainer

    _distributed_env(rank, world)
    said = {}
    args = transformers.TrainingArguments(output_dir=out, ddp_backend="gloo", report_to=[])   # no use_cpu
    try:
        ZeroTrainer(model=_llama(), args=args, zero_options={"stage": 2, "inner_compiler": "eager"})
    except RuntimeError as err:
        said["trainer"] = str(err)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        ZeroAccelerator()                                                                          # no cpu=True
    except RuntimeError as err:
        said["accelerator"] = str(err)
    AcceleratorState._reset_state(reset_partial_state=True)
    torch._dynamo.reset()
    return said


def _accelerate_runs(rank, world, out):
    _distributed_env(rank, world)
    return {stage: _accelerate_loop(stage, os.path.join(out, f"stage{stage}")) for stage in (0, 2, 3)}


def _accelerate_setup(stage: int):
    from zerocompile.integrations.accelerate import ZeroAccelerator

    torch._dynamo.reset()
    accelerator = ZeroAccelerator(cpu=True, gradient_accumulation_steps=2)
    model = _llama()
    model.compile(backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
    loader = torch.utils.data.DataLoader(Tokens(16), batch_size=2)
    return (accelerator, *accelerator.prepare(model, opt, loader, schedule))


def _accelerate_steps(accelerator, model, opt, loader, schedule, saved: str | None = None) -> tuple:
    """The loop; with ``saved``, ``accelerator.save_state(saved)`` after the second optimizer step."""
    norms, losses = [], []
    for i, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            schedule.step()
            opt.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
        if saved is not None and i == 3:
            accelerator.save_state(saved)
    return losses, norms


def _accelerate_loop(stage: int, saved: str) -> dict:
    """The loop from the start (saving its state after 2 of its 4 optimizer steps), then fresh
    objects resumed from that state with ``load_state``: the last 4 micro-steps again."""
    accelerator, model, opt, loader, schedule = _accelerate_setup(stage)
    losses, norms = _accelerate_steps(accelerator, model, opt, loader, schedule, saved)
    run = {"losses": losses, "norms": norms, "wrapped": type(model).__name__,
           "state": zerocompile.full_state_dict(model), "files": sorted(os.listdir(saved))}
    # the last lines of a fine-tuning script: the full model on the main process
    exported = saved + "-model"
    accelerator.save_model(model, exported)
    got = accelerator.get_state_dict(model)
    run["state_dict_keys"] = None if got is None else sorted(got)
    if accelerator.is_main_process:
        model.config.save_pretrained(exported)
    try:
        model.save_pretrained(exported + "-plain", is_main_process=accelerator.is_main_process)
        run["plain_save"] = "saved"
    except Exception as err:     # noqa: BLE001  (the test reads what it says)
        run["plain_save"] = f"{type(err).__name__}: {err}"
    run["exported"] = exported
    accelerator, model, opt, loader, schedule = _accelerate_setup(stage)
    accelerator.load_state(saved)
    run["resumed_losses"], run["resumed_norms"] = _accelerate_steps(
        accelerator, model, opt, accelerator.skip_first_batches(loader, 4), schedule)
    run["resumed_state"] = zerocompile.full_state_dict(model)
    return run


def _accelerate_reference():
    """The same loop in one process without Accelerate: batches of 4 (the two ranks' batches of
    2), the loss divided by the accumulation steps, torch's clipping, AdamW, the same schedule."""
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
    losses, norms = [], []
    for i, batch in enumerate(torch.utils.data.DataLoader(Tokens(16), batch_size=4)):
        loss = model(**batch).loss
        (loss / 2).backward()
        losses.append(loss.item())
        if i % 2 == 1:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            schedule.step()
            opt.zero_grad()
    return losses, norms, model.state_dict()


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory, once_per_run):
    """One 2-rank run for the Accelerate tests: the loop at stages 0, 2 and 3, each saved after
    step 2 and resumed from there."""
    return once_per_run("test_integrations.accelerate_runs",
                        lambda: run_ranks(_accelerate_runs, 2, str(tmp_path_factory.mktemp("accelerate"))))


def test_an_accelerate_loop_with_zero_accelerator_matches_one_process(accelerate_runs):
    """A plain Accelerate loop (accumulation over 2 micro-steps, ``accelerator.clip_grad_norm_``,
    a schedule) on 2 ranks at stages 0, 2 and 3: the model is not wrapped in DDP, the clipped
    norm is the global one, and losses and final weights equal one process's on the whole batch."""
    want_losses, want_norms, want_state = _accelerate_reference()
    for stage, r in ((stage, r) for runs in accelerate_runs for stage, r in runs.items()):
        assert r["wrapped"] == "LlamaForCausalLM", (stage, r["wrapped"])
        assert r["losses"] == pytest.approx(want_losses, rel=1e-5), (r["losses"], want_losses)
        assert r["norms"] == pytest.approx(want_norms, rel=1e-4), (r["norms"], want_norms)
        for key, value in r["state"].items():
            torch.testing.assert_close(value, want_state[key], rtol=1e-5, atol=1e-6)


def test_accelerate_save_state_and_load_state_resume_exactly(accelerate_runs):
    """``accelerator.save_state`` after 2 of 4 optimizer steps, then fresh objects and
    ``accelerator.load_state`` on the same 2 ranks, at stages 0, 2 and 3: the resumed micro-steps
    have the same losses and clipped norms as the run that went on, and the same final weights
    (the model and optimizer state went through zerocompile's sharded checkpoint, Accelerate's
    scheduler, step and RNG state through its own files)."""
    assert all(accelerate_runs[0][stage]["state"] for stage in (0, 2, 3))      # rank 0 holds the full states
    for rank, runs in enumerate(accelerate_runs):
        for stage in (0, 2, 3):
            r = runs[stage]
            assert "zerocompile_state" in r["files"] and "scheduler.bin" in r["files"], (stage, r["files"])
            assert "optimizer.bin" not in r["files"] and "model.safetensors" not in r["files"], (stage, r["files"])
            assert r["resumed_losses"] == r["losses"][4:], (rank, stage, r["resumed_losses"], r["losses"])
            assert r["resumed_norms"] == r["norms"][2:], (rank, stage, r["resumed_norms"], r["norms"])
            for key, value in r["state"].items():
                assert torch.equal(r["resumed_state"][key], value), (rank, stage, key)


def test_accelerate_save_model_writes_the_full_model_from_pretrained_reads(accelerate_runs):
    """``accelerator.save_model`` / ``get_state_dict`` gather the full state on the main process
    (None on the others, as Accelerate's DeepSpeed ZeRO-3 path), at every stage:
    ``from_pretrained`` loads the trained weights back. HF's own ``save_pretrained`` without a
    ``state_dict`` at stage 3 would read the shards: it refuses, naming the calls to use."""
    import transformers

    for rank, runs in enumerate(accelerate_runs):
        for stage in (0, 2, 3):
            r = runs[stage]
            if rank == 0:
                assert r["state_dict_keys"] == sorted(r["state"]), stage
                loaded = transformers.LlamaForCausalLM.from_pretrained(r["exported"]).state_dict()
                for key, value in r["state"].items():
                    if key in loaded:       # a tied head is saved once
                        assert torch.equal(loaded[key], value), (stage, key)
                assert set(r["state"]) - set(loaded) <= {"lm_head.weight"}, (stage, set(r["state"]) - set(loaded))
            else:
                assert r["state_dict_keys"] is None, (rank, stage)
            if stage == 3:
                assert "zerocompile.save_pretrained(model, directory)" in r["plain_save"], r["plain_save"]
                assert "LlamaForCausalLM.save_pretrained" in r["plain_save"], r["plain_save"]
            else:
                assert r["plain_save"] == "saved", (stage, r["plain_save"])


def test_without_the_cpu_flag_every_rank_refuses_and_names_the_fix(tmp_path):
    """On a machine without GPUs, ``ZeroTrainer`` without ``use_cpu=True`` and ``ZeroAccelerator``
    without ``cpu=True`` would leave Accelerate at distributed_type NO (no data sharding) while
    zerocompile shards over 2 ranks; both refuse on every rank, naming the flag."""
    for rank, said in enumerate(run_ranks(_refusals, 2, str(tmp_path / "refused"))):
        assert "use_cpu=True" in said.get("trainer", ""), (rank, said)
        assert "cpu=True to ZeroAccelerator" in said.get("accelerator", ""), (rank, said)
        for text in said.values():
            assert "distributed_type NO" in text and "ACCELERATE_USE_CPU=1" in text, (rank, text)


def test_declared_versions_match_pyproject_and_the_installed_ones():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    from zerocompile.integrations.accelerate import ACCELERATE_VERSIONS
    from zerocompile.integrations.transformers import TRANSFORMERS_VERSIONS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        hf = tomllib.load(f)["project"]["optional-dependencies"]["hf"]
    assert f"transformers{','.join(TRANSFORMERS_VERSIONS)}" in hf and f"accelerate{','.join(ACCELERATE_VERSIONS)}" in hf
    for dist, (low, high) in (("transformers", TRANSFORMERS_VERSIONS), ("accelerate", ACCELERATE_VERSIONS)):
        major_minor = tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version(dist))[:2])
        lo = tuple(int(x) for x in re.findall(r"\d+", low)[:2])
        hi = tuple(int(x) for x in re.findall(r"\d+", high)[:1])
        assert lo <= major_minor and major_minor[:1] < hi, (dist, major_minor, low, high)


def _save_model_on_ranks(rank, world, out):
    """One Accelerate step at stage 3 (a batch of 6 rows: 2 per rank), then ``save_model``."""
    _distributed_env(rank, world)
    accelerator, model, opt, loader, schedule = _accelerate_setup(3)
    batch = next(iter(torch.utils.data.DataLoader(Tokens(6 * world), batch_size=6)))
    mine = {k: v[rank * 6 // world:(rank + 1) * 6 // world] for k, v in batch.items()}
    accelerator.backward(model(**mine).loss)
    opt.step()
    opt.zero_grad()
    accelerator.save_model(model, out)
    if accelerator.is_main_process:
        model.config.save_pretrained(out)       # save_model writes the weights only
    return {"state": zerocompile.full_state_dict(model, rank0_only=False),
            "main": accelerator.is_main_process}


def test_accelerate_save_model_at_stage_3_on_three_ranks(tmp_path):
    """``accelerator.save_model`` at stage 3 on 3 ranks (shards padded to a multiple of 3): the
    main process writes the full model, which ``from_pretrained`` reads back equal to the
    trained weights every rank gathers."""
    out = str(tmp_path / "model")
    ranks = run_ranks(_save_model_on_ranks, 3, out)
    assert [r["main"] for r in ranks] == [True, False, False]
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    for rank, r in enumerate(ranks):
        assert set(r["state"]) - set(loaded) <= {"lm_head.weight"}, rank      # a tied head is saved once
        for key, value in loaded.items():
            assert torch.equal(r["state"][key], value), (rank, key)
