"""SFT, then DPO against a frozen reference, with TRL's trainers on zerocompile (stage 3), as
DeepSpeed-Chat's SFT -> DPO pipeline; with ``--lora`` the SFT trains a PEFT adapter (saved as
PEFT saves it) and DPO starts from the base. Runs as written, on CPUs:

    torchrun --nproc-per-node 2 examples/trl_sft_dpo.py            # 2 ranks over gloo
    python examples/trl_sft_dpo.py --lora                         # 1 process, a PEFT adapter

It builds a tiny Llama and a word-level tokenizer here (no download); give your model and
tokenizer instead (``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained``)
and your datasets. Needs ``pip install "zerocompile[trl]"`` (and ``peft`` for ``--lora``).
"""

from __future__ import annotations

import argparse
import os

import datasets
import torch
import transformers
import trl
from tokenizers import Tokenizer, models, pre_tokenizers

import zerocompile
from zerocompile.integrations.trl import ZeroDPOTrainer, ZeroSFTTrainer

WORDS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(60)]


def tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                bos_token="[BOS]", eos_token="[EOS]")


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3))


def words(n: int, length: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, 60, (length,), generator=g)) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="trl_out")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (the base stays frozen)")
    cli = parser.parse_args()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    common = dict(per_device_train_batch_size=2, max_steps=cli.steps, logging_steps=1, learning_rate=1e-3,
                  save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), bf16=False)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        common["ddp_backend"] = "gloo"           # torchrun on CPUs
    options = {"stage": 3}
    peft_config = None
    if cli.lora:
        import peft
        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    # 1. supervised fine-tuning
    sft = ZeroSFTTrainer(model=tiny_llama(), args=trl.SFTConfig(output_dir=f"{cli.out}/sft", max_length=32, **common),
                         train_dataset=datasets.Dataset.from_dict({"text": words(64, 12, 1)}),
                         processing_class=tokenizer(), peft_config=peft_config, zero_options=options)
    sft.train()
    sft.save_model(f"{cli.out}/sft/final")          # the HF layout, or PEFT's adapter files with --lora

    # 2. DPO: the policy starts from the SFT model (from the base with --lora, whose SFT result is
    # an adapter); its reference is a frozen copy, compiled at stage 3 by the trainer
    policy, reference = tiny_llama(), tiny_llama()
    if not cli.lora:
        zerocompile.load_pretrained(policy, f"{cli.out}/sft/final")
        zerocompile.load_pretrained(reference, f"{cli.out}/sft/final")
    pairs = datasets.Dataset.from_dict({"prompt": words(64, 4, 2), "chosen": words(64, 6, 3),
                                        "rejected": words(64, 6, 4)})
    dpo = ZeroDPOTrainer(model=policy, ref_model=reference,
                         args=trl.DPOConfig(output_dir=f"{cli.out}/dpo", beta=0.1, max_length=32, **common),
                         train_dataset=pairs, processing_class=tokenizer(), zero_options=options)
    dpo.train()
    dpo.save_model(f"{cli.out}/dpo/final")
    if dpo.accelerator.is_main_process:
        rewards = [round(h["rewards/margins"], 4) for h in dpo.state.log_history if "rewards/margins" in h]
        print(f"DPO reward margins per step: {rewards}")
        print(f"policy: {zerocompile.stats(dpo.model).param_bytes} parameter bytes on this rank; "
              f"reference: {zerocompile.stats(dpo.ref_model).param_bytes}")


if __name__ == "__main__":
    main()
