"""DeepSpeed's 1-bit Adam and 0/1 Adam (zerocompile.OneBitAdam, zerocompile.ZeroOneAdam) at stage 0:
the sign kernels (C++, Triton under the interpreter) bitwise the torch reference; the two-phase
compressed all-reduce equal to a plain simulation of both phases on all ranks' inputs; the warm-up
equal to torch's AdamW on the whole batch; identical parameters on every rank after the
warm-up; the loss within a few percent of plain AdamW over 20 steps of a small GPT at about 1/16
of the step's bytes; refusals (stages 1-3, clipping past the warm-up, unsupported arguments);
DeepSpeed config types; state dict and checkpoint round trips."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from harness import built_or_skipped, rank_slice
from models import make_batch, make_model
from zerocompile.deepspeed_training import optimizer_from_section
from zerocompile.errors import ZeroConfigError
from zerocompile.runtime import cpu_extension, sign_compression as S
from zerocompile.runtime.comm import resolve_group
from zerocompile.runtime.compressed_allreduce import compressed_allreduce, padded_size
from zerocompile.runtime.raw_grad import raw_grad
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.sharded_param import get_state

STEPS, FREEZE, BATCH, LR = 20, 4, 8, 2e-3
ZO_ARGS = {"var_freeze_step": 12, "var_update_scaler": 2}
"""0/1 Adam: exact steps 1, 2, 4, 6, 8, 12 (the interval doubles after every 2 exact steps),
compressed gradients at 3, 5, 7, 9-11 and 13, local steps (each synchronised) from 14 on."""


# ------------------------------------------------------------------ kernels
def _kernel_inputs():
    g = torch.Generator().manual_seed(5)
    for n in (8, 24, 8 * 1001):
        x = torch.randn(n, generator=g)
        x[:3] = torch.tensor([0.0, -0.0, 1e-30])
        if n > 8:
            x[5] = float("nan")
        yield x, S.scale_of(torch.nan_to_num(x))


def check_kernels(pack, unpack) -> None:
    """``pack(x, scale)`` and ``unpack(packed, scales, average)`` bitwise the torch reference,
    sizes not a multiple of 64, zeros (sign +1), -0.0 and NaN included."""
    g = torch.Generator().manual_seed(6)
    for x, scale in _kernel_inputs():
        want_packed, want_error = S.pack_reference(x, scale)
        packed, error = pack(x, scale)
        assert torch.equal(packed, want_packed)
        assert torch.allclose(error, want_error, rtol=0, atol=0, equal_nan=True)
        assert packed[0] & 0b111 == 0b111            # 0.0, -0.0 and 1e-30 count as +1
        for rows in (1, 2, 3):
            bits = torch.randint(0, 256, (rows, x.numel() // 8), dtype=torch.uint8, generator=g)
            scales = torch.rand(rows, generator=g)
            for average in (False, True):
                assert torch.equal(unpack(bits, scales, average), S.unpack_reference(bits, scales, average))
    # the reference against numbers written out: bits 0..7 of the first byte are elements 0..7
    packed, error = S.pack_reference(torch.tensor([1.0, -2.0, 0.0, -1.0, 3.0, -3.0, -5.0, 4.0]), torch.tensor(2.0))
    assert packed.tolist() == [0b10010101]
    assert error.tolist() == [-1.0, 0.0, -2.0, 1.0, 1.0, -1.0, -3.0, 2.0]
    got = S.unpack_reference(torch.tensor([[0b1], [0b11]], dtype=torch.uint8), torch.tensor([1.0, 3.0]), True)
    assert got.tolist() == [2.0, 1.0] + [-2.0] * 6


def test_cpp_kernels_equal_the_torch_reference_bit_for_bit():
    module = built_or_skipped(cpu_extension.load("sign_compress"), "sign_compress")
    check_kernels(module.sign_pack, module.sign_unpack)
    check_kernels(S.sign_pack, S.sign_unpack)      # the custom ops on CPU tensors run it


def test_the_ops_have_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        packed, error = S.sign_pack(torch.empty(24), torch.empty(()))
        values = S.sign_unpack(torch.empty(3, 5, dtype=torch.uint8), torch.empty(3), False)
        average = S.sign_unpack(torch.empty(3, 5, dtype=torch.uint8), torch.empty(3), True)
    assert (packed.shape, packed.dtype, error.shape) == ((3,), torch.uint8, (24,))
    assert values.shape == (120,) and average.shape == (40,) and average.dtype == torch.float32
    with pytest.raises(ValueError, match="multiple of 8"):
        S.sign_pack(torch.zeros(12), torch.tensor(1.0))


def check_triton() -> None:
    from zerocompile.runtime import triton_sign

    assert triton_sign.available(torch.device("cpu"))
    check_kernels(triton_sign.pack, triton_sign.unpack)


def test_triton_kernels_under_the_interpreter_equal_the_torch_reference_bit_for_bit():
    pytest.importorskip("triton")
    code = "import test_onebit_adam\ntest_onebit_adam.check_triton()\nprint('checked')\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert proc.returncode == 0 and "checked" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


# ------------------------------------------------------------------ the compressed all-reduce
def _simulate(xs: list, worker_errors: list, server_errors: list) -> torch.Tensor:
    """Both phases with plain torch ops on every rank's input (updates the error lists)."""
    world, n = len(xs), xs[0].numel()
    sign = lambda t: torch.where(t < 0, -1.0, 1.0)            # noqa: E731
    sent = []
    for r in range(world):
        buf = torch.zeros(worker_errors[r].numel())
        buf[:n] = xs[r]
        buf = buf + worker_errors[r]
        scale = buf.norm() / buf.numel() ** 0.5
        worker_errors[r] = buf - scale * sign(buf)
        sent.append((scale * sign(buf)).view(world, -1))
    out = []
    for i in range(world):
        acc = torch.zeros_like(sent[0][i])
        for r in range(world):
            acc = acc + sent[r][i]
        avg = acc / world + server_errors[i]
        scale = avg.norm() / avg.numel() ** 0.5
        server_errors[i] = avg - scale * sign(avg)
        out.append(scale * sign(avg))
    return torch.cat(out)[:n]


def _allreduce_worker(rank: int, world: int) -> dict:
    group = resolve_group(None)
    n = 1003
    g = torch.Generator().manual_seed(11)
    worker = [torch.randn(padded_size(n, world), generator=g) * 0.1 for _ in range(world)]
    server = [torch.randn(padded_size(n, world) // world, generator=g) * 0.1 for _ in range(world)]
    mine_w, mine_s = worker[rank].clone(), server[rank].clone()
    zerocompile.reset_stats()
    rounds = []
    for step in range(3):
        xs = [torch.randn(n, generator=g) for _ in range(world)]
        xs[0][:4] = 0.0
        got = compressed_allreduce(xs[rank].view(17, 59), mine_w, mine_s, group, PROCESS.outside)
        want = _simulate(xs, worker, server)
        rounds.append(torch.equal(got.reshape(-1), want) and torch.equal(mine_w, worker[rank])
                      and torch.equal(mine_s, server[rank]))
    stats = zerocompile.stats()
    return {"rounds": rounds, "result": got, "exact": sum(xs) / world,
            "a2a": (stats.compressed_all_to_all.count, stats.compressed_all_to_all.bytes),
            "ag": (stats.compressed_all_gather.count, stats.compressed_all_gather.bytes)}


def test_the_compressed_allreduce_equals_a_simulation_of_both_phases():
    results = run_ranks(_allreduce_worker, 2)
    row = padded_size(1003, 2) // 2 // 8 + 4          # a chunk's signs and its scale
    for res in results:
        assert res["rounds"] == [True, True, True]
        assert res["a2a"] == (3, 3 * 2 * row) and res["ag"] == (3, 3 * 2 * row)
    assert torch.equal(results[0]["result"], results[1]["result"])
    # one-bit, but it points the right way: positively correlated with the exact mean
    cos = torch.nn.functional.cosine_similarity(results[0]["result"].reshape(-1), results[0]["exact"], dim=0)
    assert cos > 0.3, cos                              # a random direction: 0 +- 0.03


# ------------------------------------------------------------------ training
def _batch(step: int):
    """Four global batches in turn: a small GPT learns them within 20 steps (random batches
    have nothing to learn at this size)."""
    return make_batch("gpt", step % 4, BATCH)


def _train(rank: int, world: int, cls, kw: dict, steps: int = STEPS, stage: int = 0):
    """Train the small GPT at ``stage`` on this rank's slice of each batch; per step the global
    loss, the bytes the optimizer step moved (``zerocompile.stats()``), and the parameters."""
    torch._dynamo.reset()
    model = make_model("gpt")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=cls, **kw)
    losses, step_bytes, snapshots = [], [], []
    for step in range(steps):
        x, y = _batch(step)
        loss = compiled(rank_slice(x, rank, world), rank_slice(y, rank, world))
        loss.backward()
        zerocompile.reset_stats()
        opt.step()
        step_bytes.append(zerocompile.stats().comm_bytes)
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
        snapshots.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return {"losses": losses, "bytes": step_bytes, "params": snapshots}, opt


def _training_worker(rank: int, world: int) -> dict:
    adamw, _ = _train(rank, world, torch.optim.AdamW, {"lr": LR, "weight_decay": 0.01, "foreach": False})
    onebit, opt = _train(rank, world, zerocompile.OneBitAdam, {"lr": LR, "weight_decay": 0.01, "freeze_step": FREEZE})
    assert opt.kernel == "torch" and isinstance(opt.inner, zerocompile.OneBitAdam)
    state = next(iter(opt.state.values()))
    zero_one, _ = _train(rank, world, zerocompile.ZeroOneAdam, {"lr": LR, "weight_decay": 0.01, **ZO_ARGS})
    return {"adamw": adamw, "onebit": onebit, "zero_one": zero_one, "state_keys": sorted(state),
            "error_world": state["error_world"]}


@pytest.fixture(scope="module")
def trained(once_per_run):
    return once_per_run("test_onebit_adam.trained", lambda: run_ranks(_training_worker, 2))


def _reference(steps: int) -> list:
    """torch's single-tensor AdamW, one process, the whole batch, uncompiled."""
    model = make_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)
    out = []
    for step in range(steps):
        model(*_batch(step)).backward()
        opt.step()
        opt.zero_grad()
        out.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return out


def test_the_warm_up_is_torch_adamw_on_the_whole_batch(trained):
    reference = _reference(FREEZE)
    for res in trained:
        for name, exact_steps in (("onebit", range(FREEZE)), ("zero_one", (0, 1))):
            for step in exact_steps:
                torch.testing.assert_close(res[name]["params"][step], reference[step], rtol=1e-6, atol=1e-6)
        # the harness itself is that close: plain AdamW through ZeroOptimizer
        torch.testing.assert_close(res["adamw"]["params"][FREEZE - 1], reference[FREEZE - 1], rtol=1e-6, atol=1e-6)
    # and the compression changes something after it
    assert not torch.allclose(trained[0]["onebit"]["params"][-1], trained[0]["adamw"]["params"][-1], atol=1e-4)


def test_every_rank_holds_the_same_parameters_after_every_step(trained):
    for name in ("onebit", "zero_one"):
        for step in range(STEPS):
            assert torch.equal(trained[0][name]["params"][step], trained[1][name]["params"][step]), (name, step)


def test_the_loss_tracks_adamw_within_a_few_percent(trained):
    res = trained[0]
    adamw = torch.tensor(res["adamw"]["losses"])
    assert adamw[-1] < 0.9 * adamw[0]                  # it trains
    for name in ("onebit", "zero_one"):
        losses = torch.tensor(res[name]["losses"])
        assert losses[-1] < 0.9 * losses[0], (name, losses)
        rel = ((losses - adamw).abs() / adamw).max().item()
        assert rel < 0.03, (name, rel, losses.tolist(), adamw.tolist())


def test_a_compressed_step_moves_under_a_tenth_of_the_fp32_allreduce(trained):
    res = trained[0]
    numel = res["adamw"]["params"][0].numel() - 96 * 64      # the tied head counts once
    fp32 = res["adamw"]["bytes"][-1]
    assert fp32 >= 4 * numel                           # the gradients' all-reduce (and the participation check)
    onebit = res["onebit"]["bytes"]
    assert all(b == fp32 for b in onebit[:FREEZE])    # the warm-up all-reduces the gradients
    assert all(b <= fp32 / 10 for b in onebit[FREEZE:]), (onebit, fp32)
    zero_one = res["zero_one"]["bytes"]
    for step in (2, 4, 8, 9, 10, 12, 15, 19):          # compressed gradients, then local steps synchronised
        assert zero_one[step] <= fp32 / 10, (step, zero_one, fp32)
    for step in (0, 1, 3, 5, 7, 11):                   # exact variance updates
        assert zero_one[step] == fp32, (step, zero_one)
    assert res["state_keys"] == ["error_rank", "error_world", "exp_avg", "exp_avg_sq", "server_error", "step",
                                 "var_updates", "worker_error"]
    assert res["error_world"] == 2


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stages_1_to_3_are_refused_at_the_first_step(stage):
    torch._dynamo.reset()
    model = make_model("mlp")
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=zerocompile.OneBitAdam, freeze_step=2)
    compiled(*make_batch("mlp", 0, 4)).backward()
    with pytest.raises(ValueError, match=f"stage 0 only.*sharded at stage {stage}"):
        opt.step()


def test_unsupported_arguments_and_clipping_past_the_warm_up_are_refused(caplog):
    p = [torch.nn.Parameter(torch.ones(3))]
    for cls in (zerocompile.OneBitAdam, zerocompile.ZeroOneAdam):
        for bad, match in (({"amsgrad": True}, "amsgrad"), ({"eps_inside_sqrt": True}, "eps_inside_sqrt"),
                           ({"max_grad_norm": 1.0}, "max_grad_norm")):
            with pytest.raises(ValueError, match=match):
                zerocompile.ZeroOptimizer(p, optimizer_class=cls, **bad)
    with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
        zerocompile.OneBitAdam(p, freeze_step=0)
    with caplog.at_level(logging.INFO, logger="zerocompile"):
        zerocompile.OneBitAdam(p, comm_backend_name="mpi", cuda_aware=True)
    assert "comm_backend_name='mpi'" in caplog.text and "cuda_aware=True" in caplog.text
    # world size 1, stage 0: clipping works in the warm-up and is refused after it
    torch._dynamo.reset()
    model = make_model("mlp")
    compiled = torch.compile(model, backend="zero", options={"stage": 0, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=zerocompile.OneBitAdam, freeze_step=1)
    with pytest.raises(ValueError, match="no fused kernel"):
        zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=zerocompile.OneBitAdam,
                                  kernel="fused").step()
    compiled(*make_batch("mlp", 0, 4)).backward()
    assert opt.clip_grad_norm_(1.0) > 0
    opt.step()
    opt.zero_grad()
    compiled(*make_batch("mlp", 1, 4)).backward()
    with pytest.raises(RuntimeError, match="past its warm-up"):
        opt.clip_grad_norm_(1.0)


# ------------------------------------------------------------------ DeepSpeed configs
def test_deepspeed_optimizer_types_build_them():
    cls, kw = optimizer_from_section({"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 23,
                                                                       "betas": [0.8, 0.99], "cuda_aware": False,
                                                                       "comm_backend_name": "nccl"}})
    assert cls is zerocompile.OneBitAdam
    assert kw == {"lr": 1e-4, "freeze_step": 23, "betas": (0.8, 0.99), "cuda_aware": False, "comm_backend_name": "nccl"}
    opt = zerocompile.ZeroOptimizer([torch.nn.Parameter(torch.ones(2))], optimizer_class=cls, **kw)
    assert opt.defaults["freeze_step"] == 23
    cls, kw = optimizer_from_section({"type": "ZeroOneAdam", "params": {"var_freeze_step": 7, "var_update_scaler": 4,
                                                                        "local_step_scaler": 10,
                                                                        "local_step_clipper": 2}})
    assert cls is zerocompile.ZeroOneAdam and kw["var_freeze_step"] == 7
    inner = cls([torch.nn.Parameter(torch.ones(2))], **kw)
    assert (inner.var_freeze_step, inner.var_update_scaler, inner.local_step_scaler, inner.local_step_clipper) == \
        (7, 4, 10, 2)
    with pytest.raises(ZeroConfigError, match="'optimizer.params.freeze_stepp' is not supported; did you mean "
                                              "'freeze_step'"):
        optimizer_from_section({"type": "OneBitAdam", "params": {"freeze_stepp": 3}})
    with pytest.raises(ZeroConfigError, match="var_freeze_stp"):
        optimizer_from_section({"type": "zerooneadam", "params": {"var_freeze_stp": 3}})
    # zerocompile.initialize: without a zero_optimization stage they run at DeepSpeed's default, 0
    torch._dynamo.reset()
    model = make_model("mlp")
    model, opt, _ = zerocompile.initialize(model, config={"train_batch_size": 4, "inner_compiler": "eager",
                                                          "optimizer": {"type": "OneBitAdam",
                                                                        "params": {"freeze_step": 1}}})
    for step in range(2):
        model(*make_batch("mlp", step, 4)).backward()
        opt.step()
        opt.zero_grad()
    assert isinstance(opt.inner, zerocompile.OneBitAdam) and opt.inner.steps_taken() == 2
    assert {get_state(p).stage for p in model.parameters()} == {0}


# ------------------------------------------------------------------ state round trips
def _round_trip_worker(rank: int, world: int, ckpt: str) -> dict:
    def build():
        torch._dynamo.reset()
        model = make_model("mlp")
        compiled = torch.compile(model, backend="zero", options={"stage": 0, "inner_compiler": "eager"})
        return model, compiled, zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=zerocompile.OneBitAdam,
                                                          lr=LR, freeze_step=2)

    def train(compiled, opt, steps):
        for step in steps:
            x, y = make_batch("mlp", step, 4)
            compiled(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
            opt.step()
            opt.zero_grad()

    model, compiled, opt = build()
    train(compiled, opt, range(4))
    saved = copy.deepcopy(opt.state_dict())        # its tensors are the live state's, as torch's are
    zerocompile.save_checkpoint(ckpt, model, opt)
    train(compiled, opt, range(4, 6))
    want = [p.detach().clone() for p in model.parameters()]
    # the state dict (per rank): the error buffers come back too, so the run continues exactly
    model2, compiled2, opt2 = build()
    model2.load_state_dict(model.state_dict())       # the parameters of step 4 are put back below
    train(compiled2, opt2, range(1))                 # bind (any step), then overwrite everything
    zerocompile.load_checkpoint(ckpt, model2, opt2)
    opt2.load_state_dict(saved)
    train(compiled2, opt2, range(4, 6))
    exact = all(torch.equal(a, b) for a, b in zip(want, model2.parameters()))
    # the checkpoint keeps rank 0's error buffers: rank 0 continues exactly, rank 1 resets them
    model3, compiled3, opt3 = build()
    zerocompile.load_checkpoint(ckpt, model3, opt3)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zerocompile").addHandler(handler)
    train(compiled3, opt3, range(4, 6))
    logging.getLogger("zerocompile").removeHandler(handler)
    return {"reset_warned": any("start again from zero" in r.getMessage() and r.levelno == logging.WARNING
                                for r in records),"exact": exact, "ckpt_exact": all(torch.equal(a, b) for a, b in zip(want, model3.parameters())),
            "params": torch.cat([p.detach().reshape(-1) for p in model3.parameters()]),
            "moments": all(torch.equal(opt3.state[p]["exp_avg_sq"], opt.state[q]["exp_avg_sq"])
                           for p, q in zip(model3.parameters(), model.parameters()))}


def test_state_dict_and_checkpoint_round_trips(tmp_path):
    results = run_ranks(_round_trip_worker, 2, str(tmp_path / "ckpt"))
    assert [r["exact"] for r in results] == [True, True]
    # rank 1 restarted its error buffers from zero (logged), so the parameters differ from the
    # uninterrupted run, but stay the same on both ranks
    assert [r["ckpt_exact"] for r in results] == [False, False]
    assert [r["reset_warned"] for r in results] == [False, True]
    assert torch.equal(results[0]["params"], results[1]["params"])
    assert all(r["moments"] for r in results)


# ------------------------------------------------------------------ accumulation and loss scaling
def _accumulation_worker(rank: int, world: int) -> dict:
    """Past the warm-up: two micro-batches per step equal one backward of both (summed loss);
    a non-finite gradient on rank 1 skips the step on both ranks (GradScaler)."""
    runs = {}
    for mode in ("micro", "whole", "scaler"):
        torch._dynamo.reset()
        model = make_model("mlp")
        compiled = torch.compile(model, backend="zero", options={"stage": 0, "inner_compiler": "eager"})
        opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=zerocompile.OneBitAdam, lr=0.01,
                                        freeze_step=1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        for step in range(4):
            (x1, y1), (x2, y2) = (make_batch("mlp", 2 * step + k, 4) for k in (0, 1))
            x1, y1, x2, y2 = (rank_slice(t, rank, world) for t in (x1, y1, x2, y2))
            if mode == "micro":
                compiled(x1, y1).backward()
                compiled(x2, y2).backward()
            elif mode == "whole":
                (compiled(x1, y1) + compiled(x2, y2)).backward()
            if mode != "scaler":
                opt.step()
            else:
                scaler.scale(compiled(x1, y1)).backward()
                if step == 2 and rank == 1:
                    raw_grad(model.l1.weight)[0, 0] = float("inf")
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        runs[mode] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        runs[mode + "_steps"] = opt.inner.steps_taken()
        runs[mode + "_skipped"] = opt.skipped_steps
    # 0/1 Adam's local steps: local from step 4 on, synchronising at step 4, then every 2nd step
    torch._dynamo.reset()
    model = make_model("mlp")
    compiled = torch.compile(model, backend="zero", options={"stage": 0, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=zerocompile.ZeroOneAdam, lr=0.01,
                                    var_freeze_step=2, var_update_scaler=1, local_step_scaler=1, local_step_clipper=2)
    runs["local"] = []
    for step in range(8):
        x, y = make_batch("mlp", step, 4)
        compiled(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        runs["local"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return runs


def test_accumulation_and_skipped_steps_past_the_warm_up():
    results = run_ranks(_accumulation_worker, 2)
    for mode in ("micro", "whole", "scaler"):
        assert torch.equal(results[0][mode], results[1][mode]), mode
    torch.testing.assert_close(results[0]["micro"], results[0]["whole"], rtol=1e-6, atol=1e-6)
    assert [(r["scaler_steps"], r["scaler_skipped"]) for r in results] == [(3, 1), (3, 1)]
    assert [(r["micro_steps"], r["micro_skipped"]) for r in results] == [(4, 0), (4, 0)]
    same = [torch.equal(a, b) for a, b in zip(results[0]["local"], results[1]["local"])]
    assert same == [True, True, True, True, False, True, False, True]     # steps 1-8
