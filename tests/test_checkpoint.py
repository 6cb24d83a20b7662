"""Sharded checkpoints (zerocompile.save_checkpoint / load_checkpoint / consolidate): exact resume
on the same layout, resharding across world sizes and stages against a plain-torch reference,
tied weights and a 0-dim parameter, a killed rank, atomic saves, clear errors."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zerocompile
from dist_utils import free_port, run_ranks, start_fresh
from harness import rank_slice, train_on_rank_slices
from models import TiedLM, make_batch, make_model
from zerocompile.runtime.dcp_shards import flat_range_boxes

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}
BATCH = 6   # divides by 1, 2 and 3 ranks


class ScaledTiedLM(TiedLM):
    """TiedLM (embedding tied to the head across a graph break, a buffer, rows that no world
    size splits evenly) plus a 0-dim parameter."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.25))

    def forward(self, idx, targets):
        return super().forward(idx, targets) * self.temperature


def _model(name: str, seed: int = 0) -> nn.Module:
    if name == "scaled":
        torch.manual_seed(seed)
        return ScaledTiedLM()
    return make_model(name, seed)


def _batch(name: str, step: int):
    return make_batch("tied" if name == "scaled" else name, step, BATCH)


def _build(name, stage, opt_name, seed=0, options=()):
    """The model compiled at ``stage`` (None: not compiled) and its ZeroOptimizer."""
    torch._dynamo.reset()
    model = _model(name, seed)
    if stage is not None:
        model = torch.compile(model, backend="zero",
                              options={"stage": stage, "inner_compiler": "eager", **dict(options)})
    cls, kw = OPTIMIZERS[opt_name]
    return model, zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=cls, **kw)


def _train(model, opt, rank, world, start, stop, name):
    return train_on_rank_slices(model, opt, (_batch(name, step) for step in range(start, stop)), rank, world)


def _first_forward(model, opt, rank, world, name):
    """A forward and backward that shard every parameter, with no optimizer step."""
    x, y = _batch(name, 99)
    model(rank_slice(x, rank, world), rank_slice(y, rank, world)).backward()
    opt.zero_grad()


def _reference(name, opt_name, steps):
    """Plain torch, one process, whole batch: losses, and model and optimizer state (by
    parameter name) after each step."""
    model = _model(name)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    names = {p: n for n, p in model.named_parameters()}
    losses, after = [], {}
    for step in range(steps):
        x, y = _batch(name, step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        after[step + 1] = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                           "optim": {names[p]: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}}
    return losses, after


def _assert_state(got: dict, want: dict, exact=False, ordered=True):
    if ordered:
        assert list(got) == list(want), "keys differ from the uncompiled model.state_dict()"
    else:
        assert sorted(got) == sorted(want), "keys differ from the uncompiled model.state_dict()"
    for key, value in want.items():
        if exact:
            assert torch.equal(got[key], value), f"{key} differs"
        else:
            torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")


# ----------------------------------------------------------------------------- pure layout
@pytest.mark.parametrize("shape", [(13, 7), (5,), (3, 4, 5), (2, 1, 3, 2), (1,), ()])
def test_flat_range_boxes_cover_the_range_in_order(shape):
    numel = max(1, torch.Size(shape).numel())
    index = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            boxes = flat_range_boxes(shape, start, stop)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            got = []
            for offsets, sizes in boxes:
                box = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else index
                got.extend(box.reshape(-1).tolist())
            assert got == list(range(start, stop)), (shape, start, stop, boxes)


# ----------------------------------------------------------------------------- same layout: exact
def _same_layout_worker(rank, world, name, stage, opt_name, options, fresh_loads, ckpt):
    model, opt = _build(name, stage, opt_name, options=options)
    _train(model, opt, rank, world, 0, 2, name)
    rng = torch.get_rng_state()
    zerocompile.save_checkpoint(ckpt, model, opt, extra={"step": 2, "rng": rng})
    runs = {"uninterrupted": _train(model, opt, rank, world, 2, 4, name)}
    states = {"uninterrupted": zerocompile.full_state_dict(model, rank0_only=False)}
    extras = []
    # the same model and optimizer, sharded and bound: load overwrites both in place
    extras.append(zerocompile.load_checkpoint(ckpt, model, opt))
    runs["bound"] = _train(model, opt, rank, world, 2, 4, name)
    states["bound"] = zerocompile.full_state_dict(model, rank0_only=False)
    for when in fresh_loads:
        model, opt = _build(name, stage, opt_name, seed=7, options=options)
        if when == AFTER:
            _first_forward(model, opt, rank, world, name)
        if when == READ_BEFORE:     # accelerate.prepare reads the optimizer before any forward
            opt.load_state_dict(opt.state_dict())
        extras.append(zerocompile.load_checkpoint(ckpt, model, opt))
        if when == READ_LOADED:     # binds the loaded state to the whole parameters
            opt.load_state_dict(opt.state_dict())
        runs[when] = _train(model, opt, rank, world, 2, 4, name)
        states[when] = zerocompile.full_state_dict(model, rank0_only=False)
    return runs, states, extras, rng


BEFORE, AFTER = "before first forward", "after first forward"
READ_BEFORE = "state_dict() read before first forward"
READ_LOADED = "state_dict() read after loading, before first forward"


@pytest.mark.parametrize("name,stage,opt_name,options,fresh_loads", [
    ("scaled", 3, "adamw", (), (AFTER, READ_BEFORE, READ_LOADED)),
    ("scaled", 1, "sgd", (), (BEFORE,)),        # whole state cut into shards at binding (0-dim too)
    ("mlp", 2, "adamw", (("param_dtype", "bfloat16"),), (AFTER, READ_BEFORE, READ_LOADED)),   # freed parameter storage
])
def test_resume_on_the_same_layout_is_bitwise(name, stage, opt_name, options, fresh_loads, tmp_path):
    """Saved after step 2 on 2 ranks; steps 3-4 after loading into the same (bound, sharded)
    model and optimizer, and into new ones before or after their first forward (also with the
    optimizer's state_dict() read before the first forward, before or after the load, as
    accelerate.prepare does), equal the uninterrupted steps 3-4 bit for bit."""
    runs, states, extras, rng = run_ranks(_same_layout_worker, 2, name, stage, opt_name, options,
                                          fresh_loads, str(tmp_path / "ckpt"))[0]
    assert set(runs) == {"uninterrupted", "bound", *fresh_loads}
    for when in ("bound", *fresh_loads):
        assert runs[when] == runs["uninterrupted"], when
        _assert_state(states[when], states["uninterrupted"], exact=True)
    for extra in extras:
        assert extra["step"] == 2 and torch.equal(extra["rng"], rng)


# ----------------------------------------------------------------------------- resharding
@dataclass(frozen=True)
class Segment:
    stage: int | None
    start: int
    stop: int
    load: str | None = None
    save: str | None = None
    after_forward: bool = False
    name: str = "scaled"
    opt: str = "adamw"


def _run_segment(rank, world, seg: Segment) -> dict:
    model, opt = _build(seg.name, seg.stage, seg.opt, seed=11 if seg.load else 0)   # a load overwrites it all
    if seg.load:
        if seg.after_forward:
            _first_forward(model, opt, rank, world, seg.name)
        assert zerocompile.load_checkpoint(seg.load, model, opt) == {"step": seg.start}
    losses = _train(model, opt, rank, world, seg.start, seg.stop, seg.name)
    if seg.save:
        zerocompile.save_checkpoint(seg.save, model, opt, extra={"step": seg.stop})
    out = {"losses": losses, "state": zerocompile.full_state_dict(model, rank0_only=False)}
    if seg.stage == 3:
        # TODO(lead): stage 3 `model.state_dict()` must either work or raise naming save_checkpoint
        # (ZeroParameter); this records which, the test asserts it
        try:
            out["module_state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
        except RuntimeError as err:
            out["module_state_dict_error"] = str(err)
    return out


def _segments(rank, world, segs):
    return [_run_segment(rank, world, seg) for seg in segs]


def test_resharding_across_world_sizes_and_stages_and_consolidation(tmp_path, capsys):
    """One run of 6 steps in segments: 2 ranks at stage 3, then 3 ranks at stage 2 (and at
    stage 3), then 1 process at stage 3, and 1 process uncompiled from the first checkpoint;
    each against plain torch on the whole batch. The checkpoints read back with torch's
    dcp_to_torch_save and with `zerocompile consolidate`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from zerocompile.cli import main

    ref_losses, ref = _reference("scaled", "adamw", 6)
    ck1, ck2, ck3 = (str(tmp_path / n) for n in ("ck1", "ck2", "ck3"))
    # 2 ranks, stage 3, steps 0-1
    a = run_ranks(_run_segment, 2, Segment(stage=3, start=0, stop=2, save=ck1))[0]
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(ref_losses[:2]), atol=1e-5, rtol=1e-5)
    # 3 ranks: stage 2 (loaded after its first forward, so into shards), steps 2-3, saved;
    # and stage 3, loaded after its first forward
    b2, b3 = run_ranks(_segments, 3, [
        Segment(stage=2, start=2, stop=4, load=ck1, save=ck2, after_forward=True),
        Segment(stage=3, start=2, stop=4, load=ck1, after_forward=True)])[0]
    for b in (b2, b3):
        torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(ref_losses[2:4]), atol=1e-5, rtol=1e-5)
        _assert_state(b["state"], ref[4]["model"])
    # 1 process: stage 3 (world size 1) from the 3-rank stage-2 checkpoint, steps 4-5, saved;
    # uncompiled (stage 0) straight from the 2-rank stage-3 checkpoint, steps 2-3
    c = _run_segment(0, 1, Segment(stage=3, start=4, stop=6, load=ck2, save=ck3, after_forward=True))
    d = _run_segment(0, 1, Segment(stage=None, start=2, stop=4, load=ck1))
    torch.testing.assert_close(torch.tensor(c["losses"]), torch.tensor(ref_losses[4:6]), atol=1e-5, rtol=1e-5)
    _assert_state(c["state"], ref[6]["model"])
    torch.testing.assert_close(torch.tensor(d["losses"]), torch.tensor(ref_losses[2:4]), atol=1e-5, rtol=1e-5)
    _assert_state(d["state"], ref[4]["model"])

    # every checkpoint reads back with torch's own dcp_to_torch_save: real shapes, optimizer
    # state under state.<fqn>.<name> equal to plain torch's
    for ck, step in ((ck1, 2), (ck2, 4), (ck3, 6)):
        dcp_to_torch_save(ck, ck + ".pt")
        flat = torch.load(ck + ".pt", weights_only=False)
        _assert_state({k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}, ref[step]["model"])
        for fqn, state in ref[step]["optim"].items():
            for key, value in state.items():
                torch.testing.assert_close(flat[f"optim.state.{fqn}.{key}"], value, atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{ck} {fqn}.{key}: {m}")
        assert flat["optim.param_groups.wte.weight.lr"] == 1e-2
        assert "optim.state.head.weight.exp_avg" not in flat    # tied: state under the first name
        assert torch.equal(flat["model.head.weight"], flat["model.wte.weight"])

    # plain torch reads the model part straight into an unsharded model
    plain = _model("scaled", seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "assuming the intent is to load in a single process"
        dcp.load({"model." + k: v for k, v in plain.state_dict().items()}, checkpoint_id=ck2, no_dist=True)
    _assert_state(plain.state_dict(), ref[4]["model"])

    # zerocompile consolidate: the full state dict of the 2-rank stage-3 checkpoint
    assert main(["consolidate", ck1, str(tmp_path / "full.pt")]) == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    _assert_state(full, a["state"], exact=True)
    assert full["head.weight"] is full["wte.weight"]     # tied, as in torch's state_dict
    _model("scaled").load_state_dict(full)
    try:
        import safetensors.torch as safetensors
    except ImportError:      # an optional package: the command says which one it needs
        safetensors = None
    code = main(["consolidate", ck1, str(tmp_path / "full.safetensors")])
    if safetensors is None:
        assert code == 1 and "'safetensors' package" in capsys.readouterr().err
    else:
        assert code == 0
        _assert_state(safetensors.load_file(tmp_path / "full.safetensors"), a["state"], exact=True,
                      ordered=False)      # safetensors files list their keys sorted

    # TODO(lead): stage 3 model.state_dict() works or raises a RuntimeError naming save_checkpoint
    if "module_state_dict_error" in a:
        assert "save_checkpoint" in a["module_state_dict_error"], a["module_state_dict_error"]
    else:
        _assert_state(a["module_state_dict"], ref[2]["model"])


# ----------------------------------------------------------------------------- consolidate
def test_consolidate_cli_errors(tmp_path, capsys):
    from zerocompile.cli import main

    assert main(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "out.pt")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["consolidate", str(tmp_path / "empty"), str(tmp_path / "out.pt")]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


# ----------------------------------------------------------------------------- a killed rank
PG_TIMEOUT = 15


def _crash_worker(rank, world, port, ckpt):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    model, opt = _build("mlp", 3, "adamw")
    _train(model, opt, rank, world, 0, 2, "mlp")
    zerocompile.save_checkpoint(ckpt, model, opt, extra={"step": 2})
    x, y = _batch("mlp", 2)
    loss = model(rank_slice(x, rank, world), rank_slice(y, rank, world))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)     # dies between its forward and its backward
    loss.backward()                              # rank 0: its reduce-scatter has no peer
    opt.step()
    _train(model, opt, rank, world, 3, 6, "mlp")
    sys.exit(0)


def _resume_and_uninterrupted(rank, world, ckpt):
    whole = _run_segment(rank, world, Segment(stage=3, start=0, stop=6, name="mlp"))
    resumed = _run_segment(rank, world, Segment(stage=3, start=2, stop=6, load=ckpt, name="mlp"))
    return whole, resumed


def test_killed_rank_fails_the_others_within_the_timeout_and_the_restart_is_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    port = free_port()
    # children of the tests' fork server (torch and zerocompile imported once), not spawned
    # interpreters that import them again: ~4-5 s of CPU per rank on 2 cores
    procs = [start_fresh(_crash_worker, r, 2, port, ckpt) for r in range(2)]
    try:
        procs[1].join(timeout=120)
        died = time.monotonic()
        assert procs[1].exitcode == -signal.SIGKILL, f"rank 1 exit code {procs[1].exitcode}"
        procs[0].join(timeout=PG_TIMEOUT + 30)
        waited = time.monotonic() - died
        assert not procs[0].is_alive(), f"rank 0 still running {waited:.0f} s after rank 1 died"
        assert procs[0].exitcode not in (0, None), "rank 0 exited cleanly although its peer died"
        assert waited < PG_TIMEOUT + 10, f"rank 0 took {waited:.0f} s to fail (process group timeout {PG_TIMEOUT} s)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    whole, resumed = run_ranks(_resume_and_uninterrupted, 2, ckpt)[0]
    assert resumed["losses"] == whole["losses"][2:]
    _assert_state(resumed["state"], whole["state"], exact=True)


# ----------------------------------------------------------------------------- one process: files and errors
def _plain(name="mlp", opt_name="adamw", seed=0, **model_kwargs):
    torch.manual_seed(seed)
    model = _model(name, seed) if not model_kwargs else type(make_model(name))(**model_kwargs)
    cls, kw = OPTIMIZERS[opt_name]
    return model, zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=cls, **kw)


def _one_step(model, opt, step=0):
    x, y = make_batch("mlp", step, 4)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    ckpt = str(tmp_path / "ckpt")
    model, opt = _plain()
    _one_step(model, opt)
    zerocompile.save_checkpoint(ckpt, model, opt, extra={"step": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _one_step(model, opt, 1)

    def broken_write(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", broken_write)
    with pytest.raises(RuntimeError, match=r"saving checkpoint .*ckpt\.tmp-\w+' failed on rank\(s\) \[0\]; "
                                           "rank 0: OSError: disk full"):
        zerocompile.save_checkpoint(ckpt, model, opt, extra={"step": 2})
    monkeypatch.undo()
    leftovers = [p for p in os.listdir(tmp_path) if p != "ckpt"]
    assert len(leftovers) == 1 and leftovers[0].startswith("ckpt.tmp-")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        zerocompile.load_checkpoint(tmp_path / leftovers[0], model, opt)
    _assert_state(zerocompile.consolidated_state_dict(ckpt), saved, exact=True)
    fresh, fresh_opt = _plain(seed=3)
    assert zerocompile.load_checkpoint(ckpt, fresh, fresh_opt) == {"step": 1}
    _assert_state(fresh.state_dict(), saved, exact=True)

    # a save that completes replaces the checkpoint and removes what the failed one left
    zerocompile.save_checkpoint(ckpt, model, opt, extra={"step": 2})
    assert os.listdir(tmp_path) == ["ckpt"]
    _assert_state(zerocompile.consolidated_state_dict(ckpt), model.state_dict(), exact=True)

    # interrupted between moving the old checkpoint aside and moving the new one in
    os.rename(ckpt, ckpt + ".old-0123456789ab")
    with pytest.raises(FileNotFoundError, match=r"previous checkpoint is .*ckpt\.old-0123456789ab"):
        zerocompile.load_checkpoint(ckpt, model, opt)


def test_errors_name_the_problem(tmp_path):
    import torch.distributed.checkpoint as dcp

    model, opt = _plain()
    _one_step(model, opt)
    ckpt = str(tmp_path / "ckpt")
    zerocompile.save_checkpoint(ckpt, model, opt)

    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        zerocompile.load_checkpoint(tmp_path / "missing", model, opt)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        zerocompile.load_checkpoint(tmp_path / "file", model, opt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        zerocompile.load_checkpoint(tmp_path / "empty", model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "foreign"), no_dist=True)
    with pytest.raises(ValueError, match="not one written by zerocompile.save_checkpoint"):
        zerocompile.load_checkpoint(tmp_path / "foreign", model, opt)

    gpt, gpt_opt = _plain("gpt")
    with pytest.raises(ValueError, match=r"different model.*missing from the checkpoint: wte\.weight.*"
                                         r"not in the model: l1\.weight"):
        zerocompile.load_checkpoint(ckpt, gpt, gpt_opt)
    wider, wider_opt = _plain(d_hidden=14)
    with pytest.raises(ValueError, match=r"shape mismatch: l1\.weight: checkpoint \(13, 7\), model \(14, 7\)"):
        zerocompile.load_checkpoint(ckpt, wider, wider_opt)
    sgd_model, sgd = _plain(opt_name="sgd", seed=5)
    untouched = {k: v.clone() for k, v in sgd_model.state_dict().items()}
    with pytest.raises(ValueError, match="holds AdamW state, but this optimizer wraps SGD"):
        zerocompile.load_checkpoint(ckpt, sgd_model, sgd)
    _assert_state(sgd_model.state_dict(), untouched, exact=True)     # checked before anything is loaded
    split = zerocompile.ZeroOptimizer([{"params": [model.l1.weight], "lr": 0.5},
                                       {"params": [p for n, p in model.named_parameters() if n != "l1.weight"]}],
                                      optimizer_class=torch.optim.AdamW, lr=1e-2)
    _one_step(model, split)
    zerocompile.save_checkpoint(tmp_path / "split", model, split)
    with pytest.raises(ValueError, match="were saved with different 'lr'"):
        zerocompile.load_checkpoint(tmp_path / "split", model, opt)
    other = zerocompile.ZeroOptimizer(make_model("mlp").parameters(), optimizer_class=torch.optim.AdamW)
    with pytest.raises(ValueError, match="not in the model"):
        zerocompile.load_checkpoint(ckpt, model, other)
    with pytest.raises(TypeError, match="ZeroOptimizer"):
        zerocompile.save_checkpoint(tmp_path / "x", model, torch.optim.SGD(model.parameters(), lr=1))

    # never replaces what is not a checkpoint
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a zerocompile checkpoint"):
        zerocompile.save_checkpoint(tmp_path / "mine", model, opt)
    with pytest.raises(FileExistsError, match="not a directory"):
        zerocompile.save_checkpoint(tmp_path / "file", model, opt)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "file").read_text() == "x"
