"""zerocompile's DeepSpeed LR schedules (zerocompile/lr_schedules.py) against DeepSpeed's own
classes: the LR and betas of every parameter group over 25 steps, for two parameter groups,
per-group values and every warm-up type. Needs DeepSpeed (the bench extra: `make bench` installs
it); tests/test_deepspeed_training.py checks the same schedules against DeepSpeed's documented
formulas without it. Prints one line per schedule and exits 1 on any difference."""

from __future__ import annotations

import sys

import torch

from zerocompile import lr_schedules


def main() -> int:
    try:
        from deepspeed.runtime import lr_schedules as ds
    except ImportError:
        print("lr_schedules_vs_deepspeed: DeepSpeed is not installed (pip install -e '.[bench]'); skipped")
        return 0
    cases = [("WarmupLR", dict(warmup_min_lr=[0.0, 1e-4], warmup_max_lr=3e-3, warmup_num_steps=7)),
             ("WarmupLR", dict(warmup_num_steps=1)),
             ("WarmupDecayLR", dict(total_num_steps=20, warmup_min_lr=1e-5, warmup_max_lr=3e-3, warmup_num_steps=6)),
             ("WarmupCosineLR", dict(total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=5,
                                     warmup_type="linear")),
             ("OneCycle", dict(cycle_min_lr=1e-4, cycle_max_lr=[1e-2, 2e-2], cycle_first_step_size=5,
                               cycle_second_step_size=3, decay_step_size=2, decay_lr_rate=0.1, decay_mom_rate=0.05)),
             ("OneCycle", dict(cycle_min_lr=1e-4, cycle_max_lr=1e-2, cycle_first_step_size=6,
                               cycle_first_stair_count=3, cycle_second_stair_count=2, cycle_second_step_size=4)),
             ("LRRangeTest", dict(lr_range_test_min_lr=[1e-4, 1e-3], lr_range_test_step_size=3,
                                  lr_range_test_staircase=True))]
    failed = 0
    for name, params in cases:
        seqs = []
        for module in (ds, lr_schedules):
            a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
            opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 0.02}], lr=0.01)
            sched = getattr(module, name)(opt, **params)
            seq = []
            for _ in range(25):
                seq.append([(g["lr"], g["betas"]) for g in opt.param_groups])
                opt.step()
                sched.step()
            seqs.append(seq)
        same = seqs[0] == seqs[1]
        failed += not same
        print(f"{name:15s} {params}: {'bitwise equal to DeepSpeed' if same else 'DIFFERS from DeepSpeed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
