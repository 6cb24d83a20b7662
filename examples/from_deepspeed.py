"""A DeepSpeed run moved onto zerocompile by its checkpoint: the Adam moments, the step and the
learning-rate schedule go on where DeepSpeed left them. Runs as written, on CPUs (over gloo):

    torchrun --nproc-per-node 2 examples/from_deepspeed.py --phase deepspeed     # DeepSpeed: 6 steps, saves
    torchrun --nproc-per-node 2 examples/from_deepspeed.py --phase zerocompile   # zerocompile goes on

(``--nproc-per-node`` may differ between the two: the checkpoint loads at any world size.) The
model is a small GPT defined here; use yours, with the optimizer param groups and the schedule
your DeepSpeed run had. The first phase needs ``pip install deepspeed``; the second does not.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import zerocompile

VOCAB, WIDTH, BATCH, TOTAL_STEPS = 128, 64, 8, 12


class TinyGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(2))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens, targets):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def batch(step: int, rank: int, world: int):
    """This rank's share of the step's global batch (the same data at any world size)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, 17), generator=g)
    rows = BATCH // world
    part = tokens[rank * rows:(rank + 1) * rows]
    return part[:, :-1], part[:, 1:]


def warmup_then_decay(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.9 ** max(0, step - 4)


def global_loss(loss: torch.Tensor, world: int) -> float:
    loss = loss.detach().clone()
    if world > 1:
        torch.distributed.all_reduce(loss)
    return float(loss) / world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("deepspeed", "zerocompile"), required=True)
    parser.add_argument("--checkpoint", default="ds_checkpoint")
    parser.add_argument("--stage", type=int, default=3, help="the ZeRO stage of this phase")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT()
    if cli.phase == "deepspeed":
        import deepspeed

        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        config = {"train_micro_batch_size_per_gpu": BATCH // world, "zero_optimization": {"stage": cli.stage},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0, "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=config,
            lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup_then_decay))
        for step in range(TOTAL_STEPS // 2):
            loss = engine(*batch(step, rank, world))
            engine.backward(loss)
            engine.step()
            value = global_loss(loss, world)
            if rank == 0:
                print(f"deepspeed step {step}: loss {value:.4f}")
        engine.save_checkpoint(cli.checkpoint)
    else:
        compiled = torch.compile(model, backend="zero", options={"stage": cli.stage, "gradient_clipping": 1.0})
        opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay)
        info = zerocompile.load_deepspeed_checkpoint(cli.checkpoint, model, opt, lr_scheduler=schedule)
        if rank == 0:
            print(f"loaded DeepSpeed's step {info['global_steps']} (ZeRO-{info['stage']} on {info['world_size']} "
                  f"ranks) onto {world} rank(s) at stage {cli.stage}")
        for step in range(info["global_steps"], TOTAL_STEPS):
            loss = compiled(*batch(step, rank, world))
            loss.backward()
            opt.step()
            schedule.step()
            opt.zero_grad()
            value = global_loss(loss, world)
            if rank == 0:
                print(f"zerocompile step {step}: loss {value:.4f}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
