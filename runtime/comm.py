"""Process-group resolution and the collectives the runtime uses.

Every collective goes through the functional collectives of ``torch.distributed``
(``torch.ops._c10d_functional``), both inside compiled graphs and in the eager
optimizer step, so graphs and runtime share one code path and one accounting.
With no process group (plain single-process run) the world size is 1 and every
collective is the identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class CommGroup:
    """The data-parallel group a model is sharded over."""

    rank: int
    """This process's rank inside the group."""
    world: int
    """Number of ranks in the group (1 without a process group)."""
    name: str
    """The c10d group name functional collectives take (empty when world is 1)."""
    group: object = None
    """The ``ProcessGroup`` object, or None without torch.distributed."""


def resolve_group(process_group=None) -> CommGroup:
    """Return the group for ``process_group`` (None: the default world group)."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return CommGroup(rank=0, world=1, name="", group=None)
        process_group = dist.group.WORLD
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    return CommGroup(rank=rank, world=world, name=process_group.group_name, group=process_group)


def is_fake_group(group: CommGroup) -> bool:
    """Whether ``group`` is torch's fake process group (``zerocompile dump --world-size N``):
    its collectives return without communicating, so their results and timings mean nothing."""
    return group.group is not None and dist.get_backend(group.group) == "fake"


def chunk_size(numel: int, world: int) -> int:
    """Elements per rank of a flat tensor padded to a multiple of ``world``."""
    return max(1, math.ceil(numel / world))


def all_gather_flat(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Concatenate the equal-size 1-D ``x`` of every rank (rank order)."""
    if world == 1:
        return x
    out = _c10d.all_gather_into_tensor(x.contiguous(), world, group_name)
    return _c10d.wait_tensor(out)


def reduce_scatter_flat(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Sum the 1-D ``x`` (length a multiple of ``world``) over ranks; keep this rank's chunk."""
    if world == 1:
        return x
    out = _c10d.reduce_scatter_tensor(x.contiguous(), "sum", world, group_name)
    return _c10d.wait_tensor(out)


def all_reduce_sum(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Sum ``x`` over ranks (out of place)."""
    if world == 1:
        return x
    out = _c10d.all_reduce(x.contiguous(), "sum", group_name)
    return _c10d.wait_tensor(out)


def pad_flat(x: torch.Tensor, padded_numel: int) -> torch.Tensor:
    """Flatten ``x`` and zero-pad it to ``padded_numel`` elements."""
    flat = x.reshape(-1)
    extra = padded_numel - flat.numel()
    if extra == 0:
        return flat
    return torch.cat([flat, flat.new_zeros(extra)])
