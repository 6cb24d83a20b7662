"""Whole-parameter optimizers on shards: Muon and Adafactor against AdamW, on 2 gloo ranks.

    python benchmarks/whole_param_step.py [--stages 1 3] [--layers 6] [--d-model 256]
                                          [--rounds 10] [--bucket-mb 4] [--quick] [--out benchmarks/results]

A GPT (``examples/train_gpt.py``'s, 6 blocks of width 256 by default, so the hidden weight
matrices hold most of the parameters) compiled with ``backend="zero"`` at each of ``--stages``,
trained by three systems:

- ``AdamW``: ``ZeroOptimizer(model.parameters())`` (element-wise, on this rank's shards);
- ``Muon + AdamW``: one ``ZeroOptimizer`` with two param groups: ``torch.optim.Muon`` on the
  2-D weights of the blocks, and ``{"optimizer_class": torch.optim.AdamW}`` on the embeddings,
  norms and biases (the tied head is the token embedding);
- ``Adafactor``: ``ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.Adafactor)``.

Muon and Adafactor run on whole parameters, each sharded parameter at one owner rank, the
pieces moved by all-to-alls (``zerocompile/optim/whole_param.py``). All systems of a stage live
side by side in every rank and take turns, one step each per round (the first rotating), each
part started after a barrier: forward and backward, then ``opt.step()`` alone (timed apart),
then ``zero_grad()``. Reported per system and stage:

- ``step ms``: the optimizer step (``opt.step()``), median over the timed rounds of the
  slowest rank's time; ``total ms``: forward + backward + step, the same way;
- ``1-proc ms``: the same torch optimizers stepping the whole (uncompiled) model in one
  process, on each rank at the same time, in rounds of their own after the stages': what the
  step costs without ZeRO;
- ``sent/rank``: bytes each rank sends in the optimizer step (``zerocompile.stats()``'s
  ``wire_bytes`` before and after ``opt.step()``, the largest over ranks), and the full-buffer
  bytes by kind (``all_to_all``: what the rank sends to the others);
- ``state/rank``: ``opt.state_bytes()`` per rank (largest, and the sum over ranks);
- ``peak``: the largest live tensor-storage bytes of one step (``LiveStorageTracker``, highest
  rank; the second of two measurement rounds) and the peak inside ``opt.step()`` over what was
  live when it began (``step peak``: what the step allocates for itself).

DeepSpeed's ZeRO Muon all-gathers each Muon matrix's momentum and its update in full (two
all-gathers of the full fp32 matrices per step, every rank then holding all of them): each rank
receives ``2 (N-1)/N * 4 * muon_elements`` bytes. That figure, from its design, is printed
beside the all-to-all bytes of Muon + AdamW (ours/theirs); both come on top of the gradient
reduction and parameter gathers every stage has. Results: ``<out>/whole_param_step.json``, ``.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_harness import prepare_main, result_header, write_results  # noqa: E402
from common import MiB, RESULTS, load_example, spawn_ranks  # noqa: E402

SYSTEMS = ("AdamW", "Muon + AdamW", "Adafactor")
KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
ADAMW = {"lr": 1e-3, "weight_decay": 0.1}
MUON = {"lr": 0.02, "weight_decay": 0.1}
ADAFACTOR = {"lr": 1e-2, "weight_decay": 0.1}
log = logging.getLogger("benchmarks.whole_param_step")
MEASURE_ROUNDS = 2
"""Untimed rounds under the memory tracker at the end; the figures are the last one's, after the
first has seen every persistent storage (the optimizer state was created outside the tracker)."""


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's share: the 2-D weights of the transformer blocks (not the embeddings or the head)."""
    return p.ndim == 2 and name.startswith("blocks.")


def optimizer_groups(system: str, model) -> list[tuple[type, list, dict]]:
    """``[(class, params, hyperparameters)]`` of ``system``: the torch optimizers it runs."""
    named = list(model.named_parameters())
    if system == "AdamW":
        return [(torch.optim.AdamW, [p for _, p in named], ADAMW)]
    if system == "Adafactor":
        return [(torch.optim.Adafactor, [p for _, p in named], ADAFACTOR)]
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    other = [p for n, p in named if not is_hidden_matrix(n, p)]
    return [(torch.optim.Muon, hidden, MUON), (torch.optim.AdamW, other, ADAMW)]


def zero_optimizer(system: str, model):
    """The ``ZeroOptimizer`` of ``system``, written the way a user would."""
    import zerocompile

    if system == "AdamW":
        return zerocompile.ZeroOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    if system == "Adafactor":
        return zerocompile.ZeroOptimizer(model.parameters(), optimizer_class=torch.optim.Adafactor, **ADAFACTOR)
    (_, hidden, _), (_, other, _) = optimizer_groups(system, model)
    return zerocompile.ZeroOptimizer([{"params": hidden},
                                      {"params": other, "optimizer_class": torch.optim.AdamW, **ADAMW}],
                                     optimizer_class=torch.optim.Muon, **MUON)


def build_model(example, args):
    torch.manual_seed(args.seed)
    return example.GPT(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)


class Runner:
    """One system at one stage inside one rank: model, optimizer, tracker and its figures."""

    def __init__(self, system: str, stage: int, example, args) -> None:
        import zerocompile
        from zerocompile.runtime.memory_tracker import LiveStorageTracker

        self.system = system
        self.tracker = LiveStorageTracker(exact_peak=True, track_inputs=True)
        with self.tracker:
            model = build_model(example, args)
            self.model = torch.compile(model, backend="zero", options={
                "stage": stage, "inner_compiler": args.inner_compiler, "bucket_mb": args.bucket_mb})
            self.opt = zero_optimizer(system, model)
        self.stats = zerocompile.stats
        self.step_ms, self.total_ms, self.losses = [], [], []
        self.sent, self.by_kind, self.peak, self.step_peak = 0.0, {}, 0, 0

    def train_step(self, x, y, timed: bool, measure: bool = False) -> None:
        """Forward and backward, then the optimizer step alone, each after a barrier."""
        dist.barrier()
        start = time.perf_counter()
        if measure:
            self.tracker.__enter__()
            self.tracker.reset_peak()
        loss = self.model(x, y)
        loss.backward()
        self.losses.append(float(loss.detach()))
        fwd_bwd = time.perf_counter() - start
        dist.barrier()
        before = self.stats()
        if measure:
            self.tracker.settled_live_bytes()
            live, peak = self.tracker.live_bytes(), self.tracker.peak
            self.tracker.reset_peak()
        start = time.perf_counter()
        self.opt.step()
        step = time.perf_counter() - start
        after = self.stats()
        if measure:
            self.step_peak = self.tracker.peak - live
            self.peak = max(peak, self.tracker.peak)
            self.tracker.__exit__(None, None, None)
            self.sent = after.wire_bytes - before.wire_bytes
            self.by_kind = {k: getattr(after, k).bytes - getattr(before, k).bytes for k in KINDS}
        self.opt.zero_grad()
        if timed:
            self.step_ms.append(step * 1e3)
            self.total_ms.append((fwd_bwd + step) * 1e3)


class PlainStep:
    """The same torch optimizers on the whole uncompiled model in this process (no ZeRO):
    gradients from one backward, kept, so every timed call is one full step."""

    def __init__(self, system: str, example, args, x, y) -> None:
        self.system = system
        model = build_model(example, args)
        model(x, y).backward()
        self.opts = [cls(params, **hyper) for cls, params, hyper in optimizer_groups(system, model)]
        self.step_ms = []

    def step(self, timed: bool) -> None:
        dist.barrier()
        start = time.perf_counter()
        for opt in self.opts:
            opt.step()
        if timed:
            self.step_ms.append((time.perf_counter() - start) * 1e3)


def rank_main(rank: int, world: int, args) -> dict:
    """Every stage's systems in this rank; returns this rank's figures."""
    example = load_example()
    table = example.successor_table(args.vocab)
    rounds = 1 + args.warmup + args.rounds + MEASURE_ROUNDS
    batches = []
    for step in range(rounds):
        x, y = example.global_batch(step, args.batch * world, args.seq_len, table)
        lo, hi = rank * args.batch, (rank + 1) * args.batch
        batches.append((x[lo:hi].clone(), y[lo:hi].clone()))
    for _ in range(5):   # the first collectives of a process are slow
        dist.all_reduce(torch.zeros(1024))
    out = {"stages": {}}
    for stage in args.stages:
        torch._dynamo.reset()
        runners = [Runner(s, stage, example, args) for s in SYSTEMS]
        for r in range(rounds):
            if rank == 0:
                log.info("stage %d: round %d/%d", stage, r + 1, rounds)
            shift = r % len(runners)
            timed = 1 + args.warmup <= r < rounds - MEASURE_ROUNDS
            for runner in runners[shift:] + runners[:shift]:
                runner.train_step(*batches[r], timed=timed, measure=r >= rounds - MEASURE_ROUNDS)
        out["stages"][stage] = {
            run.system: {"step_ms": run.step_ms, "total_ms": run.total_ms, "losses": run.losses,
                         "sent_bytes": run.sent, "bytes_by_kind": run.by_kind,
                         "state_bytes": run.opt.state_bytes(), "peak_bytes": run.peak,
                         "step_peak_bytes": run.step_peak, "kernel": run.opt.kernel,
                         "owners": run.opt.owners()}
            for run in runners}
        del runners
    # the one-process steps last, in rounds of their own: interleaved with the systems' steps,
    # Muon's one-process step slowed the systems' steps of its phase by up to 4x here
    torch._dynamo.reset()
    plain = [PlainStep(s, example, args, *batches[0]) for s in SYSTEMS]
    for r in range(1 + args.warmup + args.rounds):
        shift = r % len(plain)
        for p in plain[shift:] + plain[:shift]:
            p.step(timed=r > args.warmup)
    out["plain_step_ms"] = {p.system: p.step_ms for p in plain}
    model = build_model(example, args)
    out["numel"] = sum(p.numel() for p in model.parameters())
    out["muon_numel"] = sum(p.numel() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    return out


def per_round(per_rank: list[list[float]]) -> list[float]:
    """The slowest rank's time of each round."""
    return [max(times) for times in zip(*per_rank)]


def slowest(per_rank: list[list[float]]) -> float:
    """Median over rounds of the slowest rank's time."""
    return statistics.median(per_round(per_rank))


def summarise(ranks: list[dict], world: int) -> dict:
    """The figures of every stage and system over the ranks."""
    muon = ranks[0]["muon_numel"]
    deepspeed = 2 * (world - 1) / world * 4 * muon
    out = {"numel": ranks[0]["numel"], "muon_numel": muon, "world": world, "deepspeed_muon_bytes": deepspeed,
           "plain_step_ms": {s: slowest([r["plain_step_ms"][s] for r in ranks]) for s in SYSTEMS},
           "plain_step_ms_each": {s: per_round([r["plain_step_ms"][s] for r in ranks]) for s in SYSTEMS}, "stages": {}}
    for stage in ranks[0]["stages"]:
        rows = {}
        for s in SYSTEMS:
            each = [r["stages"][stage][s] for r in ranks]
            row = {"step_ms": slowest([e["step_ms"] for e in each]), "total_ms": slowest([e["total_ms"] for e in each]),
                   "step_ms_each": per_round([e["step_ms"] for e in each]),
                   "sent_bytes": max(e["sent_bytes"] for e in each),
                   "bytes_by_kind": {k: max(e["bytes_by_kind"][k] for e in each) for k in KINDS},
                   "state_bytes_per_rank": [e["state_bytes"] for e in each],
                   "state_bytes_max": max(e["state_bytes"] for e in each),
                   "state_bytes_sum": sum(e["state_bytes"] for e in each),
                   "peak_bytes": max(e["peak_bytes"] for e in each),
                   "step_peak_bytes": max(e["step_peak_bytes"] for e in each),
                   "kernel": each[0]["kernel"], "owners": each[0]["owners"],
                   "losses": each[0]["losses"], "plain_step_ms": out["plain_step_ms"][s]}
            rows[s] = row
        for s in SYSTEMS:
            rows[s]["step_x_adamw"] = rows[s]["step_ms"] / rows["AdamW"]["step_ms"]
            rows[s]["total_x_adamw"] = rows[s]["total_ms"] / rows["AdamW"]["total_ms"]
        rows["Muon + AdamW"]["all_to_all_x_deepspeed"] = rows["Muon + AdamW"]["bytes_by_kind"]["all_to_all"] / deepspeed
        out["stages"][stage] = rows
    return out


def table(summary: dict) -> list[str]:
    """The markdown table and the lines under it."""
    lines = ["| stage | optimizer | step ms | × AdamW | 1-proc ms | total ms | sent/rank MiB | all-to-all | "
             "all-gather | reduce-scatter | all-reduce | state/rank MiB (max / sum) | peak MiB | step peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for stage, rows in summary["stages"].items():
        for s, e in rows.items():
            kinds = " | ".join(f"{e['bytes_by_kind'][k] / MiB:.2f}" for k in KINDS)
            lines.append(f"| {stage} | {s} | {e['step_ms']:.1f} | {e['step_x_adamw']:.2f} | {e['plain_step_ms']:.1f} | "
                         f"{e['total_ms']:.1f} | {e['sent_bytes'] / MiB:.2f} | {kinds} | "
                         f"{e['state_bytes_max'] / MiB:.2f} / {e['state_bytes_sum'] / MiB:.2f} | "
                         f"{e['peak_bytes'] / MiB:.1f} | {e['step_peak_bytes'] / MiB:.2f} |")
    ds = summary["deepspeed_muon_bytes"]
    lines.append("")
    lines.append(f"Muon's matrices: {summary['muon_numel'] / 1e6:.2f}M of {summary['numel'] / 1e6:.2f}M parameters. "
                 f"DeepSpeed's ZeRO Muon (two all-gathers of the full fp32 matrices per step, from its design): "
                 f"{ds / MiB:.2f} MiB received per rank and step.")
    for stage, rows in summary["stages"].items():
        m = rows["Muon + AdamW"]
        lines.append(f"- stage {stage}: Muon's all-to-alls send {m['bytes_by_kind']['all_to_all'] / MiB:.2f} MiB per rank, "
                     f"×{m['all_to_all_x_deepspeed']:.2f} DeepSpeed's; Muon + AdamW's step ×{m['step_x_adamw']:.2f} "
                     f"AdamW's, Adafactor's ×{rows['Adafactor']['step_x_adamw']:.2f}.")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 3], choices=[0, 1, 2, 3])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the first")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds")
    p.add_argument("--bucket-mb", type=float, default=4.0,
                   help="the bucket_mb option (also the optimizer's all-to-all buckets: several per step)")
    p.add_argument("--inner-compiler", default="eager", choices=["eager", "inductor"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--quick", action="store_true", help="a tiny GPT, 1 timed round (a smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.heads, args.vocab, args.seq_len, args.batch = 2, 64, 2, 256, 16, 2
        args.warmup, args.rounds, args.bucket_mb = 0, 1, 0.02
    prepare_main()
    ranks = spawn_ranks(args.world_size, rank_main, (args,), threads=args.threads)
    summary = summarise(ranks, args.world_size)
    lines = table(summary)
    print("\n".join(lines))
    result = {**result_header("whole_param_step", args, argv), **summary}
    write_results(args.out, "whole_param_step", result,
                  f"Whole-parameter optimizers on shards ({args.world_size} gloo ranks, GPT {args.layers} blocks of "
                  f"width {args.d_model}, vocab {args.vocab}, {args.batch} x {args.seq_len} tokens per rank, "
                  f"bucket_mb {args.bucket_mb}, {args.inner_compiler} inner compiler)", lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
