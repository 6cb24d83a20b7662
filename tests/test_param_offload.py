"""Parameter offload (``offload_param``, stage 3): the master shards live in files between uses.

The numbers are those of stage 3 without it, bit for bit (the graph reads the same values from
the file that it would read from the shard); the shards really leave memory (no parameter
bytes are live between steps, and the fetched shard is not kept from forward to backward);
gathering for eager code, writing a parameter, and checkpoints go through the files; bad
settings are clear errors."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

import zerocompile
import zoo
from census import StorageCensus
from dist_utils import run_ranks
from harness import Run, assert_matches, reference, train_on_rank_slices, zero_train_many
from models import make_batch, make_model
from zerocompile.runtime.sharded_param import get_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nvme(path) -> dict:
    return {"device": "nvme", "nvme_path": str(path)}


ZOO_NAMES = ["loop_break_every", "shared_across_blocks", "param_view_across_break", "eager_block"]


def _bitwise_runs(tmp_path):
    base = Run(model="gpt", stage=3, opt="adamw", steps=3, clip=1.0)
    both = Run(model="gpt", stage=3, opt="adamw", steps=3, clip=1.0,
               options=(("offload_param", _nvme(f"{tmp_path}/p")), ("offload_optimizer", _nvme(f"{tmp_path}/o"))))
    return [base, both]


def _group_worker(rank, world, root):
    """The 2-rank runs of this module's tests, in one spawned group of ranks, each in its own
    directory under ``root`` (the memory census first, in a process that has run nothing yet)."""
    out = {"memory": _memory_worker(rank, world, f"{root}/memory")}
    out["zoo"] = _zoo_worker(rank, world, ZOO_NAMES, f"{root}/zoo")
    torch._dynamo.reset()
    out["read_order"] = _read_order_worker(rank, world, f"{root}/read_order")
    return out


@pytest.fixture(scope="module")
def two_ranks(ranks_in_folder):
    return ranks_in_folder("test_param_offload.two_ranks", _group_worker, "memory", "zoo", "read_order")


def test_param_offload_is_bitwise_stage_three_on_two_ranks(tmp_path):
    """The GPT of the equivalence tests with clipping, with parameter and optimizer offload
    (ZeRO-Infinity's setting). Parameter offload alone is tested on the zoo below. Its own group
    of ranks: it compares stats(), which counts every model alive in the process."""
    base = _bitwise_runs(tmp_path)[0]
    plain, off = run_ranks(zero_train_many, 2, _bitwise_runs(tmp_path))[0]
    assert_matches(plain, reference(base))
    assert off["losses"] == plain["losses"] and off["norms"] == plain["norms"]
    for key, value in plain["state"].items():
        assert torch.equal(off["state"][key], value), key
    # stats() counts every model alive in the process, the plain run's too: the offloaded run
    # adds no parameter bytes to the plain run's shards
    assert off["stats"]["param_bytes"] == plain["stats"]["param_bytes"]
    psi_half = plain["stats"]["param_bytes"]          # the resident fp32 shards of the plain run
    assert off["stats"]["offloaded_param_bytes"] == psi_half > 0
    assert off["stats"]["offloaded_bytes"] == 2 * psi_half and off["stats"]["optimizer_state_bytes"] == 0


def _zoo_worker(rank, world, names, path):
    out = {}
    for name in names:
        for offload in (False, True):
            torch._dynamo.reset()
            model = zoo.make(name)
            # the loop's graph breaks leave the head eager and the eager block is never compiled
            # (by design of the zoo): their parameters stay whole
            options = {"stage": 3, "inner_compiler": "eager", "allow_unsharded": True}
            if offload:
                options["offload_param"] = _nvme(path)
            compiled = torch.compile(model, backend="zero", options=options)
            opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1)
            losses = train_on_rank_slices(compiled, opt, (zoo.batch(step, 4) for step in range(3)), rank, world)
            files = sum(1 for p in model.parameters() if (sp := get_state(p)) is not None and sp.shard_file)
            out[(name, offload)] = (losses, zerocompile.full_state_dict(compiled, rank0_only=False), files)
    return out


def test_param_offload_on_the_zoo(two_ranks):
    """A graph break after every block of a layer loop (one frame run for every block: each must
    read its own files), parameters shared across blocks and tied to the head, a view of a
    parameter used across a break, a block Dynamo never compiles (its parameters stay full next
    to their shards in files)."""
    names = ZOO_NAMES
    res = two_ranks[1][0]["zoo"]
    for name in names:
        plain, off = res[(name, False)], res[(name, True)]
        assert off[0] == plain[0], name
        assert off[2] > 0 and res[(name, False)][2] == 0, name
        for key, value in plain[1].items():
            assert torch.equal(off[1][key], value), (name, key)


def _memory_worker(rank, world, path):
    """Live bytes after the forward and after the step, with and without parameter offload."""
    out = {}
    for offload in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        census = StorageCensus()
        with census:
            model = make_model("gpt")
            psi_padded = sum(-(-p.numel() // world) * world for p in model.parameters())
            options = {"stage": 3, "inner_compiler": "eager", "offload_optimizer": _nvme(path)}
            if offload:
                options["offload_param"] = _nvme(path)
            compiled = torch.compile(model, backend="zero", options=options)
            opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-3)
            after_forward, after_step = [], []
            for step in range(2):
                x, y = make_batch("gpt", step, 8)
                per = 8 // world
                loss = compiled(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
                del x, y
                gc.collect()
                after_forward.append(census.settled_live_bytes())
                loss.backward()
                del loss
                opt.step()
                gc.collect()
                after_step.append(census.settled_live_bytes())
                opt.zero_grad()
                if step == 0:       # AdamW's step counters: 0-dim tensors, one per parameter
                    counters = sum(s["step"].untyped_storage().nbytes() for s in opt.inner.state.values())
        out[offload] = {"forward": after_forward, "step": after_step, "psi_padded": psi_padded,
                        "buffers": opt.inner.buffer_bytes(), "stats": zerocompile.stats().as_dict(),
                        "counters": counters}
        del compiled, opt, model
        gc.collect()
    return out


def test_param_offload_leaves_only_gradients_resident(two_ranks):
    """Stage 3 fp32 on 2 ranks with both offloads, counted by a dispatch mode as the memory tests
    count: after the step exactly the formula, the gradient shards (4 Psi/N), plus the buffers
    ``stats()`` reports apart (the optimizer pipeline's) plus AdamW's step counters are live, no
    fetched shard or read buffer; after the forward exactly the 4 Psi/N of resident shards
    fewer bytes are live than without parameter offload (the fetched shards are not saved for
    the backward, which fetches again)."""
    tmp_path = two_ranks[0] / "memory"
    for res in (ranks["memory"] for ranks in two_ranks[1]):
        plain, off = res[False], res[True]
        shards = 4 * plain["psi_padded"] // 2
        # the census records a storage when an op creates or writes it: the plain run's shards,
        # built outside any op and only read by the first forward's all-gathers, are counted
        # from the first optimizer step on, so the forwards are compared at the second step
        assert off["forward"][1] == plain["forward"][1] - shards, (plain["forward"], off["forward"])
        assert off["stats"]["offload_buffer_bytes"] == off["buffers"] > 0
        assert off["stats"]["offloaded_param_bytes"] == shards
        for step in range(2):
            grads = shards            # the gradient shards, alive until zero_grad()
            assert off["step"][step] == grads + off["stats"]["offload_buffer_bytes"] + off["counters"], off
            assert off["step"][step] == plain["step"][step] - shards
    # the ranks end with os._exit (no finalizers): what they left is removed by the next run
    from zerocompile.runtime.param_offload import remove_stale_directories

    assert len(remove_stale_directories(str(tmp_path))) == 2 and os.listdir(tmp_path) == []


class _ReadEvents(torch.utils._python_dispatch.TorchDispatchMode):
    """The order in which a step starts file reads (``zerocompile::fetch_shard``, by file
    number), waits for them (``wait_tensor`` of a read's tensor) and starts all-gathers."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:      # compiled code runs compiled under it
        return True

    def __init__(self):
        super().__init__()
        self.events = []
        self.reading = {}       # storage of a read in flight -> its file number

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.zerocompile.fetch_shard.default:
            self.reading[out.untyped_storage()._cdata] = int(args[1].item())
            self.events.append(("start", int(args[1].item())))
        elif func is torch.ops._c10d_functional.wait_tensor.default and args[0].untyped_storage()._cdata in self.reading:
            self.events.append(("wait", self.reading.pop(args[0].untyped_storage()._cdata)))
        elif func in (torch.ops._c10d_functional.all_gather_into_tensor.default,
                      torch.ops._c10d_functional.all_gather_into_tensor_out.default,
                      torch.ops.zerocompile.all_gather_point_to_point.default,
                      torch.ops.zerocompile.all_gather_point_to_point_unpacked.default,  # what "auto" takes
                      torch.ops.zerocompile.watched_all_gather.default):  # with the collective watchdog
            self.events.append(("gather", None))
        return out


def _read_order_worker(rank, world, path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    # buckets of about one weight and a bias (the first smaller): a few all-gathers, each the
    # unit of the reads that feed it; nothing kept gathered for the backward, which reads every
    # file again
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager", "bucket_mb": 0.02,
                                                             "unshard_budget_mb": 0, "offload_param": _nvme(path)})
    compiled(torch.randn(2, 64)).sum().backward()
    with _ReadEvents() as fwd:
        loss = compiled(torch.randn(2, 64)).sum()
    with _ReadEvents() as bwd:
        loss.backward()
    files = sorted(get_state(p).shard_file.number for p in model.parameters())
    results = zerocompile.frame_reports()[-1]["results"]
    gathers = {kind: results["bucketing"][kind]["all_gather"] for kind in ("forward", "backward")}
    return fwd.events, bwd.events, files, results["prefetch"], gathers


def _units(events):
    """The reads waited for before each all-gather, in order."""
    units, current = [], []
    for kind, number in events:
        if kind == "wait":
            current.append(number)
        elif kind == "gather" and current:
            units.append(current)
            current = []
    return units + ([current] if current else [])


def test_file_reads_are_issued_one_bucket_ahead(two_ranks):
    """Each bucket's file reads start before the previous bucket's reads are waited for, so
    they run (on their threads) while that bucket is waited for, all-gathered and computed
    with; every read is waited for once, after it started: in forward every parameter's, in
    backward those of the weights the input gradients need (layers 1-3). The reads of a
    bucket are one unit: the fetches are bucketed with the all-gathers they feed (they once
    were taken for all-gathers themselves, and every parameter was gathered alone)."""
    for fwd, bwd, files, report, gathers in (ranks["read_order"] for ranks in two_ranks[1]):
        assert gathers["forward"]["before"] == 8 and gathers["backward"]["before"] == 3
        assert 1 < gathers["forward"]["after"] < 8, gathers      # weights and biases share buckets
        for events, count, kind in ((fwd, 8, "forward"), (bwd, 3, "backward")):
            starts = [n for kind, n in events if kind == "start"]
            waits = [n for kind, n in events if kind == "wait"]
            assert sorted(starts) == sorted(waits) and len(set(starts)) == count and set(starts) <= set(files), events
            where = {(kind, n): i for i, (kind, n) in enumerate(events) if kind != "gather"}
            assert all(where[("start", n)] < where[("wait", n)] for n in starts)
            units = _units(events)
            assert len(units) == gathers[kind]["after"], events
            # every read after the first unit's started ahead of its place
            assert report[kind]["file_reads_ahead"] == count - len(units[0]), (report, units)
            for current, following in zip(units, units[1:]):
                first_wait = min(where[("wait", n)] for n in current)
                assert all(where[("start", n)] < first_wait for n in following), (current, following, events)


def test_prefetch_fetches_moves_each_read_one_unit_ahead_at_world_size_one():
    """Without all-gathers each read is a unit of its own: read k+1 starts right before the
    wait of read k, the waits and the compute stay where they were, and a second pass moves
    nothing (reads only ever move earlier)."""
    from zerocompile.passes.prefetch import prefetch_fetches

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    inputs = [(graph.placeholder(f"s{i}"), graph.placeholder(f"n{i}")) for i in range(3)]
    names = {}
    for i, (shard, number) in enumerate(inputs):
        fetch = graph.call_function(torch.ops.zerocompile.fetch_shard.default, (shard, number, "dir"))
        wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (fetch,))
        x = graph.call_function(torch.ops.aten.mul.Tensor, (x, wait))
        names.update({fetch: f"read{i}", wait: f"wait{i}", x: f"use{i}"})
    graph.output(x)
    assert prefetch_fetches(graph) == 2
    order = [names[n] for n in graph.nodes if n in names]
    assert order == ["read0", "read1", "wait0", "use0", "read2", "wait1", "use1", "wait2", "use2"]
    assert prefetch_fetches(graph) == 0
    assert [names[n] for n in graph.nodes if n in names] == order


def test_a_read_that_fails_in_the_graph_is_an_error(tmp_path):
    """A parameter file deleted outside zerocompile: the graph's read, on its own thread, fails,
    and the wait for it raises the error naming the file (never garbage values)."""
    model, off = _tiny(tmp_path, True)
    _train(off, steps=1)
    os.remove(get_state(model[2].weight).shard_file.path)
    with pytest.raises(Exception, match=r"the parameter file .*shard-.*\.bin' is gone"):
        off(torch.randn(2, 40))


def _tiny(tmp_path, offload, frozen=False, **options):
    torch.compiler.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.Tanh(), torch.nn.Linear(300, 7))
    if frozen:          # as in fine-tuning: the first layer's weight is not trained
        model[0].weight.requires_grad_(False)
    if offload:
        options["offload_param"] = _nvme(tmp_path)
    compiled = torch.compile(model, backend="zero", options={"stage": 3, "inner_compiler": "eager", **options})
    return model, compiled


def _train(compiled, steps=3, dtype=torch.float32, start=0):
    opt = zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        loss = compiled(torch.randn(5, 40, generator=g).to(dtype)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.parametrize("options", [{}, {"param_dtype": "bfloat16"}, {"debug_checks": True},
                                     {"reshard_after_forward": False}])
def test_world_size_one_param_offload(tmp_path, options):
    """No process group (no all-gather: the fetched shard is the parameter); bfloat16 compute
    (the cast follows the fetch); the debug mode that checks every op's storage (the fetch
    reads the file, never the shard's freed storage); the gathered parameters kept from forward
    to backward."""
    _, plain = _tiny(tmp_path, False, **options)
    want = _train(plain)[0], zerocompile.full_state_dict(plain)
    model, off = _tiny(tmp_path, True, **options)
    got = _train(off)[0], zerocompile.full_state_dict(off)
    assert got[0] == want[0]
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), key
    for p in model.parameters():
        sp = get_state(p)
        assert sp.shard.untyped_storage().nbytes() == 0 and os.path.getsize(sp.shard_file.path) == 4 * sp.chunk


def test_frozen_parameters_under_param_offload(tmp_path):
    """A frozen parameter's shard lives in its file like the others and is read by every
    forward; it gets no gradient, its file is left as it was, and the rest trains exactly as
    without offload."""
    _, plain = _tiny(tmp_path, False, frozen=True)
    want = _train(plain)[0], zerocompile.full_state_dict(plain)
    model, off = _tiny(tmp_path, True, frozen=True)
    before = model[0].weight.detach().clone()
    got = _train(off)[0], zerocompile.full_state_dict(off)
    assert got[0] == want[0]
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), key
    assert torch.equal(got[1]["0.weight"], before)
    sp = get_state(model[0].weight)
    assert sp.shard.grad is None and sp.shard.untyped_storage().nbytes() == 0
    assert os.path.getsize(sp.shard_file.path) == 4 * sp.chunk


class _ResidentAtEachUpdate(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of offloaded shards holding storage whenever the fused Adam kernel runs."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:      # compiled code runs compiled under it
        return True

    def __init__(self, states):
        super().__init__()
        self.states = states
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.zerocompile.fused_adam_step.default:
            self.seen.append(sum(sp.shard.untyped_storage().nbytes() for sp in self.states))
        return func(*args, **(kwargs or {}))


def test_the_step_reads_back_a_bounded_part_of_the_shards_at_a_time(tmp_path):
    """With buffer_count x buffer_size = 2 x 2048 elements the 0.weight shard (12000 elements)
    is updated alone and the three others together; the numbers are those of one update of all."""
    _, plain = _tiny(tmp_path, False)
    want = _train(plain)[0], zerocompile.full_state_dict(plain)
    model, off = _tiny(tmp_path, False, offload_param={**_nvme(tmp_path), "buffer_count": 2, "buffer_size": 2048})
    opt = zerocompile.ZeroOptimizer(off.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        loss = off(torch.randn(5, 40, generator=g)).float().square().mean()
        loss.backward()
        states = [get_state(p) for p in model.parameters()]
        with _ResidentAtEachUpdate(states) as spy:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        assert spy.seen == [12000 * 4, (300 + 7 * 300 + 7) * 4], spy.seen
        assert all(sp.shard.untyped_storage().nbytes() == 0 for sp in states)
    assert losses == want[0]
    for key, value in zerocompile.full_state_dict(off).items():
        assert torch.equal(value, want[1][key]), key


def test_param_offload_with_inductor(tmp_path):
    _, plain = _tiny(tmp_path, False, inner_compiler="inductor")
    want = _train(plain)[0], zerocompile.full_state_dict(plain)
    _, off = _tiny(tmp_path, True, inner_compiler="inductor")
    got = _train(off)[0], zerocompile.full_state_dict(off)
    assert got[0] == want[0]
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), key


def test_eager_reads_and_writes_go_through_the_files(tmp_path):
    """``gathered_parameters`` reads the files; a write into a parameter (``copy_``, as custom
    init or EMA restore does) lands in its file, and the next forward computes with it."""
    model, off = _tiny(tmp_path, True)
    _train(off, steps=1)
    full = zerocompile.full_state_dict(off)
    with zerocompile.gathered_parameters(off):
        assert torch.equal(model[0].weight.detach(), full["0.weight"])
        norm = model[0].weight.norm().item()
    assert norm == pytest.approx(full["0.weight"].norm().item())
    new = torch.full_like(full["2.weight"], 0.25)
    with torch.no_grad():
        model[2].weight.copy_(new)
    assert torch.equal(zerocompile.full_state_dict(off)["2.weight"], new)
    x = torch.randn(3, 40)
    with torch.no_grad():
        expect = torch.tanh(x @ full["0.weight"].T + full["0.bias"]) @ new.T + full["2.bias"]
        torch.testing.assert_close(off(x), expect, rtol=1e-6, atol=1e-6)


def test_checkpoints_move_between_offloaded_and_resident_runs(tmp_path):
    """Save from a run with parameter offload, resume without it, and the other way round: the
    same weights as three uninterrupted steps."""
    _, plain = _tiny(tmp_path / "p", False)
    _train(plain, steps=3)
    want = zerocompile.full_state_dict(plain)
    for first, second in ((True, False), (False, True)):
        _, a = _tiny(tmp_path / "p", first)
        opt = _train(a, steps=2)[1]
        ckpt = tmp_path / f"ckpt-{first}"
        zerocompile.save_checkpoint(ckpt, a, opt)
        _, b = _tiny(tmp_path / "p", second)
        b(torch.randn(1, 40))           # compiled (and offloaded) before the load
        opt_b = zerocompile.ZeroOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        zerocompile.load_checkpoint(ckpt, b, opt_b)
        for step in range(2, 3):
            g = torch.Generator().manual_seed(step)
            b(torch.randn(5, 40, generator=g)).float().square().mean().backward()
            opt_b.step()
            opt_b.zero_grad()
        got = zerocompile.full_state_dict(b)
        for key, value in want.items():
            assert torch.equal(got[key], value), (first, key)


def test_param_offload_errors_and_the_cpu_no_op(tmp_path, caplog):
    from zerocompile.config import ZeroConfig, ZeroConfigError
    from zerocompile.deepspeed_config import translate_deepspeed

    with pytest.raises(ZeroConfigError, match=r"'offload_param' needs stage 3 .* not stage 2"):
        ZeroConfig.from_options({"stage": 2, "offload_param": _nvme(tmp_path)})
    with pytest.raises(ZeroConfigError, match=r"'offload_param.ratio' = 0.5 is invalid"):
        ZeroConfig.from_options({"offload_param": {**_nvme(tmp_path), "ratio": 0.5}})
    with pytest.raises(ZeroConfigError, match=r"'offload_param.device' = 'nvme' needs 'offload_param.nvme_path'"):
        ZeroConfig.from_options({"offload_param": {"device": "nvme"}})
    with pytest.raises(ZeroConfigError, match=r"unknown key 'offload_param.nvme'"):
        ZeroConfig.from_options({"offload_param": {"device": "nvme", "nvme": "/x"}})
    ds = translate_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 5, "max_in_cpu": 1e9}},
        "aio": {"thread_count": 3}})
    cfg = ZeroConfig.from_options(ds)
    assert cfg.step.offload_param.device == "nvme" and cfg.step.offload_param.threads == 3

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(Exception, match=r"offload_param: cannot create the directory .*file/sub.*give offload_param.nvme_path a writable"):
        _tiny(blocker / "sub", True)[1](torch.randn(2, 40))

    model, compiled = _tiny(tmp_path, False, offload_param={"device": "cpu"})
    with caplog.at_level("INFO", logger="zerocompile"):
        compiled(torch.randn(2, 40))
    assert "offload_param device 'cpu': the parameters are on the CPU" in caplog.text
    assert all(get_state(p).shard_file is None for p in model.parameters())

    torch.compiler.reset()
    a = torch.nn.Linear(2, 2)
    ca = torch.compile(a, backend="zero", options={"stage": 3, "inner_compiler": "eager",
                                                    "offload_param": _nvme(tmp_path)})
    cb = torch.compile(torch.nn.Sequential(a), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
    ca(torch.randn(1, 2))
    with pytest.raises(Exception, match="already sharded with offload_param"):
        cb(torch.randn(1, 2))
    torch.compiler.reset()


def test_shard_files_say_what_went_wrong(tmp_path):
    """A parameter file deleted or truncated outside zerocompile is an error naming it, not
    garbage values; directories of ended processes on this host are removed, those of live
    processes and of other hosts are not."""
    from zerocompile.runtime import param_offload
    from zerocompile.runtime.swap_file import SwapFileError

    values = torch.arange(1000, dtype=torch.float32)
    f = param_offload.ShardFile(str(tmp_path / "d"), "w", values)
    out = torch.empty(1000)
    f.read_into(out)
    assert torch.equal(out, values)
    with open(f.path, "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(SwapFileError, match=r"ended at byte 100 of 4000; it was changed outside zerocompile"):
        f.read_into(out)
    os.remove(f.path)
    with pytest.raises(SwapFileError, match=r"the parameter file .* is gone"):
        f.read_into(out)
    f.close()

    mine = param_offload.param_directory(zerocompile.runtime.offload_settings.OffloadSettings(
        device="nvme", nvme_path=str(tmp_path)))
    prefix = os.path.basename(mine).rsplit("-pid", 1)[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name in (f"{prefix}-pid{dead.pid}", f"{prefix}-pid{os.getpid()}", "zerocompile-params-otherhost-pid1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard-1.bin").write_bytes(b"x")
    assert param_offload.remove_stale_directories(str(tmp_path)) == [str(tmp_path / f"{prefix}-pid{dead.pid}")]
    assert sorted(os.listdir(tmp_path)) == sorted([f"{prefix}-pid{os.getpid()}", "zerocompile-params-otherhost-pid1"])
