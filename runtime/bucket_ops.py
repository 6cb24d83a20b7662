"""The copies into and out of a bucket of the bucketing pass, as opaque graph ops.

A bucketed all-gather returns ``world`` rows, one per rank, each the concatenation of that
rank's chunk of every parameter in the bucket. Parameter ``i`` is column block ``i`` of the
rows, which has to be copied out to be contiguous.

Written as slices and clones, the copies are fused by inductor into the kernels that read
the parameters, with the block's offset in the bucket as a constant of the kernel's code.
Every transformer block then gets kernels of its own instead of sharing one (inductor reuses
a kernel only when its code is identical): on the 4-block demo GPT twice the kernels to
compile, and the first step took twice plain ``torch.compile``'s. As one custom op the copies
run as an extern kernel (one ``split_with_sizes_copy``: one loop on CPU, one kernel on CUDA),
and the kernels that read a parameter read it from a buffer of its own, the same for every
block.

The average of a reduced gradient over ranks (the reduce-scatter's sum divided by the world
size) is an op of its own too. Written as ``aten.div``, inductor makes one kernel of it per
bucket, with the bucket's length in the kernel's code, so no two share one: four buckets of the
4M GPT's backward cost four C++ compiles (about a second each, cold) for one vectorised loop.
``torch.div`` computes the same IEEE quotients, element by element, at run time.

The copies into a bucket (the shards before an all-gather, the padded gradients before a
reduce-scatter) are ops of their own for the same reason and one more: as a ``cat`` they
become one generated kernel with a loop per parameter (hundreds of lines of C++ for a
bucket of 50 parameters), slow to compile and never shared. ``torch.cat`` does the same
copies at run time.
"""

from __future__ import annotations

import torch

__all__ = ["divide_reduced", "pack_gradients", "pack_shards", "unpack_gathered_bucket"]


@torch.library.custom_op("zerocompile::unpack_gathered_bucket", mutates_args=())
def unpack_gathered_bucket(gathered: torch.Tensor, world: int, chunks: list[int]) -> list[torch.Tensor]:
    """The flat ``world * chunks[i]`` parameters in the all-gathered ``gathered`` (``world``
    rows of ``sum(chunks)`` elements), each a new contiguous tensor in rank order."""
    rows = gathered.view(world, -1)
    outs = [torch.empty(world * chunk, dtype=gathered.dtype, device=gathered.device) for chunk in chunks]
    torch.split_with_sizes_copy(rows, chunks, dim=1, out=[o.view(world, c) for o, c in zip(outs, chunks)])
    return outs


@unpack_gathered_bucket.register_fake
def _unpack_gathered_bucket_fake(gathered, world, chunks):
    return [gathered.new_empty(world * chunk) for chunk in chunks]


@torch.library.custom_op("zerocompile::pack_shards", mutates_args=())
def pack_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    """The flat shards of a bucket's parameters, concatenated: what the bucket's all-gather sends."""
    return torch.cat(shards)


@pack_shards.register_fake
def _pack_shards_fake(shards):
    return shards[0].new_empty(sum(s.numel() for s in shards))


@torch.library.custom_op("zerocompile::pack_gradients", mutates_args=())
def pack_gradients(grads: list[torch.Tensor], world: int) -> torch.Tensor:
    """The padded flat gradients of a bucket's parameters (each ``world * chunk`` elements),
    as the bucket's reduce-scatter takes them: ``world`` rows, row ``r`` the concatenation of
    chunk ``r`` of every gradient, flattened."""
    total = sum(g.numel() for g in grads) // world
    out = torch.empty(world * total, dtype=grads[0].dtype, device=grads[0].device)
    torch.cat([g.view(world, -1) for g in grads], dim=1, out=out.view(world, total))
    return out


@pack_gradients.register_fake
def _pack_gradients_fake(grads, world):
    return grads[0].new_empty(sum(g.numel() for g in grads))


@torch.library.custom_op("zerocompile::divide_reduced", mutates_args=())
def divide_reduced(reduced: torch.Tensor, divisor: float) -> torch.Tensor:
    """``reduced / divisor``, a new tensor: the average over ranks of a reduced gradient, the
    quotients bitwise those of ``aten.div`` (generated or not)."""
    return torch.div(reduced, divisor)


@divide_reduced.register_fake
def _divide_reduced_fake(reduced, divisor):
    return torch.empty_like(reduced)
