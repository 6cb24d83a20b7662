"""The functions the capture pass inserts into a frame's graph, one per parameter.

Each is a plain function of tensors and printable constants (ints, dtypes, the
group name), so the rewritten graph reads like ordinary torch code. Each wraps an
``autograd.Function`` whose forward and backward use functional collectives only;
AOTAutograd traces both into the joint graph, where the partitioner splits them
into the forward graph (all-gathers) and the backward graph (reductions).

Gradients are averaged over ranks, as DDP does: summed by the collective, then
divided by the world size, in ``reduce_dtype``. Stages 0 and 1 insert no collective:
their full gradients accumulate locally and ``ZeroOptimizer`` reduces them once per
optimizer step.
"""

from __future__ import annotations

import torch

from zerocompile.runtime.comm import all_gather_flat, chunk_size, pad_flat, reduce_scatter_flat


def _reduce_scatter_grad(grad, numel, reduce_dtype, shard_dtype, world, group_name):
    chunk = chunk_size(numel, world)     # the shard's size, that of the gradient returned
    flat = pad_flat(grad.to(reduce_dtype), chunk * world)
    shard_grad = reduce_scatter_flat(flat, world, group_name)
    if world > 1:
        shard_grad = shard_grad / world
    return shard_grad.to(shard_dtype)


class _GatherShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, numel, shape, compute_dtype, reduce_dtype, world, group_name):
        ctx.args = (numel, reduce_dtype, shard.dtype, world, group_name)
        full = all_gather_flat(shard.to(compute_dtype), world, group_name)
        return full[:numel].view(shape)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_grad(grad, *ctx.args),) + (None,) * 6


class _ReplicaWithShardGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, replica, numel, reduce_dtype, world, group_name):
        ctx.args = (numel, reduce_dtype, shard.dtype, world, group_name)
        return replica.view_as(replica)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_grad(grad, *ctx.args),) + (None,) * 5


def gather_param(shard, numel, shape, compute_dtype, reduce_dtype, world, group_name):
    """Stage 3: cast the flat shard to ``compute_dtype``, all-gather it, view it as the parameter.

    Backward: gradient cast to ``reduce_dtype``, padded, reduce-scattered, averaged,
    cast to the shard's dtype (it lands in ``shard.grad``).
    """
    return _GatherShard.apply(shard, numel, tuple(shape), compute_dtype, reduce_dtype, world, group_name)


def replica_with_sharded_grad(shard, replica, numel, reduce_dtype, world, group_name):
    """Stage 2: compute with the replicated parameter; reduce-scatter its gradient into the shard."""
    return _ReplicaWithShardGrad.apply(shard, replica, numel, reduce_dtype, world, group_name)


def cast_param(param, compute_dtype):
    """Stage 0: compute in ``compute_dtype``; the gradient flows back to the parameter's dtype."""
    return param.to(compute_dtype)
