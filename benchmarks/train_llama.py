"""Train a Hugging Face Llama with zerocompile: a plain torchrun-style script, the workload
``zerocompile plan`` is benchmarked on (``benchmarks/plan_llama70b.sh``).

    torchrun --nproc-per-node 8 benchmarks/train_llama.py --size 70b --steps 10
    zerocompile plan --world-size 1024 -- benchmarks/train_llama.py --size 70b --steps 2

``--size 70b`` is Llama-3-70B's shape (80 layers, hidden 8192, 64 heads, 8 KV heads, FFN
28672, vocabulary 128256); ``tiny`` is the same architecture small enough to train here. The
model is built in bfloat16 (``--dtype``) and compiled with ``backend="zero"`` (stage 3 and
``recompute="full"`` by default, ``--options`` adds options) block by block: the embedding, each
decoder layer and the head, so the 80 identical layers compile once (``compile_by_blocks``). It trains with
AdamW on random tokens.
"""

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
import transformers

import zerocompile

SIZES = {
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=500000.0, max_position_embeddings=512),
}


class Embed(torch.nn.Module):
    """The frame before the layers: token embedding and rotary position embedding."""

    def __init__(self, body: transformers.LlamaModel):
        super().__init__()
        self.body = body

    def forward(self, ids: torch.Tensor):
        x = self.body.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return x, positions, self.body.rotary_emb(x, position_ids=positions)


class Head(torch.nn.Module):
    """The frame after the layers: final norm, head and next-token loss."""

    def __init__(self, lm: transformers.LlamaForCausalLM):
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm.lm_head(self.lm.model.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def compile_by_blocks(lm: transformers.LlamaForCausalLM, options: dict):
    """The loss function, compiled block by block as with FSDP2: the embedding, each decoder
    layer (one compiled frame that all the identical layers run) and the head."""
    embed = torch.compile(Embed(lm.model), backend="zero", options=options)
    head = torch.compile(Head(lm), backend="zero", options=options)
    for layer in lm.model.layers:
        layer.compile(backend="zero", options=options)

    def loss_of(ids: torch.Tensor) -> torch.Tensor:
        x, positions, rotary = embed(ids)
        for layer in lm.model.layers:
            x = layer(x, position_ids=positions, position_embeddings=rotary)     # causal, no mask
        return head(x, ids)

    return loss_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 4096; tiny: 64)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--checkpointing", choices=("none", "reentrant", "non_reentrant"), default="none",
                        help="HF gradient checkpointing of every decoder layer (gradient_checkpointing_enable)")
    parser.add_argument("--options", default="{}", help="backend options as JSON, over stage 3 + recompute full")
    parser.add_argument("--compile", choices=("blocks", "whole"), default="blocks",
                        help="'whole': torch.compile(model, backend='zero') on the whole HF model, as a user "
                             "writes it (the loss from model(input_ids=, labels=)); 'blocks': compile_by_blocks")
    args = parser.parse_args()

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device is not None else "gloo", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    torch.manual_seed(0)
    shape = dict(SIZES[args.size])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    seq = args.seq or (64 if args.size == "tiny" else 4096)
    # no KV cache in training: it would also make each layer's frame guard on its layer index
    config = transformers.LlamaConfig(**shape, attn_implementation="sdpa", use_cache=False)
    # built in its dtype and on its device (not converted afterwards with .to(): under
    # zerocompile plan that fails on torch 2.13, see docs/cli.md)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    with torch.device(device or "cpu"):
        model = transformers.LlamaForCausalLM(config)
    torch.set_default_dtype(default_dtype)
    if args.checkpointing != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.checkpointing == "reentrant"})
    options = {"stage": 3, "recompute": "full", **json.loads(args.options)}
    if args.compile == "whole":
        whole = torch.compile(model, backend="zero", options=options)

        def compiled(ids):
            return whole(input_ids=ids, labels=ids).loss
    else:
        compiled = compile_by_blocks(model, options)
    opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-5)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, seq), generator=g).to(device or "cpu")
        loss = compiled(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
