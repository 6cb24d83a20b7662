"""The update of one optimizer step: the inner optimizer steps the targets (shards kept in
files read back for it), then the replicas are refreshed from the updated shards (stages 1/2),
or, in a step skipped for overflow, nothing moves; after a step in which frames were compiled,
the garbage Dynamo's tracing left is collected."""

from __future__ import annotations

import gc
import logging
from collections import defaultdict

import torch

from zerocompile.optim.buckets import bucket_bytes
from zerocompile.runtime import fused_adam
from zerocompile.runtime.session import newest_frame_order
from zerocompile.runtime.param_offload import resident_shards
from zerocompile.runtime.step_collectives import all_gather_concat

log = logging.getLogger("zerocompile")


def shard_states(params) -> dict:
    """``{id(target): shard state}`` of the parameters of ``params`` (the optimizer's
    ``OptimizerParams``) that have one, each keyed by the tensor the inner optimizer updates for
    it: what ``step_pipelined`` and ``step_inner`` read, made once a step."""
    return {id(sp.rules.optimizer_target(sp)): sp for _, sp in params.pairs() if sp is not None}


def step_inner(inner, states: dict, clipper, copies: dict) -> None:
    """The inner optimizer's update. Shards kept in files (``offload_param``) are read back
    for it and written again: with zerocompile's fused kernels part by part, at most
    ``buffer_count * buffer_size`` elements of them at a time (each parameter's update
    depends on nothing else, so the numbers are those of one step of all); torch's
    optimizers update every tensor in one call, so all of them at once. ``states``: the
    optimizer's ``shard_states``; ``clipper``: its ``GradClipper``; ``copies``: filled as
    ``_fused_step`` says."""
    offloaded = [sp for sp in states.values() if sp.shard_file is not None]
    if not isinstance(inner, fused_adam.FusedAdam):
        with resident_shards(offloaded, write=True, threads=max((sp.offload_param.threads for sp in offloaded),
                                                                 default=1)):
            inner.step()
        return
    if not offloaded:
        _fused_step(inner, [t for g in inner.param_groups for t in g["params"]], states, clipper, copies, every=True)
        return
    in_files = {id(sp.shard) for sp in offloaded}
    _fused_step(inner, [t for g in inner.param_groups for t in g["params"] if id(t) not in in_files], states,
                clipper, copies)
    settings = offloaded[0].offload_param
    limit = settings.buffer_count * settings.buffer_size
    part, size = [], 0
    for sp in offloaded + [None]:
        if part and (sp is None or size + sp.chunk > limit):
            with resident_shards(part, write=True, threads=settings.threads):
                _fused_step(inner, [s.shard for s in part], states, clipper, copies)
            part, size = [], 0
        if sp is not None:
            part.append(sp)
            size += sp.chunk


def _fused_step(inner, targets: list, states: dict, clipper, copies: dict, every: bool = False) -> None:
    """The fused inner optimizer's update of ``targets``, the gradients still owed a deferred
    clipping coefficient multiplied by it inside the kernel, and (stages 1/2 with a
    ``param_dtype``) the shard's copy in the compute dtype, which the replica's all-gather
    sends, written in the same pass (into ``copies``: id(shard) -> the updated shard in the
    compute dtype). ``states`` maps ``id`` of each target to its parameter's shard state.
    ``every``: ``targets`` are all of the inner optimizer's (then it is not asked to pick them
    out of its groups)."""
    written = {}
    for t in targets:
        sp = states.get(id(t))
        if (t.grad is not None and sp is not None and sp.rules.keeps_replica and sp.requires_grad
                and sp.compute_dtype != sp.dtype):
            written[id(t)] = torch.empty(t.shape, dtype=sp.compute_dtype, device=t.device)
    scale = clipper.deferred_scale
    scaled = [t for t in targets if scale is not None and id(t) in clipper.deferred]
    rest = [t for t in targets if scale is None or id(t) not in clipper.deferred]
    if scaled:
        inner.update(scale, scaled, written)
    if rest:
        inner.update(1.0, None if every and not scaled else rest, written)
    # the inner optimizer removed the copies it did not write (parameters whose optimizer
    # state streams from a swap file): the after-step casts those shards itself
    copies.update(written)


def step_pipelined(inner, params, states: dict, clipper) -> bool:
    """The update and the replicas' refresh together, bucket by bucket: each all-gather bucket's
    shards are stepped right before the bucket is packed, while the previous bucket's gather is
    in flight (each parameter's update depends on nothing else: the numbers of one step of
    all). The other targets are stepped first. Only for zerocompile's fused Adam on shards that
    are views of their replicas' buffers (the compute dtype is the master dtype, no
    ``offload_param``; not ``OffloadedAdam``, which streams its state per call); returns False,
    having done nothing, elsewhere (then ``step_inner`` and ``after_step``). ``params``: the
    optimizer's ``OptimizerParams``; ``states``: their ``shard_states``; ``clipper``: the
    optimizer's ``GradClipper``."""
    if type(inner) is not fused_adam.FusedAdam:
        return False
    gathered = {id(sp.shard): sp for sp in states.values()
                if sp.rules.keeps_replica and sp.requires_grad and not sp.separate_full_param}
    if not gathered or any(sp.shard_file is not None or sp.compute_dtype != sp.dtype or sp.separate_full_param
                           for sp in states.values()):
        return False
    targets = {id(t): t for g in inner.param_groups for t in g["params"]}
    _fused_step(inner, [t for i, t in targets.items() if i not in gathered], states, clipper, {})
    stepped = set()

    def step_part(part: list) -> None:
        todo = [sp.shard for sp in part if id(sp.shard) in targets and id(sp.shard) not in stepped]
        stepped.update(id(t) for t in todo)
        if todo:
            _fused_step(inner, todo, states, clipper, {})
        # stage 1: a stepped bucket's shard gradients go before the bucket is packed, as they
        # went before the gathers unpipelined (the step's peak stays that of one bucket)
        _drop_shard_gradients([sp for sp in part if sp.rules.reduces_in_step])

    # after_step gathers exactly the shards of ``gathered`` (trainable, with a replica): each
    # is stepped once, by its bucket
    after_step(params, {}, step_part)
    return True


def after_step(params, copies: dict, step_part=None) -> None:
    """Refresh the replicas (and separate full parameters) from the updated shards, drop the
    shard gradients reduced in the step, release eager-gathered copies. ``copies``: what
    ``step_inner`` wrote in the compute dtype. ``step_part(states)``: called with the shard
    states of each all-gather bucket right before the bucket reads their shards
    (``step_pipelined``: their update)."""
    replicas = defaultdict(list)
    dropped = []
    for _, sp in params.pairs():
        if sp is None or not sp.rules.shards_master:
            continue
        if sp.rules.keeps_replica and sp.requires_grad:
            replicas[(sp.group, sp.compute_dtype)].append((sp, sp.refresh_replica, sp.replica_place))
        if sp.keep_full and sp.requires_grad and sp.separate_full_param:
            replicas[(sp.group, sp.dtype)].append((sp, sp.refresh_param, None))
        if sp.rules.reduces_in_step:
            dropped.append(sp)
        if sp.materialized:
            sp.release()             # eager-gathered copies are stale now
    if step_part is None:
        _drop_shard_gradients(dropped)
    for (group, dtype), items in replicas.items():
        with resident_shards([sp for sp, _, _ in items]):     # offload_param: shards read back
            shards = [copies.get(id(sp.shard)) if dtype == sp.compute_dtype else None for sp, _, _ in items]
            shards = [c if c is not None else sp.shard.detach().to(dtype) for c, (sp, _, _) in zip(shards, items)]
            prepare = None if step_part is None else (lambda bucket: step_part([items[i][0] for i in bucket]))
            choice = items[0][0].gradient_reduction       # stages 1-2: how the buckets travel
            # point to point, each replica receives the other ranks' chunks in place
            all_gather_concat(shards, group, bucket_bytes([sp for sp, _, _ in items]),
                              lambda i, rows: items[i][1](rows), prepare,
                              choose=None if choice is None else choice.gather_kind_for,
                              places=[place for _, _, place in items], session=params.session())
    if step_part is not None:       # the buckets' updates read them: dropped once all are stepped
        _drop_shard_gradients(dropped)


def _drop_shard_gradients(states) -> None:
    """Stage 1 after a step: the shard gradients the step reduced are dropped (the full
    gradients stay until ``zero_grad()``)."""
    for sp in states:
        sp.shard.grad = None
        sp.forget_reduction()


def skip_update(params) -> None:
    """The update is skipped: shards, replicas and optimizer state stay as they are."""
    log.info("ZeroOptimizer: step skipped, non-finite gradients on some rank")
    for _, sp in params.pairs():
        if sp is not None and sp.rules.reduces_in_step:
            sp.shard.grad = None     # as after a step: the full gradients stay until zero_grad()
            sp.forget_reduction()


def collect_compile_garbage(collected_through) -> int:
    """After a step in which frames were compiled, run Python's cyclic garbage collector
    once. Dynamo's tracing leaves reference cycles that hold each compiled frame's example
    inputs (that step's activations: a decoder layer's hidden states, its position ids);
    uncollected, they stay alive until the interpreter's next full collection, at a point
    of its choosing, and every step's peak until then counts them. Collected here, the
    memory of later steps is the program's own, the same in a real run and in ``plan``.
    ``collected_through``: the compile order of the newest frame whose garbage was collected;
    returns the new one."""
    newest = newest_frame_order()
    if newest > collected_through:
        gc.collect()
        return newest
    return collected_through
