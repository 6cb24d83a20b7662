"""Gradients that eager code accumulates into sharded parameters (stages 2 and 3): reduced into
the shards during the backward, so ``p.grad`` of every sharded parameter is the same ``DTensor``
of the shard, wherever it ran, and no full gradient outlives the backward.

A post-accumulate-grad hook notes each such gradient (autograd calls it once per backward, with
the sum of every use). Two moments reduce them, each the same collectives on every rank:

- **when a module's backward ends** (the hook on its forward's inputs, ``EagerRegions``): the
  module's own parameters (no other module owns them) that, in the backward before, had their
  gradient by then on every rank (``eligible``) are reduce-scattered at once, in one bucketed
  call, as FSDP2 does per module. A rank whose gradient is not there this time sends zeros, and
  the gradient, when it comes, is a leftover of the second moment; so a module's full gradients
  live from its backward to its backward's end, not to the end of the whole backward.
- **when the backward ends**: the leftovers (gradients of modules whose inputs need no gradient,
  such as an embedding of token ids, of parameters several modules own, such as a tied
  embedding and head, and of the first backward). The ranks first agree, with one all-reduce of
  a small mask, on which parameters some rank has one for (where only some ranks' data reached
  a parameter, an expert, the others send zeros), which parameters every rank had by their
  module's end (the next backward's ``eligible``), and which got none anywhere: a parameter no
  rank's data reached keeps no gradient, as in one process, even where its module's end sent
  zeros for it.

Gradients of parameters compiled with ``loss_scale`` (the compiled backward leaves their shard
gradients scaled, the eager ones are not) and stage 0/1 gradients (reduced once per step by
definition) wait for the optimizer step instead, which reduces them as before.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.comm import all_reduce, is_fake_group
from zerocompile.runtime.raw_grad import raw_grad, set_raw_grad
from zerocompile.runtime.sharded_param import ShardedParam
from zerocompile.runtime.step_collectives import reduce_scatter_mean

_LABEL = "eager gradients"


class EagerGradients:
    """The eager gradients of one model's parameters (``EagerRegions.grads``)."""

    def __init__(self):
        self.states: list[ShardedParam] = []
        """The parameters whose eager gradients are reduced in the backward, in the order they were
        hooked (the same on every rank)."""
        self.ids: set[int] = set()
        """``id`` of each of ``states``."""
        self.owners: dict[int, int] = defaultdict(int)
        """How many eager units own each parameter (by ``id`` of the state)."""
        self.eligible: set[int] = set()
        """Reduced when their module's backward ends (see the module docstring); agreed by all ranks."""
        # this backward's
        self.accumulated: set[int] = set()
        """Gradients accumulated and not reduced yet."""
        self.seen: set[int] = set()
        """Gradients accumulated at all."""
        self.ended: set[int] = set()
        """Parameters whose module's backward ended, with their gradient there (``missed``: without)."""
        self.missed: set[int] = set()
        self.sent_early: dict[int, tuple] = {}
        """``id`` -> ``(state, shard gradient it created or None)`` of what a module's end reduced."""

    def add(self, sp: ShardedParam) -> None:
        self.states.append(sp)
        self.ids.add(id(sp))

    def accumulated_into(self, sp: ShardedParam) -> None:
        self.accumulated.add(id(sp))
        self.seen.add(id(sp))

    def pending(self) -> bool:
        return bool(self.accumulated or self.sent_early)

    def module_backward_ended(self, states: list[ShardedParam]) -> None:
        """A module's backward ended: reduce its own eligible parameters' gradients (zeros where
        this rank has none yet); note for the next backward which ones had theirs."""
        own = [sp for sp in states if id(sp) in self.ids and self.owners[id(sp)] == 1]
        items = []
        for sp in own:
            have = id(sp) in self.accumulated
            (self.ended if have else self.missed).add(id(sp))
            if id(sp) not in self.eligible or id(sp) in self.sent_early:
                continue
            if have:
                grad = raw_grad(sp.param)
                set_raw_grad(sp.param, None)
                self.accumulated.discard(id(sp))
            else:
                grad = torch.zeros(sp.shape, dtype=sp.compute_dtype, device=sp.device)
            items.append((sp, grad))
        for sp, created in _reduce_into_shards(items):
            self.sent_early[id(sp)] = (sp, created)

    def backward_ended(self) -> None:
        """The backward ended: agree on the leftovers and reduce them (see the module docstring)."""
        by_group = defaultdict(list)
        for sp in self.states:
            by_group[(sp.group, sp.reduce_dtype)].append(sp)
        eligible = set()
        for (group, _), states in by_group.items():
            rows = torch.tensor([[id(sp) in self.accumulated for sp in states],
                                 [not (id(sp) in self.ended and id(sp) not in self.missed) for sp in states],
                                 [id(sp) in self.seen for sp in states]], dtype=torch.uint8, device=states[0].device)
            if group.world > 1 and not is_fake_group(group) and states[0].device.type != "meta":
                session = states[0].session or PROCESS.outside
                with session.comms.timed(rows.device, _LABEL):
                    session.record("all_reduce", rows.numel())
                    rows = all_reduce(rows, "max", group.name)
            leftover, late, anywhere = rows.tolist()
            items = []
            for sp, some_rank, not_early, some_grad in zip(states, leftover, late, anywhere):
                if not not_early:
                    eligible.add(id(sp))
                if id(sp) in self.sent_early and not some_grad:
                    _drop_zeros(*self.sent_early[id(sp)])
                if not some_rank:
                    continue
                if id(sp) in self.accumulated:
                    grad = raw_grad(sp.param)
                    set_raw_grad(sp.param, None)
                else:               # another rank's data reached it, this rank's did not
                    grad = torch.zeros(sp.shape, dtype=sp.compute_dtype, device=sp.device)
                items.append((sp, grad))
            _reduce_into_shards(items)
        self.eligible = eligible
        self.accumulated, self.seen, self.ended, self.missed, self.sent_early = set(), set(), set(), set(), {}


def _reduce_into_shards(items: list) -> list:
    """Reduce-scatter ``(state, full gradient)`` pairs, bucketed, and add each rank's chunk into
    the state's shard gradient; returns ``(state, the shard gradient it created, or None where it
    added to one)``."""
    by_group = defaultdict(list)
    for sp, grad in items:
        by_group[(sp.group, sp.reduce_dtype)].append((sp, grad))
    out = []
    for (group, reduce_dtype), pairs in by_group.items():
        choice = next((sp.gradient_reduction for sp, _ in pairs if sp.gradient_reduction is not None), None)
        # the model's; 0: one tensor per collective
        bucket = int(pairs[0][0].option("passes", "bucket_mb", 25.0) * 2**20)
        shards = reduce_scatter_mean([(g, sp.padded_numel) for sp, g in pairs], group, bucket, reduce_dtype,
                                     choice.kind_for if choice is not None else None, label=_LABEL,
                                     session=pairs[0][0].session or PROCESS.outside)
        with torch.no_grad():
            for (sp, grad), shard_grad in zip(pairs, shards):
                shard_grad = shard_grad.to(sp.dtype)
                if sp.shard.grad is None:
                    sp.shard.grad = shard_grad if shard_grad.data_ptr() != grad.data_ptr() else shard_grad.clone()
                    out.append((sp, sp.shard.grad))
                else:
                    sp.shard.grad.add_(shard_grad)
                    out.append((sp, None))
    return out


def _drop_zeros(sp: ShardedParam, created) -> None:
    """No rank's data reached ``sp`` in this backward, but its module's end sent zeros for it:
    where that created its shard gradient (and nothing added to it since: still all zeros), the
    parameter has no gradient, as in one process."""
    if created is not None and sp.shard.grad is created and not bool(created.any()):
        sp.shard.grad = None
