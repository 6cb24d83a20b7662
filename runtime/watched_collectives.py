"""zerocompile's collectives as the collective watchdog runs them (``runtime/collective_watch.py``):
``torch.library`` ops that start the collective through ``torch.distributed`` and register its
``Work`` for the result, so that ``wait_tensor`` waits through the watchdog. In compiled graphs
``passes/lowerings/watch_collectives.py`` puts them in place of the functional collectives, with each one's
site (each has a fake kernel of the functional collective's shape; inductor calls it as an extern
kernel); eager code calls them through ``runtime/comm.py: watched``, so that a dispatch mode (a
test's census) sees every collective as one op, in graphs and out. The ``_into`` and ``_``
variants write into a buffer the caller gives (an eager bucket reused, an in-place all-reduce,
also in graphs: a stage-2 gradient bucket's).
"""

from __future__ import annotations

import torch

from zerocompile.runtime.session import PROCESS


@torch.library.custom_op("zerocompile::watched_all_gather", mutates_args=())
def watched_all_gather(x: torch.Tensor, world: int, group_name: str, site: str) -> torch.Tensor:
    """``all_gather_into_tensor(x, world, group_name)``, watched."""
    return PROCESS.watch.start("all_gather", x, group_name, site, world=world)


@watched_all_gather.register_fake
def _all_gather_fake(x, world, group_name, site):
    return x.new_empty((world * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("zerocompile::watched_reduce_scatter", mutates_args=())
def watched_reduce_scatter(x: torch.Tensor, reduce_op: str, world: int, group_name: str, site: str) -> torch.Tensor:
    """``reduce_scatter_tensor(x, reduce_op, world, group_name)``, watched."""
    return PROCESS.watch.start("reduce_scatter", x, group_name, site, world=world, reduce_op=reduce_op)


@watched_reduce_scatter.register_fake
def _reduce_scatter_fake(x, reduce_op, world, group_name, site):
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))


@torch.library.custom_op("zerocompile::watched_all_reduce", mutates_args=())
def watched_all_reduce(x: torch.Tensor, reduce_op: str, group_name: str, site: str) -> torch.Tensor:
    """``all_reduce(x, reduce_op, group_name)``, watched."""
    return PROCESS.watch.start("all_reduce", x, group_name, site, reduce_op=reduce_op)


@watched_all_reduce.register_fake
def _all_reduce_fake(x, reduce_op, group_name, site):
    return torch.empty_like(x)


@torch.library.custom_op("zerocompile::watched_all_to_all", mutates_args=())
def watched_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str,
                       site: str) -> torch.Tensor:
    """``all_to_all_single(x, out_splits, in_splits, group_name)``, watched."""
    return PROCESS.watch.start("all_to_all", x, group_name, site, out_splits=out_splits, in_splits=in_splits)


@watched_all_to_all.register_fake
def _all_to_all_fake(x, out_splits, in_splits, group_name, site):
    return x.new_empty((sum(out_splits) if out_splits else x.shape[0], *x.shape[1:]))


@torch.library.custom_op("zerocompile::watched_all_gather_into", mutates_args=("out",))
def watched_all_gather_into(x: torch.Tensor, world: int, group_name: str, site: str, out: torch.Tensor) -> None:
    """``all_gather_into_tensor_out(x, world, group_name, out=out)``, watched (eager only)."""
    PROCESS.watch.start("all_gather", x, group_name, site, world=world, out=out)


@watched_all_gather_into.register_fake
def _all_gather_into_fake(x, world, group_name, site, out):
    return None


@torch.library.custom_op("zerocompile::watched_all_reduce_", mutates_args=("x",))
def watched_all_reduce_(x: torch.Tensor, reduce_op: str, group_name: str, site: str) -> None:
    """``all_reduce_(x, reduce_op, group_name)`` in place, watched: the eager step's buckets, and in
    graphs a stage-2 gradient bucket all-reduced in its own memory (``passes/reduce_scatter_in_place.py``)."""
    PROCESS.watch.start("all_reduce", x, group_name, site, reduce_op=reduce_op, out=x)


@watched_all_reduce_.register_fake
def _all_reduce__fake(x, reduce_op, group_name, site):
    return None
