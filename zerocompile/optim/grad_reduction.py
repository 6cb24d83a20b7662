"""The gradients the compiled graphs did not reduce, reduced where the inner optimizer reads
them: whole gradients all-reduced (stage 0, and parameters no compiled frame has used), full
local gradients reduce-scattered into the shards (stage 1), eager gradients of freed parameters
added to the shards (stages 2/3); the ranks agree first on which gradients they hold. Also the
warning about (or refusal of) parameters kept whole, and clearing gradients for ``zero_grad``."""

from __future__ import annotations

import logging
from collections import defaultdict
import torch

from zerocompile import loss_scale
from zerocompile.errors import UnshardedParametersError
from zerocompile.optim.buckets import bucket_bytes, reduction_chooser
from zerocompile.optim.early_reduction import EarlyReduction
from zerocompile.runtime.session import frame_roots
from zerocompile.runtime.grad_participation import (Holder, compare_holders, fill_missing, layout_differences,
                                                    participation_error)
from zerocompile.runtime.leaf_modules import leaf_parameters
from zerocompile.runtime.sharded_param import get_state
from zerocompile.runtime.step_collectives import all_reduce_mean_, reduce_scatter_mean
from zerocompile.runtime.zero_parameter import raw_grad, raw_grads, set_raw_grad

log = logging.getLogger("zerocompile")


class GradReducer:
    """``params``: the optimizer's ``OptimizerParams``; ``scaling``: its ``LossScaling`` (the
    ``loss_scale`` option's scaler, or None); ``local_gradients``: a predicate, True while the
    inner optimizer takes this rank's local gradients (1-bit Adam: then nothing is all-reduced)."""

    def __init__(self, params, scaling, local_gradients=None) -> None:
        self.params = params
        self.scaling = scaling
        self.local_gradients = local_gradients
        self.reduced = False            # the gradients of this step were reduced (some may be stale again)
        self._warned_unsharded = False   # the warning about parameters no compiled frame used, given
        self.early = EarlyReduction(params, local_gradients)    # stage 1's overlap_reduction option

    def reduce(self) -> None:
        """Bring every gradient to where the inner optimizer reads it, averaged over ranks and,
        with the ``loss_scale`` option, divided by the scale where the backward left it scaled.

        Called by the step, by ``clip_grad_norm_`` and by the first read of a ``p.grad`` after a
        backward (``runtime/zero_parameter.py``). A compiled forward after that (more
        micro-batches before the step) makes its parameters' gradients stale
        (``ShardedParam.grad_reduced``), and the next call reduces them again: at stage 0 the
        all-reduce of what was averaged plus the new local part (averaging values equal on
        every rank leaves them as they are), at stage 1 the whole local gradient into the
        shard, at stages 2 and 3 nothing (the backward reduced the new part)."""
        states = self.params.states()
        if self.reduced and all(sp.grad_reduced for sp in states):
            return
        again = self.reduced     # some gradients were reduced before the last backward
        # stage 1, overlap_reduction: what the backward already reduced, where it is still right
        early = self.early.settle(self.params) if not again else {}
        self._agree_on_gradients()
        scaler = self.scaling.loss_scaler()
        scale = scaler.scale if scaler is not None else None
        full = defaultdict(list)        # (group, reduce dtype) -> replicated grads to all-reduce
        # (group, reduce dtype) -> (state, full grad, accumulate?, scale it carries or None)
        to_scatter = defaultdict(list)
        params, sps = self.params.columns()
        for p, sp, own in zip(params, sps, raw_grads(params)):
            if sp is None or not sp.rules.shards_master:
                if own is not None and (sp is None or not again or not sp.grad_synced):
                    group = self.params.group_of(sp)
                    rd = sp.reduce_dtype if sp is not None else torch.float32
                    full[(group, rd)].append((sp, own))
                continue
            key = (sp.group, sp.reduce_dtype)
            scaled = scale if scale is not None and loss_scale.holds_scaled_gradient(sp) else None
            if sp.rules.reduces_in_step:
                if again and sp.grad_reduced and own is None:
                    continue
                if id(sp) in early:
                    if early[id(sp)] is not None:
                        _store_shard_grad(sp, early[id(sp)], False, scaled)
                    continue
                _check_unchanged_since_reduced(sp)
                grad = raw_grad(sp.replica)
                eager = None
                if p is not sp.replica and own is not None:   # eager use of a freed parameter
                    set_raw_grad(p, None)
                    if scaled is None:
                        grad = own.to(sp.compute_dtype) if grad is None else grad.add_(own)
                    else:   # not scaled, unlike the replica's: reduced apart, added once that is unscaled
                        eager = own
                if grad is not None:
                    to_scatter[key].append((sp, grad, False, scaled))
                if eager is not None:
                    to_scatter[key].append((sp, eager, grad is not None, None))
                continue
            if scaled is not None and sp.shard.grad is not None:
                if not sp.grad_unscaled:
                    sp.shard.grad.div_(scaled)
                    sp.grad_unscaled = True
                elif not sp.grad_reduced:
                    raise RuntimeError(
                        f"ZeroOptimizer: a backward added loss-scaled gradients to parameter '{sp.name}', "
                        "whose gradient had already been unscaled (read through p.grad, clipped, or stepped "
                        "without zero_grad() after it). With the loss_scale option, read and clip gradients "
                        "after the last micro-batch's backward, and call opt.zero_grad() after each step")
            if own is not None:      # stages 2/3: a gradient from eager use of the parameter
                to_scatter[key].append((sp, own, True, None))
                set_raw_grad(p, None)
        self._warn_unsharded(full)
        if self.local_gradients is not None and self.local_gradients():
            full.clear()         # the inner optimizer averages (compressed) what it derives from them
        for (group, rd), items in full.items():
            all_reduce_mean_([g for _, g in items], group, bucket_bytes([s for s, _ in items]), rd,
                             session=self.params.session())
            for sp, _ in items:
                if sp is not None:
                    sp.grad_synced = True    # p.grad is now the averaged gradient: readable
        for (group, rd), items in to_scatter.items():
            shards = reduce_scatter_mean([(item[1], item[0].padded_numel) for item in items], group,
                                         bucket_bytes([item[0] for item in items]), rd,
                                         reduction_chooser([item[0] for item in items]), session=self.params.session())
            for (sp, _, accumulate, scaled), shard_grad in zip(items, shards):
                _store_shard_grad(sp, shard_grad, accumulate, scaled)
        for sp in states:
            sp.grad_reduced = True
            if sp.rules.reduces_in_step and sp.shard.grad is not None:
                sp.reduced_grad_version = sp.shard.grad._version
        self.reduced = True

    def _agree_on_gradients(self) -> None:
        """Make every rank hold the same set of gradients to reduce: a zero gradient where
        another rank has one and this rank's data did not reach the parameter; at stage 3,
        outside leaf modules, and wherever ranks shard a parameter differently, an error on
        every rank instead (runtime/grad_participation.py)."""
        group = self.params.layout_group()
        if group.world == 1:
            return
        holders = []
        for p in self.params:
            if not p.requires_grad:
                continue
            sp = get_state(p)
            # what decides how it is reduced: whole (stage 0, or no state) or into its stage's shards
            layout = 0 if sp is None or not sp.rules.shards_master else 1 + sp.stage
            replica = sp.replica if sp is not None and sp.rules.reduces_in_step and sp.replica is not p else None
            holders += [Holder(p, p, layout), Holder(p, replica, 0)]
        rows = compare_holders(holders, group, self.params.device(), self.params.session())
        if rows is None:
            return
        roots = {id(m): m for m in frame_roots()}
        roots = sorted(roots.values(), key=lambda m: -sum(1 for _ in m.parameters()))   # the model first
        split = layout_differences(holders, rows)
        if split:
            raise participation_error([_param_name(h.param, roots) for h, _ in split], [d for _, d in split], roots,
                                      "are sharded on some ranks only, by a compiled frame that ran on those ranks "
                                      "only")
        partial = fill_missing(holders, rows)
        stage = max((sp.stage for sp in self.params.states()), default=0)
        leaves = leaf_parameters(roots)
        refused = [(h, ranks) for h, ranks in partial if id(h.param) not in leaves
                   and (sp.stage if (sp := get_state(h.param)) is not None else stage) == 3]
        if refused:
            raise participation_error([_param_name(h.param, roots) for h, _ in refused],
                                      [f"ranks {ranks}" for _, ranks in refused], roots,
                                      "got a gradient on some ranks only at stage 3")

    def _warn_unsharded(self, full: dict) -> None:
        """Parameters that no compiled frame has used (no ``ShardedParam``) and that get
        gradients on several ranks are kept whole everywhere, as DDP keeps them (exact, but not
        sharded). At stage 3 that is refused (``UnshardedParametersError``) unless the frames
        were compiled with ``allow_unsharded``; otherwise a warning, once. ``full``: the
        gradients to all-reduce whole, by (group, reduce dtype)."""
        if self._warned_unsharded or all(group.world <= 1 for group, _ in full):
            return
        grads = [g for items in full.values() for sp, g in items if sp is None]
        if not grads or not any(bool(g.any()) for g in grads):
            return      # none, or all zero: torch's _init_optim_state stepping before the first forward
        unsharded = [p for p in self.params if get_state(p) is None and raw_grad(p) is not None]
        names = parameter_names(unsharded)
        listed = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        elements = f"{sum(g.numel() for g in grads):,}"
        stage3 = [sp for sp in self.params.states() if sp.stage == 3]
        if stage3 and not all(sp.option("step", "allow_unsharded", False) for sp in stage3):
            raise UnshardedParametersError(
                f"ZeroOptimizer: {len(grads)} parameter(s) ({elements} elements: {listed}) were used by no frame "
                "compiled with backend='zero', so at stage 3 every rank would keep them whole, with whole "
                "gradients and optimizer state. Dynamo ran the code that uses them eagerly: a graph break it "
                "could not resume from (e.g. inside a torch.utils.checkpoint region, or in a loop), a "
                "torch.compiler.disable'd function, or a torch.nn module compiled on its own (Dynamo does not "
                "compile the forward of nn.Linear, nn.Embedding... as a frame: compile the module that calls it). "
                "See why with TORCH_LOGS=graph_breaks and run that code inside a compiled frame, or keep them "
                "whole on purpose with options={'allow_unsharded': True}")
        self._warned_unsharded = True
        shapes = ", ".join(str(list(g.shape)) for g in grads[:4]) + (", ..." if len(grads) > 4 else "")
        log.warning(
            "ZeroOptimizer: %d parameter(s) (%s elements; shapes %s; %s) were used by no frame compiled with "
            "backend='zero', so every rank keeps them whole, with whole gradients (all-reduced) and optimizer "
            "state. Run the code that uses them inside a compiled frame; note that Dynamo does not compile the "
            "forward of a torch.nn module (nn.Linear, nn.Embedding...) as a frame of its own: compile the module "
            "that calls it", len(grads), elements, shapes, listed)


def clear_gradients(params, set_to_none: bool) -> None:
    """``zero_grad``: clear gradients wherever zerocompile keeps them (parameters, replicas,
    shards) and forget that they were reduced. ``params``: the optimizer's parameters."""
    for p in params:
        sp = get_state(p)
        holders = [p] if sp is None else {id(t): t for t in (p, sp.replica, sp.shard) if t is not None}.values()
        if sp is not None:
            sp.forget_reduction()
        for t in holders:
            grad = raw_grad(t)
            if grad is None:
                continue
            if set_to_none:
                set_raw_grad(t, None)
            else:
                grad.detach_()
                grad.zero_()


def _store_shard_grad(sp, shard_grad: torch.Tensor, accumulate: bool, scaled) -> None:
    """Put this rank's averaged row ``shard_grad`` of a reduction (in the reduce dtype, a view
    of the bucket's result) into ``sp``'s shard gradient, in the master dtype, divided by the
    loss scale ``scaled`` it carries (None: none), added to it where ``accumulate``."""
    shard_grad = shard_grad.to(sp.dtype)
    if scaled is not None:
        shard_grad = shard_grad / scaled        # in the master dtype
    if accumulate and sp.shard.grad is not None:
        sp.shard.grad.add_(shard_grad)
    else:
        sp.shard.grad = shard_grad if scaled is not None else shard_grad.clone()


def _check_unchanged_since_reduced(sp) -> None:
    """Stage 1 reduces the whole local gradient into the shard again after more micro-batches;
    that replaces the shard gradient, so it must still be what the last reduction left."""
    grad = sp.shard.grad
    if grad is not None and sp.reduced_grad_version is not None and grad._version != sp.reduced_grad_version:
        raise RuntimeError(
            f"ZeroOptimizer: at stage 1 the averaged gradient of parameter '{sp.name}' was changed in place "
            "(through p.grad: clipped or scaled) and then a backward added local gradients to it before the "
            "step; the two cannot be combined exactly. Change or clip gradients after the last micro-batch's "
            "backward, or use stage 0 or 2")


def _param_name(param, roots) -> str:
    """``param``'s name under the first of ``roots`` (largest first: the model, so the name is
    the same on every rank) that holds it, else its shard state's."""
    for root in roots:
        for name, p in root.named_parameters():
            if p is param:
                return name
    sp = get_state(param)
    return sp.name if sp is not None else f"of shape {list(param.shape)}"


def parameter_names(params: list) -> list:
    """Each parameter's name in the modules the compiled frames were reached from (its shape
    where no such module holds it)."""
    names = {}
    for root in frame_roots():
        for name, p in root.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
    return [names.get(id(p), f"a parameter of shape {list(p.shape)}") for p in params]
