"""``WholeParameterOptimizer``: a whole-parameter optimizer (Muon, Adafactor, yours) on shards.

Such an optimizer reads a parameter as a whole (Muon orthogonalizes the matrix, Adafactor
factors its second moment over rows and columns), so a flat shard will not do. Each sharded
parameter gets one owner rank (``owners.assign_owners``, balanced by elements). Per step, in
buckets of about ``bucket_bytes``:

1. one packed all-to-all sends each rank's pieces of every parameter of the bucket to its
   owner: the reduced shard gradient, and the master shard unless the owner already holds the
   exact master values (stages 1-2 without a ``param_dtype``: the replica is the master);
2. the owner assembles each whole parameter and gradient and runs the user's optimizer class
   on it (its state lives on the owner only);
3. a second all-to-all sends the updated pieces back to the shards. It is in flight while the
   owner steps the next bucket (the collectives are asynchronous), and the next bucket's pieces
   travel while this one is stepped.

Bytes sent per rank and step: ``(N-1)/N`` of its shard gradients (plus as much for the master
shards where they travel) and ``(N-1)/N`` of its shards back, against DeepSpeed's two
all-gathers of the full matrices (momentum and update) that leave every rank with all of them.

Parameters kept whole (stage 0, or no compiled frame sharded them) are stepped on every rank,
as plain data parallelism does: every rank holds the same averaged gradient.

The whole tensors the user's optimizer sees keep their identity across steps (its state is
keyed by them) but hold storage only inside the step. ``state`` shows the owned state keyed by
the targets (the shards), ``load_state_dict`` keeps the owned entries of whole state.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch.optim import Optimizer

from zerocompile.optim.owners import assign_owners, owner_loads
from zerocompile.runtime.sharded_param import get_state
from zerocompile.runtime.step_collectives import bucket_indices, finish_all_to_all, start_all_to_all

log = logging.getLogger("zerocompile")

OWN_KEYS = ("optimizer_class", "whole_parameter")
"""Param-group keys that ``ZeroOptimizer`` reads itself and never hands to an inner optimizer."""


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of ``shape`` that holds one element of storage (an expanded scalar): what a whole
    parameter is between steps."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


class _Entry:
    """One parameter of the optimizer: its target (shard or the parameter), its shard state
    (None: kept whole), its owner rank and the whole tensor the user's optimizer updates."""

    def __init__(self, target, param, sp, owner: int, whole) -> None:
        self.target = target
        self.param = param
        self.sp = sp
        self.owner = owner
        self.whole = whole

    @property
    def sharded(self) -> bool:
        return self.sp is not None and self.target is not self.param

    def sends_master(self) -> bool:
        """The owner needs this rank's master shard (it has no exact master copy of its own)."""
        sp = self.sp
        return not (sp.rules.keeps_replica and sp.compute_dtype == sp.dtype)


class WholeParameterOptimizer(Optimizer):
    """``optimizer_class`` on whole parameters, each at its owner rank. ``groups``: param groups
    whose params are the targets; ``params``: the ``ZeroOptimizer``'s ``OptimizerParams`` (to map
    targets to parameters and shard states); ``defaults``: keyword arguments for the class;
    ``bucket_bytes``: the size of the all-to-all buckets."""

    def __init__(self, groups: list[dict], optimizer_class: type, defaults: dict, params,
                 bucket_bytes: int) -> None:
        by_target = {}
        for p in params:
            sp = get_state(p)
            target = p if sp is None else sp.rules.optimizer_target(sp)
            by_target[id(target)] = (p, sp)
        super().__init__(groups, {})
        self.optimizer_class = optimizer_class
        self.bucket_bytes = bucket_bytes
        self.layout = params.layout_group()
        self.session = params.session()
        """The model's ``ModelSession``: it counts and times the all-to-alls."""
        self.entries: list[_Entry] = []
        sharded = []
        for group in self.param_groups:
            for t in group["params"]:
                p, sp = by_target[id(t)]
                entry = _Entry(t, p, sp, self.layout.rank, None)
                if entry.sharded:
                    sharded.append(entry)
                self.entries.append(entry)
        owners = assign_owners([e.sp.numel for e in sharded], self.layout.world)
        for entry, owner in zip(sharded, owners):
            entry.owner = owner
            if owner == self.layout.rank:
                entry.whole = placeholder(entry.sp.shape, entry.sp.dtype, entry.target.device)
        self.owned_elements = owner_loads([e.sp.numel for e in sharded], owners, self.layout.world)
        """Elements of the sharded parameters owned by each rank (the optimizer state follows them)."""
        self._by_target = {id(e.target): e for e in self.entries}
        inner_groups = []
        for group in self.param_groups:
            tensors = []
            for t in group["params"]:
                e = self._by_target[id(t)]
                if not e.sharded:
                    tensors.append(t)
                elif e.whole is not None:
                    tensors.append(e.whole)
            inner_groups.append({**_hyper(group), "params": tensors})
        self.inner = optimizer_class(inner_groups, **defaults)
        if len(sharded):
            log.info("ZeroOptimizer: %s runs on whole parameters: %d sharded parameters, each at one owner rank "
                     "(elements owned per rank: %s)", optimizer_class.__name__, len(sharded), self.owned_elements)

    # ------------------------------------------------------------------ state, as the binding reads it
    @property
    def state(self) -> dict:
        """The user's optimizer state of each target this rank steps (owned or kept whole)."""
        out = {}
        for e in self.entries:
            tensor = e.target if not e.sharded else e.whole
            if tensor is not None and tensor in self.inner.state:
                out[e.target] = self.inner.state[tensor]
        return out

    @state.setter
    def state(self, value) -> None:
        pass    # torch.optim.Optimizer.__init__ assigns an empty state; the user's optimizer holds it

    def holds_whole_state(self, target) -> bool:
        """The state of ``target`` is whole (the parameter's shape), never cut into shards."""
        return True

    def has(self, target) -> bool:
        """``target`` is one of this optimizer's."""
        return id(target) in self._by_target

    def owner_of(self, target) -> int:
        """The rank that holds the state of ``target`` (this rank for parameters kept whole)."""
        return self._by_target[id(target)].owner

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's layout over the targets (positions in the param groups); the whole state
        of parameters another rank owns is dropped."""
        index, positions = 0, {}
        for group in self.param_groups:
            for t in group["params"]:
                positions[index] = self._by_target[id(t)]
                index += 1
        inner_index, inner_of = 0, {}
        for group in self.inner.param_groups:
            for tensor in group["params"]:
                inner_of[id(tensor)] = inner_index
                inner_index += 1
        state = {}
        for key, values in state_dict["state"].items():
            e = positions[key]
            tensor = e.target if not e.sharded else e.whole
            if tensor is not None:
                state[inner_of[id(tensor)]] = values
        groups = []
        for saved, group in zip(state_dict["param_groups"], self.inner.param_groups):
            # the class's own defaults stay where the saved group does not set them
            groups.append({**_hyper(group), **_hyper(saved), "params": [inner_of[id(t)] for t in group["params"]]})
        self.inner.load_state_dict({"state": state, "param_groups": groups})
        for ours, loaded in zip(self.param_groups, self.inner.param_groups):
            ours.update(_hyper(loaded))

    def add_param_group(self, param_group: dict) -> None:
        if "inner" not in self.__dict__:        # Optimizer.__init__ adding the first groups
            super().add_param_group(param_group)
            return
        raise ValueError("ZeroOptimizer.add_param_group: a group of a whole-parameter optimizer "
                         f"({self.optimizer_class.__name__}) cannot be added after the optimizer bound "
                         "(owners are assigned then); give all param groups to the constructor")

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        for ours, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(_hyper(ours))
        whole = [e for e in self.entries if not e.sharded]
        if any(e.target.grad is not None for e in whole):
            self._step_only(whole, {})
        sharded = [e for e in self.entries if e.sharded and e.target.grad is not None]
        if sharded:
            self._step_owned(sharded)

    def _step_only(self, entries: list, grads: dict) -> None:
        """Run the user's optimizer on ``entries`` only: the whole tensors of owned parameters get
        ``grads[id(entry)]`` as gradient, parameters kept whole their own; others none."""
        hidden = []
        wanted = {id(e.target if not e.sharded else e.whole) for e in entries}
        for group in self.inner.param_groups:
            for t in group["params"]:
                if id(t) not in wanted and t.grad is not None:
                    hidden.append((t, t.grad))
                    t.grad = None
        for e in entries:
            if e.sharded:
                e.whole.grad = grads[id(e)]
        try:
            self.inner.step()
        finally:
            for t, g in hidden:
                t.grad = g
            for e in entries:
                if e.sharded:
                    e.whole.grad = None

    def _step_owned(self, entries: list) -> None:
        """Gradients (and master values) to the owners, the owners' steps, the values back.
        Two buckets at most are in flight: bucket ``k + 1``'s pieces travel to the owners while
        bucket ``k`` is stepped, and bucket ``k``'s updated pieces travel back while bucket ``k + 1``
        is stepped; a bucket's whole matrices are freed once packed for the way back."""
        world, rank = self.layout.world, self.layout.rank
        buckets = _buckets(entries, self.bucket_bytes)
        pending_in = self._start_in(buckets[0])
        pending_out = None
        for k, bucket in enumerate(buckets):
            received = finish_all_to_all(pending_in, session=self.session) if world > 1 else pending_in
            if k + 1 < len(buckets):
                pending_in = self._start_in(buckets[k + 1])
            owned = [e for e in bucket if e.owner == rank]
            if owned:
                self._step_only(owned, self._assemble(received, bucket, owned))
            del received
            started = (bucket, self._start_out(bucket, owned))
            for e in owned:
                e.whole.data = placeholder(e.sp.shape, e.sp.dtype, e.target.device)
            if pending_out is not None:
                self._finish_out(*pending_out)
            pending_out = started
        self._finish_out(*pending_out)

    def _assemble(self, received: torch.Tensor, bucket: list, owned: list) -> dict:
        """Set each owned parameter's whole tensor to its assembled master values; return its
        assembled gradient by ``id(entry)``."""
        pieces = _unpack_received(received, bucket, self.layout.rank, self.layout.world)
        grads = {}
        for e in owned:
            grad_rows, master_rows = pieces[id(e)]
            sp = e.sp
            grads[id(e)] = grad_rows.reshape(-1)[: sp.numel].view(sp.shape).to(sp.dtype)
            if master_rows is not None:
                e.whole.data = master_rows.reshape(-1)[: sp.numel].view(sp.shape).clone()
            else:
                e.whole.data = sp.replica.detach().reshape(sp.shape).clone()
        return grads

    def _finish_out(self, bucket: list, pending) -> None:
        """Write the updated pieces of ``bucket`` that came back into this rank's shards."""
        received = finish_all_to_all(pending, session=self.session) if self.layout.world > 1 else pending
        by_owner = defaultdict(list)
        for e in bucket:
            by_owner[e.owner].append(e)
        offset = 0                            # each owner's pieces, in owner order, then bucket order
        for owner in range(self.layout.world):
            for e in by_owner[owner]:
                chunk = e.sp.chunk
                e.target.copy_(received[offset : offset + chunk])
                offset += chunk

    def _start_in(self, bucket: list):
        """Pack this rank's pieces of ``bucket`` by owner (gradient, then master where it
        travels) and start the all-to-all to the owners."""
        world = self.layout.world
        by_owner = defaultdict(list)
        for e in bucket:
            by_owner[e.owner].append(e)
        parts, counts = [], []
        for owner in range(world):
            n = 0
            for e in by_owner[owner]:
                parts.append(e.target.grad.reshape(-1).to(e.sp.dtype))
                n += e.sp.chunk
                if e.sends_master():
                    parts.append(e.target.detach().reshape(-1))
                    n += e.sp.chunk
            counts.append(n)
        send = torch.cat(parts) if parts else bucket[0].target.new_zeros(0)
        if world == 1:
            return send
        recv_counts = [sum(e.sp.chunk * (2 if e.sends_master() else 1) for e in by_owner[self.layout.rank])] * world
        return start_all_to_all(send, counts, recv_counts, self.layout, session=self.session)

    def _start_out(self, bucket: list, owned: list):
        """Start the all-to-all that sends each rank its pieces of the updated parameters this
        rank owns in ``bucket``."""
        world = self.layout.world
        rows = []
        for e in owned:
            sp = e.sp
            flat = e.whole.detach().new_zeros(sp.padded_numel)
            flat[: sp.numel].copy_(e.whole.detach().reshape(-1))
            rows.append(flat.view(world, sp.chunk))
        send = torch.cat(rows, dim=1).reshape(-1) if rows else bucket[0].target.new_zeros(0)
        if world == 1:
            return send
        mine = sum(e.sp.chunk for e in owned)
        recv_counts = [0] * world
        for e in bucket:
            recv_counts[e.owner] += e.sp.chunk
        return start_all_to_all(send, [mine] * world, recv_counts, self.layout, session=self.session)


def _unpack_received(received: torch.Tensor, bucket: list, rank: int, world: int) -> dict:
    """``{id(entry): (gradient rows, master rows or None)}`` of the parameters of ``bucket``
    that ``rank`` owns, from what the all-to-all to the owners brought: each sender's part holds
    those parameters in bucket order, gradient then master; rows are ``(world, chunk)``."""
    owned = [e for e in bucket if e.owner == rank]
    per_sender = sum(e.sp.chunk * (2 if e.sends_master() else 1) for e in owned)
    parts = received.view(world, per_sender) if per_sender else received.new_zeros(world, 0)
    out, offset = {}, 0
    for e in owned:
        chunk = e.sp.chunk
        grad = parts[:, offset : offset + chunk]
        offset += chunk
        master = None
        if e.sends_master():
            master = parts[:, offset : offset + chunk]
            offset += chunk
        out[id(e)] = (grad, master)
    return out


def _buckets(entries: list, cap: int) -> list[list]:
    """``entries`` in order, in buckets of at most ``cap`` bytes of shard and of one master dtype
    (a bucket is one flat buffer); every rank makes the same buckets."""
    sizes = [e.sp.padded_numel * e.target.element_size() for e in entries]
    breaks = [i > 0 and e.sp.dtype != entries[i - 1].sp.dtype for i, e in enumerate(entries)]
    return [[entries[i] for i in bucket] for bucket in bucket_indices(sizes, cap, breaks)]


def _hyper(group: dict) -> dict:
    """A param group's hyperparameters: without ``params`` and zerocompile's own keys."""
    return {k: v for k, v in group.items() if k != "params" and k not in OWN_KEYS}
