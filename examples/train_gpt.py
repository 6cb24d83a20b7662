"""Train a small GPT with zerocompile (ZeRO stages 0-3 as a torch.compile backend).

Run it on this machine's CPUs (the script spawns ``--world-size`` gloo ranks itself)::

    python examples/train_gpt.py                          # ZeRO-3, 2 ranks, 10 steps
    python examples/train_gpt.py --stage 1 --inner-compiler eager
    python examples/train_gpt.py --world-size 4 --grad-accum 2 --steps 20

or under torchrun (which starts the ranks; ``--world-size`` is then ignored)::

    torchrun --nproc_per_node 2 examples/train_gpt.py --stage 2

or under ``zerocompile dump --world-size N``, which has already initialised a (fake) process
group of N ranks: the script then runs in that process on that group and spawns nothing::

    zerocompile dump --world-size 64 -- examples/train_gpt.py --steps 1

The model is an ordinary ``nn.Module`` (pre-LN transformer, LM head tied to the token
embedding); the training loop is what you would write for a single process, plus
``torch.compile(model, backend="zero", options={...})`` and ``zerocompile.ZeroOptimizer``.
The data are synthetic: token sequences from a fixed random Markov chain (each token has
four possible successors, Zipf-distributed), sampled with a ``torch.Generator`` seeded by
the step, so the loss has something to learn and every run sees the same batches; each
rank takes its slice of the global batch.

Rank 0 prints one line per step::

    step   3 | loss 5.0574 | mem 6.62 MiB/rank x1.000 | ag 87 6.6 MiB  rs 52 3.3 MiB  ar 1 0.0 MiB | wire x0.995 | 133 ms

- ``loss``: mean cross-entropy, averaged over ranks.
- ``mem``: model-state bytes this rank holds after ``opt.step()`` and before ``opt.zero_grad()``
  (parameters + gradients + optimizer state, from ``zerocompile.stats()``), and its ratio to
  the ZeRO formula for fp32 AdamW with Psi parameters (tied weights counted once) on N ranks:
  stage 0 16Psi, stage 1 8Psi + 8Psi/N, stage 2 4Psi + 12Psi/N, stage 3 16Psi/N bytes.
- ``ag`` / ``rs`` / ``ar``: all-gathers, reduce-scatters and all-reduces of this step, count
  and MiB of their full buffers.
- ``wire``: bytes each rank sends with ring algorithms (``stats().wire_bytes``) over the ZeRO
  formula: stages 0-2 2Psi(N-1)/N, stage 3 3Psi(N-1)/N elements of 4 bytes. The formula is
  for one micro-batch per step: with ``--grad-accum K`` stages 2 and 3 communicate in every
  backward, so expect a ratio near (K+1)/2 at stage 2 and K at stage 3. Stage 3 comes in a
  little under 1: its backward gathers again only the parameters the backward needs (not
  the position embedding or the biases of Linear layers).

Ratios are printed as ``n/a`` on one rank or with a 16-bit ``--param-dtype`` (the formulas
above are for fp32). The first step includes compilation; the summary's time is the mean
of the other steps.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import zerocompile

MiB = 2**20


# --------------------------------------------------------------------------- model
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layers: int, n_heads: int):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight          # tied: one parameter, used twice
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --------------------------------------------------------------------------- data
def successor_table(vocab: int, branching: int = 4) -> torch.Tensor:
    """The fixed Markov chain the data come from: ``branching`` possible next tokens per token,
    drawn from a Zipf distribution (so the loss first falls fast, learning token frequencies,
    then slowly, learning the transitions)."""
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(zipf.expand(vocab, vocab), branching, replacement=True,
                             generator=torch.Generator().manual_seed(1234))


def global_batch(step: int, batch: int, seq_len: int, table: torch.Tensor):
    """The whole (all ranks) batch of ``step``: inputs and next-token targets, ``(batch, seq_len)``."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(table.shape[0], (batch,), generator=g)
    choice = torch.randint(table.shape[1], (batch, seq_len), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = table[tokens[:, t], choice[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


# --------------------------------------------------------------------------- formulas
def memory_formula(stage: int, psi: int, n: int) -> float:
    """ZeRO per-rank model-state bytes for fp32 AdamW (params 4, grads 4, two moments 8 per element)."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def wire_formula(stage: int, psi: int, n: int) -> float:
    """ZeRO bytes each rank sends per step with ring collectives, fp32."""
    return (3 if stage == 3 else 2) * psi * (n - 1) / n * 4


def ratio(value: float, formula: float | None) -> str:
    return "n/a" if formula is None else f"x{value / formula:.3f}"


# --------------------------------------------------------------------------- training
def train(args, rank: int, world: int) -> None:
    torch.manual_seed(0)                                     # same initial model on every rank
    model = GPT(args.vocab, args.seq_len, args.d_model, args.n_layers, args.n_heads)
    psi = sum(p.numel() for p in model.parameters())        # parameters() yields the tied one once

    options = {"stage": args.stage, "inner_compiler": args.inner_compiler}
    if args.param_dtype is not None:
        options["param_dtype"] = args.param_dtype
    model = torch.compile(model, backend="zero", options=options)
    opt = zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                    lr=args.lr, weight_decay=0.1)

    fp32 = args.param_dtype in (None, "float32", "fp32")
    compare = world > 1 and fp32
    mem_ref = memory_formula(args.stage, psi, world) if compare else None
    wire_ref = wire_formula(args.stage, psi, world) if compare else None

    micro = args.batch_size // (world * args.grad_accum)     # sequences per rank and micro-step
    table = successor_table(args.vocab)
    if rank == 0:
        print(f"GPT {psi / 1e6:.3f}M params (Psi={psi}), ZeRO stage {args.stage}, {world} rank(s), "
              f"{args.param_dtype or 'fp32'}, {args.inner_compiler}, global batch {args.batch_size} "
              f"x {args.seq_len} tokens, grad-accum {args.grad_accum}; formulas: mem "
              f"{'n/a' if mem_ref is None else f'{mem_ref / MiB:.2f} MiB'}, wire "
              f"{'n/a' if wire_ref is None else f'{wire_ref / MiB:.2f} MiB'}", flush=True)

    times, last = [], None
    for step in range(args.steps):
        t0 = time.perf_counter()
        zerocompile.reset_stats()
        x, y = global_batch(step, args.batch_size, args.seq_len, table)
        lo = rank * micro * args.grad_accum
        loss_sum = torch.zeros(())
        for k in range(args.grad_accum):
            a, b = lo + k * micro, lo + (k + 1) * micro
            loss = model(x[a:b], y[a:b])
            (loss / args.grad_accum).backward()
            loss_sum += loss.detach().float()
        if args.clip > 0:
            opt.clip_grad_norm_(args.clip)
        opt.step()
        st = zerocompile.stats()          # after step, before zero_grad: where the formulas hold
        opt.zero_grad()
        ms = (time.perf_counter() - t0) * 1e3
        times.append(ms)

        loss_avg = loss_sum / args.grad_accum
        if dist.is_initialized():
            dist.all_reduce(loss_avg)
        loss_avg = loss_avg.item() / world
        mem = st.param_bytes + st.grad_bytes + st.optimizer_state_bytes
        comm = "  ".join(f"{short} {tot.count} {tot.bytes / MiB:.1f} MiB" for short, tot in
                         (("ag", st.all_gather), ("rs", st.reduce_scatter), ("ar", st.all_reduce)))
        last = (loss_avg, ratio(mem, mem_ref), ratio(st.wire_bytes, wire_ref))
        if rank == 0:
            print(f"step {step:3d} | loss {loss_avg:.4f} | mem {mem / MiB:.2f} MiB/rank {last[1]} | "
                  f"{comm} | wire {last[2]} | {ms:.0f} ms", flush=True)

    if rank == 0 and last is not None:
        steady = times[1:] or times
        print(f"done: stage {args.stage}, {world} rank(s), final loss {last[0]:.4f}, "
              f"mem/formula {last[1]}, wire/formula {last[2]}, "
              f"{sum(steady) / len(steady):.0f} ms/step after the first ({times[0]:.0f} ms)", flush=True)
        if st.shared_memory_bytes:
            print(f"the ranks' transfers went through a {st.shared_memory_bytes / MiB:.1f} MiB shared-memory segment "
                  "(one per host, beside the model state: zerocompile.stats().shared_memory_bytes)", flush=True)


# --------------------------------------------------------------------------- launch
def _run_rank(rank: int, world: int, port: int, args) -> None:
    """Entry point of a rank this script spawned itself."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _init_and_train(args, rank, world)


def _init_and_train(args, rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        train(args, rank, world)
    finally:
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3), help="ZeRO stage")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--world-size", type=int, default=2,
                   help="ranks to spawn when not launched by torchrun")
    p.add_argument("--param-dtype", default=None,
                   choices=("float32", "fp32", "bfloat16", "bf16", "float16", "fp16"),
                   help="dtype parameters are gathered and computed in (None: fp32)")
    p.add_argument("--inner-compiler", default="inductor", choices=("inductor", "eager"),
                   help="what compiles the sharded graphs (eager: no C++ compile, for debugging)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch (all ranks, all micro-steps); None: 8, rounded up to a multiple "
                        "of world size x --grad-accum")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--d-model", type=int, default=128, help="embedding width")
    p.add_argument("--n-layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--n-heads", type=int, default=4, help="attention heads")
    args = p.parse_args(argv)
    if args.d_model % args.n_heads:
        p.error(f"--d-model {args.d_model} is not a multiple of --n-heads {args.n_heads}")
    return args, p


def main(argv=None) -> None:
    args, parser = parse_args(argv)
    # a process group already set up by whoever runs this script (zerocompile dump --world-size)
    existing = dist.is_available() and dist.is_initialized()
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if existing:
        world = dist.get_world_size()
    else:
        world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    if world < 1 or args.grad_accum < 1:
        parser.error(f"world size {world} and --grad-accum {args.grad_accum} must be >= 1")
    per_step = world * args.grad_accum
    if args.batch_size is None:
        args.batch_size = -(-8 // per_step) * per_step
    if args.batch_size < 1 or args.batch_size % per_step:
        parser.error(f"--batch-size {args.batch_size} must be a positive multiple of "
                     f"world size x --grad-accum = {world} x {args.grad_accum}")
    # the first step compiles the model (tens of seconds with inductor on a small CPU machine):
    # rank 0 says which frame compiled and how long it took, whether or not stderr is a terminal
    # (ZEROCOMPILE_PROGRESS=0 turns it off)
    os.environ.setdefault("ZEROCOMPILE_PROGRESS", "1")
    if existing:
        train(args, dist.get_rank(), world)
    elif torchrun:
        _init_and_train(args, int(os.environ["RANK"]), world)
    else:
        mp.start_processes(_run_rank, args=(world, _free_port(), args), nprocs=world,
                           join=True, start_method="spawn")


if __name__ == "__main__":
    main()
