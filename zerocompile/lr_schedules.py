"""DeepSpeed's learning-rate schedules as torch schedulers.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest`` take the
parameters of DeepSpeed's classes of the same names (the ``scheduler.params`` of a DeepSpeed
config) and give the same learning rates, computed with the same float64 formulas, so the
values are equal bit for bit. They are ``torch.optim.lr_scheduler.LRScheduler`` subclasses:
call ``scheduler.step()`` after every ``opt.step()`` (DeepSpeed's ``engine.step()`` does both;
it skips the scheduler in a step skipped for overflow, which ``scaler.step(opt)`` users mirror
by checking ``opt.skipped_steps``), and ``state_dict`` / ``load_state_dict`` resume them.

Counting: DeepSpeed's ``last_batch_iteration`` starts at -1, and after ``n`` calls of
``step()`` is ``n - 1``; torch's ``last_epoch`` counts the step its constructor takes, so
DeepSpeed's iteration is ``last_epoch - 1`` here. Every schedule's value at iteration -1 (what
the first ``opt.step()`` uses) is DeepSpeed's: ``warmup_min_lr`` for the warm-ups, 0 for
``WarmupCosineLR``, ``cycle_min_lr`` for ``OneCycle``.

A value given per parameter group (a list, one entry per group) is used per group, as
DeepSpeed does; a single value applies to every group.
"""

from __future__ import annotations

import logging
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

log = logging.getLogger("zerocompile")

WARMUP_TYPES = ("log", "linear")
"""DeepSpeed's ``warmup_type`` values: the LR rises with ``log(i + 1) / log(W)`` or ``i / W``."""

ONE_CYCLE_BETA2 = 0.99
"""The second beta ``OneCycle`` writes with each cycled momentum, as DeepSpeed's does."""


def _per_group(optimizer: Optimizer, value, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name} has {len(value)} values for {len(optimizer.param_groups)} parameter groups; "
                             "give one value, or one per group")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_warmup(warmup_num_steps, warmup_type) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps = {warmup_num_steps!r} is invalid; allowed: an integer > 0")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type = {warmup_type!r} is invalid; allowed: {', '.join(map(repr, WARMUP_TYPES))}")
    return max(2, warmup_num_steps)     # DeepSpeed's: log(W) must not be 0


def _check_total(total_num_steps, warmup_steps: int) -> None:
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) or total_num_steps <= 0:
        raise ValueError(f"total_num_steps = {total_num_steps!r} is invalid; allowed: an integer > 0")
    if total_num_steps < warmup_steps:
        log.warning("DeepSpeed schedule: total_num_steps %d is less than warmup_num_steps %d", total_num_steps,
                    warmup_steps)


def _warmup_fraction(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """How far the warm-up has gone at ``iteration`` (0 <= iteration < warmup_steps)."""
    if warmup_type == "log":
        return (1.0 / math.log(warmup_steps)) * math.log(iteration + 1)
    return iteration / warmup_steps


class DeepSpeedSchedule(LRScheduler):
    """Base: ``lrs_at(iteration)`` gives every group's LR at DeepSpeed's ``last_batch_iteration``."""

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)


class WarmupLR(DeepSpeedSchedule):
    """From ``warmup_min_lr`` up to ``warmup_max_lr`` (default: each group's LR) over
    ``warmup_num_steps`` iterations (at least 2), then constant:
    ``lr(i) = min + (max - min) * g(i)``, ``g(i) = log(i + 1) / log(W)`` (``"log"``) or
    ``i / W`` (``"linear"``) while ``i < W``, else 1; ``lr(-1) = min``."""

    def __init__(self, optimizer: Optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log"):
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``'s warm-up, then a linear decay to 0 at ``total_num_steps``:
    ``g(i) = max(0, (T - i) / max(1, T - W))`` for ``i >= W``. ``warmup_max_lr`` defaults to
    0.001, as DeepSpeed's."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log"):
        self.total_num_steps = total_num_steps
        _check_total(total_num_steps, _check_warmup(warmup_num_steps, warmup_type))
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, float(self.total_num_steps - iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(DeepSpeedSchedule):
    """Each group's LR (when built) times a ratio: from ``warmup_min_ratio`` up to 1 over the
    warm-up (``r = wmin + g(i) * (1 - wmin)``), then a cosine down to ``cos_min_ratio`` at
    ``total_num_steps``: ``r = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2)`` with
    ``p = min(1, (i - W + 1) / max(1, T - W))``. 0 at iteration -1, as DeepSpeed's."""

    def __init__(self, optimizer: Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log"):
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        _check_total(total_num_steps, self.warmup_num_steps)
        self.total_num_steps = total_num_steps
        self.warmup_type = warmup_type
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.peak_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer)

    def ratio_at(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            rise = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.peak_lrs]
        ratio = self.ratio_at(iteration)
        return [peak * ratio for peak in self.peak_lrs]


class OneCycle(DeepSpeedSchedule):
    """DeepSpeed's 1Cycle: the LR rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` iterations and falls back over ``cycle_second_step_size``
    (default: the first), in stairs when the stair counts are > 0; after the cycle it decays as
    ``cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)`` (``d`` iterations after the
    cycle; no decay when ``decay_step_size`` or the rate is 0). With ``cycle_momentum`` and an
    optimizer with ``betas``, the first beta moves the other way between ``cycle_max_mom`` and
    ``cycle_min_mom`` (and grows by ``decay_mom_rate`` after the cycle), and the second beta is
    set to 0.99, as DeepSpeed's does; without ``betas`` momentum is not cycled (a warning, as
    DeepSpeed's). At iteration -1 the LR is ``cycle_min_lr`` and the first beta
    ``cycle_min_mom``."""

    def __init__(self, optimizer: Optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None, cycle_first_stair_count=0,
                 cycle_second_stair_count=None, decay_step_size=0, cycle_momentum: bool = True,
                 cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate: float = 0.0):
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if not first > 0:
            raise ValueError(f"cycle_first_step_size = {cycle_first_step_size!r} is invalid; allowed: a number > 0")
        if not second >= 0:
            raise ValueError(f"cycle_second_step_size = {cycle_second_step_size!r} is invalid; allowed: a number >= 0")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.decay_lr_rate = decay_lr_rate
        self.lr_decays = not (no_decay or math.isclose(decay_lr_rate, 0))
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and not all("betas" in group for group in optimizer.param_groups):
            log.warning("OneCycle: cycle_momentum is off: the optimizer has no betas (DeepSpeed cycles only "
                        "Adam-style betas)")
            self.cycle_momentum = False
        self.decay_mom_rate = decay_mom_rate
        self.mom_decays = not (no_decay or math.isclose(decay_mom_rate, 0))
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer)

    def _scale(self, iteration: int) -> float:
        """Where in the cycle iteration ``iteration`` is: 0 at the ends, 1 at the peak."""
        position = iteration + 1
        cycle = math.floor(1 + position / self.total_size)
        x = 1.0 + position / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            in_cycle = position % self.total_size
            if in_cycle <= self.first_step_size:
                stair = in_cycle * stairs / self.first_step_size
            else:
                stair = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if not self.lr_decays:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def momenta_at(self, iteration: int) -> list[float]:
        """The first beta of every group at ``iteration``."""
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        if not self.mom_decays:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [high * factor for high in self.max_moms]

    def step(self, epoch=None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups, self.momenta_at(self.last_epoch - 1)):
                group["betas"] = (beta1, ONE_CYCLE_BETA2)


class LRRangeTest(DeepSpeedSchedule):
    """DeepSpeed's LR range test: ``lr(i) = min * (1 + rate * (i + 1) / step_size)`` (the
    quotient floored with ``lr_range_test_staircase``)."""

    def __init__(self, optimizer: Optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False):
        if not lr_range_test_step_size > 0:
            raise ValueError(f"lr_range_test_step_size = {lr_range_test_step_size!r} is invalid; allowed: a number > 0")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer)

    def lrs_at(self, iteration: int) -> list[float]:
        interval = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
"""DeepSpeed's ``scheduler.type`` names and their classes here."""
