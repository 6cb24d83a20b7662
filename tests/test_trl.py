"""TRL's trainers with zerocompile (``zerocompile.integrations.transformers.zero_trainer``), on 2
gloo ranks against the same trainer in one process: ``SFTTrainer`` at stage 3, ``DPOTrainer`` with
its reference model (the policy at stage 3 with AdamW, the reference frozen at stage 3, inference
only), and a PEFT LoRA adapter under ``zero_trainer(SFTTrainer)`` saved the way PEFT saves it. The
tokenizer is built here with ``tokenizers`` (no download)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import zerocompile
from dist_utils import run_ranks

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

WORDS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(60)]
LLAMA = dict(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
             bos_token_id=2, eos_token_id=3)


def _offline() -> None:
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", HF_DATASETS_OFFLINE="1")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                bos_token="[BOS]", eos_token="[EOS]")


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _words(n: int, length: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 60, (length,), generator=g)) for _ in range(n)]


def _sft_data():
    return datasets.Dataset.from_dict({"text": _words(16, 7, 3)})


def _dpo_data():
    return datasets.Dataset.from_dict({"prompt": _words(16, 3, 5), "chosen": _words(16, 4, 6),
                                       "rejected": _words(16, 4, 7)})


def _common(out: str, per_device: int) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=2, max_steps=3,
                logging_steps=1, use_cpu=True, report_to=[], seed=0, disable_tqdm=True, learning_rate=1e-2,
                save_strategy="no", max_grad_norm=1.0, bf16=False)


def _sft(out: str, per_device: int, trainer_class, **extra):
    args = trl.SFTConfig(max_length=16, **_common(out, per_device))
    return trainer_class(model=_llama(), args=args, train_dataset=_sft_data(), processing_class=_tokenizer(), **extra)


def _dpo(out: str, per_device: int, trainer_class, **extra):
    args = trl.DPOConfig(max_length=16, beta=0.1, **_common(out, per_device))
    return trainer_class(model=_llama(), ref_model=_llama(), args=args, train_dataset=_dpo_data(),
                         processing_class=_tokenizer(), **extra)


def _lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _logged(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _ranks(rank: int, world: int, out: str) -> dict:
    from zerocompile.integrations.trl import ZeroDPOTrainer, ZeroSFTTrainer
    from zerocompile.runtime.session import PROCESS

    _offline()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    options = {"stage": 3, "inner_compiler": "eager"}
    results = {}
    torch._dynamo.reset()
    sft = _sft(os.path.join(out, "sft"), 2, ZeroSFTTrainer, zero_options=options)
    sft.train()
    results["sft"] = {"loss": _logged(sft, "loss"), "state": zerocompile.full_state_dict(sft.model)}
    torch._dynamo.reset()
    dpo = _dpo(os.path.join(out, "dpo"), 2, ZeroDPOTrainer, zero_options=options)
    dpo.train()
    ref_session = PROCESS.session_of_model(dpo.ref_model)
    results["dpo"] = {"loss": _logged(dpo, "loss"), "chosen": _logged(dpo, "rewards/chosen"),
                      "rejected": _logged(dpo, "rewards/rejected"), "state": zerocompile.full_state_dict(dpo.model),
                      "ref_stage": ref_session.config.sharding.stage, "ref_optimizers": len(ref_session.optimizers),
                      "ref_sharded": all(p.numel() == 0 or p.untyped_storage().size() == 0
                                         for p in dpo.ref_model.parameters()),
                      "sessions": PROCESS.session_of_model(dpo.model) is not ref_session}
    torch._dynamo.reset()
    lora = _sft(os.path.join(out, "lora"), 2, ZeroSFTTrainer, zero_options=options,
                peft_config=_lora())
    lora.train()
    lora.save_model(os.path.join(out, "lora", "final"))
    results["lora"] = {"loss": _logged(lora, "loss"),
                       "base_sharded": all(p.untyped_storage().size() == 0 for p in lora.model.parameters()
                                           if not p.requires_grad),
                       "trainable": sorted(n for n, p in lora.model.named_parameters() if p.requires_grad),
                       "optimized": sum(len(g["params"]) for g in lora.optimizer.param_groups)}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory, once_per_run):
    def compute():
        _offline()
        root = tmp_path_factory.mktemp("trl")
        want = {}
        sft = _sft(str(root / "ref_sft"), 4, trl.SFTTrainer)
        sft.train()
        want["sft"] = {"loss": _logged(sft, "loss"), "state": sft.model.state_dict()}
        dpo = _dpo(str(root / "ref_dpo"), 4, trl.DPOTrainer)
        dpo.train()
        want["dpo"] = {"loss": _logged(dpo, "loss"), "chosen": _logged(dpo, "rewards/chosen"),
                       "rejected": _logged(dpo, "rewards/rejected"), "state": dpo.model.state_dict()}
        lora = _sft(str(root / "ref_lora"), 4, trl.SFTTrainer, peft_config=_lora())
        lora.train()
        lora.save_model(str(root / "ref_lora" / "final"))
        want["lora"] = {"loss": _logged(lora, "loss")}
        return root, want, run_ranks(_ranks, 2, str(root / "zero"))
    return once_per_run("test_trl.runs", compute)


def test_sft_trainer_at_stage_3_matches_one_process(runs):
    _, want, got = runs
    assert len(want["sft"]["loss"]) == 3
    for rank, r in enumerate(got):
        assert r["sft"]["loss"] == pytest.approx(want["sft"]["loss"], rel=1e-5), (rank, r["sft"]["loss"])
    assert got[1]["sft"]["state"] == {}                        # full_state_dict: rank 0's
    for key, value in want["sft"]["state"].items():
        torch.testing.assert_close(got[0]["sft"]["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_dpo_trainer_with_its_reference_matches_one_process(runs):
    """Losses and rewards per step equal TRL's in one process; the reference is its own model,
    frozen, sharded at stage 3, with no optimizer."""
    _, want, got = runs
    assert len(want["dpo"]["loss"]) == 3
    for rank, r in enumerate(got):
        for key in ("loss", "chosen", "rejected"):
            assert r["dpo"][key] == pytest.approx(want["dpo"][key], rel=1e-5, abs=1e-6), (rank, key, r["dpo"][key])
        assert (r["dpo"]["ref_stage"], r["dpo"]["ref_optimizers"], r["dpo"]["sessions"]) == (3, 0, True)
        assert r["dpo"]["ref_sharded"]
    for key, value in want["dpo"]["state"].items():
        torch.testing.assert_close(got[0]["dpo"]["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_lora_adapter_trains_alone_and_saves_as_peft_does(runs):
    """Only the adapters are in the optimizer; the adapter saved on 2 ranks is the one-process
    adapter (PEFT's two files), and ``PeftModel.from_pretrained`` loads it in one process."""
    from safetensors.torch import load_file

    root, want, got = runs
    for rank, r in enumerate(got):
        assert r["lora"]["loss"] == pytest.approx(want["lora"]["loss"], rel=1e-5), (rank, r["lora"]["loss"])
        assert r["lora"]["trainable"] and all("lora_" in n for n in r["lora"]["trainable"])
        assert r["lora"]["optimized"] == len(r["lora"]["trainable"]) and r["lora"]["base_sharded"]
    mine, theirs = root / "zero" / "lora" / "final", root / "ref_lora" / "final"
    assert sorted(p.name for p in mine.iterdir() if p.name.startswith("adapter_")) == \
        ["adapter_config.json", "adapter_model.safetensors"]
    a, b = load_file(mine / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
    assert sorted(a) == sorted(b) and a
    for key, value in b.items():
        torch.testing.assert_close(a[key], value, rtol=1e-5, atol=1e-6, msg=key)
    loaded = peft.PeftModel.from_pretrained(_llama(), str(mine))
    state = loaded.state_dict()
    for key, value in b.items():
        name = next(k for k in state if k.endswith(key.replace(".weight", ".default.weight").split("base_model.")[-1]))
        torch.testing.assert_close(state[name], value, msg=key)


def test_the_trainers_mixed_precision_becomes_the_options_or_is_refused(tmp_path):
    """TRL's configs default to ``bf16=True``: the model then computes in bfloat16 from float32
    master shards (``param_dtype``), as DeepSpeed's ``bf16`` would; ``fp16=True`` is refused with
    the options to use; a ``param_dtype`` that contradicts ``bf16`` too. One process, nothing runs."""
    from zerocompile.integrations.transformers import zero_trainer

    _offline()
    from zerocompile.integrations.trl import TRL_VERSIONS, ZeroSFTTrainer

    ZeroSFT = zero_trainer(trl.SFTTrainer)
    assert ZeroSFT is ZeroSFTTrainer and ZeroSFT.__name__ == "ZeroSFTTrainer"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["optional-dependencies"]["trl"]
    assert f"trl{','.join(TRL_VERSIONS)}" in declared
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_length=16)
    assert args.bf16
    trainer = ZeroSFT(model=_llama(), args=args, train_dataset=_sft_data(), processing_class=_tokenizer(),
                      zero_options={"stage": 2})
    assert (trainer.zero_config.sharding.stage, trainer.zero_config.sharding.param_dtype) == (2, torch.bfloat16)
    with pytest.raises(ValueError, match="param_dtype is torch.float16; set bf16=False"):
        ZeroSFT(model=_llama(), args=args, train_dataset=_sft_data(), processing_class=_tokenizer(),
                zero_options={"param_dtype": "float16"})
    with pytest.raises(ValueError, match="compiled already"):
        compiled = _llama()
        compiled.compile(backend="zero")
        ZeroSFT(model=compiled, args=args, train_dataset=_sft_data(), processing_class=_tokenizer(),
                zero_options={"stage": 2})
    from types import SimpleNamespace

    from zerocompile.integrations.transformers import _with_precision
    with pytest.raises(ValueError, match="fp16=True.*'param_dtype': 'float16', 'loss_scale': 'dynamic'"):
        _with_precision({"stage": 3}, SimpleNamespace(fp16=True, bf16=False), "ZeroSFTTrainer")
    assert _with_precision({"stage": 3}, SimpleNamespace(fp16=False, bf16=False), "x").sharding.param_dtype is None
    with pytest.raises(TypeError, match="takes transformers.Trainer or a subclass"):
        zero_trainer(torch.nn.Module)
    with pytest.raises(TypeError, match="given by position and by keyword"):
        ZeroSFT(_llama(), model=_llama())
