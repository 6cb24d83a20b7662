"""Every rank reduces the same gradients, whatever each rank's data reached.

``ZeroOptimizer.step()`` reduces the gradients autograd left outside the compiled graphs:
whole gradients of parameters at stage 0 (and of parameters no compiled frame uses),
all-reduced; stage 1's replica gradients, reduce-scattered; and the gradients eager code
left on gathered parameters (stages 1-3, leaf modules), reduce-scattered. Which of those
exist depends on the rank's data when part of a model runs only for some inputs: a
mixture-of-experts expert no token of this rank was routed to gets no gradient here. A
reduction over only the gradients present would give each rank other buckets, and gloo
aborts the process ("Received data size doesn't match expected size").

So before reducing, the ranks compare their gradient holders (two slots per trainable
parameter: the parameter, and its stage-1 replica where that is a separate tensor), each as a
code: whether it holds a gradient, and how the parameter is held (its stage, or no shard
state). Every step one all-reduce of 16 bytes compares a hash of the codes across ranks; only
where they differ, an all-gather of the codes (4 bytes per holder and rank) says who holds
what (``compare_holders``; nothing on one rank).
A holder with a gradient on some ranks gets a zero gradient on the others (what that rank
contributes: its data did not reach the parameter), so every rank reduces the same set, in
the same buckets, as ``DistributedDataParallel(find_unused_parameters=True)`` does. A holder
without a gradient on every rank stays without one (the optimizer skips it, as it would in
one process).

At stage 3 a parameter outside a leaf module whose gradient exists on some ranks only was
gathered (or left whole) by code that ran on some ranks only; and a parameter sharded on some
ranks only (a compiled frame, such as an expert's own ``forward``, ran there only and gave
it its state) would be reduced by different collectives. Both are refused with an error on
every rank that names the module and the fix, ``zerocompile.set_leaf_modules``
(``participation_error``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from zerocompile.runtime.comm import CommGroup, all_gather_flat, all_reduce, is_fake_group

_c10d = torch.ops._c10d_functional


@dataclass
class Holder:
    """A tensor autograd may leave a gradient on, for one parameter (``tensor`` None: a slot
    this parameter does not use here, so that every rank lists the same number of holders)."""

    param: torch.Tensor
    tensor: torch.Tensor | None
    layout: int
    """How the parameter's gradient is reduced here: 0 = whole (stage 0, or no shard state: no
    compiled frame has used it on this rank), else 1 + its stage (into shards). Part of the
    comparison: the ranks must agree on it too."""

    @property
    def has_grad(self) -> bool:
        return self.tensor is not None and torch.Tensor.grad.__get__(self.tensor) is not None

    def code(self) -> int:
        return int(self.has_grad) | (self.layout << 1)


def compare_holders(holders: list[Holder], group: CommGroup, device, session) -> list[list[int]] | None:
    """Every rank's ``code()`` of each holder (a ``world x len(holders)`` list), or None when
    all ranks have the same codes.

    The common case, every rank the same: one all-reduce (MAX) of two int64, a hash of the
    codes and its negation, which gives the largest and the smallest hash at once. Only where
    they differ, an all-gather of one int32 per holder and rank. No communication on one rank;
    on a fake group (``zerocompile plan``) and for a model on the meta device the all-reduce
    is issued (and counted) like on a real one and reads as agreed. ``session``: the model's
    ``ModelSession``, which counts and times them."""
    if group.world == 1:
        return None
    codes = [h.code() for h in holders]
    digest = hashlib.sha256(repr(codes).encode()).digest()
    value = int.from_bytes(digest[:8], "little") >> 2       # fits an int64, and so does -value
    pair = torch.tensor([value, -value], dtype=torch.int64, device=device)
    with session.comms.timed(pair.device, "gradient participation check"):
        session.record("all_reduce", pair.numel() * pair.element_size())
        reduced = all_reduce(pair, "max", group.name)
    if is_fake_group(group) or reduced.is_meta:
        return None         # one process stands for every rank, and a meta tensor holds no value
    top, neg_bottom = reduced.tolist()
    if top == -neg_bottom:
        return None
    # the hashes differ: so may the number of holders, if the ranks' models differ
    count = torch.tensor([len(codes)], dtype=torch.int64, device=device)
    counts = all_gather_flat(count, group.world, group.name).tolist()
    session.record("all_gather", 8 * group.world)
    if len(set(counts)) > 1:
        raise RuntimeError(
            f"zerocompile: ZeroOptimizer holds {counts} gradient holders on ranks 0..{group.world - 1}: the "
            "ranks' optimizers were built over different parameters. Build it over the same model on every rank")
    mine = torch.tensor(codes, dtype=torch.int32, device=device)
    session.record("all_gather", mine.numel() * mine.element_size() * group.world)
    return all_gather_flat(mine, group.world, group.name).view(group.world, -1).tolist()


def fill_missing(holders: list[Holder], rows: list[list[int]]) -> list[tuple[Holder, list[int]]]:
    """Give each holder without a gradient here, but with one on another rank, a zero
    gradient; return the holders whose gradient exists on some ranks only, each with the ranks
    that hold it."""
    partial = []
    for i, holder in enumerate(holders):
        ranks = [r for r, row in enumerate(rows) if row[i] & 1]
        if 0 < len(ranks) < len(rows):
            partial.append((holder, ranks))
            if not holder.has_grad:
                t = holder.tensor
                torch.Tensor.grad.__set__(t, torch.zeros(t.shape, dtype=t.dtype, device=t.device))
    return partial


def layout_differences(holders: list[Holder], rows: list[list[int]]) -> list[tuple[Holder, str]]:
    """The holders whose parameter is held differently across ranks, each with who holds it how."""
    out = []
    for i, holder in enumerate(holders):
        layouts: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            layouts.setdefault(row[i] >> 1, []).append(r)
        if len(layouts) > 1:
            out.append((holder, "; ".join(f"ranks {ranks}: " + ("not sharded" if lay == 0
                                                                  else f"sharded at stage {lay - 1}")
                                          for lay, ranks in layouts.items())))
    return out


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


def participation_error(names: list[str], details: list[str], roots, problem: str) -> RuntimeError:
    """The error for parameters ``names`` (each with its ``details``) that ranks treat differently,
    ``problem`` saying how. ``roots``: modules to look the names up in (a frame's model)."""
    # the modules holding them ran on some ranks only: the one that decided is the innermost
    # module of your own class strictly above all of them, which ran everywhere
    modules = [_module_path(name) for name in names]
    common = modules[0]
    for module in modules[1:]:
        while common and not (module == common or module.startswith(common + ".")):
            common = _module_path(common)
    path = _module_path(common)
    module_desc, fix = f"'{path or '(the model)'}'", "zerocompile.set_leaf_modules(model, [TheModuleClass])"
    for root in roots:      # the model first
        try:
            name, module = _routing_module(root, path)
        except AttributeError:
            continue
        module_desc = f"'{name or '(the model)'}' ({type(module).__name__})"
        fix = f"zerocompile.set_leaf_modules(model, [{type(module).__name__}])"
        break
    shown = ", ".join(f"'{n}' ({d})" for n, d in zip(names[:4], details[:4]))
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return RuntimeError(
        f"zerocompile: parameters of module {module_desc} {problem}: "
        f"{shown}{more}. The module runs parts of itself depending on each rank's data (e.g. experts "
        "reached only by the tokens routed to them), so the ranks would gather and reduce different "
        f"parameters and hang or abort. Mark it a leaf module before compiling: {fix} (its parameters "
        "are then gathered together on entry, the same on every rank, like DeepSpeed's set_z3_leaf_modules)")
