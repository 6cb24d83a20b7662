"""Every rank reduces the same gradients, whatever each rank's data reached.

``ZeroOptimizer.step()`` reduces the gradients autograd left outside the compiled graphs:
whole gradients of parameters at stage 0 (and of parameters no compiled frame uses),
all-reduced; stage 1's replica gradients, reduce-scattered; and the gradients eager code
left on gathered parameters (stages 1-3, leaf modules), reduce-scattered. Which of those
exist depends on the rank's data when part of a model runs only for some inputs: a
mixture-of-experts expert no token of this rank was routed to gets no gradient here. A
reduction over only the gradients present would give each rank other buckets, and gloo
aborts the process ("Received data size doesn't match expected size").

So before reducing, the ranks agree on which gradient holders (each trainable parameter, and
its stage-1 replica where that is a separate tensor) hold a gradient: every step one
all-reduce of 16 bytes compares a hash of this rank's set across ranks, and only where the
sets differ a second all-reduce of one int32 per holder counts the ranks holding each
(``gradient_counts``; nothing on one rank).
A holder with a gradient on some ranks gets a zero gradient on the others (what that rank
contributes: its data did not reach the parameter), so every rank reduces the same set, in
the same buckets, as ``DistributedDataParallel(find_unused_parameters=True)`` does. A holder
without a gradient on every rank stays without one (the optimizer skips it, as it would in
one process).

At stage 3 a parameter outside a leaf module whose gradient exists on some ranks only was
gathered (or left whole) by code that ran on some ranks only; that is refused with an error
on every rank that names its module and the fix, ``zerocompile.set_leaf_modules``
(``participation_error``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from zerocompile.runtime.accounting import ACCOUNTING
from zerocompile.runtime.comm import CommGroup, all_gather_flat, all_reduce_sum

_c10d = torch.ops._c10d_functional


@dataclass
class Holder:
    """A tensor autograd may leave a gradient on, for one parameter."""

    param: torch.Tensor
    tensor: torch.Tensor
    has_grad: bool


def gradient_counts(present: list[bool], group: CommGroup, device) -> list[int]:
    """How many ranks of ``group`` have each entry of ``present`` true.

    The common case, every rank the same: one all-reduce (MAX) of two int64, a hash of
    ``present`` and its negation, which gives the largest and the smallest hash at once. Only
    where they differ, a second all-reduce (SUM) of one int32 per entry counts. No
    communication on one rank; on a fake group (``zerocompile plan``) the first all-reduce
    is issued (and counted) like on a real one and reads as agreed."""
    if group.world == 1:
        return [int(p) for p in present]
    digest = hashlib.sha256(bytes(present)).digest()
    value = int.from_bytes(digest[:8], "little") >> 2       # fits an int64, and so does -value
    pair = torch.tensor([value, -value], dtype=torch.int64, device=device)
    ACCOUNTING.record("all_reduce", pair.numel() * pair.element_size())
    top, neg_bottom = _c10d.wait_tensor(_c10d.all_reduce(pair, "max", group.name)).tolist()
    if top == -neg_bottom:
        return [group.world * int(p) for p in present]
    flags = torch.tensor(present, dtype=torch.int32, device=device)
    ACCOUNTING.record("all_reduce", flags.numel() * flags.element_size())
    return all_reduce_sum(flags, group.world, group.name).tolist()


def fill_missing(holders: list[Holder], counts: list[int], world: int) -> list[Holder]:
    """Give each holder without a gradient here, but with one on another rank, a zero
    gradient; return the holders whose gradient exists on some ranks only."""
    partial = []
    for holder, count in zip(holders, counts):
        if 0 < count < world:
            partial.append(holder)
        if count > 0 and not holder.has_grad:
            t = holder.tensor
            torch.Tensor.grad.__set__(t, torch.zeros(t.shape, dtype=t.dtype, device=t.device))
    return partial


def ranks_holding(holders: list[Holder], group: CommGroup, device) -> list[list[int]]:
    """For each of ``holders`` (the same list on every rank), the ranks where it has a
    gradient (one all-gather; only on the way to an error)."""
    mine = torch.tensor([h.has_grad for h in holders], dtype=torch.int32, device=device)
    rows = all_gather_flat(mine, group.world, group.name).view(group.world, -1)
    return [[r for r in range(group.world) if rows[r, i]] for i in range(len(holders))]


def _module_path(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _routing_module(root: torch.nn.Module, path: str) -> tuple[str, torch.nn.Module]:
    """The innermost module at or above ``path`` whose class is not one of torch.nn's own
    (containers and layers): the module whose forward decides what runs."""
    parts = path.split(".") if path else []
    while True:
        name = ".".join(parts)
        module = root.get_submodule(name)
        if not type(module).__module__.startswith("torch.nn") or not parts:
            return name, module
        parts.pop()


def participation_error(names: list[str], ranks_with: list[list[int]], roots) -> RuntimeError:
    """The error for stage-3 parameters (``names``, each held by ``ranks_with``) whose gradient
    exists on some ranks only. ``roots``: modules to look the names up in (a frame's model)."""
    common = names[0]
    for name in names[1:]:
        while common and not (name == common or name.startswith(common + ".")):
            common = _module_path(common)
    path = _module_path(common) if common == names[0] and len(names) == 1 else common
    module_desc, fix = f"'{path or '(the model)'}'", "zerocompile.set_leaf_modules(model, [TheModuleClass])"
    for root in roots:
        try:
            name, module = _routing_module(root, path)
        except AttributeError:
            continue
        module_desc = f"'{name or '(the model)'}' ({type(module).__name__})"
        fix = f"zerocompile.set_leaf_modules(model, [{type(module).__name__}])"
        break
    shown = ", ".join(f"'{n}' (ranks {r})" for n, r in zip(names[:4], ranks_with[:4]))
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return RuntimeError(
        f"zerocompile: at stage 3, parameters of module {module_desc} got a gradient on some ranks only: "
        f"{shown}{more}. The module runs parts of itself depending on each rank's data (e.g. experts "
        "reached only by the tokens routed to them), so the ranks would gather and reduce different "
        f"parameters and hang or abort. Mark it a leaf module before compiling: {fix} (its parameters "
        "are then gathered together on entry, the same on every rank, like DeepSpeed's set_z3_leaf_modules)")
