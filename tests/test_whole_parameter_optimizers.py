"""Whole-parameter optimizers (Muon, Adafactor, a class of yours) on sharded models: each
sharded parameter stepped whole at one owner rank, the pieces moved by all-to-alls.

Against plain torch on one process and the whole batch. Muon's Newton-Schulz iteration
amplifies the reduction-order differences of data parallelism (a DDP-like run differs from one
process by about 3e-3 in the weights after a few steps, 1e-5 in the loss), so Muon is compared
at that tolerance; Adafactor at 1e-4."""

from __future__ import annotations

import os

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from harness import rank_slice
from models import make_batch, make_model

MUON = (torch.optim.Muon, {"lr": 0.02, "weight_decay": 0.01})
ADAMW = {"lr": 3e-3, "weight_decay": 0.01}
ADAFACTOR = (torch.optim.Adafactor, {"lr": 0.01, "weight_decay": 0.01})
MUON_TOL = dict(weights=3e-3, loss=1e-5)
ADAFACTOR_TOL = dict(weights=1e-4, loss=1e-4)
STEPS = 4
BATCH = 12          # divisible by 2 and 3 ranks


def _is_hidden_matrix(name: str, p) -> bool:
    """Muon's share, as people split it: the 2-D weights of the hidden layers."""
    return p.ndim == 2 and not any(k in name for k in ("wte", "wpe", "head"))


def _groups(model, optimizer: str):
    """Param groups for one ZeroOptimizer / torch optimizer set-up of ``optimizer``."""
    named = list(model.named_parameters())
    if optimizer == "adafactor":
        return [{"params": [p for _, p in named]}]
    hidden = [p for n, p in named if _is_hidden_matrix(n, p)]
    other = [p for n, p in named if not _is_hidden_matrix(n, p)]
    return [{"params": hidden}, {"params": other, "optimizer_class": torch.optim.AdamW, **ADAMW}]


def _torch_optimizers(model, optimizer: str):
    """The same set-up in plain torch: one optimizer per class."""
    if optimizer == "adafactor":
        cls, kw = ADAFACTOR
        return [cls(model.parameters(), **kw)]
    hidden, other = _groups(model, "muon")
    cls, kw = MUON
    return [cls(hidden["params"], **kw), torch.optim.AdamW(other["params"], **ADAMW)]


def _reference(model_name: str, optimizer: str, steps: int = STEPS, accum: int = 1, clip=None):
    model = make_model(model_name)
    opts = _torch_optimizers(model, optimizer)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = make_batch(model_name, step * accum + micro, BATCH)
            loss = model(x, y) / accum
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _zero_optimizer(model, optimizer: str, two_optimizers: bool = False):
    if optimizer == "adafactor":
        cls, kw = ADAFACTOR
        return [zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=cls, **kw)]
    hidden, other = _groups(model, "muon")
    cls, kw = MUON
    if two_optimizers:       # as people write it: Muon for the hidden matrices, AdamW beside it
        return [zerocompile.ZeroOptimizer(hidden["params"], optimizer_class=cls, **kw),
                zerocompile.ZeroOptimizer(other["params"], optimizer_class=torch.optim.AdamW, **ADAMW)]
    return [zerocompile.ZeroOptimizer([hidden, other], optimizer_class=cls, **kw)]


def _train(rank, world, model_name, optimizer, stage, steps=STEPS, accum=1, clip=None, options=None,
           two_optimizers=False, start=0, model=None, opts=None):
    if model is None:
        torch._dynamo.reset()
        opts_ = {"stage": stage, "inner_compiler": "eager", **(options or {})}
        model = torch.compile(make_model(model_name), backend="zero", options=opts_)
        opts = _zero_optimizer(model, optimizer, two_optimizers)
    losses = []
    for step in range(start, start + steps):
        total = torch.zeros(())
        for micro in range(accum):
            x, y = make_batch(model_name, step * accum + micro, BATCH)
            loss = model(rank_slice(x, rank, world), rank_slice(y, rank, world)) / accum
            loss.backward()
            total += loss.detach()
        if clip is not None:
            norms = [opt.clip_grad_norm_(clip) for opt in opts]
            assert len(norms) == 1     # one optimizer: one global norm
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return model, opts, losses


def _result(rank, world, model_name, optimizer, stage, **kw):
    model, opts, losses = _train(rank, world, model_name, optimizer, stage, **kw)
    state = zerocompile.full_state_dict(model, rank0_only=False)
    stats = zerocompile.stats()
    held = sum(opt.state_bytes() for opt in opts)
    return {"losses": losses, "state": state, "state_bytes": held, "all_to_all": stats.all_to_all.count,
            "kernels": [opt.kernel for opt in opts], "owners": opts[0].owners()}


def _assert_close(result, ref, tol):
    losses, state = ref
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), atol=tol["loss"], rtol=tol["loss"])
    assert set(result["state"]) == set(state)
    for key, value in state.items():
        torch.testing.assert_close(result["state"][key], value, atol=tol["weights"], rtol=0,
                                   msg=lambda m: f"{key}: {m}")


# ----------------------------------------------------------------------------- one group of ranks
def _misc_worker(rank, world, root):
    """The 2-rank runs of the smaller tests below, in one spawned group of ranks: each returns
    what its test checks. (The dump's test has its own: it compares stats() with the dump.)"""
    return {"bf16": _bf16_worker(rank, world),
            "declared": _declared_worker(rank, world),
            "offload": _offload_worker(rank, world, os.path.join(root, "offload")),
            "deepspeed_muon": _deepspeed_muon_worker(rank, world)}


@pytest.fixture(scope="module")
def misc(ranks_in_folder):
    return ranks_in_folder("test_whole_parameter_optimizers.misc", _misc_worker, "offload")


def _misc(misc, key):
    return [ranks[key] for ranks in misc[1]]


# ----------------------------------------------------------------------------- exactness
def _two_rank_cases(rank, world, tmp):
    out = {}
    for stage in (0, 1):
        out[("gpt", "muon", stage)] = _result(rank, world, "gpt", "muon", stage)
    # stage 2 with gradient accumulation and clipping; stage 3 with the master shards in files
    # (offload_param: read back for the step, as for any optimizer); stage 3 plain: the
    # checkpoint and three-rank tests
    out[("gpt", "muon", 2)] = _result(rank, world, "gpt", "muon", 2, accum=2, clip=0.5)
    out[("gpt", "muon", 3)] = _result(rank, world, "gpt", "muon", 3, options={
        "offload_param": {"device": "nvme", "nvme_path": tmp}})
    out[("gpt", "adafactor", 3)] = _result(rank, world, "gpt", "adafactor", 3)
    out[("mlp", "adafactor", 1)] = _result(rank, world, "mlp", "adafactor", 1)
    out[("frozen", "adafactor", 2)] = _result(rank, world, "frozen", "adafactor", 2)
    out[("tied", "muon-two", 3)] = _result(rank, world, "tied", "muon", 3, two_optimizers=True)
    return out


def test_muon_and_adafactor_match_one_process_on_two_ranks(tmp_path):
    results = run_ranks(_two_rank_cases, 2, str(tmp_path))
    refs = {}
    for (model_name, optimizer, stage), got in results[0].items():
        kind = "adafactor" if optimizer.startswith("adafactor") else "muon"
        kw = dict(accum=2, clip=0.5) if (optimizer, stage) == ("muon", 2) and model_name == "gpt" else {}
        key = (model_name, kind, tuple(kw.items()))
        if key not in refs:
            refs[key] = _reference(model_name, kind, **kw)
        tol = ADAFACTOR_TOL if kind == "adafactor" else MUON_TOL
        for rank in range(2):
            _assert_close(results[rank][(model_name, optimizer, stage)], refs[key], tol)
        # stage 0 keeps parameters whole on every rank: each steps them itself, nothing travels
        assert (got["all_to_all"] > 0) == (stage > 0) and bool(got["owners"]) == (stage > 0)
        # every rank ends with the same model
        for key2, value in got["state"].items():
            torch.testing.assert_close(results[1][(model_name, optimizer, stage)]["state"][key2], value, atol=0, rtol=0)


def _three_rank_cases(rank, world):
    return {
        "muon": _result(rank, world, "gpt", "muon", 3),
        # tied weights used by two frames (a graph break between body and head)
        "tied-adafactor": _result(rank, world, "tied", "adafactor", 1),
    }


def test_three_ranks_and_the_optimizer_state_is_split_by_owner():
    results = run_ranks(_three_rank_cases, 3)
    for name, (model_name, kind, tol) in {"muon": ("gpt", "muon", MUON_TOL),
                                          "tied-adafactor": ("tied", "adafactor", ADAFACTOR_TOL)}.items():
        ref = _reference(model_name, kind)
        for rank in range(3):
            _assert_close(results[rank][name], ref, tol)
    # Muon's state (one momentum matrix per hidden weight) lives at the owners only: the ranks
    # hold it once in all, each within one matrix of 1/3 of it (AdamW's is sharded: 1/3 each)
    model = make_model("gpt")
    opts = _torch_optimizers(model, "muon")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for opt in opts:
        opt.step()
    muon_state = sum(s["momentum_buffer"].numel() * 4 for s in opts[0].state.values())
    adam_state = sum(v.numel() * 4 for s in opts[1].state.values() for k, v in s.items() if k != "step")
    largest = max(p.numel() * 4 for p in opts[0].param_groups[0]["params"])
    held = [results[rank]["muon"]["state_bytes"] for rank in range(3)]
    owners = results[0]["muon"]["owners"]
    assert all(results[rank]["muon"]["owners"] == owners for rank in range(3))     # no communication needed
    assert set(owners) == {n for n, p in model.named_parameters() if _is_hidden_matrix(n, p)}
    assert set(owners.values()) == {0, 1, 2}
    assert abs(sum(held) - (muon_state + adam_state)) <= 3 * 8 * 64 * 4     # AdamW shards' padding at most
    for h in held:
        assert h <= (muon_state + adam_state) / 3 + largest + 8 * 64 * 4


# ----------------------------------------------------------------------------- options
def _bf16_worker(rank, world):
    # stage 2: the replica is bfloat16, so the float32 master shards travel to the owner (stage 3
    # always sends them)
    return [_result(rank, world, "gpt", "muon", 2, options={"param_dtype": "bfloat16"})]


def test_bf16_compute_matches_one_rank_with_the_same_options(misc):
    """bfloat16 compute, float32 masters: against one rank with the same options, at bfloat16's
    resolution (a loss near 4.5 moves in steps of 0.03); the masters the owners step stay
    float32 (the master shards travel to the owners, not the bfloat16 replicas)."""
    one = run_ranks(_bf16_worker, 1)[0]
    two = _misc(misc, "bf16")
    for i in range(1):
        for rank in range(2):
            _assert_close(two[rank][i], (one[i]["losses"], one[i]["state"]), dict(weights=1e-2, loss=0.1))
        hidden = two[0][i]["state"]["blocks.0.fc.weight"]
        assert hidden.dtype == torch.float32
        assert not torch.equal(hidden, hidden.to(torch.bfloat16).float()), "masters rounded to bfloat16"


# ----------------------------------------------------------------------------- checkpoints
def _save_worker(rank, world, path):
    model, opts, losses = _train(rank, world, "gpt", "muon", 3, steps=2)
    zerocompile.save_checkpoint(path, model, opts[0], extra={"step": 2})
    state = opts[0].state_dict()       # torch's layout: the owner's whole state, plain tensors
    owned = sorted(k for k, st in state["state"].items() if "momentum_buffer" in st)
    # a fresh model and optimizer at the same world size: the model from the checkpoint, the
    # optimizer from the state dict, before the first forward shards the model
    torch._dynamo.reset()
    model = torch.compile(make_model("gpt", seed=5), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opts = _zero_optimizer(model, "muon")
    zerocompile.load_checkpoint(path, model)
    opts[0].load_state_dict(state)
    _, _, again = _train(rank, world, "gpt", "muon", 3, steps=2, start=2, model=model, opts=opts)
    return losses, again, zerocompile.full_state_dict(model, rank0_only=False), owned


def _load_worker(rank, world, path, stage):
    torch._dynamo.reset()
    model = torch.compile(make_model("gpt", seed=5), backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opts = _zero_optimizer(model, "muon")
    assert zerocompile.load_checkpoint(path, model, opts[0]) == {"step": 2}
    _, _, losses = _train(rank, world, "gpt", "muon", stage, steps=2, start=2, model=model, opts=opts)
    return losses, zerocompile.full_state_dict(model, rank0_only=False), opts[0].state_bytes()


def test_checkpoint_saves_the_owners_state_and_reshards_it_to_another_world_size(tmp_path):
    """2 ranks at stage 3 save after 2 steps (each owner writes its matrices' momentum); 3 ranks at
    stage 2 and 1 process at stage 1 load it (new owners) and continue: all equal 4 steps of
    plain torch. The torch-layout state dict loads back at the same world size."""
    path = str(tmp_path / "ck")
    ref_losses, ref_state = _reference("gpt", "muon", steps=4)
    saved = run_ranks(_save_worker, 2, path)
    for losses, again, state, _ in saved:
        _assert_close({"losses": losses + again, "state": state}, (ref_losses, ref_state), MUON_TOL)
    # the owners hold the momentum of disjoint matrices: rank 0's and rank 1's state dicts differ
    keys = [set(owned) for *_, owned in saved]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    three = run_ranks(_load_worker, 3, path, 2)
    one = run_ranks(_load_worker, 1, path, 1)
    for losses, state, _ in three + one:
        _assert_close({"losses": losses, "state": state}, (ref_losses[2:], ref_state), MUON_TOL)
    assert sum(b for _, _, b in three) == pytest.approx(one[0][2], rel=0.02)   # held once, split three ways


# ----------------------------------------------------------------------------- declared classes, errors
class ScaledSignSGD(torch.optim.Optimizer):
    """A whole-parameter optimizer of a user's: the step scales by the parameter's RMS."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                rms = p.pow(2).mean().sqrt().clamp(min=1e-3)
                p.add_(p.grad.sign(), alpha=-group["lr"] * float(rms))


def _declared_worker(rank, world):
    torch._dynamo.reset()
    model = torch.compile(make_model("mlp"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=ScaledSignSGD, whole_parameter=True, lr=0.01)
    _, _, losses = _train(rank, world, "mlp", None, 3, model=model, opts=[opt])
    return losses, zerocompile.full_state_dict(model, rank0_only=False)


def test_a_declared_whole_parameter_class_matches_plain_torch(misc):
    model = make_model("mlp")
    opt = ScaledSignSGD(model.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = make_batch("mlp", step, BATCH)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for got in _misc(misc, "declared"):
        _assert_close({"losses": got[0], "state": got[1]}, (losses, model.state_dict()), dict(weights=1e-6, loss=1e-6))
    with pytest.raises(ValueError, match="ScaledSignSGD is not known to be element-wise.*whole_parameter=True"):
        zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=ScaledSignSGD)


def test_bad_input_is_refused_early():
    model = make_model("gpt")
    with pytest.raises(ValueError, match="Muon refuses a parameter of this param group.*only supports 2D"):
        zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.Muon)
    with pytest.raises(TypeError, match="a param group's 'optimizer_class' must be a torch.optim.Optimizer subclass"):
        zerocompile.ZeroOptimizer([{"params": list(model.parameters()), "optimizer_class": "AdamW"}])
    with pytest.raises(ValueError, match="contradict"):
        zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=ScaledSignSGD, whole_parameter=True,
                                  assume_elementwise=True)
    with pytest.raises(ValueError, match="LBFGS cannot run on sharded parameters"):
        zerocompile.ZeroOptimizer([{"params": list(model.parameters()), "optimizer_class": torch.optim.LBFGS}])


def _offload_worker(rank, world, path):
    torch._dynamo.reset()
    model = torch.compile(make_model("gpt"), backend="zero", options={
        "stage": 3, "inner_compiler": "eager", "offload_optimizer": {"device": "nvme", "nvme_path": path}})
    opts = _zero_optimizer(model, "muon")
    try:
        _train(rank, world, "gpt", "muon", 3, steps=1, model=model, opts=opts)
    except ValueError as err:
        return str(err)
    return None


def test_offloading_a_whole_parameter_optimizers_state_is_a_clear_error(misc):
    for message in _misc(misc, "offload"):
        assert message is not None and "offload_optimizer='nvme' is not supported for Muon" in message


# ----------------------------------------------------------------------------- DeepSpeed's Muon
DS_MUON = {"type": "Muon", "params": {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9,
                                      "weight_decay": 0.01, "ns_method": "standard"}}


def _deepspeed_muon_worker(rank, world):
    torch._dynamo.reset()
    config = {"zero_optimization": {"stage": 3}, "optimizer": DS_MUON, "inner_compiler": "eager"}
    model, opt, _ = zerocompile.initialize(make_model("gpt"), config=config)
    classes = [g["optimizer_class"].__name__ for g in opt.param_groups]
    lrs = [g["lr"] for g in opt.param_groups]
    _, _, losses = _train(rank, world, "gpt", None, 3, model=model, opts=[opt])
    return losses, zerocompile.full_state_dict(model, rank0_only=False), classes, lrs


def test_deepspeed_muon_section_builds_muon_with_aux_adamw(misc):
    """DeepSpeed's rule: Muon for parameters with 2+ dimensions whose name has neither "embed"
    nor "lm_head" (here wte, tied to the head, is one of them), Adam for the rest; muon_lr and
    adam_lr win over lr; the Adam group has DeepSpeed's betas (0.9, 0.95) and eps 1e-10."""
    from zerocompile.deepspeed_training import uses_muon

    model = make_model("gpt")
    named = list(model.named_parameters())
    muon = [p for n, p in named if uses_muon(n, p)]
    other = [p for n, p in named if not uses_muon(n, p)]
    opts = [torch.optim.Muon(muon, lr=0.02, momentum=0.9, weight_decay=0.01),
            torch.optim.AdamW(other, lr=3e-3, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.01)]
    losses = []
    for step in range(STEPS):
        x, y = make_batch("gpt", step, BATCH)
        loss = model(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    for got_losses, state, classes, lrs in _misc(misc, "deepspeed_muon"):
        assert classes == ["Muon", "AdamW"] and lrs == [0.02, 3e-3]
        _assert_close({"losses": got_losses, "state": state}, (losses, model.state_dict()), MUON_TOL)


def test_deepspeed_muon_section_errors():
    bad = {"type": "Muon", "params": {"nesterov": False}}
    with pytest.raises(zerocompile.ZeroConfigError, match="optimizer.params.nesterov' is not supported.*muon_lr"):
        zerocompile.initialize(make_model("gpt"), config={"optimizer": bad})
    from zerocompile.deepspeed_training import optimizer_from_section
    with pytest.raises(zerocompile.ZeroConfigError, match="'Muon' splits the model's parameters by name"):
        optimizer_from_section(DS_MUON)


def test_hugging_faces_adafactor_runs_on_whole_parameters():
    """transformers' Adafactor (TrainingArguments(optim="adafactor")) is in the rule table by name."""
    from transformers.optimization import Adafactor

    from zerocompile.optimizer_rules import needs_whole_parameter

    assert needs_whole_parameter(Adafactor)
    model = make_model("mlp")
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=Adafactor, lr=1e-3, relative_step=False)
    ref_model = make_model("mlp")
    ref = Adafactor(ref_model.parameters(), lr=1e-3, relative_step=False)
    for step in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            x, y = make_batch("mlp", step, BATCH)
            m(x, y).backward()
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="Adafactor is not element-wise"):
        zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=Adafactor, assume_elementwise=True)


def test_add_param_group_after_binding_is_refused_where_it_cannot_be_honoured():
    """A group added after the first step binds joins only an optimizer of one element-wise class,
    and only of that class; otherwise a clear error, and the group is not left half-added."""
    model = make_model("gpt")
    hidden, other = _groups(model, "muon")
    for build, group, pattern in [
        (lambda: zerocompile.ZeroOptimizer(hidden["params"][:2], optimizer_class=torch.optim.Muon),
         {"params": hidden["params"][2:4], "optimizer_class": torch.optim.AdamW}, "fixed when it binds"),
        (lambda: zerocompile.ZeroOptimizer(hidden["params"][:2], optimizer_class=torch.optim.AdamW),
         {"params": hidden["params"][2:4], "optimizer_class": torch.optim.SGD, "lr": 0.1},
         "optimizer_class SGD is not the AdamW this optimizer bound"),
        (lambda: zerocompile.ZeroOptimizer(hidden["params"][:2], optimizer_class=torch.optim.AdamW),
         {"params": hidden["params"][2:4], "optimizer_class": torch.optim.Muon}, "fixed when it binds"),
    ]:
        opt = build()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        with pytest.raises(ValueError, match=f"ZeroOptimizer.add_param_group: .*{pattern}"):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1
    opt.add_param_group({"params": hidden["params"][4:6]})     # AdamW's own class: joins
    opt.step()
    assert len(opt.param_groups) == 2 and all(p in opt.state for p in hidden["params"][4:6])


# ----------------------------------------------------------------------------- the dump shows the step
def _dump_worker(rank, world, root):
    torch._dynamo.reset()
    model = torch.compile(make_model("gpt"), backend="zero", options={"stage": 3, "inner_compiler": "eager",
                                                                      "dump": root})
    opts = _zero_optimizer(model, "muon")
    _train(rank, world, "gpt", "muon", 3, steps=2, model=model, opts=opts)
    muon_bytes = zerocompile.stats().all_to_all.bytes
    torch._dynamo.reset()
    model = torch.compile(make_model("mlp"), backend="zero", options={"stage": 0, "inner_compiler": "eager",
                                                                      "dump": root})
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=zerocompile.OneBitAdam, lr=1e-3,
                                    freeze_step=1)
    _train(rank, world, "mlp", None, 0, steps=3, model=model, opts=[opt])
    return muon_bytes


def test_the_dump_records_each_optimizer_steps_collectives(tmp_path, capsys):
    """The optimizer step's collectives are eager, in no graph: the dump writes them per step to
    rank{R}/optimizer_steps.json and `zerocompile show` prints them (the all-to-alls of Muon's
    owners, 1-bit Adam's compressed momentum after its warm-up)."""
    import json

    from zerocompile.cli import main

    muon_bytes = run_ranks(_dump_worker, 2, str(tmp_path))[0]
    data = json.loads((tmp_path / "rank0" / "optimizer_steps.json").read_text())
    muon, onebit = (data["optimizers"][k] for k in sorted(data["optimizers"]))
    assert "Muon+AdamW" in sorted(data["optimizers"])[0] and "OneBitAdam" in sorted(data["optimizers"])[1]
    assert muon["steps"] == 2 and sum(r["collectives"]["all_to_all"]["bytes"] for r in muon["recorded"]) == muon_bytes
    warmup, compressed = onebit["recorded"][0]["collectives"], onebit["recorded"][-1]["collectives"]
    assert "all_reduce" in warmup and "compressed_all_to_all" not in warmup
    assert "compressed_all_to_all" in compressed and compressed["compressed_all_to_all"]["bytes"] > 0
    assert main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "optimizer steps" in out and "all-to-all 2x" in out and "compressed-all-to-all" in out
