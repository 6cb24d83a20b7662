"""Process-group resolution and the collectives the runtime uses.

Every collective goes through the functional collectives of ``torch.distributed``
(``torch.ops._c10d_functional``), both inside compiled graphs and in the eager
optimizer step, so graphs and runtime share one code path and one accounting.
With no process group (plain single-process run) the world size is 1 and every
collective is the identity.

All-gathers on gloo run as ``all_gather_into_tensor_out`` (into a buffer we allocate), never
as ``all_gather_into_tensor``. In torch 2.13 the latter becomes an ``ALLGATHER_COALESCED``
work on gloo, and ``ProcessGroupGloo::runLoop`` writes each finished work's op-type name into
one shared ``std::string`` (``pgStatus_->lastCompletedWorkName``) from its two worker threads
without a lock. A name longer than 15 characters lives on the heap, so two works finishing at
about the same time (gathers and reduce-scatters in flight together, prefetching, or a gather
started right after another one's wait) free the same buffer twice: heap corruption, seen as
SIGSEGV or ``malloc(): unaligned tcache chunk detected`` anywhere later. The ``_out`` variant
goes through ``ProcessGroupGloo::_allgather_base`` (an ``ALLGATHER`` work, a name short
enough to stay inside the string), gives the same values and is waited for the same way.
Graph passes keep writing ``all_gather_into_tensor``; ``lower_collectives_for_backend``
rewrites the final graphs right before an inner compiler gets them.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import operator

import torch
import torch.distributed as dist
import torch.fx

from zerocompile import _torch_compat
from zerocompile.errors import ZeroConfigError
from zerocompile.runtime import watched_collectives  # noqa: F401  (registers the zerocompile::watched_* ops)
from zerocompile.runtime.session import PROCESS

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


@functools.cache
def _subgroups(process_group, k: int, strided: bool):
    # process groups are made collectively, in the same order on every rank: once per group,
    # size and layout, when the first frame that needs it compiles (every rank compiles its
    # frames in the same order), and kept for the process group's life
    if not strided:
        return dist.new_subgroups(group_size=k, group=process_group)[0]
    world = dist.get_world_size(process_group)
    return dist.new_subgroups_by_enumeration([list(range(i, world, k)) for i in range(k)])[0]


def _hpz_group(group: CommGroup, k: int, strided: bool) -> CommGroup:
    if group.group is not dist.group.WORLD:
        raise ZeroConfigError("option 'zero_hpz_partition_size' needs the default (world) process group: its "
                              "groups of k ranks are made with torch.distributed.new_subgroups, which every rank "
                              "of the world calls; leave process_group unset")
    sub = _subgroups(group.group, k, strided)
    try:
        world = dist.get_world_size(sub)
    except (RuntimeError, ValueError):       # destroyed with its process group: make it again
        _subgroups.cache_clear()
        sub = _subgroups(group.group, k, strided)
        world = dist.get_world_size(sub)
    return CommGroup(rank=dist.get_rank(sub), world=world, name=sub.group_name, group=sub)


def hpz_subgroup(group: CommGroup, k: int) -> CommGroup:
    """The group of ``k`` consecutive ranks of ``group`` this rank belongs to (ranks
    ``g*k .. g*k+k-1``): ZeRO++ hpZ's secondary partition group, one node when ``k`` is the
    number of devices per node. Made on first use on every rank, and again after the process
    group it splits was destroyed and made anew."""
    if k == 1 or k == group.world:
        return group
    return _hpz_group(group, k, strided=False)


def hpz_cross_subgroup(group: CommGroup, k: int) -> CommGroup:
    """The ``N/k`` ranks of ``group`` at this rank's position in their groups of ``k``
    (ranks ``i, i+k, i+2k, ..``): one rank per node, the second hop of qgZ's hierarchical
    reduction. Its rank ``h`` is the rank of group ``h``. Made like ``hpz_subgroup``."""
    if k == 1 or k == group.world:
        raise ValueError(f"hpz_cross_subgroup: k={k} makes no second hop in a world of {group.world}")
    return _hpz_group(group, k, strided=True)


def is_fake_group(group: CommGroup) -> bool:
    """Whether ``group`` is torch's fake process group (``zerocompile dump --world-size N``):
    its collectives return without communicating, so their results and timings mean nothing."""
    return group.group is not None and dist.get_backend(group.group) == "fake"


def chunk_size(numel: int, world: int) -> int:
    """Elements per rank of a flat tensor of ``numel`` elements padded to a multiple of
    ``world``: ``ceil(numel / world)``, and 1 for an empty tensor (every rank's shard holds at
    least one element, padding). The one formula of the shard layout: the shards, the
    gradients the backward reduce-scatters into them and the state dicts all use it."""
    return max(1, -(-numel // world))


def agreement_digest(value) -> int:
    """A nonzero 56-bit number for ``repr(value)``, for ``every_rank_holds``."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "little") | 1


def every_rank_holds(value: int, world: int, group_name: str, device=None) -> bool:
    """Whether every rank of the group passed the same nonzero ``value`` (0: this rank holds
    nothing); an all-gather of one number per rank, so every rank calls it at the same point."""
    values = all_gather_flat(torch.tensor([value], dtype=torch.int64, device=device), world, group_name).tolist()
    return values[0] != 0 and all(v == values[0] for v in values)


def watched(kind: str, x: torch.Tensor, group_name: str, *, world: int = 1, label: str | None = None,
            **kwargs) -> torch.Tensor | None:
    """Start an eager collective through the collective watchdog (``runtime/collective_watch.py``:
    its ``wait_tensor`` waits, watched); None where the watchdog is off, ``x`` is being traced
    into a graph (which ``passes/lowerings/watch_collectives.py`` handles) or the group is torch's fake
    one: the caller then issues the functional collective. ``label``: the call site in its
    report (default: the innermost ``CollectiveWatch.scope``); ``kwargs``: as
    ``CollectiveWatch.start``'s."""
    watch = PROCESS.watch
    if not watch.on or _torch_compat.is_graph_value(x) or \
            _torch_compat.collective_backend(group_name, x.device) in (None, "fake"):
        return None
    nbytes = x.numel() * x.element_size() * (world if kind == "all_gather" else 1)
    site = watch.eager_site(kind, nbytes, label)
    ops, out = torch.ops.zerocompile, kwargs.get("out")
    if kind == "all_gather" and out is not None:
        ops.watched_all_gather_into(x, world, group_name, site, out)
        return out
    if kind == "all_gather":
        return ops.watched_all_gather(x, world, group_name, site)
    if kind == "reduce_scatter":
        return ops.watched_reduce_scatter(x, kwargs["reduce_op"], world, group_name, site)
    if kind == "all_reduce" and out is x:
        ops.watched_all_reduce_(x, kwargs["reduce_op"], group_name, site)
        return x
    if kind == "all_reduce":
        return ops.watched_all_reduce(x, kwargs["reduce_op"], group_name, site)
    return ops.watched_all_to_all(x, kwargs["out_splits"], kwargs["in_splits"], group_name, site)


def all_gather_flat(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Concatenate the equal-size 1-D ``x`` of every rank (rank order)."""
    if world == 1:
        return x
    return _c10d.wait_tensor(start_all_gather_flat(x, world, group_name))


def start_all_gather_flat(x: torch.Tensor, world: int, group_name: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Start the all-gather of ``all_gather_flat`` (``world`` > 1) and return its result
    without waiting for it: ``torch.ops._c10d_functional.wait_tensor`` it before reading. With
    ``out`` (eager only: ``world * len(x)`` elements), the result is written there, so a caller
    can reuse one buffer for many gathers; ``x`` must stay unchanged until the wait."""
    x = x.contiguous()
    started = watched("all_gather", x, group_name, world=world, out=out)
    if started is not None:
        return started
    if out is not None:
        return _c10d.all_gather_into_tensor_out(x, world, group_name, out=out)
    if not _torch_compat.is_traced_tensor(x) and gathers_need_out_variant(group_name, x.device):
        return _c10d.all_gather_into_tensor_out(x, world, group_name, out=x.new_empty((world * x.shape[0],)))
    # traced into a graph: passes see the functional op; lowered before it runs
    return _c10d.all_gather_into_tensor(x, world, group_name)


def gathers_need_out_variant(group_name: str, device) -> bool:
    """Whether all-gathers of ``device`` tensors on this group must run as
    ``all_gather_into_tensor_out`` (gloo; see the module docstring)."""
    return _torch_compat.collective_backend(group_name, device) == "gloo"


def lower_collectives_for_backend(graph: torch.fx.Graph) -> int:
    """Rewrite each ``all_gather_into_tensor`` of ``graph`` whose group runs it on gloo into
    ``all_gather_into_tensor_out`` into a buffer allocated right before it (same values, same
    ``wait_tensor``, the node's metadata kept). Returns how many were rewritten."""
    done = 0
    for node in list(graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)):
        inp, world, group_name = node.args
        val = node.meta.get("val")
        device = val.device if val is not None else inp.meta["val"].device
        if not gathers_need_out_variant(group_name, device):
            continue
        with graph.inserting_before(node):
            shape = _output_shape(graph, inp, world)
            buf = graph.call_function(torch.ops.aten.empty.memory_format, (shape,),
                                      {"dtype": inp.meta["val"].dtype, "device": device})
            out = graph.call_function(_c10d.all_gather_into_tensor_out.default, (inp, world, group_name),
                                      {"out": buf})
        if val is not None:
            buf.meta["val"] = val
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        done += 1
    return done


def _output_shape(graph: torch.fx.Graph, inp: torch.fx.Node, world: int) -> list:
    """``[world * inp.shape[0], *inp.shape[1:]]`` with graph nodes for symbolic sizes."""
    shape = []
    for dim, size in enumerate(inp.meta["val"].shape):
        if not isinstance(size, int):
            size = graph.call_function(torch.ops.aten.sym_size.int, (inp, dim))
        if dim == 0:
            size = size * world if isinstance(size, int) else graph.call_function(operator.mul, (size, world))
        shape.append(size)
    return shape


def check_collectives_runnable(graph: torch.fx.Graph) -> None:
    """Raise if ``graph`` still holds an all-gather that is unsafe on its backend (a graph
    that did not go through ``lower_collectives_for_backend``)."""
    for node in graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default):
        val = node.meta.get("val")
        device = val.device if val is not None else node.args[0].meta["val"].device
        if gathers_need_out_variant(node.args[2], device):
            raise RuntimeError(
                f"zerocompile: node '{node.name}' runs all_gather_into_tensor on a gloo group, which "
                "corrupts the heap when collectives finish concurrently (torch 2.13, see "
                "runtime/comm.py); lower the graph with lower_collectives_for_backend first")


def reduce_scatter_flat(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Sum the 1-D ``x`` (length a multiple of ``world``) over ranks; keep this rank's chunk."""
    if world == 1:
        return x
    return _c10d.wait_tensor(start_reduce_scatter(x, "sum", world, group_name))


def start_reduce_scatter(x: torch.Tensor, reduce_op: str, world: int, group_name: str) -> torch.Tensor:
    """Start ``reduce_scatter_tensor(x, reduce_op, world, group_name)`` (watched where the
    watchdog is on); ``wait_tensor`` its result before reading it."""
    x = x.contiguous()
    started = watched("reduce_scatter", x, group_name, world=world, reduce_op=reduce_op)
    return started if started is not None else _c10d.reduce_scatter_tensor(x, reduce_op, world, group_name)


def all_reduce(x: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """``x`` reduced over the ranks of the group (out of place; ``reduce_op``: ``"sum"``,
    ``"max"``...), waited for."""
    x = x.contiguous()
    started = watched("all_reduce", x, group_name, reduce_op=reduce_op)
    return _c10d.wait_tensor(started if started is not None else _c10d.all_reduce(x, reduce_op, group_name))


def start_all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group_name: str) -> torch.Tensor:
    """Start ``all_to_all_single(x, out_splits, in_splits, group_name)`` (watched where the
    watchdog is on); ``wait_tensor`` its result before reading it."""
    x = x.contiguous()
    started = watched("all_to_all", x, group_name, out_splits=list(out_splits), in_splits=list(in_splits))
    return started if started is not None else _c10d.all_to_all_single(x, list(out_splits), list(in_splits),
                                                                       group_name)


def all_reduce_sum(x: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Sum ``x`` over ranks (out of place)."""
    if world == 1:
        return x
    return all_reduce(x, "sum", group_name)


def pad_flat(x: torch.Tensor, padded_numel: int) -> torch.Tensor:
    """Flatten ``x`` and zero-pad it to ``padded_numel`` elements."""
    flat = x.reshape(-1)
    extra = padded_numel - flat.numel()
    if extra == 0:
        return flat
    return torch.cat([flat, flat.new_zeros(extra)])
