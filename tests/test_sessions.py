"""Several models in one process, each with its own session (``runtime/session.py``): an
RLHF-style step with a policy at stage 3 (AdamW), its frozen reference at stage 3 run for
inference only and a reward model at stage 2 (SGD), each with its own monitor and comms-logger
settings, trained interleaved in one process on 2 gloo ranks, against the same three run one
after another in another process. Each model's losses, weights, ``stats(model)``, comms-logger
rows and monitor files are the same both ways, and each model's figures are its own only."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import zerocompile
from dist_utils import run_ranks
from models import make_batch, make_model
from zerocompile.runtime.session import PROCESS

STEPS, BATCH = 3, 8
POLICY_LOGGER = {"enabled": True}
REWARD_LOGGER = {"enabled": True, "prof_all": False, "prof_ops": ["all_gather_into_tensor"]}


def _options(stage: int, **extra) -> dict:
    return {"stage": stage, "inner_compiler": "eager", **extra}


def _monitor(folder: Path, job: str) -> dict:
    return {"csv_monitor": {"enabled": True, "output_path": str(folder), "job_name": job}}


def _half(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


class _Models:
    """The three models, compiled with their own options; each is built right before its first use."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def reference(self):
        torch.manual_seed(0)
        model = make_model("gpt").requires_grad_(False)      # the policy's initial weights, frozen
        return model, torch.compile(model, backend="zero", options=_options(3))

    def policy(self):
        torch.manual_seed(0)
        model = make_model("gpt")
        compiled = torch.compile(model, backend="zero", options=_options(
            3, comms_logger=POLICY_LOGGER, monitor=_monitor(self.folder, "policy")))
        return model, compiled, zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.AdamW, lr=3e-3)

    def reward(self):
        torch.manual_seed(1)
        model = make_model("mlp")
        compiled = torch.compile(model, backend="zero", options=_options(
            2, comms_logger=REWARD_LOGGER, monitor=_monitor(self.folder, "reward")))
        return model, compiled, zerocompile.ZeroOptimizer(compiled.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)


def _policy_step(compiled, opt, x, y, ref_loss) -> float:
    """A DPO-like loss: the policy's own, and how far it moved from the reference's."""
    loss = compiled(x, y)
    (loss + (loss - ref_loss) ** 2).backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def _reward_step(compiled, opt, x, y) -> float:
    loss = compiled(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def _figures(model, compiled) -> dict:
    stats = zerocompile.stats(model).as_dict()
    del stats["compile_seconds"]
    rows = [(r["kind"], r["msg_bytes"], r["count"]) for r in stats.pop("comm_latency")]
    return {"stats": stats, "rows": rows, "state": zerocompile.full_state_dict(compiled),
            "flops_since_step": PROCESS.session_of_model(model).flops["flops"]}


def _batches(rank: int, world: int, step: int):
    x, y = make_batch("gpt", step, BATCH)
    u, v = make_batch("mlp", step, BATCH)
    return _half(x, rank, world), _half(y, rank, world), _half(u, rank, world), _half(v, rank, world)


def _together(rank: int, world: int, folder: str) -> dict:
    """The three interleaved in every step, as an RLHF loop runs them."""
    models = _Models(Path(folder))
    ref, ref_c = models.reference()
    policy, policy_c, policy_opt = models.policy()
    reward, reward_c, reward_opt = models.reward()
    out = {"reference": [], "policy": [], "reward": []}
    for step in range(STEPS):
        x, y, u, v = _batches(rank, world, step)
        with torch.no_grad():
            ref_loss = ref_c(x, y)
        out["reference"].append(float(ref_loss))
        out["policy"].append(_policy_step(policy_c, policy_opt, x, y, ref_loss))
        out["reward"].append(_reward_step(reward_c, reward_opt, u, v))
    figures = {name: _figures(m, c) for name, m, c in (("reference", ref, ref_c), ("policy", policy, policy_c),
                                                         ("reward", reward, reward_c))}
    total = zerocompile.stats().as_dict()
    zerocompile.close_monitors()
    sessions = {name: PROCESS.session_of_model(m) for name, m in (("reference", ref), ("policy", policy),
                                                                  ("reward", reward))}
    return {"losses": out, "figures": figures, "total": total,
            "distinct_sessions": len({id(s) for s in sessions.values()}),
            "optimizers": {name: len(s.optimizers) for name, s in sessions.items()}}


def _one_after_another(rank: int, world: int, folder: str) -> dict:
    """The reference's inference, then the policy's training, then the reward model's: each
    model alone while it runs, all in one process."""
    models = _Models(Path(folder))
    out = {"reference": [], "policy": [], "reward": []}
    ref, ref_c = models.reference()
    ref_losses = []
    for step in range(STEPS):
        x, y, _, _ = _batches(rank, world, step)
        with torch.no_grad():
            ref_losses.append(ref_c(x, y))
        out["reference"].append(float(ref_losses[-1]))
    figures = {"reference": _figures(ref, ref_c)}
    policy, policy_c, policy_opt = models.policy()
    for step in range(STEPS):
        x, y, _, _ = _batches(rank, world, step)
        out["policy"].append(_policy_step(policy_c, policy_opt, x, y, ref_losses[step]))
    figures["policy"] = _figures(policy, policy_c)
    reward, reward_c, reward_opt = models.reward()
    for step in range(STEPS):
        _, _, u, v = _batches(rank, world, step)
        out["reward"].append(_reward_step(reward_c, reward_opt, u, v))
    figures["reward"] = _figures(reward, reward_c)
    zerocompile.close_monitors()
    return {"losses": out, "figures": figures}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, once_per_run):
    def compute():
        root = tmp_path_factory.mktemp("sessions")
        (root / "together").mkdir()
        (root / "apart").mkdir()
        return root, run_ranks(_together, 2, str(root / "together")), \
            run_ranks(_one_after_another, 2, str(root / "apart"))
    return once_per_run("test_sessions.runs", compute)


def _csv(folder: Path, tag: str) -> list:
    with open(folder / (tag.replace("/", "_") + ".csv")) as f:
        return [(int(step), float(value)) for step, value in list(csv.reader(f))[1:]]


TIMINGS = ("step_time_ms", "achieved_tflops", "compile_seconds")


def _monitored(folder: Path) -> dict:
    """Every tag the CSV monitor wrote in ``folder`` but the timings, with its values."""
    tags = [p.stem for p in folder.glob("*.csv")]
    return {tag: _csv(folder, tag) for tag in tags if not tag.endswith(TIMINGS)}


def test_models_interleaved_in_one_process_train_as_each_does_alone(runs):
    _, together, apart = runs
    for rank, (a, b) in enumerate(zip(together, apart)):
        assert a["distinct_sessions"] == 3, a["distinct_sessions"]
        assert a["optimizers"] == {"reference": 0, "policy": 1, "reward": 1}
        # the frozen reference has no step of its own: interleaved, each policy step ends its step
        # too (one forward's FLOPs); alone, its three forwards wait for a step that never comes
        ref_a, ref_b = a["figures"]["reference"], b["figures"]["reference"]
        assert ref_a["stats"]["flops_per_step"] * STEPS == ref_b["flops_since_step"] > 0
        assert ref_b["stats"]["flops_per_step"] == 0 and ref_a["flops_since_step"] == 0
        for name in ("reference", "policy", "reward"):
            assert a["losses"][name] == b["losses"][name], (rank, name)         # bitwise
            fa, fb = a["figures"][name], b["figures"][name]
            skip = {"flops_per_step"} if name == "reference" else set()
            assert {k: v for k, v in fa["stats"].items() if k not in skip} == \
                {k: v for k, v in fb["stats"].items() if k not in skip}, (rank, name, fa["stats"], fb["stats"])
            assert fa["rows"] == fb["rows"], (rank, name)
            assert set(fa["state"]) == set(fb["state"]) and len(fa["state"]) == (0 if rank else len(fa["state"]))
            for key, value in fa["state"].items():
                assert torch.equal(value, fb["state"][key]), (name, key)
    # the weights moved for the two trained models only
    state = together[0]["figures"]
    torch.manual_seed(0)
    initial = make_model("gpt").state_dict()
    assert all(torch.equal(state["reference"]["state"][k], v) for k, v in initial.items())
    assert not torch.equal(state["policy"]["state"]["head.weight"], initial["head.weight"])


def test_each_models_figures_are_its_own(runs):
    """The reference ran inference only: gathers, no gradient reduction; each comms logger kept its
    own settings (the reward model's times all-gathers only); ``stats()`` is the sum of the
    models' ``stats(model)``."""
    _, together, _ = runs
    for result in together:
        figures = result["figures"]
        ref, policy, reward = (figures[n]["stats"] for n in ("reference", "policy", "reward"))
        assert ref["all_gather"]["count"] > 0 and ref["reduce_scatter"]["count"] == 0
        assert ref["optimizer_state_bytes"] == 0 and ref["flops_per_step"] > 0
        assert policy["reduce_scatter"]["count"] > 0 and policy["optimizer_state_bytes"] > 0
        assert reward["reduce_scatter"]["count"] > 0
        assert figures["reference"]["rows"] == []                          # no comms logger there
        assert {kind for kind, _, _ in figures["policy"]["rows"]} >= {"all_gather", "reduce_scatter"}
        assert {kind for kind, _, _ in figures["reward"]["rows"]} == {"all_gather"}
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert result["total"][kind]["count"] >= sum(f[kind]["count"] for f in (ref, policy, reward))
        for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes"):
            assert result["total"][key] == sum(f[key] for f in (ref, policy, reward)), key


def test_each_monitor_writes_its_own_models_figures(runs):
    """Rank 0's CSV files: the policy's and the reward model's, each in its own folder with its own
    model's figures, the same interleaved as one after another."""
    root, _, _ = runs
    for job in ("policy", "reward"):
        together, apart = _monitored(root / "together" / job), _monitored(root / "apart" / job)
        assert together and together == apart, job
        assert [step for step, _ in together["Train_Samples_lr"]] == list(range(1, STEPS + 1))
    policy = _monitored(root / "together" / "policy")
    reward = _monitored(root / "together" / "reward")
    assert policy["Train_Samples_comm_bytes_reduce_scatter"] != reward["Train_Samples_comm_bytes_reduce_scatter"]


def _two_models(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    a, b = make_model("mlp"), make_model("mlp")
    ca = torch.compile(a, backend="zero", options=_options(3))
    cb = torch.compile(b, backend="zero", options=_options(3))
    x, y = make_batch("mlp", 0, 4)
    ca(x, y).backward()
    cb(x, y).backward()
    out = {}
    opt = zerocompile.ZeroOptimizer(list(a.parameters()) + list(b.parameters()), torch.optim.SGD, lr=0.1)
    try:
        opt.step()
        out["two"] = "no error"
    except ValueError as err:
        out["two"] = str(err)
    try:
        zerocompile.stats(make_model("mlp"))
        out["uncompiled"] = "no error"
    except ValueError as err:
        out["uncompiled"] = str(err)
    return out


def test_one_optimizer_over_two_models_and_stats_of_an_uncompiled_model_are_refused():
    for result in run_ranks(_two_models, 2):
        assert "belong to 2 compiled models" in result["two"] and "one ZeroOptimizer trains one model" in result["two"], \
            result["two"]
        assert "MLP has no zerocompile session" in result["uncompiled"], result["uncompiled"]


def test_a_models_frames_share_its_step_options():
    """The options of a model's optimizer step and its observability are its session's, given
    once: a block of the model compiled with another ``gradient_clipping`` (or comms logger) than
    the block before (whose compile gave the whole model its shard states) is refused at its
    compile, naming the option; and the session's own check refuses any frame of the model with
    other step or observability options (one process)."""
    from zerocompile.config import ZeroConfig
    from zerocompile.runtime.session import ModelSession, TimerSites

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make_model("gpt")
    model.blocks[0].compile(backend="zero", options=_options(3))
    model.blocks[1].compile(backend="zero", options=_options(3, gradient_clipping=1.0))
    x, y = make_batch("gpt", 0, 2)
    with pytest.raises(Exception, match="already sharded with gradient_clipping 0.0, but this frame was compiled "
                                        "with 1.0"):
        model(x, y)
    torch._dynamo.reset()
    session = ModelSession("GPT", TimerSites(), ZeroConfig.from_options(_options(3)))
    session.check_model_options(ZeroConfig.from_options(_options(3, bucket_mb=1)), "frame 1/0", "step",
                                ("loss_scale", "gradient_clipping", "offload_optimizer", "allow_unsharded"))
    session.check_model_options(ZeroConfig.from_options(_options(3, dump="/tmp/x")), "frame 1/0", "observability",
                                ("monitor", "flops_profiler", "comms_logger"))
    csv = {"csv_monitor": {"enabled": True, "output_path": "/tmp/x", "job_name": "j"}}
    for options, section, name in (
            ({"gradient_clipping": 1.0}, "step", "gradient_clipping"), ({"loss_scale": "dynamic"}, "step", "loss_scale"),
            ({"allow_unsharded": True}, "step", "allow_unsharded"),
            ({"offload_optimizer": {"device": "cpu"}}, "step", "offload_optimizer"),
            ({"monitor": csv}, "observability", "monitor"),
            ({"flops_profiler": {"enabled": True}}, "observability", "flops_profiler"),
            ({"comms_logger": {"enabled": True}}, "observability", "comms_logger")):
        with pytest.raises(ValueError, match=rf"\[frame 1/0\]: this frame of model 'GPT' was compiled with {name} .*"
                                             rf"cannot use different {name} options"):
            session.check_model_options(ZeroConfig.from_options(_options(3, **options)), "frame 1/0", section, (name,))
    # a frame of the model with another comms logger is refused at its compile
    torch._dynamo.reset()
    model = make_model("gpt")
    model.blocks[0].compile(backend="zero", options=_options(3))
    model.blocks[1].compile(backend="zero", options=_options(3, comms_logger={"enabled": True}))
    with pytest.raises(Exception, match="compiled with comms_logger .*cannot use different comms_logger options"):
        model(x, y)
    torch._dynamo.reset()
