"""HF gradient checkpointing (``model.gradient_checkpointing_enable()``, reentrant and not) with
``backend="zero"`` on 2 gloo ranks: the same losses and final weights as one process on the whole
batch at stages 0-3 (``CASES``), and every decoder layer sharded: the model state each rank holds is the ZeRO
formula's (the run without checkpointing holds exactly that too, as measured)."""

from __future__ import annotations

import functools

import pytest
import torch

import zerocompile
from dist_utils import run_ranks

transformers = pytest.importorskip("transformers")

LLAMA = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
MODES = {"plain": None, "reentrant": True, "non_reentrant": False}   # plain: the references only
CASES = [("reentrant", 0), ("non_reentrant", 1)] + [(mode, stage) for mode in ("reentrant", "non_reentrant")
                                                    for stage in (2, 3)]
"""Each mode at stages 2 and 3 (whole parameters, reduced gradients; gathered in the forward and
again in the recomputation), stages 0 and 1 once each: a checkpointed block is traced and
recomputed alike at stages 0-2, where the parameters are whole (8 configurations took 60 s)."""
STEPS = 2


def _llama(mode: str):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    if MODES[mode] is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": MODES[mode]})
    return model.train()


def _batches():
    ids = torch.randint(0, 128, (STEPS, 4, 8), generator=torch.Generator().manual_seed(1))
    return list(ids)


@functools.cache
def _reference(mode: str) -> dict:
    """One process, whole batch, plain PyTorch (checkpointing as configured)."""
    model = _llama(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _model_state_bytes(model, opt) -> int:
    """Parameter, gradient and optimizer-state bytes this rank holds for ``model``: the storages
    each parameter's shard state keeps alive (shard, replica, parameter, their gradients), the
    whole parameter and gradient of a parameter no frame sharded, and the optimizer's state."""
    from zerocompile.runtime.sharded_param import get_state

    params, grads = {}, {}
    for p in model.parameters():
        sp = get_state(p)
        if sp is None:
            params[p.untyped_storage()._cdata] = p.untyped_storage().nbytes()
            if p.grad is not None:
                grads[p.grad.untyped_storage()._cdata] = p.grad.untyped_storage().nbytes()
            continue
        ps, gs = sp.storages()
        params.update(ps)
        grads.update(gs)
    return sum(params.values()) + sum(grads.values()) + opt.state_bytes()


def _zero_run(rank: int, world: int, mode: str, stage: int) -> dict:
    from zerocompile.runtime.sharded_param import get_state

    torch._dynamo.reset()
    model = _llama(mode)
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    per = 4 // world
    losses, held = [], 0
    for ids in _batches():
        mine = ids[rank * per:(rank + 1) * per]
        loss = compiled(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        held = _model_state_bytes(model, opt)     # after the step, gradients still held
        opt.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return {"losses": losses, "held": held, "state": zerocompile.full_state_dict(compiled, rank0_only=False),
            "unsharded": [n for n, p in model.named_parameters() if get_state(p) is None]}


def _all_runs(rank: int, world: int) -> dict:
    return {(mode, stage): _zero_run(rank, world, mode, stage) for mode, stage in CASES}


def _formula_bytes(stage: int, world: int) -> int:
    """Parameter, gradient and AdamW-state bytes per rank by the ZeRO formulas (fp32: 4 bytes
    per element of each, 8 of Adam's two moments): stage 0 holds 16Ψ, stage 1 8Ψ + 8Ψ/N, stage
    2 4Ψ + 12Ψ/N, stage 3 16Ψ/N; the sharded parts padded to a multiple of N elements per
    parameter."""
    sizes = [p.numel() for p in _llama("plain").parameters()]
    psi, shards = sum(sizes), sum(-(-n // world) for n in sizes)
    return {0: 16 * psi, 1: 8 * psi + 8 * shards, 2: 4 * psi + 12 * shards, 3: 16 * shards}[stage]


@pytest.fixture(scope="module")
def runs(once_per_run):
    return once_per_run("test_gradient_checkpointing.runs", lambda: run_ranks(_all_runs, 2))


@pytest.mark.parametrize("mode,stage", CASES)
def test_checkpointed_hf_llama_matches_one_process_and_stays_sharded(runs, mode, stage):
    want = _reference(mode)
    plain_ref = _reference("plain")
    # checkpointing itself changes no number (the recomputation is exact)
    assert want["losses"] == pytest.approx(plain_ref["losses"], rel=1e-6)
    for rank, r in enumerate(runs):
        got = r[(mode, stage)]
        assert got["unsharded"] == [], (rank, got["unsharded"])
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), (rank, got["losses"], want["losses"])
        for key, value in want["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
        assert got["held"] == _formula_bytes(stage, len(runs)), (rank, got["held"], _formula_bytes(stage, len(runs)))


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.ids = torch.randint(0, 128, (n, 8), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer_args(out: str, per_device: int):
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=per_device, gradient_checkpointing=True, learning_rate=1e-2,
        max_steps=2, logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], seed=0, disable_tqdm=True)


def _zero_trainer(rank: int, world: int, out: str) -> dict:
    import os

    from zerocompile.integrations.transformers import ZeroTrainer
    from zerocompile.runtime.sharded_param import get_state

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch._dynamo.reset()
    trainer = ZeroTrainer(model=_llama("plain"), args=_trainer_args(out, 2), train_dataset=_Tokens(8),
                          zero_options={"stage": 3, "inner_compiler": "eager"})
    trainer.train()
    model = trainer.model
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "checkpointing": model.is_gradient_checkpointing,
            "unsharded": [n for n, p in model.named_parameters() if get_state(p) is None]}


def test_zero_trainer_with_gradient_checkpointing_matches_trainer_and_shards_every_layer(tmp_path):
    """``ZeroTrainer`` with ``TrainingArguments(gradient_checkpointing=True)`` at stage 3 on 2
    ranks: the layers are checkpointed and sharded, and the losses equal a plain ``Trainer``'s
    in one process on the whole batch."""
    reference = transformers.Trainer(model=_llama("plain"), args=_trainer_args(str(tmp_path / "ref"), 4),
                                     train_dataset=_Tokens(8))
    reference.train()
    want = [h["loss"] for h in reference.state.log_history if "loss" in h]
    assert len(want) == 2
    for rank, r in enumerate(run_ranks(_zero_trainer, 2, str(tmp_path / "zero"))):
        assert r["checkpointing"], rank
        assert r["unsharded"] == [], (rank, r["unsharded"])
        assert r["losses"] == pytest.approx(want, rel=1e-5), (rank, r["losses"], want)
