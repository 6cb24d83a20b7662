"""ZeroConfig: defaults, parsing, and every kind of bad input gets a clear, early error."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import zerocompile
from zerocompile.config import ZeroConfig, ZeroConfigError


def test_defaults():
    cfg = ZeroConfig.from_options(None)
    assert cfg.sharding.stage == 3 and cfg.sharding.param_dtype is None and cfg.sharding.reduce_dtype is torch.float32
    assert cfg.compiler.inner_compiler == "inductor" and cfg.sharding.process_group is None and cfg.passes.bucket_mb > 0
    assert cfg.passes.reshard_after_forward is True and cfg.passes.disabled_passes == ()


@pytest.mark.parametrize("spelling,dtype", [
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
    ("fp16", torch.float16), ("float16", torch.float16), (torch.float16, torch.float16),
    ("float32", torch.float32), (None, None)])
def test_param_dtype_spellings(spelling, dtype):
    assert ZeroConfig.from_options({"param_dtype": spelling}).sharding.param_dtype == dtype


def test_unknown_key_suggests_closest():
    with pytest.raises(ZeroConfigError, match=r"unknown option 'stag'; did you mean 'stage'\?"):
        ZeroConfig.from_options({"stag": 3})
    with pytest.raises(ZeroConfigError, match=r"did you mean 'param_dtype'"):
        ZeroConfig.from_options({"param_dtyp": "bf16"})
    with pytest.raises(ZeroConfigError, match=r"unknown option 'zzz'; valid options: stage, "):
        ZeroConfig.from_options({"zzz": 1})


@pytest.mark.parametrize("options,pattern", [
    ({"stage": 4}, r"option 'stage' = 4 is invalid; allowed: 0, 1, 2, 3"),
    ({"stage": "3"}, r"option 'stage' = '3' is invalid"),
    ({"stage": True}, r"option 'stage' = True is invalid"),
    ({"param_dtype": "int8"}, r"option 'param_dtype' = 'int8' is invalid; allowed: 'float32', 'bfloat16', 'float16' or None"),
    ({"param_dtype": torch.float64}, r"option 'param_dtype' = torch.float64 is invalid"),
    ({"reduce_dtype": None}, r"option 'reduce_dtype' = None is invalid; allowed: 'float32', 'bfloat16', 'float16'$"),
    ({"bucket_mb": -1}, r"option 'bucket_mb' = -1 is invalid; allowed: a finite number of MiB >= 0 \(0 = off\)"),
    ({"bucket_mb": "25"}, r"option 'bucket_mb' = '25' is invalid"),
    ({"inner_compiler": "aot_eager"}, r"option 'inner_compiler' = 'aot_eager' is invalid; allowed: 'inductor', 'eager'"),
    ({"process_group": "world"}, r"option 'process_group' = 'world' is invalid"),
    ({"reshard_after_forward": 1}, r"option 'reshard_after_forward' = 1 is invalid; allowed: True, False"),
    ({"disabled_passes": "reshard_after_forward"}, r"option 'disabled_passes' = 'reshard_after_forward' is invalid"),
    ({"disabled_passes": ["reshard_after_forwrd"]}, r"unknown pass in the disabled passes: 'reshard_after_forwrd'; did you mean 'reshard_after_forward'\?"),
    ({"disabled_passes": ["insert_param_collectives"]}, r"pass 'insert_param_collectives' cannot be disabled"),
    ({"passes": {"disable": ["prefetc"]}}, r"unknown pass in the disabled passes: 'prefetc'; did you mean 'prefetch'\?"),
    ({"passes": {"disable": ["tag_collectives"]}}, r"pass 'tag_collectives' cannot be disabled"),
    ({"passes": {"enable": ["prefetch"]}}, r"option 'passes' = .* is invalid; allowed: a dict \{'disable': \[pass names\]\}"),
    ({"passes": {"disable": "prefetch"}}, r"option 'passes.disable' = 'prefetch' is invalid; allowed: a list of pass names"),
    ({"passes": {"disable": []}, "disabled_passes": []}, r"give disabled passes once"),
    ({"prefetch": "yes"}, r"option 'prefetch' = 'yes' is invalid; allowed: True, False"),
    ({"prefetch_mb": -1}, r"option 'prefetch_mb' = -1 is invalid; allowed: a number of MiB >= 0"),
    ({"prefetch_mb": float("inf")}, r"option 'prefetch_mb' = inf is invalid; allowed: a number of MiB >= 0 \(finite\)"),
    ({"bucket_mb": float("inf")}, r"option 'bucket_mb' = inf is invalid; allowed: a finite number of MiB >= 0"),
    ({"memory_limit_mb": float("inf")}, r"option 'memory_limit_mb' = inf is invalid"),
    ({"passes": {"disable": ["tag_collectives"]}}, r"pass 'tag_collectives' cannot be disabled: it only labels nodes"),
    ({"unshard_budget_mb": "all"}, r"option 'unshard_budget_mb' = 'all' is invalid; allowed: a number of MiB >= 0, or 'auto'"),
    ({"unshard_budget_mb": float("nan")}, r"option 'unshard_budget_mb' = nan is invalid"),
    ({"unshard_budget_mb": "auto"}, r"option 'unshard_budget_mb' = 'auto' needs 'memory_limit_mb'"),
    ({"memory_limit_mb": "1G"}, r"option 'memory_limit_mb' = '1G' is invalid; allowed: a number of MiB >= 0 \(finite\), or None"),
    ({"recompute": "selective"}, r"option 'recompute' = 'selective' is invalid; allowed: 'none', 'full', or \{'memory_budget_mb': MiB\}"),
    ({"recompute": {"budget": 3}}, r"option 'recompute' = \{'budget': 3\} is invalid"),
    ({"recompute": {"memory_budget_mb": -2}}, r"option 'recompute.memory_budget_mb' = -2 is invalid"),
    ({"cost_model": "measure"}, r"option 'cost_model' = 'measure' is invalid; allowed: 'probe' or a dict with keys flops_per_s"),
    ({"cost_model": {"flops": 1e12}}, r"unknown key in option 'cost_model': 'flops'; did you mean 'flops_per_s'\?"),
    ({"cost_model": {"alpha_us": 0}}, r"option 'cost_model.alpha_us' = 0 is invalid; allowed: a finite number > 0"),
    ({"dump": 3}, r"option 'dump' = 3 is invalid; allowed: a directory path, or None"),
])
def test_bad_values_name_field_value_and_allowed(options, pattern):
    with pytest.raises(ZeroConfigError, match=pattern):
        ZeroConfig.from_options(options)


def test_options_must_be_a_dict():
    with pytest.raises(ZeroConfigError, match="options must be a dict or the path of a DeepSpeed JSON file, got list"):
        ZeroConfig.from_options([("stage", 3)])


def test_deepspeed_dict_is_translated():
    cfg = ZeroConfig.from_options({
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**20, "allgather_bucket_size": 2**20},
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
        "inner_compiler": "eager",
    })
    assert (cfg.sharding.stage, cfg.sharding.param_dtype, cfg.sharding.reduce_dtype, cfg.compiler.inner_compiler) == (
        2, torch.bfloat16, torch.bfloat16, "eager")
    assert cfg.passes.bucket_mb == 4.0  # 2**20 elements x 4 bytes
    assert ZeroConfig.from_options({"fp16": {"enabled": True}}).sharding.param_dtype is torch.float16
    assert ZeroConfig.from_options({"bf16": {"enabled": False}}).sharding.param_dtype is None


@pytest.mark.parametrize("ds,pattern", [
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}},
     r"DeepSpeed key 'zero_optimization.mics_shard_size' is not supported by zerocompile; translated: "),
    ({"zero_optimization": {"stage": 3, "overlap_com": True}},
     r"'zero_optimization.overlap_com' is not supported by zerocompile; did you mean 'zero_optimization.overlap_comm'"),
    ({"zero_optimization": {"stage": 3, "overlap_comm": "yes"}}, r"'zero_optimization.overlap_comm' = 'yes' is invalid"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}},
     r"'zero_optimization.stage3_prefetch_bucket_size' = 0 is invalid; allowed: a number of elements > 0"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
     r"'zero_optimization.cpu_offload' and 'offload_optimizer' both offload"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     r"'fp16.fp16_master_weights_and_grads' = True is not supported: zerocompile keeps float32 master"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, r"'fp16.auto_cast' = True is not supported"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     r"option 'offload_param' needs stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": "cpu"}},
     r"DeepSpeed key 'zero_optimization.offload_param' must be a dict"),
    ({"zero_optimization": {"stage": 3}, "sparse_attention": {"mode": "fixed"}},
     r"DeepSpeed key 'sparse_attention' is not supported by zerocompile; translated: .* accepted as "
     r"training-loop settings \(not applied, with a warning\): train_batch_size"),
    ({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}, r"DeepSpeed key 'pipeline' is not supported"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, r"DeepSpeed key 'bf16.immediate_grad_update'"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"enables both 'bf16' and 'fp16'"),
    ({"bf16": {"enabled": "yes"}}, r"'bf16.enabled' = 'yes' is invalid; allowed: true, false, 'auto'"),
    ({"zero_optimization": {"stage": 5}}, r"option 'stage' = 5 is invalid"),
    ({"zero_optimization": {"reduce_bucket_size": 10, "allgather_bucket_size": 20}}, r"differ"),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, r"'zero_optimization.reduce_bucket_size' = -1 is invalid"),
    ({"zero_optimization": {"stage": 2}, "stage": 3}, r"option 'stage' is given both directly and through a DeepSpeed key"),
    ({"zero_optimization": 3}, r"'zero_optimization' must be a dict"),
    ({"zero_optimization": {"stage": 3}, "stag": 3}, r"unknown option 'stag'; did you mean 'stage'\?"),
])
def test_deepspeed_untranslatable_keys_are_rejected_by_name(ds, pattern):
    with pytest.raises(ZeroConfigError, match=pattern):
        ZeroConfig.from_options(ds)


def test_torch_compile_surfaces_the_config_error():
    model = torch.compile(torch.nn.Linear(2, 2), backend="zero", options={"stag": 3})
    with pytest.raises(Exception, match=r"unknown option 'stag'; did you mean 'stage'\?"):
        model(torch.randn(1, 2))


def test_backend_resolves_through_entry_point_without_import():
    import subprocess
    import sys

    code = ("import torch._dynamo, sys; assert 'zero' in torch._dynamo.list_backends(); "
            "assert 'zerocompile' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_zero_optimizer_rejects_bad_optimizer_class_and_hyperparameters():
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        zerocompile.ZeroOptimizer(params, optimizer_class="adamw")
    with pytest.raises(ValueError, match="AdamW rejects"):
        zerocompile.ZeroOptimizer(params, optimizer_class=torch.optim.AdamW, lr=-1.0)


def test_fp16_warns_that_there_is_no_loss_scaling(caplog):
    with caplog.at_level("WARNING", logger="zerocompile"):
        ZeroConfig.from_options({"param_dtype": "fp16"})
    assert "no loss scaling" in caplog.text


def test_pass_options_are_parsed():
    cfg = ZeroConfig.from_options({
        "passes": {"disable": ["prefetch", "bucketing"]}, "bucket_mb": 0, "prefetch_mb": 8,
        "unshard_budget_mb": "auto", "memory_limit_mb": 512, "recompute": {"memory_budget_mb": 64},
        "cost_model": {"flops_per_s": 1e12, "alpha_us": 10}, "dump": "/tmp/x"})
    assert cfg.passes.disabled_passes == ("prefetch", "bucketing") and cfg.passes.bucket_mb == 0
    assert (cfg.passes.prefetch_mb, cfg.passes.unshard_budget_mb, cfg.passes.memory_limit_mb) == (8, "auto", 512)
    assert cfg.passes.recompute == {"memory_budget_mb": 64.0}
    assert cfg.compiler.cost_model == {"flops_per_s": 1e12, "alpha_us": 10}
    assert ZeroConfig.from_options({"unshard_budget_mb": float("inf")}).passes.unshard_budget_mb == float("inf")
    defaults = ZeroConfig()
    assert (defaults.passes.prefetch, defaults.passes.unshard_budget_mb, defaults.passes.recompute,
            defaults.compiler.cost_model) == (
        True, 0.0, "none", "probe")


def test_pipeline_that_cannot_be_satisfied_is_refused():
    from zerocompile.passes.manager import GraphPass, check_pipeline

    noop = lambda gm, ctx, **_: gm  # noqa: E731
    passes = [GraphPass("make_plan", noop, ("joint",), provides=("plan",)),
              GraphPass("use_plan", noop, ("forward",), requires=("plan",))]
    check_pipeline(ZeroConfig(), passes)                      # both on: fine
    with pytest.raises(ZeroConfigError, match=r"pass 'use_plan' requires 'plan', which pass 'make_plan' provides, "
                                              r"but that pass is disabled"):
        check_pipeline(ZeroConfig(), [passes[1]] + [GraphPass("make_plan", noop, ("joint",), provides=("plan",),
                                                               enabled=lambda config: False)])


def test_offload_optimizer_option_and_its_deepspeed_keys(tmp_path):
    from zerocompile.runtime.offload_settings import OffloadSettings

    assert ZeroConfig().step.offload_optimizer == OffloadSettings() and not ZeroConfig().step.offload_optimizer.enabled
    cfg = ZeroConfig.from_options({"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path),
                                                         "buffer_count": 3, "ratio": 0.5}})
    assert cfg.step.offload_optimizer == OffloadSettings(device="nvme", nvme_path=str(tmp_path), buffer_count=3, ratio=0.5)
    ds = ZeroConfig.from_options({
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path),
                                                                "pin_memory": True, "pipeline_read": True}},
        "aio": {"block_size": 2 * 2**20, "thread_count": 4, "queue_depth": 8}})
    assert ds.step.offload_optimizer == OffloadSettings(device="nvme", nvme_path=str(tmp_path), threads=4,
                                                        block_size=2 * 2**20)
    for bad, pattern in [
        ({"device": "gpu"}, r"option 'offload_optimizer.device' = 'gpu' is invalid; allowed: 'none', 'cpu', 'nvme'"),
        ({"device": "nvme"}, r"'offload_optimizer.device' = 'nvme' needs 'offload_optimizer.nvme_path'"),
        ({"device": "cpu", "buffer_count": 1}, r"'offload_optimizer.buffer_count' = 1 is invalid; allowed: an integer >= 2"),
        ({"device": "cpu", "ratio": 0}, r"'offload_optimizer.ratio' = 0 is invalid; allowed: a fraction in \(0, 1\]"),
        ({"device": "cpu", "block_size": 1000}, r"'offload_optimizer.block_size' = 1000 is invalid"),
        ({"device": "cpu", "colour": 1}, r"unknown key 'offload_optimizer.colour'"),
        ("nvme", r"option 'offload_optimizer' = 'nvme' is invalid"),
    ]:
        with pytest.raises(ZeroConfigError, match=pattern):
            ZeroConfig.from_options({"offload_optimizer": bad})
    with pytest.raises(ZeroConfigError, match=r"DeepSpeed key 'aio.use_direct' is not supported"):
        ZeroConfig.from_options({"zero_optimization": {"stage": 3}, "aio": {"use_direct": True}})


# ------------------------------------------------------------------ DeepSpeed configs as they are
# Written out from DeepSpeed's own examples: the ZeRO-2 and ZeRO-3 configs of the Hugging Face
# DeepSpeed integration docs (with their "auto" values), the CIFAR-10 example of
# DeepSpeedExamples, and the ZeRO++ tutorial.
_AUTO_FP16 = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
              "hysteresis": 2, "min_loss_scale": 1}
_HF_LOOP = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO2 = {
    "fp16": _AUTO_FP16, "bf16": {"enabled": "auto"}, **_HF_LOOP,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
}
HF_ZERO3 = {
    "fp16": _AUTO_FP16, "bf16": {"enabled": "auto"}, **_HF_LOOP,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
}
CIFAR = {
    "train_batch_size": 16, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False, "bf16": {"enabled": False},
    "fp16": {"enabled": True, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True,
                          "contiguous_gradients": True, "cpu_offload": False},
}
ZERO_PP = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 10000000, "reduce_scatter": True,
                          "zero_quantized_weights": True, "zero_hpz_partition_size": 16,
                          "zero_quantized_gradients": True, "contiguous_gradients": True, "overlap_comm": True,
                          "stage3_prefetch_bucket_size": 5e7},
}


@pytest.mark.parametrize("name", ["HF_ZERO2", "HF_ZERO3", "CIFAR", "ZERO_PP"])
def test_deepspeed_example_configs_translate_from_their_json_files(name, tmp_path, caplog):
    """Each example, written to a JSON file and given as ``options=path``: the keys with a
    zerocompile meaning set those options (``gradient_clipping`` too), the training-loop keys the
    backend cannot apply are one WARNING each saying where that setting lives (the ``"auto"`` ones
    one WARNING together), the other accepted keys one INFO line each, and nothing else is left
    over."""
    from zerocompile import deepspeed_config

    ds = globals()[name]
    path = tmp_path / f"{name.lower()}.json"
    path.write_text(json.dumps(ds))
    deepspeed_config._advise.cache_clear()
    deepspeed_config.warn_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="zerocompile"):
        cfg = ZeroConfig.from_options(str(path))
        assert ZeroConfig.from_options(path) == cfg                  # a Path as well
    expected = {
        "HF_ZERO2": dict(stage=2, param_dtype=None, loss_scale=None, bucket_mb=2e8 * 4 / 2**20, prefetch=True,
                         offload_optimizer="cpu"),
        "HF_ZERO3": dict(stage=3, param_dtype=None, loss_scale=None, bucket_mb=ZeroConfig().passes.bucket_mb, prefetch=True,
                         prefetch_mb=ZeroConfig().passes.prefetch_mb, offload_optimizer="cpu", offload_param="cpu"),
        "CIFAR": dict(stage=0, param_dtype=torch.float16, bucket_mb=5e7 * 4 / 2**20, prefetch=True,
                      offload_optimizer=None, gradient_clipping=1.0),
        "ZERO_PP": dict(stage=3, param_dtype=torch.bfloat16, bucket_mb=1e7 * 4 / 2**20, prefetch_mb=5e7 * 2 / 2**20,
                        zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=16),
    }[name]
    for field_name, value in expected.items():
        got = cfg.flat()[field_name]
        if field_name.startswith("offload_"):
            got = None if got.device == "none" else got.device
        assert got == value, (field_name, got, value)
    if name == "CIFAR":
        assert (cfg.step.loss_scale.initial_scale, cfg.step.loss_scale.window, cfg.step.loss_scale.hysteresis,
                cfg.step.loss_scale.min_scale) == (2.0**15, 500, 2, 1)
    messages = [r.getMessage() for r in caplog.records if r.name == "zerocompile"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "zerocompile" and r.levelno == logging.WARNING]
    autos = [m for m in warnings if "'auto', which HF Trainer" in m]
    assert len(autos) <= 1, autos
    for key in ds:
        if key in deepspeed_config.ACCEPTED_KEYS:
            (line,) = [m for m in messages if m.startswith(f"DeepSpeed key '{key}' ")]
            assert line not in warnings, line
        elif key in deepspeed_config.TRAINING_LOOP_KEYS or key == "gradient_clipping":
            if deepspeed_config.contains_auto(ds[key]):
                assert autos and key in autos[0], (key, autos)
            elif key != "gradient_clipping":
                (line,) = [m for m in warnings if m.startswith(f"DeepSpeed key '{key}' is not applied")]
    if name == "HF_ZERO3":
        assert any("'fp16.enabled'" in m and "reads as false" in m for m in messages)
        assert any("'zero_optimization.reduce_bucket_size'" in m and "keeps zerocompile's default" in m
                   for m in messages)
        assert any("'zero_optimization.stage3_gather_16bit_weights_on_model_save'" in m and "full_state_dict" in m
                   for m in messages)
        assert "gradient_clipping" in autos[0] and "zerocompile.initialize" in autos[0]


def test_a_deepspeed_json_file_as_torch_compile_options(tmp_path, monkeypatch):
    """``torch.compile(model, backend="zero", options=path)`` compiles with the file's settings
    (here stage 2 and bfloat16 compute on one process), ``ZEROCOMPILE_OPTIONS`` still overrides
    it, and a missing or malformed file is a one-line error naming it."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                                "train_micro_batch_size_per_gpu": 2}))
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    compiled = torch.compile(model, backend="zero", options=str(path))
    out = compiled(torch.randn(2, 4))
    assert out.dtype is torch.bfloat16
    monkeypatch.setenv("ZEROCOMPILE_OPTIONS", json.dumps({"param_dtype": None, "inner_compiler": "eager"}))
    from zerocompile.backend import _with_environment_options
    merged = _with_environment_options(str(path))
    assert (merged.sharding.stage, merged.sharding.param_dtype, merged.compiler.inner_compiler) == (2, None, "eager")
    with pytest.raises(ZeroConfigError, match=r"options = '.*missing.json': no such file"):
        ZeroConfig.from_options(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{\"zero_optimization\": ")
    with pytest.raises(ZeroConfigError, match=r"options file '.*bad.json' is not a JSON DeepSpeed config"):
        ZeroConfig.from_options(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ZeroConfigError, match=r"must hold a JSON object \(a DeepSpeed config\), got list"):
        ZeroConfig.from_options(bad)


@pytest.mark.parametrize("options, message", [
    ({"stage": 2, "zero_quantized_weights": True},
     "option 'zero_quantized_weights' needs stage 3 (it quantizes the parameter all-gathers, which only stage 3 "
     "has), not stage 2; use stage=3, or drop it"),
    ({"stage": 1, "zero_quantized_gradients": True},
     "option 'zero_quantized_gradients' needs stage 2 or 3 (it quantizes the gradient reduce-scatters of the "
     "backward graphs), not stage 1; use stage=2 or 3, or drop it"),
    ({"stage": 2, "zero_hpz_partition_size": 2},
     "option 'zero_hpz_partition_size' needs stage 3 (it partitions the parameters the backward re-gathers), "
     "not stage 2; use stage=3, or set it to 1"),
])
def test_options_that_ask_for_a_stage_bound_pass_are_refused_from_the_registry(options, message):
    """The stage each ZeRO++ option needs is the stages of the pass it asks for (one rule, in
    passes/manager.py), and the message names the option, the reason and both fixes."""
    with pytest.raises(ZeroConfigError) as err:
        ZeroConfig.from_options(options)
    assert str(err.value) == message


def test_each_option_is_in_one_section_typed_and_parsed_once(tmp_path, monkeypatch):
    """The sections hold typed values (no field typed ``object``); every flat option has one
    section and one parser; a DeepSpeed file with options over it parses each value once, and
    no parser sees an already-parsed value."""
    import dataclasses

    from zerocompile import config as config_module
    from zerocompile.config import OPTION_SECTION, SECTIONS

    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert "object" not in str(f.type), (section, f.name, f.type)
            assert OPTION_SECTION[f.name] == section
    assert set(config_module._PARSERS) == set(OPTION_SECTION)
    assert set(ZeroConfig().flat()) == set(OPTION_SECTION)

    calls = []
    parsed_types = tuple(type(v) for v in ZeroConfig().flat().values() if dataclasses.is_dataclass(v))
    for name, parse in list(config_module._PARSERS.items()):
        def counting(value, name=name, parse=parse):
            assert not isinstance(value, parsed_types), (name, value)
            calls.append(name)
            return parse(value)
        monkeypatch.setitem(config_module._PARSERS, name, counting)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                                "bf16": {"enabled": True}, "gradient_clipping": 1.0,
                                "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}}))
    cfg = ZeroConfig.from_options(str(path)).with_options({"bucket_mb": 5, "stage": 2})
    assert sorted(calls) == sorted(["stage", "offload_optimizer", "param_dtype", "gradient_clipping", "monitor",
                                    "bucket_mb", "stage"])
    assert (cfg.sharding.stage, cfg.sharding.param_dtype, cfg.passes.bucket_mb, cfg.step.gradient_clipping,
            cfg.step.offload_optimizer.device, cfg.observability.monitor.tensorboard) == \
        (2, torch.bfloat16, 5, 1.0, "cpu", str(tmp_path / "j"))
