"""Bytes per optimizer step of 1-bit Adam and 0/1 Adam against AdamW's float32 all-reduce, at
stage 0 (where DeepSpeed offers them), on ``--world-size`` gloo ranks::

    python benchmarks/onebit_bytes.py                 # the example GPT (examples/train_gpt.py), 2 ranks

Each optimizer trains the same GPT from the same seed on the same data for ``--steps`` steps
(1-bit Adam: ``freeze_step`` = half of them; 0/1 Adam: ``var_freeze_step`` = half, a
``var_update_scaler`` of 2); per step the bytes ``zerocompile.stats()`` counts in
``opt.step()`` (the full buffers of every collective: AdamW's all-reduce of the gradients, the
compressed all-to-all and all-gather). It prints, per optimizer, the bytes of its last step and
their ratio to AdamW's, the number of compressed steps and the last loss, and writes
``results/onebit_bytes.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, load_example, spawn_ranks  # noqa: E402

import zerocompile  # noqa: E402


def rank_main(rank: int, world: int, args) -> dict:
    ex = load_example()
    table = ex.successor_table(args.vocab)
    half = args.steps // 2
    optimizers = {
        "AdamW": (torch.optim.AdamW, {}),
        "OneBitAdam": (zerocompile.OneBitAdam, {"freeze_step": half}),
        "ZeroOneAdam": (zerocompile.ZeroOneAdam, {"var_freeze_step": half, "var_update_scaler": 2}),
    }
    out = {}
    for name, (cls, kw) in optimizers.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ex.GPT(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
        compiled = torch.compile(model, backend="zero", options={"stage": 0})
        opt = zerocompile.ZeroOptimizer(compiled.parameters(), optimizer_class=cls, lr=args.lr, **kw)
        per_step, losses = [], []
        for step in range(args.steps):
            x, y = ex.global_batch(step, args.batch, args.seq_len, table)
            per = args.batch // world
            loss = compiled(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            loss.backward()
            zerocompile.reset_stats()
            opt.step()
            per_step.append(zerocompile.stats().comm_bytes)
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = {"bytes": per_step, "loss": losses[-1],
                     "numel": sum(p.numel() for p in model.parameters())}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks to spawn")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, default=RESULTS / "onebit_bytes.json")
    args = p.parse_args(argv)
    res = spawn_ranks(args.world_size, rank_main, (args,), threads=max(1, (os.cpu_count() or 2) // args.world_size))[0]
    base = res["AdamW"]["bytes"][-1]
    print(f"stage 0, {args.world_size} gloo ranks, GPT of {res['AdamW']['numel']:,} parameters, {args.steps} steps; "
          f"bytes of the full buffers that opt.step() moves (zerocompile.stats()), last step")
    print("| optimizer | bytes/step | × AdamW's fp32 all-reduce | compressed steps | last loss |\n|---|---|---|---|---|")
    for name, r in res.items():
        compressed = sum(b < base / 2 for b in r["bytes"])
        print(f"| {name} | {r['bytes'][-1]:,} | ×{r['bytes'][-1] / base:.3f} | {compressed} of {args.steps} | "
              f"{r['loss']:.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                                    "results": res}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
