"""Monitors (``zerocompile/monitor.py``, ``zerocompile/optim/monitoring.py``): DeepSpeed's
TensorBoard, CSV, W&B and Comet monitors from a DeepSpeed config, written by rank 0 after every
``ZeroOptimizer.step()``; the files are read back (TensorBoard's event reader, the CSV files, the
W&B offline run's transaction log, the Comet offline archive) and every figure is checked against
what the ranks computed themselves."""

from __future__ import annotations

import csv
import json
import os
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zerocompile
from dist_utils import run_ranks
from zerocompile.config import ZeroConfig
from zerocompile.errors import ZeroConfigError
from zerocompile.monitor import MonitorSettings

REPO = Path(__file__).resolve().parent.parent
STEPS = 3
BATCH = 4          # per rank


def _train(rank: int, world: int, out: str, options: dict) -> dict:
    from models import make_batch, make_model

    # W&B and Comet keep their runs on disk, under the test's directory
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=out, WANDB_SILENT="true",
                      COMET_OFFLINE_DIRECTORY=str(Path(out) / "comet"))
    torch.manual_seed(0)
    model = make_model("gpt")
    compiled = torch.compile(model, backend="zero", options={**options, "inner_compiler": "eager"})
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    seen = {"lr": [], "grad_norm": [], "loss": [], "own_loss": [], "comm": [], "state": [], "flops": []}
    before = zerocompile.stats()
    for step in range(STEPS):
        x, y = make_batch("gpt", step * world + rank, BATCH)
        loss = compiled(x, y)
        loss.backward()
        zerocompile.log_metrics({"train_loss": loss})
        seen["lr"].append(opt.param_groups[0]["lr"])
        seen["grad_norm"].append(float(opt.clip_grad_norm_(1.0)) if step != 1 else None)
        opt.step()
        now = zerocompile.stats()          # as the step ends: its gradients are still held
        seen["flops"].append(now.flops_per_step)
        opt.zero_grad()
        sched.step()
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        seen["loss"].append(sum(float(v) for v in losses) / world)
        seen["own_loss"].append(float(loss.detach()))
        seen["comm"].append({k: getattr(now, k).bytes - getattr(before, k).bytes
                             for k in ("all_gather", "reduce_scatter", "all_reduce")})
        seen["state"].append(now.param_bytes + now.grad_bytes + now.optimizer_state_bytes)
        seen.setdefault("compile_seconds", []).append(now.compile_seconds - before.compile_seconds)
        seen.setdefault("simulated_peak", []).append(
            max(r["results"].get("simulated_peak_bytes", 0) for r in zerocompile.frame_reports()))
        before = now
    zerocompile.close_monitors()       # the ranks leave with os._exit: no exit handlers run
    return seen


def _ds_options(path: Path) -> dict:
    return {"zero_optimization": {"stage": 3}, "train_batch_size": 2 * BATCH,
            "tensorboard": {"enabled": True, "output_path": str(path), "job_name": "tb"},
            "csv_monitor": {"enabled": True, "output_path": str(path), "job_name": "csv"},
            "wandb": {"enabled": True, "project": "zc-test", "group": "g1", "team": "my-team"},
            "comet": {"enabled": True, "online": False, "project": "zc-test", "experiment_name": "job",
                      "samples_log_interval": 16}}


@pytest.fixture(scope="module")
def run(tmp_path_factory, once_per_run):
    def compute():
        path = tmp_path_factory.mktemp("monitor")       # kept until the run ends
        return path, run_ranks(_train, 2, str(path), _ds_options(path))
    return once_per_run("test_monitor.run", compute)


def _csv(path: Path, tag: str) -> list:
    with open(path / "csv" / (tag.replace("/", "_") + ".csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", tag.split("/")[-1]]
    return [(int(x), float(v)) for x, v in rows[1:]]


def _tensorboard(path: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1, events           # rank 0 only
    acc = EventAccumulator(str(path / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_every_tag_is_written_once_per_step_by_rank_0_with_the_ranks_figures(run):
    path, ranks = run
    seen = ranks[0]
    samples = [2 * BATCH * (i + 1) for i in range(STEPS)]    # x counts samples (train_batch_size)
    board = _tensorboard(path)
    assert all(f > 0 for f in seen["flops"]) and all(p > 0 for p in seen["simulated_peak"])
    expected = {"lr": seen["lr"], "train_loss": seen["loss"], "model_state_bytes": seen["state"],
                "flops": seen["flops"], "simulated_peak_bytes": seen["simulated_peak"],
                "comm_bytes_all_gather": [c["all_gather"] for c in seen["comm"]],
                "comm_bytes_reduce_scatter": [c["reduce_scatter"] for c in seen["comm"]]}
    for name, values in expected.items():
        tag = f"Train/Samples/{name}"
        for got in (board[tag], _csv(path, tag)):
            assert [x for x, _ in got] == samples, tag
            assert [v for _, v in got] == pytest.approx(values, rel=1e-6), tag
    # clipping ran in steps 1 and 3 only: the norm each returned
    norms = [(x, v) for x, v in zip(samples, seen["grad_norm"]) if v is not None]
    assert [x for x, _ in board["Train/Samples/grad_norm"]] == [x for x, _ in norms]
    assert [v for _, v in board["Train/Samples/grad_norm"]] == pytest.approx([v for _, v in norms], rel=1e-6)
    assert [x for x, _ in board["Train/Samples/step_time_ms"]] == samples
    assert all(v > 0 for _, v in board["Train/Samples/step_time_ms"])
    # each rank's own loss differs: what is written is their mean
    assert all(a != b for a, b in zip(ranks[0]["own_loss"], ranks[1]["own_loss"]))
    # the CSV monitor writes the same tags as TensorBoard
    assert sorted(p.stem for p in (path / "csv").glob("*.csv")) == sorted(t.replace("/", "_") for t in board)
    # the first step compiled the model: its compile time is written at that step only
    assert seen["compile_seconds"][0] > 0 and seen["compile_seconds"][1:] == [0, 0]
    assert board["Train/Samples/compile_seconds"] == [(samples[0], pytest.approx(seen["compile_seconds"][0]))]
    # W&B: one offline run (rank 0's), its history is TensorBoard's, step for step
    run_record, history = _wandb_run(path)
    assert (run_record.project, run_record.run_group, run_record.entity) == ("zc-test", "g1", "my-team")
    assert [h["_step"] for h in history] == samples
    for tag, points in board.items():
        assert [(h["_step"], h[tag]) for h in history if tag in h] == [(x, pytest.approx(v)) for x, v in points], tag
    # Comet: one offline archive; a tag is logged when 16 samples passed since its last log
    comet = _comet_metrics(path)
    for tag, points in board.items():
        due, last = [], None
        for x, v in points:
            if last is None or x - last >= 16:
                due.append((x, pytest.approx(v)))
                last = x
        assert comet.get(tag) == due, tag
    assert len(comet) == len(board)


def _wandb_run(path: Path):
    """The run record and the history rows of the one W&B offline run under ``path``, read from
    its transaction log (W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of records
    with a 7-byte header each: CRC, length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    files = list(path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files             # rank 0 only
    data = files[0].read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:          # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    # say what the log held when it has no run record
    assert len(runs) == 1, (f"{files[0]}: {len(data)} bytes, {len(runs)} run records among "
                            f"{[r.WhichOneof('record_type') for r in records]}")
    return runs[0], history


def _comet_metrics(path: Path) -> dict:
    """Tag -> [(step, value)] of the Train/ metrics in the one Comet offline archive under ``path``
    (the archive format of comet_ml 3.x: ``messages.json``, one message per line)."""
    import comet_ml

    assert comet_ml.__version__.startswith("3.")
    archives = list((path / "comet").glob("*.zip"))
    assert len(archives) == 1, archives      # rank 0 only
    out: dict = {}
    with zipfile.ZipFile(archives[0]) as archive:
        for line in archive.read("messages.json").decode().splitlines():
            message = json.loads(line)
            metric = message.get("payload", {}).get("metric") if message.get("type") == "metric_msg" else None
            if metric and metric["metricName"].startswith("Train/"):
                out.setdefault(metric["metricName"], []).append((metric["step"], metric["metricValue"]))
    return out


def test_options_and_deepspeed_keys():
    cfg = ZeroConfig.from_options({"monitor": {"csv_monitor": {"enabled": True, "output_path": "a", "job_name": "b"}}})
    assert cfg.observability.monitor == MonitorSettings(csv="a/b")
    assert ZeroConfig.from_options({"monitor": {"tensorboard": {"enabled": False}}}).observability.monitor is None
    ds = ZeroConfig.from_options({"tensorboard": {"enabled": True, "job_name": "j"}, "train_batch_size": 64})
    assert ds.observability.monitor == MonitorSettings(tensorboard="j", samples_per_step=64)
    assert ZeroConfig.from_options({"wandb": {"enabled": False, "project": "p"}}).observability.monitor is None
    wb = ZeroConfig.from_options({"wandb": {"enabled": True, "group": "g"}}).observability.monitor.wandb
    assert (wb.project, wb.group, wb.team) == ("deepspeed", "g", None)          # DeepSpeed's default project
    cm = ZeroConfig.from_options({"comet": {"enabled": True, "api_key": "secret", "mode": "get"}}).observability.monitor.comet
    assert cm.samples_log_interval == 100 and cm.mode == "get" and "secret" not in repr(cm)
    assert ZeroConfig.from_options({"flops_profiler": {"enabled": False, "profile_step": 3}}).observability.flops_profiler is None
    fp = ZeroConfig.from_options({"flops_profiler": {"enabled": True, "profile_step": 3}}).observability.flops_profiler
    assert fp.profile_step == 3 and fp.module_depth == -1 and fp.detailed
    # DeepSpeed's recompute_fwd_factor (newer configs carry it): accepted, the recompute is counted instead
    assert ZeroConfig.from_options({"flops_profiler": {"enabled": True, "recompute_fwd_factor": 0.0}}).observability.flops_profiler == \
        ZeroConfig.from_options({"flops_profiler": {"enabled": True}}).observability.flops_profiler
    for options, message in (
            ({"wandb": {"enabled": True, "entity": "p"}}, "unknown key(s) entity"),
            ({"wandb": {"enabled": True, "project": 3}}, "'wandb.project' = 3"),
            ({"comet": {"enabled": True, "mode": "append"}}, "'comet.mode' = 'append'"),
            ({"comet": {"enabled": True, "samples_log_interval": 0}}, "samples_log_interval"),
            ({"comet": {"enabled": True, "online": "no"}}, "'comet.online'"),
            ({"comet": {"enabled": True, "api_key": 123}}, "'comet.api_key' = <hidden>"),
            ({"monitor": {"tensorboard": {"enabled": True, "path": "x"}}}, "unknown key(s) path"),
            ({"monitor": {"tensorboard": {"enabled": "yes"}}}, "give true or false"),
            ({"monitor": {"mlflow": {}}}, "unknown key(s) mlflow"),
            ({"monitor": {"samples_per_step": 0}}, "samples_per_step"),
            ({"monitor": "logs"}, "option 'monitor'"),
            ({"flops_profiler": {"enabled": True, "profile_steps": 1}}, "unknown key(s) profile_steps"),
            ({"flops_profiler": {"enabled": True, "profile_step": 0}}, "'profile_step' = 0"),
            ({"flops_profiler": {"enabled": True, "peak_tflops": -1}}, "'peak_tflops' = -1"),
            ({"flops_profiler": {"enabled": True, "recompute_fwd_factor": -1}}, "'recompute_fwd_factor' = -1"),
            ({"flops_profiler": {"enabled": 1}}, "give true or false")):
        with pytest.raises(ZeroConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ZeroConfig.from_options(options)


def test_a_monitor_without_its_package_says_which_extra_to_install(monkeypatch):
    from zerocompile.monitor import MetricWriter, parse_monitor

    for module, kind, extra in (("wandb", "wandb", "wandb"), ("comet_ml", "comet", "comet")):
        monkeypatch.setitem(sys.modules, module, None)          # as if it were not installed
        with pytest.raises(ZeroConfigError, match=rf"pip install 'zerocompile\[{extra}\]'"):
            MetricWriter(parse_monitor({kind: {"enabled": True}}))


def test_wandb_logs_into_the_scripts_own_run_and_leaves_it_open(tmp_path, monkeypatch):
    """A script that started its W&B run (HF Trainer's report_to="wandb") gets the figures in it,
    with x as a tag (the run counts its own steps); closing the monitor does not finish the run."""
    import wandb

    from zerocompile.monitor import MetricWriter, parse_monitor

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="own")
    try:
        writer = MetricWriter(parse_monitor({"wandb": {"enabled": True, "project": "other"}}))
        writer.write({"Train/Samples/lr": 0.5}, 64)
        writer.close()
        assert wandb.run is run
    finally:
        run.finish()
        # W&B's service process writes the offline log; finish() can return before it flushed
        # (the log held its 7-byte header only, 2 in ~80 full runs): stopping the service
        # closes the log (an exiting rank does the same at its exit)
        wandb.teardown()
    _, history = _wandb_run(tmp_path)
    assert [(h["Train/Samples/lr"], h["Train/Samples/x"]) for h in history] == [(0.5, 64)]


def test_log_metrics_refuses_what_it_cannot_write():
    with pytest.raises(TypeError, match="give a number"):
        zerocompile.log_metrics({"loss": "low"})
    with pytest.raises(ValueError, match="one number"):
        zerocompile.log_metrics({"loss": torch.ones(2)})
    with pytest.raises(TypeError, match="dict"):
        zerocompile.log_metrics([1.0])


def _mlp_with_csv_monitor(path: str, stage: int):
    """An MLP compiled at ``stage`` whose CSV monitor writes to ``path/x``, and its optimizer."""
    from models import make_model

    torch.manual_seed(0)
    model = make_model("mlp")
    options = {"stage": stage, "inner_compiler": "eager",
               "monitor": {"csv_monitor": {"enabled": True, "output_path": path, "job_name": "x"}}}
    return torch.compile(model, backend="zero", options=options), \
        zerocompile.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)


def _bad_path(rank: int, world: int, path: str) -> str:
    from models import make_batch

    compiled, opt = _mlp_with_csv_monitor(path, 2)
    x, y = make_batch("mlp", rank, 4)
    compiled(x, y).backward()
    try:
        opt.step()
    except ZeroConfigError as exc:
        return str(exc)
    return "no error"


def _different_names(rank: int, world: int, path: str) -> str:
    from models import make_batch

    compiled, opt = _mlp_with_csv_monitor(path, 2)
    x, y = make_batch("mlp", rank, 4)
    compiled(x, y).backward()
    zerocompile.log_metrics({"loss": 1.0, "only_rank_1": 2.0} if rank == 1 else {"loss": 1.0})
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_log_different_names_get_one_clear_error_each(tmp_path):
    for said in run_ranks(_different_names, 2, str(tmp_path)):
        assert "the ranks logged different names" in said and "rank 1: loss, only_rank_1" in said, said


def test_a_path_the_monitor_cannot_write_is_one_clear_error_on_every_rank(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")          # a file where the output directory should be
    errors = run_ranks(_bad_path, 2, str(blocker / "logs"))
    assert all("the monitor cannot write" in e and str(blocker) in e for e in errors), errors


def test_show_metrics_plots_what_the_monitors_wrote(run, tmp_path):
    """``zerocompile show --metrics DIR``: the CSV monitor's directory and TensorBoard's give the
    same table of tags, and a plot with one panel per tag."""
    from dist_utils import run_cli

    from zerocompile.cli.show import read_metrics

    path, _ = run
    series = {kind: read_metrics(path / kind) for kind in ("csv", "tb")}
    assert sorted(series["csv"]) == sorted(series["tb"]) and "Train/Samples/train_loss" in series["csv"]
    for tag, points in series["csv"].items():
        assert [v for _, v in points] == pytest.approx([v for _, v in series["tb"][tag]], rel=1e-6), tag
    for kind in ("csv", "tb"):
        out = tmp_path / f"{kind}.png"
        # a wide console: the table's lines are not wrapped (the test reads them)
        done = run_cli(["show", "--metrics", str(path / kind), "--out", str(out)], REPO, environ={**os.environ, "COLUMNS": "200"},
                       timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert out.stat().st_size > 10_000
        shown = sorted(ln.split()[1] for ln in done.stdout.splitlines() if "Train/Samples/" in ln)
        assert shown == sorted(series[kind]), done.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_cli(["show", "--metrics", str(empty)], REPO, timeout=120)
    assert done.returncode == 2 and "holds no monitor files" in done.stderr
    done = run_cli(["show", str(empty), "--metrics", str(empty)], REPO, timeout=120)
    assert done.returncode == 2 and "not both" in done.stderr


def _disk_goes_away(rank: int, world: int, path: str) -> int:
    import shutil

    from models import make_batch

    compiled, opt = _mlp_with_csv_monitor(path, 3)
    for step in range(3):
        x, y = make_batch("mlp", step * world + rank, 4)
        compiled(x, y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0 and rank == 0:          # the monitor's directory becomes a file: writes fail
            shutil.rmtree(Path(path) / "x")
            (Path(path) / "x").write_text("")
    return step + 1


def test_a_write_that_fails_later_stops_the_monitor_not_the_training(tmp_path):
    assert run_ranks(_disk_goes_away, 2, str(tmp_path)) == [3, 3]


def _logs_after_each_step(rank: int, world: int, path: str) -> list:
    from models import make_batch

    compiled, opt = _mlp_with_csv_monitor(path, 2)
    for step in range(3):
        x, y = make_batch("mlp", step * world + rank, 4)
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        zerocompile.log_metrics({"after_step": float(10 * step + rank)})   # after the step, as many loops do
    zerocompile.close_monitors()       # every rank: the last value's mean over the ranks is written here
    return []


def test_values_logged_after_the_last_step_are_written_by_close_monitors(tmp_path):
    run_ranks(_logs_after_each_step, 2, str(tmp_path))
    # each value is written with the next step's figures, the last one by close_monitors at the
    # step after the last: 3 points for 3 steps, each the mean over the 2 ranks
    with open(tmp_path / "x" / "Train_Samples_after_step.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "after_step"]
    assert [(int(x), float(v)) for x, v in rows[1:]] == [(2, 0.5), (3, 10.5), (4, 20.5)]
