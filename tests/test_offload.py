"""Optimizer offload (``offload_optimizer``): the same numbers as without it, bit for bit (the
same fused kernel updates every element, tile by tile); the moments really leave memory (the
files hold them; live bytes after a step are params + grads + buffers); checkpoints move
between offloaded and resident runs; bad settings are clear errors."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zerocompile
from census import StorageCensus
from harness import Run, assert_matches, reference, zero_train_many
from models import make_batch, make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nvme(path, **kw) -> dict:
    return {"device": "nvme", "nvme_path": str(path), "buffer_size": 2048, "buffer_count": 3, **kw}


# ----------------------------------------------------------------------------- one group of ranks
def _bitwise_runs(stage, tmp_path):
    base = Run(model="gpt", stage=stage, opt="adamw", steps=4, clip=1.0)
    return [base] + [Run(model="gpt", stage=stage, opt="adamw", steps=4, clip=1.0,
                         options=(("offload_optimizer", _nvme(tmp_path, **extra)),))
                     for extra in ({}, {"ratio": 0.5})]


def _group_worker(rank, world, root):
    """The 2-rank runs of this module's tests, in one spawned group of ranks, each in its own
    directory under ``root`` (the memory census first, in a process that has run nothing yet)."""
    out = {"memory": _memory_worker(rank, world, f"{root}/memory")}
    for stage in (1, 3):
        out[("bitwise", stage)] = zero_train_many(rank, world, _bitwise_runs(stage, f"{root}/bitwise{stage}"))
    torch._dynamo.reset()
    out["checkpoint"] = _checkpoint_worker(rank, world, f"{root}/swap", f"{root}/ckpt")
    out["hf"] = _hf_worker(rank, world, f"{root}/hf")
    return out


@pytest.fixture(scope="module")
def two_ranks(ranks_in_folder):
    return ranks_in_folder("test_offload.two_ranks", _group_worker, "memory", "bitwise1", "bitwise3", "hf")


@pytest.mark.parametrize("stage", [1, 3])
def test_nvme_offload_is_bitwise_the_run_without_it(two_ranks, stage):
    """Tiny buffers (2048 elements, 3 in flight) so every parameter streams in several tiles;
    a ratio of 0.5 offloads some parameters and keeps the others resident."""
    tmp_path = two_ranks[0] / f"bitwise{stage}"
    base = _bitwise_runs(stage, tmp_path)[0]
    plain, offloaded, partial = two_ranks[1][0][("bitwise", stage)]
    assert_matches(plain, reference(base))
    for res in (offloaded, partial):
        assert res["losses"] == plain["losses"] and res["norms"] == plain["norms"]
        for key, value in plain["state"].items():
            assert torch.equal(res["state"][key], value), key
    assert offloaded["stats"]["optimizer_state_bytes"] == 0 < offloaded["stats"]["offloaded_bytes"]
    assert 0 < partial["stats"]["optimizer_state_bytes"] < plain["stats"]["optimizer_state_bytes"]
    assert not os.listdir(tmp_path) or all(f.endswith(".swap") for f in os.listdir(tmp_path))


def _memory_worker(rank, world, path):
    torch.manual_seed(0)
    census = StorageCensus()
    with census:
        model = make_model("gpt")
        psi_padded = sum(-(-p.numel() // world) * world for p in model.parameters())
        compiled = torch.compile(model, backend="zero", options={
            "stage": 3, "inner_compiler": "eager", "offload_optimizer": _nvme(path)})
        opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-3)
        for step in range(2):
            x, y = make_batch("gpt", step, 8)
            per = 8 // world
            compiled(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
            opt.step()
            del x, y
            gc.collect()
            live = census.settled_live_bytes()
            opt.zero_grad()
    swap = opt.inner._swap
    buffers = opt.inner.buffer_bytes()
    return {"live": live, "psi_padded": psi_padded, "buffers": buffers, "file_bytes": os.path.getsize(swap.path),
            "stats_buffers": zerocompile.stats().offload_buffer_bytes,
            "offloaded": opt.offloaded_bytes(), "state_bytes": opt.state_bytes(), "kernel": opt.kernel,
            "offload": opt.offload}


def test_nvme_offload_resident_bytes_are_params_grads_and_buffers(two_ranks):
    """Stage 3 fp32, 2 ranks: live bytes after the step (counted by a dispatch mode, as the
    memory tests count) are at most 8 Psi/N (shards and their gradients) plus the pipeline's
    buffers plus AdamW's 4-byte step counters; the swap file holds the 8 Psi/N of moments."""
    tmp_path = two_ranks[0] / "memory"
    for res in (ranks["memory"] for ranks in two_ranks[1]):
        n = 2
        state = 8 * res["psi_padded"] / n
        assert res["kernel"] == "cpp" and res["offload"] == "nvme"
        assert res["offloaded"] == state and res["state_bytes"] == 0
        assert res["file_bytes"] >= state
        assert 8 * res["psi_padded"] / n <= res["live"] <= 8 * res["psi_padded"] / n + res["buffers"] + 4096, res
        assert res["stats_buffers"] == res["buffers"] > 0          # stats() reports the buffers apart
    assert not os.listdir(tmp_path)        # the swap files are deleted at exit


def _checkpoint_worker(rank, world, path, ckpt):
    """Train 2 steps, save, then resume into a fresh model and optimizer with the other
    offload setting and train 2 more; compare with 4 uninterrupted steps."""
    def make(offload):
        torch._dynamo.reset()
        model = make_model("gpt")
        options = {"stage": 3, "inner_compiler": "eager"}
        if offload:
            options["offload_optimizer"] = _nvme(path)
        compiled = torch.compile(model, backend="zero", options=options)
        return compiled, zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-2)

    def train(compiled, opt, steps):
        for step in steps:
            x, y = make_batch("gpt", step, 8)
            per = 8 // world
            compiled(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
            opt.step()
            opt.zero_grad()

    out = {}
    compiled, opt = make(False)
    train(compiled, opt, range(4))
    out["uninterrupted"] = zerocompile.full_state_dict(compiled, rank0_only=False)
    for first, second in ((True, False), (False, True)):
        compiled, opt = make(first)
        train(compiled, opt, range(2))
        zerocompile.save_checkpoint(f"{ckpt}/{first}", compiled, opt)
        compiled, opt = make(second)
        zerocompile.load_checkpoint(f"{ckpt}/{first}", compiled, opt)
        train(compiled, opt, range(2, 4))
        out[(first, second)] = zerocompile.full_state_dict(compiled, rank0_only=False)
        assert opt.offload == ("nvme" if second else None)
    return out


def test_checkpoints_move_between_offloaded_and_resident_runs(two_ranks):
    res = two_ranks[1][0]["checkpoint"]
    for key in ((True, False), (False, True)):
        for name, value in res["uninterrupted"].items():
            assert torch.equal(res[key][name], value), (key, name)


def _hf_worker(rank, world, path):
    import test_third_party_models as hf

    out = {}
    for offload in (False, True, "params too"):
        torch._dynamo.reset()
        options = {"stage": 3, "inner_compiler": "eager"}
        if offload:
            options["offload_optimizer"] = _nvme(path)
        if offload == "params too":
            options["offload_param"] = {"device": "nvme", "nvme_path": path}
        model = torch.compile(hf.build("llama"), backend="zero", options=options)
        opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        per = hf.BATCH // world
        for step in range(3):
            hf.loss_of(model, "llama", hf.batch(step)[rank * per:(rank + 1) * per]).backward()
            opt.step()
            opt.zero_grad()
        out[offload] = zerocompile.full_state_dict(model)
    return out


def test_nvme_offload_on_an_hf_llama_is_bitwise_the_run_without_it(two_ranks):
    """Optimizer offload, and optimizer + parameter offload (ZeRO-Infinity's setting)."""
    res = two_ranks[1][0]["hf"]
    for name, value in res[False].items():
        assert torch.equal(res[True][name], value), name
        assert torch.equal(res["params too"][name], value), name


def _compiled_tiny(options):
    torch.compiler.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager", **options})
    compiled(torch.randn(3, 6)).sum().backward()
    return compiled


def test_offload_errors_and_the_cpu_no_op(tmp_path, caplog):
    compiled = _compiled_tiny({"offload_optimizer": _nvme(tmp_path)})
    with pytest.raises(ValueError, match=r"offload_optimizer='nvme' streams the optimizer state through zerocompile's "
                                         r"fused Adam kernel, which cannot run here: SGD is not torch.optim.Adam"):
        zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.SGD, lr=0.1).step()
    with pytest.raises(ValueError, match=r"cannot run here: param group 0 sets amsgrad=True"):
        zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, amsgrad=True).step()
    with pytest.raises(ValueError, match=r"cannot run here: kernel='torch' was asked for"):
        zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, kernel="torch").step()

    blocker = tmp_path / "file"
    blocker.write_text("x")
    compiled = _compiled_tiny({"offload_optimizer": _nvme(blocker / "sub")})
    from zerocompile.runtime.swap_file import SwapFileError

    with pytest.raises(SwapFileError, match=r"cannot create nvme_path .*file/sub"):
        zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW).step()

    compiled = _compiled_tiny({"offload_optimizer": {"device": "cpu"}})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW)
    with caplog.at_level("INFO", logger="zerocompile"):
        opt.step()
    assert opt.offload is None and opt.kernel == "cpp"
    assert "offload_optimizer device 'cpu': the model is on the CPU" in caplog.text

    torch.compiler.reset()
    a = torch.nn.Linear(2, 2)
    ca = torch.compile(a, backend="zero", options={"stage": 3, "inner_compiler": "eager",
                                                    "offload_optimizer": _nvme(tmp_path)})
    cb = torch.compile(torch.nn.Sequential(a), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    ca(torch.randn(1, 2))
    with pytest.raises(Exception, match="already sharded with offload_optimizer"):
        cb(torch.randn(1, 2))
    torch.compiler.reset()


def test_offload_files_are_deleted_when_the_process_exits(tmp_path):
    """The optimizer's swap file and the directory of parameter files exist while a process
    trains with both offloads on NVMe, and nothing of them is left after it exits."""
    script = textwrap.dedent(f"""
        import json, os, torch, zerocompile
        model = torch.nn.Linear(64, 64)
        nvme = {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}}
        c = torch.compile(model, backend="zero", options={{"stage": 3, "inner_compiler": "eager",
            "offload_optimizer": nvme, "offload_param": nvme}})
        c(torch.randn(2, 64)).sum().backward()
        opt = zerocompile.ZeroOptimizer(c.parameters(), torch.optim.AdamW)
        opt.step()
        names = sorted(os.listdir({str(tmp_path)!r}))
        print(json.dumps({{n: sorted(os.listdir(os.path.join({str(tmp_path)!r}, n)))
                          if os.path.isdir(os.path.join({str(tmp_path)!r}, n)) else None for n in names}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    (swap,) = [n for n, files in seen.items() if files is None]
    (params,) = [n for n, files in seen.items() if files is not None]
    assert swap.startswith("zerocompile-optimizer-rank0-pid")
    assert params.startswith("zerocompile-params-") and len(seen[params]) == 2     # weight, bias
    assert os.listdir(tmp_path) == []


def _train_tiny(stage, offload, dtype=torch.float32, steps=4, **options):
    torch.compiler.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 7)).to(dtype)
    if offload:
        options["offload_optimizer"] = offload
    compiled = torch.compile(model, backend="zero", options={"stage": stage, "inner_compiler": "eager", **options})
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = compiled(torch.randn(5, 40, generator=g).to(dtype)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, zerocompile.full_state_dict(compiled), opt


@pytest.mark.parametrize("stage,dtype", [(0, torch.float32), (2, torch.float32), (3, torch.bfloat16)])
def test_world_size_one_offload_every_stage_and_dtype(tmp_path, stage, dtype):
    """No process group; stage 0 steps whole (not flat) parameters; a bfloat16 model keeps
    bfloat16 masters and moments, streamed in 2-byte tiles."""
    plain = _train_tiny(stage, None, dtype)
    off = _train_tiny(stage, _nvme(tmp_path), dtype)
    assert off[2].offload == "nvme" and off[0] == plain[0]
    for key, value in plain[1].items():
        assert off[1][key].dtype == dtype and torch.equal(off[1][key], value), key
    assert off[2].offloaded_bytes() == 2 * sum(p.numel() for p in off[2].inner.param_groups[0]["params"]) * (
        2 if dtype == torch.bfloat16 else 4)


def test_offload_with_loss_scaling_skips_the_overflowing_step_alike(tmp_path):
    """float16 compute with the loss_scale option: the first steps overflow at scale 2**16 and
    are skipped; the skipped steps leave the offloaded state as they leave the resident one."""
    opts = dict(param_dtype="float16", loss_scale={"initial_scale": 2.0**24, "hysteresis": 1})
    plain = _train_tiny(3, None, steps=5, **opts)
    off = _train_tiny(3, _nvme(tmp_path), steps=5, **opts)
    assert plain[2].skipped_steps == off[2].skipped_steps > 0
    assert off[0] == plain[0]
    for key, value in plain[1].items():
        assert torch.equal(off[1][key], value), key


def test_auto_ratio_offloads_the_least_that_fits_the_memory_limit(tmp_path):
    """ratio="auto" with memory_limit_mb: resident optimizer state fits what the limit leaves
    after parameters, gradients and the largest simulated transient peak (from the frame's
    report), and keeping one more parameter's state resident would not fit; the numbers are
    those of the run without offload."""
    from zerocompile.config import ZeroConfig, ZeroConfigError

    with pytest.raises(ZeroConfigError, match="'offload_optimizer.ratio' = 'auto' needs 'memory_limit_mb'"):
        ZeroConfig.from_options({"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "ratio": "auto"}})
    def report_since(started):      # frames of earlier tests may still be alive in this process
        (report,) = [r for r in zerocompile.frame_reports() if r["compiled_at_ns"] > started]
        return report

    started = time.monotonic_ns()
    plain = _train_tiny(3, None, memory_limit_mb=1000.0)
    report = report_since(started)
    weights = sum(p.numel() * 4 for p in plain[1].values())
    # room for about half of AdamW's two moments next to params, grads and the transient peak
    limit_mb = (2 * weights + report["results"]["simulated_peak_bytes"] + weights) / 2**20
    started = time.monotonic_ns()
    off = _train_tiny(3, _nvme(tmp_path, ratio="auto"), memory_limit_mb=limit_mb)
    assert off[0] == plain[0] and all(torch.equal(off[1][k], v) for k, v in plain[1].items())
    opt = off[2]
    report = report_since(started)
    transient = report["results"]["simulated_peak_bytes"]
    targets = opt.inner.param_groups[0]["params"]
    weights = sum(t.numel() * t.element_size() for t in targets)
    available = limit_mb * 2**20 - 2 * weights - transient
    resident = opt.state_bytes()
    assert 0 < available and 0 < resident <= available < 2 * weights   # some state offloaded, some kept
    offloaded = [t for t in targets if t in opt.inner._offloaded]
    assert resident + 2 * offloaded[-1].numel() * offloaded[-1].element_size() > available
    assert opt.offloaded_bytes() + resident == 2 * weights


class _KernelCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """How many tensors each fused Adam kernel call wrote a compute-dtype copy of."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:      # compiled code runs compiled under it
        return True

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.zerocompile.fused_adam_step.default:
            self.copies.append(len(args[5]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stage", [1, 2])
def test_the_kernel_writes_the_replica_copy_bitwise_as_a_cast(tmp_path, stage):
    """Stages 1/2 with bfloat16 compute: the kernel writes each updated float32 shard's bfloat16
    copy (the replica all-gather's input) in the same pass. With the optimizer state streamed
    from a swap file it cannot, and the shard is cast after the step instead: the same weights
    bit for bit."""
    spy = _KernelCopies()
    with spy:
        plain = _train_tiny(stage, None, steps=3, param_dtype="bfloat16")
    assert spy.copies and all(n == 4 for n in spy.copies), spy.copies       # 4 parameters per call
    spy = _KernelCopies()
    with spy:
        off = _train_tiny(stage, _nvme(tmp_path), steps=3, param_dtype="bfloat16")
    assert spy.copies and all(n == 0 for n in spy.copies), spy.copies
    assert off[0] == plain[0]
    for key, value in plain[1].items():
        assert torch.equal(off[1][key], value), key


@pytest.mark.parametrize("elements, settings, tile", [
    (3_000_000, {}, 94208),                      # 1/32 of the offloaded elements, in whole pages
    (300_000, {}, 65536),                        # the floor: a small model's buffers stay small
    (100_000, {}, 26624),                        # all buffers together at most the state: 1/4 of it
    (300_000_000, {}, 4194304),                  # the cap: buffer_size
    (3_000_000, {"buffer_size": 2048}, 2048),    # a smaller buffer_size wins over the floor
    (3_000_000, {"buffer_count": 2}, 188416),
])
def test_offload_tiles_are_sized_to_the_offloaded_state(tmp_path, elements, settings, tile):
    """The buffers hold about 1/8 of the offloaded state (buffer_count tiles of 1/(8 buffer_count)
    of its elements), at least 65536 elements per tile, at most buffer_size, and all together
    never more than the state itself."""
    from zerocompile.runtime.offload_settings import OffloadSettings
    from zerocompile.runtime.offloaded_adam import OffloadedAdam

    p = torch.zeros(elements, device="meta", requires_grad=True)
    opt = OffloadedAdam([p], OffloadSettings(device="cpu", **settings), name="t", lr=1e-3)
    opt._plan()
    assert opt._tile_elems() == tile


@pytest.mark.parametrize("tile", [2048, 65536])
def test_a_tile_of_several_parameters_steps_each_and_keeps_the_others(tmp_path, tile):
    """Parameters share tiles in the swap file (one read and one write per moment and tile): a
    step where only some of them have gradients updates those, and leaves the others' moments as
    they were, including a never-stepped one beside an already stepped one (no read is skipped
    for a tile that holds any written moments). Every figure bit for bit FusedAdam's, with the
    resident state, after each step; and a parameter larger than a tile spans several."""
    from zerocompile.runtime.fused_adam import FusedAdam
    from zerocompile.runtime.offload_settings import OffloadSettings
    from zerocompile.runtime.offloaded_adam import OffloadedAdam

    torch.manual_seed(0)
    sizes = [300, 5000, 7, 70_000, 129]
    make = lambda: [torch.nn.Parameter(torch.randn(n, dtype=torch.float32)) for n in sizes]  # noqa: E731
    ref_params = make()
    off_params = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    hyper = dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    ref = FusedAdam(ref_params, **hyper)
    settings = OffloadSettings(device="nvme", nvme_path=str(tmp_path), buffer_size=tile, buffer_count=2)
    off = OffloadedAdam(off_params, settings, name="tiles", **hyper)
    # which parameters have gradients at each step: the first steps leave some never stepped
    schedule = [[0, 3], [1], [2, 4], [0, 1, 2, 3, 4], [4]]
    for step, present in enumerate(schedule):
        g = torch.Generator().manual_seed(step)
        for i, (r, o) in enumerate(zip(ref_params, off_params)):
            grad = torch.randn(r.numel(), generator=g)
            r.grad = grad.clone() if i in present else None
            o.grad = grad.clone() if i in present else None
        ref.step()
        off.step()
        for r, o in zip(ref_params, off_params):
            assert torch.equal(r, o), step
            want, got = ref.state.get(r, {}), off.param_state(o)
            assert set(want) == set(got), step
            for key, value in want.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(got[key])), (step, key)
    (layout,) = off._layouts.values()
    size = off._tile_elems()
    if tile == 2048:       # parameters larger than a tile span several
        assert size == 2048 and len([a for a in range(0, layout.size, size) if layout.pieces(a, a + size)]) > len(sizes)
    else:                  # small parameters share a tile (at most a buffer_count-th of the state: 38912)
        assert size == 38912 and len(layout.pieces(0, size)) == 4, [(a, b) for _, a, b in layout.pieces(0, size)]
    off.close()
    assert not os.listdir(tmp_path)
