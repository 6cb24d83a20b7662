"""Stage 1 with the ``overlap_reduction`` option: the full gradients reduced into the shards
during the backward that comes before the optimizer step, bucket by bucket as autograd
finishes them, instead of in the step: DDP's overlap of the all-reduce with the backward, and
DeepSpeed's ``overlap_comm``.

How it decides, per optimizer (``EarlyReduction``, owned by ``GradReducer``):

- A hook after each stage-1 replica's gradient accumulation (``register_post_accumulate_grad_hook``,
  as FSDP2 and DDP use) counts, per backward, how many times each replica received a gradient,
  and how many backwards ran between two steps. A backward counts when it reaches a replica.
- The backward whose number since the last step equals the number the last step had is taken
  to be the last before the step (a loop with ``k`` micro-batches per step launches during the
  ``k``-th; the first two steps launch nothing: one to bind, one to count). In that backward,
  the plan's buckets (fixed, the same on every rank: the trainable stage-1 parameters in
  reverse order, about the order the backward finishes them, cut at ``bucket_mb``) start in
  order, each as soon as each of its parameters has received as many gradients as in the last
  step's last backward; whatever has not started when the backward ends starts then. Each bucket
  is reduced exactly as the step would (``runtime/step_collectives.py``'s ``BucketReduction``:
  the same collective, the same cast and padding), at most two in flight, so the buffers are
  the step's two.
- The step checks what was reduced: a bucket is used only if, on every rank, each of its
  gradients is still the tensor it read with the same version (no later backward added to it,
  nothing changed it in place, no eager gradient of a freed parameter waits to be added) — one
  all-reduce (MAX) of a flag per bucket and per parameter (which ranks had a gradient at all).
  Any other bucket is reduced by the step as without the option, on every rank alike. So the
  shard gradients are the step's, bit for bit on two ranks, whatever the loop does; a wrong
  guess costs one reduction of the bucket, never a wrong number.

Every rank must follow the same pattern of backwards per optimizer step (as DDP's overlap and
the in-graph reductions of stages 2 and 3 require; a constant difference is fine, since each rank
guesses from its own last step): a rank that launches while another does not pairs its
collectives with different ones, a hang the collective watchdog (``collective_timeout_s``) names,
or wrong sums where the sizes happen to agree. docs/config.md says so; the option is off by
default.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from zerocompile._torch_compat.autograd import queue_end_of_backward
from zerocompile.optim.buckets import bucket_bytes, reduction_chooser
from zerocompile.runtime.comm import all_reduce, is_fake_group
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.sharded_param import get_state
from zerocompile.runtime.step_collectives import BucketReduction, bucket_indices
from zerocompile.runtime.zero_parameter import raw_grad

LABEL = "stage 1 gradient reduction overlapped with the backward"
_c10d = torch.ops._c10d_functional


@dataclass
class _Plan:
    """The buckets, the same on every rank: ``items`` the shard states in launch order,
    ``buckets`` ``(key, positions in items)`` in launch order, ``key`` ``(group, reduce dtype)``."""

    items: list
    buckets: list[tuple[tuple, list[int]]]
    group: object
    session: object
    choose: dict = field(default_factory=dict)     # key -> choose(bucket bytes) or None


@dataclass
class _Launch:
    """The buckets one backward started: what each read, and their reductions."""

    reductions: dict                   # key -> BucketReduction over that key's items
    index: dict                        # position in plan.items -> index in its key's reduction
    read: dict = field(default_factory=dict)       # position -> (gradient tensor or None, its version)
    started: int = 0                   # buckets started, in plan order
    in_flight: deque = field(default_factory=deque)     # (reduction, handle, issued)


class EarlyReduction:
    """The ``overlap_reduction`` machinery of one ``ZeroOptimizer``: ``params`` its
    ``OptimizerParams``, ``local_gradients()`` True while its inner optimizer takes local
    gradients (1-bit Adam: nothing is reduced then, so nothing is launched)."""

    def __init__(self, params, local_gradients=None) -> None:
        self.params = params
        self.local_gradients = local_gradients
        self.plan: _Plan | None = None
        self._plan_key = None
        self._hooks: dict[int, tuple] = {}           # id(replica) -> (weakref to it, hook handle)
        self._in_backward = False
        self._backwards = 0          # backwards since the last step that reached a stage-1 replica
        self._expected: int | None = None     # how many the last step had (None: not counted yet)
        self._fires: dict[int, int] = {}       # id(state) -> gradients received in the running backward
        self._last_fires: dict[int, int] = {}  # the same, the last backward before the last step
        self._ended_fires: dict[int, int] = {}  # the same, the last backward that ended
        self._launching = False
        self.launch: _Launch | None = None
        self.launches = 0            # backwards that launched
        self.started_in_backward = 0   # buckets started before their backward ended (the overlap)
        self.used = 0                # buckets whose reduction a step used

    # ------------------------------------------------------------------ step boundaries
    def step_ended(self) -> None:
        """The optimizer stepped (or cleared the gradients): what was launched and not used is
        waited for and dropped, the counts of this step become the next step's guess, and the
        plan and hooks follow the current stage-1 parameters."""
        if self.launch is not None:
            self._drain(self.launch)
            self.launch = None
        if self._backwards:
            self._expected = self._backwards
            self._last_fires = self._ended_fires
        self._backwards = 0
        self._arm()

    def _arm(self) -> None:
        config = self.params.session().config       # the model's options (one value per model)
        if config is None or not config.step.overlap_reduction:
            self.plan, self._plan_key = None, None     # the common case: no pass over the parameters
            return
        states = [sp for sp in reversed(self.params.states())
                  if sp.stage == 1 and sp.rules.reduces_in_step and sp.requires_grad
                  and sp.option("step", "overlap_reduction", False)]
        if states and self.local_gradients is not None and self.local_gradients():
            states = []
        key = tuple((id(sp), id(sp.replica)) for sp in states)
        if key != self._plan_key:
            self._plan_key = key
            self.plan = self._make_plan(states)
        if self.plan is None:
            return
        for sp in self.plan.items:
            replica = sp.replica
            held = self._hooks.get(id(replica))
            if held is not None and held[0]() is replica:
                continue
            me, state = weakref.ref(self), weakref.ref(sp)

            def hook(_tensor, me=me, state=state) -> None:
                owner, sp = me(), state()
                if owner is not None and sp is not None:
                    owner._accumulated(sp)

            self._hooks[id(replica)] = (weakref.ref(replica), replica.register_post_accumulate_grad_hook(hook))

    def _make_plan(self, states: list) -> _Plan | None:
        if not states:
            return None
        groups = {sp.group.name for sp in states}
        group = states[0].group
        if len(groups) > 1 or group.world <= 1 or is_fake_group(group) or any(
                sp.replica.device.type == "meta" for sp in states):
            return None          # one real group of several ranks only
        cap = bucket_bytes(states)
        by_key: dict[tuple, list[int]] = {}
        for i, sp in enumerate(states):
            by_key.setdefault((sp.group.name, sp.reduce_dtype), []).append(i)
        buckets = []
        for key, positions in by_key.items():
            elem = torch.empty((), dtype=key[1]).element_size()
            for bucket in bucket_indices([states[i].padded_numel * elem for i in positions], cap):
                buckets.append((key, [positions[j] for j in bucket]))
        buckets.sort(key=lambda b: b[1][0])          # in launch order: that of their first item
        choose = {key: reduction_chooser([states[i] for i in positions]) for key, positions in by_key.items()}
        return _Plan(states, buckets, group, self.params.session(), choose)

    # ------------------------------------------------------------------ during the backward
    def _accumulated(self, sp) -> None:
        """A stage-1 replica's gradient was accumulated (the hook)."""
        if not self._in_backward:
            self._in_backward = True
            self._backwards += 1
            self._fires = {}
            self._launching = (self.plan is not None and self.launch is None and self._expected is not None
                               and self._backwards == self._expected)
            if self._launching:
                self.launch = self._new_launch(self.plan)
                self.launches += 1
            queue_end_of_backward(self._backward_ended)
        self._fires[id(sp)] = self._fires.get(id(sp), 0) + 1
        if self._launching:
            self._start_ready()

    def _backward_ended(self) -> None:
        self._in_backward = False
        self._ended_fires = self._fires
        if self._launching:
            self._launching = False
            self._start_all(self.launch)

    def _new_launch(self, plan: _Plan) -> _Launch:
        reductions, index, lists = {}, {}, {}
        for key, positions in plan.buckets:
            lists.setdefault(key, [])
            for i in positions:
                index[i] = len(lists[key])
                lists[key].append(None)
        for key, grads in lists.items():
            largest = max(sum(plan.items[i].padded_numel for i in positions)
                          for k, positions in plan.buckets if k == key)
            reductions[key] = BucketReduction(grads, plan.group, key[1], plan.choose.get(key), plan.session,
                                              slots=2, slot_numel=largest)
        return _Launch(reductions, index)

    def _start_ready(self) -> None:
        launch, plan = self.launch, self.plan
        while launch.started < len(plan.buckets):
            _, positions = plan.buckets[launch.started]
            if any(self._fires.get(id(plan.items[i]), 0) < self._last_fires.get(id(plan.items[i]), 0)
                   for i in positions):
                return
            self._start_next(launch, plan)
            self.started_in_backward += 1

    def _start_all(self, launch: _Launch) -> None:
        while launch.started < len(self.plan.buckets):
            self._start_next(launch, self.plan)

    def _start_next(self, launch: _Launch, plan: _Plan) -> None:
        """Start the next bucket of the plan: read each of its gradients (zeros where a
        parameter has none: what the step would reduce for a rank without one), after letting
        the oldest of two buckets in flight finish (its buffer is the one this one packs into)."""
        key, positions = plan.buckets[launch.started]
        reduction = launch.reductions[key]
        for i in positions:
            sp = plan.items[i]
            grad = raw_grad(sp.replica)
            launch.read[i] = (grad, None if grad is None else grad._version)
            if grad is None:
                grad = torch.zeros(sp.replica.shape, dtype=sp.compute_dtype, device=sp.replica.device)
            reduction.grads[launch.index[i]] = (grad, sp.padded_numel)
        while len(launch.in_flight) > 1:
            self._finish_oldest(launch)
        bucket = [launch.index[i] for i in positions]
        comms = plan.session.comms
        with PROCESS.watch.scope(LABEL), comms.capturing(plan.items[positions[0]].replica.device) as issued:
            handle = reduction.start(launch.started, bucket)
        launch.started += 1
        launch.in_flight.append((reduction, handle, issued))
        if comms.settings is not None and comms.settings.blocking:
            self._finish_oldest(launch)

    def _finish_oldest(self, launch: _Launch) -> None:
        reduction, handle, issued = launch.in_flight.popleft()
        if issued:
            _c10d.wait_tensor(handle[-1])
            self.plan.session.comms.done(issued, LABEL)
        reduction.finish(*handle)

    def _drain(self, launch: _Launch) -> None:
        self._start_all(launch)
        while launch.in_flight:
            self._finish_oldest(launch)

    # ------------------------------------------------------------------ in the step
    def settle(self, params) -> dict:
        """``{id(state): averaged shard-row gradient or None}`` of the parameters whose launched
        reduction the step may use (None: no rank had a gradient, so the parameter gets none);
        empty where nothing was launched. Waits for the buckets in flight and agrees with the
        other ranks (one all-reduce) on which buckets hold what the step would reduce.
        ``params``: the optimizer's parameters (an eager gradient on a freed one makes its
        bucket unusable)."""
        launch, plan = self.launch, self.plan
        if launch is None:
            return {}
        self.launch = None
        self._launching = False
        self._drain(launch)
        eager = {id(sp) for p in params if (sp := get_state(p)) is not None and p is not sp.replica
                 and raw_grad(p) is not None}
        flags = []                  # per bucket: unusable here; per item: had a gradient here
        for _, positions in plan.buckets:
            bad = 0
            for i in positions:
                sp = plan.items[i]
                grad, version = launch.read[i]
                now = raw_grad(sp.replica)
                if now is not grad or (now is not None and now._version != version) or id(sp) in eager:
                    bad = 1
            flags.append(bad)
        had = [int(launch.read[i][0] is not None) for i in range(len(plan.items))]
        agreed = torch.tensor(flags + had, dtype=torch.int64, device=plan.items[0].replica.device)
        with plan.session.comms.timed(agreed.device, "stage 1 overlapped reduction check"):
            plan.session.record("all_reduce", agreed.numel() * agreed.element_size())
            agreed = all_reduce(agreed, "max", plan.group.name).tolist()
        bad, had = agreed[:len(plan.buckets)], agreed[len(plan.buckets):]
        usable = {}
        for b, (key, positions) in enumerate(plan.buckets):
            if bad[b]:
                continue
            self.used += 1
            results = launch.reductions[key].results
            for i in positions:
                usable[id(plan.items[i])] = results[launch.index[i]] if had[i] else None
        return usable
