"""``zerocompile tune``: the search on a model of plan's figures (what it plans, in which order,
when it stops, how it judges), its output files and its command line. Whether its estimated
ranking matches real runs on this machine is timing, so it is a benchmark:
``benchmarks/tune_ranking.py`` (in ``make bench``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import run_cli
from zerocompile.config import ZeroConfig
from zerocompile.deepspeed_config import translate_deepspeed
from zerocompile.plan import HARDWARE
from zerocompile.tune import (Tuner, TuneSettings, deepspeed_config, experiment_name, model_state_by_stage,
                              write_results)

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 600
GiB = 2**30


def _report(stage: int, peak: float, step_s: float, state: dict) -> dict:
    return {"stages": [stage], "peak_bytes_per_rank": int(peak), "estimated_step_s": step_s,
            "model_state_bytes_by_kind": state, "model_state_bytes_per_rank": sum(state.values()),
            "activations": {}}


class Model:
    """Plan's figures for a made-up model on 8 ranks: 8 GiB of parameters, as many of gradients,
    16 GiB of optimizer state (each full); every stage shards as ZeRO does. Peak = model state +
    2 GiB of activations (``recompute`` halves them); step time by stage, ``bucket_mb`` 50 a bit
    faster. ``calls`` records what was planned."""

    world = 8

    def __init__(self, limit_gib: float):
        self.limit = limit_gib
        self.calls: list = []

    def state(self, stage: int) -> dict:
        w = self.world
        return {"params": 8 * GiB / (w if stage == 3 else 1), "grads": 8 * GiB / (w if stage >= 2 else 1),
                "optimizer_state": 16 * GiB / (w if stage >= 1 else 1)}

    def plan(self, options: dict, mb, gas) -> dict:
        self.calls.append(dict(options))
        stage = options.get("stage", 3)
        state = self.state(stage)
        activations = 1 * GiB if options.get("recompute") == "full" else 2 * GiB
        step = {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.4}[stage]
        if options.get("bucket_mb") == 50.0:
            step -= 0.05
        if options.get("recompute") == "full":
            step += 0.3
        return _report(stage, sum(state.values()) + activations, step, state)


def _settings(limit_gib: float, **kw) -> TuneSettings:
    return TuneSettings(world_size=Model.world, hardware=HARDWARE["h100"], memory_limit_bytes=limit_gib * GiB,
                        base_options={"stage": 3}, **kw)


def test_the_search_plans_the_stages_then_around_the_best_and_picks_the_fastest_that_fits():
    model = Model(limit_gib=19)
    tuner = Tuner(_settings(19), model.plan)
    tuner.run()
    # stage 0 holds 32 GiB of model state by the formulas: not planned, with why
    assert [s["options"] for s in tuner.skipped] == [{"stage": 0}]
    assert "memory" in tuner.skipped[0]["why"]
    # stage 1 holds 18 GiB, planned: its 2 GiB of activations put it over; stage 2 fits and is
    # faster than 3
    assert [c.get("stage") for c in model.calls[:3]] == [3, 2, 1]
    best = tuner.best()
    assert best.options["stage"] == 2 and best.options.get("bucket_mb") == 50.0 and best.verdict == "best"
    verdicts = {e.name: e.verdict for e in tuner.experiments}
    assert verdicts["baseline"].startswith("time:") and verdicts["z1"].startswith("memory:")
    # ranked: the fits by time, then the rest by peak
    ranked = tuner.ranked()
    assert ranked[0] is best and ranked[-1].name == "z1"


def test_the_search_stops_after_patience_experiments_without_a_better_one():
    model = Model(limit_gib=100)
    tuner = Tuner(_settings(100, patience=2, max_experiments=50), model.plan)
    tuner.run()
    # baseline, the three other stages (a sweep is never cut short), then two that do not beat stage
    # 0's bucket 50 (which is not a knob at stage 0: stage 0's neighbours are recompute and offload)
    assert len(tuner.experiments) == 1 + 3 + 2
    capped = Tuner(_settings(100, max_experiments=3), Model(100).plan)
    capped.run()
    assert len(capped.experiments) == 3


def test_when_nothing_fits_an_optimizer_offload_row_is_derived_from_the_best():
    model = Model(limit_gib=3.2)
    tuner = Tuner(_settings(3.2), model.plan)
    tuner.run()
    derived = [e for e in tuner.experiments if e.derived_from]
    assert derived and "offload_optimizer" in derived[0].options
    source = next(e for e in tuner.experiments if e.name == derived[0].derived_from)
    moved = source.report["model_state_bytes_by_kind"]["optimizer_state"]
    assert derived[0].peak_bytes == source.peak_bytes - moved
    assert derived[0].step_ms > source.step_ms
    assert all("offload_optimizer" not in c for c in model.calls)       # derived, never planned


def test_the_micro_batch_search_keeps_the_samples_per_step():
    """A model whose step is fastest at micro-batch 4 of 16 samples per rank: the search walks
    there by doubling, every experiment trains 16 samples, and samples/s follows."""
    planned = []

    def plan(options, mb, gas):
        planned.append((mb, gas))
        step = 1.0 + 0.1 * abs(mb - 4) + 0.02 * gas
        return _report(3, GiB, step, Model(1).state(3))

    tuner = Tuner(_settings(100, micro_batch=1, grad_accum=16, exact=True), plan)
    tuner.run()
    assert all(mb * gas == 16 for mb, gas in planned)
    best = tuner.best()
    assert (best.micro_batch, best.grad_accum) == (4, 4)
    assert best.samples_per_s(Model.world) == pytest.approx(16 * Model.world / best.step_ms * 1e3)
    assert "mb4_gas4" in best.name


def test_the_stage_the_script_chose_is_read_from_the_baseline():
    """No stage in --options: the baseline runs the script's own (2 here), so the sweep plans
    stages 3, 1 and 0, not stage 2 again."""
    model = Model(limit_gib=100)

    def plan(options, mb, gas):
        return model.plan({"stage": 2, **options}, mb, gas)

    settings = _settings(100)
    settings.base_options = {}
    tuner = Tuner(settings, plan)
    tuner.run()
    assert [c["stage"] for c in model.calls[:4]] == [2, 3, 1, 0]


def test_model_state_by_stage_follows_the_zero_formulas():
    state = Model(1).state(3)
    got = model_state_by_stage(_report(3, 0, 0, state), 8)
    for stage in range(4):
        assert got[stage] == pytest.approx(sum(Model(1).state(stage).values()))


def test_the_deepspeed_config_translates_back_to_the_options():
    options = {"stage": 3, "bucket_mb": 50.0, "prefetch": True, "zero_hpz_partition_size": 8,
               "zero_quantized_weights": True, "zero_quantized_gradients": True,
               "reshard_after_forward": False, "recompute": "full"}
    ds, left = deepspeed_config(options, micro_batch=2, grad_accum=4)
    assert sorted(left) == ["recompute", "reshard_after_forward"]
    back = translate_deepspeed(ds)
    assert back == {k: v for k, v in options.items() if k not in left}
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert experiment_name({"stage": 2, "bucket_mb": 50.0, "micro_batch": 2}) == "z2_bucket50_mb2"


def test_the_results_directory(tmp_path):
    model = Model(limit_gib=19)
    settings = _settings(19)
    tuner = Tuner(settings, model.plan)
    tuner.run()
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "z9_from_an_earlier_tune.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("keep me")
    out = write_results(tmp_path, tuner, settings, ["train.py", "--x", "1"])
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert out["best"]["name"] == tuner.best().name and out["baseline"]["name"] == "baseline"
    assert {e["name"] for e in out["experiments"]} == {e.name for e in tuner.experiments}
    for e in out["experiments"]:
        assert set(e) >= {"options", "estimated_step_ms", "peak_bytes_per_rank", "verdict"}
    best = json.loads((tmp_path / "best_options.json").read_text())
    ZeroConfig.from_options(best)                                  # accepted as options=
    ds = json.loads((tmp_path / "ds_config_optimal.json").read_text())
    assert translate_deepspeed(ds)["stage"] == best["stage"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "best: " + tuner.best().name in summary and "memory:" in summary
    assert sorted(p.stem for p in (tmp_path / "experiments").iterdir()) == sorted(e.name for e in tuner.experiments)
    assert "torchrun" in (tmp_path / "cmd_optimal.txt").read_text()


def test_tune_on_a_real_script(tmp_path):
    """The command line on the tiny Llama at 16 ranks (two nodes of the h100 profile): one JSON
    object with best and baseline first on stdout, the files in --out, and the experiments that
    differ in pass options only planned on a trace made for an earlier one. The memory limit
    (0.56 MiB per rank: the two-layer model's state is about 1.3 MiB whole) puts stages 0 and 1
    over it by the formulas alone (skipped, not planned), so the sweep plans stage 2 on a trace of
    its own and the experiments after it are knobs around the best, on its trace."""
    limit_gb = 0.00056
    done = run_cli(["tune", "--world-size", "16", "--hardware", "h100", "--memory-limit-gb", str(limit_gb),
                    "--jobs", "1", "--max-experiments", "4", "--out", str(tmp_path / "out"), "--json", "--",
                    str(REPO / "benchmarks" / "train_llama.py"), "--size", "tiny", "--layers", "2", "--seq", "32",
                    "--steps", "20"], REPO, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[0])
    assert got["baseline"]["options"] == {} and got["best"]["peak_bytes_per_rank"] <= limit_gb * GiB
    assert got["best"]["estimated_step_ms"] <= got["baseline"]["estimated_step_ms"]
    assert 2 <= len(got["experiments"]) <= 4
    assert sorted(s["options"]["stage"] for s in got["skipped"]) == [0, 1], got["skipped"]
    assert sorted(e["options"].get("stage", 3) for e in got["experiments"]).count(2) >= 1
    assert got["best"]["activations"]["saved_bytes"] > 0          # what the frames save, as plan reports it
    assert (tmp_path / "out" / "summary.txt").is_file() and (tmp_path / "out" / "best_options.json").is_file()
    # the stages need traces of their own; a knob turned around the best reuses the best's trace
    traces = got["traces"]
    assert traces["made"] + traces["reused"] == len(got["experiments"]) and traces["reused"] >= 1
    assert sorted(e["trace"] for e in got["experiments"]).count("reused") == traces["reused"]
    assert "traces:" in (tmp_path / "out" / "summary.txt").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "8", "--hardware", "cpu"], "pass --memory-limit-gb"),
    (["--world-size", "8", "--memory-limit-gb", "1", "--micro-batch", "2"], "needs '{micro_batch}'"),
    (["--world-size", "8", "--memory-limit-gb", "1", "--", "{micro_batch}"], "give the baseline with --micro-batch"),
    (["--world-size", "8", "--options", '{"offload_optimizer": {"device": "cpu"}}'], "cannot set 'offload_optimizer'"),
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--world-size", "8", "--memory-limit-gb", "1", "--tokens-per-sample", "64"], "--tokens-per-sample needs"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, argv, message):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    if "--" in argv:
        cut = argv.index("--")
        argv = argv[:cut] + ["--", str(script)] + argv[cut + 1:]
    else:
        argv = argv + ["--", str(script)]
    done = run_cli(["tune", *argv], REPO, timeout=60)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


# a torchrun-style script whose micro-batch size and accumulation come from its arguments
SCRIPT = REPO / "benchmarks" / "tune_train.py"


def test_verify_from_the_command_line(tmp_path):
    """``--verify 1``: the best planned configuration runs for real on 2 ranks and its measured
    step time and peak come back beside the estimate (in --json and summary.txt)."""
    script = SCRIPT
    # one experiment (the baseline, so the best): the search itself is tested above; 4 steps, the
    # fewest --verify's measurement takes
    done = run_cli(["tune", "--world-size", "2", "--hardware", "cpu", "--memory-limit-gb", "4", "--micro-batch", "4",
                    "--max-experiments", "1", "--jobs", "1", "--verify", "1", "--tokens-per-sample", "16", "--out", str(tmp_path / "out"), "--json",
                    "--", str(script), "--batch", "{micro_batch}", "--accum", "{grad_accum}", "--steps", "4"], REPO,
                   timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[0])
    measured = got["best"]["measured"]
    assert measured and measured["step_ms"] > 0 and measured["peak_bytes"] > 0 and measured["ranks"] == 2
    assert got["best"]["samples_per_s"] > 0
    assert got["best"]["tokens_per_s"] == pytest.approx(got["best"]["samples_per_s"] * 16)
    assert "measured" in (tmp_path / "out" / "summary.txt").read_text()
