"""HF Trainer and Accelerate with zerocompile (``zerocompile.integrations``), on 2 gloo ranks
against the same training in one process: ``ZeroTrainer`` at stages 2 and 3 (gradient
accumulation, clipping, a linear schedule with warmup, evaluation, checkpoint and resume) and
a hand-written Accelerate loop with ``ZeroAccelerator``."""

from __future__ import annotations

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

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
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
        trainer = ZeroTrainer(model=_llama(), args=_args(where, 2, ddp_backend="gloo"), train_dataset=Tokens(32),
                              eval_dataset=Tokens(8, seed=4), zero_options={"stage": stage, "inner_compiler": "eager"})
        trainer.train()
        evaluated = trainer.evaluate()["eval_loss"]
        trained = zerocompile.full_state_dict(trainer.model)
        torch._dynamo.reset()
        resumed = ZeroTrainer(model=_llama(), args=_args(where, 2, ddp_backend="gloo"), train_dataset=Tokens(32),
                              zero_options={"stage": stage, "inner_compiler": "eager"})
        resumed.train(resume_from_checkpoint=os.path.join(where, "checkpoint-2"))
        results[stage] = {"losses": _train_losses(trainer), "eval": evaluated, "trained": trained,
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
        assert run["trained"]
        for key, value in run["trained"].items():
            assert torch.equal(run["resumed_state"][key], value), (stage, key)
        saved = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "zero" / f"stage{stage}" / "checkpoint-4"))
        for key, value in saved.state_dict().items():
            assert torch.equal(value, run["trained"][key]), (stage, key)


def _accelerate_runs(rank, world):
    _distributed_env(rank, world)
    return {stage: _accelerate_loop(stage) for stage in (2, 3)}


def _accelerate_loop(stage: int) -> dict:
    from zerocompile.integrations.accelerate import ZeroAccelerator

    torch._dynamo.reset()
    accelerator = ZeroAccelerator(cpu=True, gradient_accumulation_steps=2)
    model = _llama()
    model.compile(backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
    loader = torch.utils.data.DataLoader(Tokens(16), batch_size=2)
    model, opt, loader, schedule = accelerator.prepare(model, opt, loader, schedule)
    norms, losses = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 0.5)))
            opt.step()
            schedule.step()
            opt.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    return {"losses": losses, "norms": norms, "wrapped": type(model).__name__,
            "state": zerocompile.full_state_dict(model)}


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


def test_an_accelerate_loop_with_zero_accelerator_matches_one_process():
    """A plain Accelerate loop (accumulation over 2 micro-steps, ``accelerator.clip_grad_norm_``,
    a schedule) on 2 ranks at stages 2 and 3: the model is not wrapped in DDP, the clipped norm
    is the global one, and losses and final weights equal one process's on the whole batch."""
    want_losses, want_norms, want_state = _accelerate_reference()
    for stage, r in ((stage, r) for runs in run_ranks(_accelerate_runs, 2) for stage, r in runs.items()):
        assert r["wrapped"] == "LlamaForCausalLM", (stage, r["wrapped"])
        assert r["losses"] == pytest.approx(want_losses, rel=1e-5), (r["losses"], want_losses)
        assert r["norms"] == pytest.approx(want_norms, rel=1e-4), (r["norms"], want_norms)
        for key, value in r["state"].items():
            torch.testing.assert_close(value, want_state[key], rtol=1e-5, atol=1e-6)


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
