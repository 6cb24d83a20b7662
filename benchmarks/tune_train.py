"""A torchrun-style training script whose micro-batch size and accumulation come from its
arguments, for ``zerocompile tune``'s checks: the demo GPT at stage 3 (eager inner compiler),
AdamW, ``--steps`` steps of ``--accum`` micro-batches of ``--batch`` sequences per rank.
``tests/test_tune.py`` tunes and verifies it; ``benchmarks/tune_ranking.py`` plans and runs
splits of it.

    torchrun --nproc-per-node 2 benchmarks/tune_train.py --batch 4 --accum 4 [--steps 6]
"""

import argparse
import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import zerocompile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import make_batch, make_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int)
parser.add_argument("--accum", type=int)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
model = torch.compile(make_model("gpt"), backend="zero", options={"stage": 3, "inner_compiler": "eager"})
opt = zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
for step in range(args.steps):
    for micro in range(args.accum):
        x, y = make_batch("gpt", step * args.accum + micro, args.batch)
        (model(x, y) / args.accum).backward()
    opt.step()
    opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
