"""Pass (forward, then backward graph): offload the activations the forward saves for backward.

After the min-cut partitioner, the forward graph returns its real outputs followed by the
tensors (then the SymInts) it saves for backward, and the backward graph takes them as its
first placeholders (the SymInts first, then the tensors, in the same order; AOTAutograd pairs
them by position, and a forward pass may have renamed a node). What moves is a storage: a
saved tensor's ``storage_root`` (the node whose buffer it is or views). For each storage
chosen (below), this pass

- in the **forward** graph, inserts ``zerocompile::offload_activation`` right after the node
  that makes it (role ``activation_offload``) and saves the op's token in the place of every
  saved tensor of that storage, so the storage is freed as soon as the forward's last use of
  it is done;
- in the **backward** graph, makes those placeholders tokens and inserts one
  ``zerocompile::reload_activation`` of the storage (role ``activation_reload``) ahead of the
  first use of any of them, a ``wait_tensor`` of it (role ``activation_reload_wait``) right
  before that use, and for each tensor saved as a view of the storage (q, k and v split out of
  one projection, a transposed or reshaped output) that view of the reloaded copy (role
  ``activation_reload_view``). The bytes move once however many views are saved.

**Which storages.** Those the forward computes, not graph inputs (the shards and the batch
exist anyway), not among the forward's real outputs (the caller holds those), of at least
``min_kb``, dense (contiguous up to a permutation of dimensions), with concrete sizes, on the
CPU or a CUDA device; a saved view of one must lie inside it. Without a budget every such
storage is offloaded. With one, only those the ``plan_activations`` pass chose (they carry the
tag ``offload_activation``), or what the partitioner saves in their place: an op computed
from chosen tensors only that the plan did not see saved (no ``plan_saw_saved`` tag), of the
backward it moved into the forward or of the forward (``chosen_by_plan``).

**When reloads start.** Storages are grouped by the numbered block whose backward reads them
first: the last block of the forward that read them (a block's output belongs to the next
block, whose first op read it), or the block that made them if the forward never read them (a
norm's statistics); a storage with neither is a group of its own. Groups are ordered by first
use in backward. A block group's reloads start half way through the backward of the block
group before it (at the first use of the middle one of its storages, in order of first use), so
the reads of block k run while the backward of block k+1 computes and about one and a half
blocks' worth of reloaded bytes are live at once; the first group's start at the beginning of
the backward, and the groups of single storages do not move that point. A storage first used
before its group's start (the groups' first uses interleave, as after inductor's partitioner)
starts its reload at that use instead.

The decision is recorded in ``ctx.results["offload_activations"]`` (``offloaded``: the saved
tensors' names; ``entries``: per saved tensor its ``position`` among the saved tensors, its
``root`` storage, ``group``, ``bytes`` (the storage's, on its first tensor), ``signature``,
``root_layout`` and ``view``; ``storages``; ``saved_symints``; ``offloaded_bytes``; ``kept``: the
saved tensors left in memory, with why; ``groups``: the storages per group, in reload order) and
logged at INFO on ``zerocompile.passes``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import call, concrete_int, set_tag, tag, tensor_nbytes
from zerocompile.passes.analyses.liveness import is_view, storage_root
from zerocompile.passes.recompute import numbered_block_of
from zerocompile.runtime import activation_offload

_OFFLOAD = torch.ops.zerocompile.offload_activation.default
_RELOAD = torch.ops.zerocompile.reload_activation.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_AS_STRIDED = torch.ops.aten.as_strided.default
_SLICE = torch.ops.aten.slice.Tensor
_MB = 2**20


def why_kept(val, min_bytes: float) -> str | None:
    """Why a saved storage of (fake) value ``val`` cannot move, whatever made it, or None."""
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    if val.device.type not in ("cpu", "cuda"):
        return f"on {val.device.type}"
    if any(isinstance(x, torch.SymInt) for x in (*val.shape, *val.stride(), val.storage_offset())):
        return "symbolic shape"
    if activation_offload.dense_span([concrete_int(s) for s in val.shape],
                                     [concrete_int(s) for s in val.stride()]) is None:
        return "not dense"
    if tensor_nbytes(val) < max(min_bytes, 1):
        return "smaller than min_kb"
    return None


def offloadable_roots(roots, root_bytes: dict, min_bytes: float) -> list:
    """Of the saved storages ``roots`` (their defining nodes, with their bytes), those this pass
    would move; the profile times their sizes and ``plan_activations`` chooses among them."""
    return [r for r in roots if r.op != "placeholder" and root_bytes.get(r, 0) > 0
            and why_kept(r.meta.get("val"), min_bytes) is None]


def view_layout(val, base) -> tuple | None:
    """``(size, stride, offset)`` that ``as_strided`` of a dense copy of ``base`` takes to give
    the view ``val``, or None when ``val`` does not lie in ``base``'s span (or is ``base``'s own
    layout, or has symbolic sizes)."""
    parts = (*val.shape, *val.stride(), val.storage_offset(), base.storage_offset())
    if any(isinstance(x, torch.SymInt) for x in parts):
        return None
    size, stride = [int(x) for x in val.shape], [int(x) for x in val.stride()]
    offset = int(val.storage_offset()) - int(base.storage_offset())
    span = activation_offload.dense_span([int(x) for x in base.shape], [int(x) for x in base.stride()])
    last = offset + sum((n - 1) * st for n, st in zip(size, stride) if n > 0)
    if span is None or offset < 0 or (min(size, default=1) > 0 and last >= span):
        return None
    return size, stride, offset


def eligible(node: torch.fx.Node, outputs: set, min_bytes: float, planned: bool) -> str | None:
    """Why the saved ``node`` stays in memory, or None when its storage (``storage_root``) may
    be offloaded."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    root = storage_root(node)
    if root.op == "placeholder":
        return "a graph input or a view of one"
    if node in outputs or root in outputs:
        return "a forward output"
    base = root.meta.get("val")
    why = why_kept(base, min_bytes)
    if why is not None:
        return why
    if root is not node and view_layout(val, base) is None:
        return "a view its base's copy cannot give"
    if planned and not chosen_by_plan(node):
        return "kept by the plan"
    return None


def chosen_by_plan(node: torch.fx.Node, memo: dict | None = None) -> bool:
    """Whether the plan offloads ``node``: it or its storage carries the tag; or the plan did not
    see it saved (no ``plan_saw_saved`` tag: the plan kept what it saw and did not choose) and it
    is an op computed from chosen tensors only (through ops of the same kind). The partitioner
    may save an op's result instead of the tensors it reads: an op of the backward it moved into
    the forward (``exp`` of a log-softmax), or a forward op of a decomposed norm (inductor's
    LayerNorm saves ``(x - mean) * rstd`` where the plan chose ``x``, ``mean`` and ``rstd``); that
    result is what the plan's storages became. (Forward ops were left out before: in about 1
    compile in 3 of an inductor GPT, when the offload plan won over recompute, 160 KB stayed in
    memory with the plan's estimate at 0 bytes.)"""
    memo = {} if memo is None else memo
    if node in memo:
        return memo[node]
    memo[node] = False                                  # a cycle cannot occur; guards the recursion
    root = storage_root(node)
    if tag(node).get("offload_activation") or tag(root).get("offload_activation"):
        memo[node] = True
    elif tag(node).get("plan_saw_saved") or tag(root).get("plan_saw_saved"):
        memo[node] = False
    elif node.op == "call_function":
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        memo[node] = bool(inputs) and all(chosen_by_plan(a, memo) for a in inputs)
    return memo[node]


def offload_saved(graph: torch.fx.Graph, num_fwd_outputs: int, device: str, nvme_path: str, min_bytes: float,
                  planned: bool) -> tuple[list, list, int]:
    """Forward graph: tokens saved in place of the chosen saved tensors; a storage saved several
    times (as itself and as views of it) is copied out once and saves one token at each place.
    Returns (offloaded: one dict per saved tensor, with ``position``, ``name``, ``root``,
    ``bytes`` (its storage's, on the first tensor of a storage only), ``signature``, and
    ``root_layout`` and ``view`` for the backward), kept ``(name, bytes, why)``, the number of
    saved SymInts. ``position`` is the tensor's index among the saved tensors, which is how
    AOTAutograd pairs them with the backward's placeholders (a forward pass may have renamed
    the node)."""
    output = next(iter(graph.find_nodes(op="output")))
    outs = list(output.args[0])
    real = {a for a in outs[:num_fwd_outputs] if isinstance(a, torch.fx.Node)}
    offloaded, kept = [], []
    tokens: dict = {}
    readers = _readers(graph)
    position = symints = 0
    for i in range(num_fwd_outputs, len(outs)):
        node = outs[i]
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            symints += 1
            continue
        j, position = position, position + 1
        why = eligible(node, real, min_bytes, planned)
        if why is not None:
            kept.append((node.name, tensor_nbytes(node.meta["val"]), why))
            continue
        root = storage_root(node)
        base = root.meta["val"]
        first = root not in tokens
        if first:
            with graph.inserting_after(root):
                tokens[root] = call(graph, _OFFLOAD, (root, device, nvme_path), role="activation_offload",
                                    saved=root.name)
        outs[i] = tokens[root]
        offloaded.append({"position": j, "name": node.name, "root": root.name, "group": _group(root, readers),
                          "bytes": tensor_nbytes(base) if first else 0, "signature": _signature(node.meta["val"]),
                          "root_layout": ([int(x) for x in base.shape], [int(x) for x in base.stride()]),
                          "view": None if root is node else view_layout(node.meta["val"], base)})
    output.args = (tuple(outs),) + tuple(output.args[1:])
    return offloaded, kept, symints


def _readers(graph: torch.fx.Graph) -> dict:
    """``{storage root: the forward nodes that read it}`` (through any view of it)."""
    readers: dict = {}
    for node in graph.nodes:
        if node.op != "call_function" or is_view(node) or node.target is operator.getitem:
            continue
        for a in node.all_input_nodes:
            readers.setdefault(storage_root(a), []).append(node)
    return readers


def _group(root: torch.fx.Node, readers: dict) -> str:
    """The reload group of a saved storage: the numbered block whose backward reads it first,
    i.e. the last block of the forward that read it (a block's output is read by the next
    block, or by the head: its backward needs it, not its maker's); the block that made it if
    the forward never reads it (a norm's saved statistics); its own group otherwise."""
    blocks = [numbered_block_of(n) for n in readers.get(root, [])]
    if blocks:
        inside = [b for b in blocks if b is not None]
        return inside[-1] if inside else f"#{root.name}"
    return numbered_block_of(root) or f"#{root.name}"


def _signature(val) -> str:
    return f"{val.dtype} {tuple(val.shape)} {tuple(val.stride())}"


def saved_placeholders(graph: torch.fx.Graph, positions: list, symints: int, signatures: list) -> list:
    """The backward's placeholders of the saved tensors at ``positions`` (AOTAutograd's order:
    the saved SymInts, then the saved tensors, then the tangents). Each must hold a tensor of the
    dtype, shape and strides the forward saved there (``signatures``), or this raises: a
    placeholder taken for another would be read as the wrong tensor."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    chosen = []
    for j, signature in zip(positions, signatures):
        node = placeholders[symints + j] if symints + j < len(placeholders) else None
        val = node.meta.get("val") if node is not None else None
        if not isinstance(val, torch.Tensor) or _signature(val) != signature:
            raise RuntimeError(f"offload_activations: the backward's input for saved tensor {j} is "
                               f"{_signature(val) if isinstance(val, torch.Tensor) else val!r}, not the {signature} "
                               "the forward saved; the saved tensors are not in the order this pass expects (a "
                               "torch change?). Set offload_activations=None and report it")
        chosen.append(node)
    return chosen


def reload_saved(graph: torch.fx.Graph, chosen: list, entries: list, device: str, nvme_path: str) -> list:
    """Backward graph: the placeholders of ``chosen`` (with their forward ``entries``, from
    ``offload_saved``) become tokens; each storage is reloaded once, one block ahead of the first
    use of any of its tensors, and each tensor saved as a view of it is that view of the reloaded
    copy (see the module docstring). Returns the groups of storages, in reload order."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    storages: dict = {}                    # root name -> [(placeholder, entry)] of the used ones
    for node, entry in zip(chosen, entries):
        if node.users:
            storages.setdefault(entry["root"], []).append((node, entry))
    first = {node: min(node.users, key=index.__getitem__) for members in storages.values() for node, _ in members}

    def first_use(root: str) -> torch.fx.Node:
        return min((first[n] for n, _ in storages[root]), key=index.__getitem__)

    groups: dict = {}
    for root, members in storages.items():
        groups.setdefault(members[0][1].get("group") or f"#{root}", []).append(root)
    order = sorted(groups, key=lambda k: min(index[first_use(r)] for r in groups[k]))
    first_compute = next(n for n in nodes if n.op != "placeholder")
    start_before = first_compute
    for key in order:
        # a group's reloads start half way through the backward of the block group before it
        # (the groups of single tensors outside the blocks do not move that point)
        next_start = start_before
        if not key.startswith("#"):
            # half way through this block's backward: its first reads, in order, the middle one
            firsts = sorted((first_use(r) for r in groups[key]), key=index.__getitem__)
            next_start = firsts[len(firsts) // 2]
        for root in sorted(groups[key], key=lambda r: index[first_use(r)]):
            members = storages[root]
            users = {node: list(node.users) for node, _ in members}      # before the reload reads the token
            token, entry = members[0]
            val = token.meta["val"]
            size, stride = entry["root_layout"]
            # no later than the first use: groups can interleave (inductor's partitioner moves
            # ops), and a block's middle read can come after the next group's first use
            at = min(start_before, first_use(root), key=index.__getitem__)
            with graph.inserting_before(at):
                reload = call(graph, _RELOAD, (token, device, nvme_path, size, stride, val.dtype, val.device),
                              role="activation_reload", saved=root)
            with graph.inserting_before(first_use(root)):
                waited = call(graph, _WAIT, (reload,), role="activation_reload_wait", saved=root)
            for node, entry in members:
                replacement = waited
                if entry["view"] is not None:
                    with graph.inserting_before(first[node]):
                        replacement = _view_of(graph, waited, entry["view"], size, stride, node.name)
                for user in users[node]:
                    user.replace_input_with(node, replacement)
            for node, _ in members:
                _make_token(node)
        start_before = next_start
    for node in chosen:
        if not node.users:
            _make_token(node)
    return [[r for r in groups[k]] for k in order]


def _view_of(graph: torch.fx.Graph, copy: torch.fx.Node, view: tuple, size: list, stride: list,
             name: str) -> torch.fx.Node:
    """The view ``(size, stride, offset)`` of the reloaded ``copy`` of a storage (laid out as
    ``size``/``stride``), with its offset relative to ``copy``'s: the reload's buffer starts on a
    page boundary inside a larger allocation, so its own storage offset is not 0, and an
    ``as_strided`` with an offset would take it as absolute (eager) or relative (inductor).
    Without an offset both keep the input's; a ``slice`` adds the view's."""
    view_size, view_stride, offset = view
    base = copy
    if offset:
        span = activation_offload.dense_span(size, stride)
        flat = call(graph, _AS_STRIDED, (copy, [span], [1]), role="activation_reload_view", saved=name)
        base = call(graph, _SLICE, (flat, 0, offset, span), role="activation_reload_view", saved=name)
    return call(graph, _AS_STRIDED, (base, view_size, view_stride), role="activation_reload_view", saved=name)


def _make_token(node: torch.fx.Node) -> None:
    """``node`` (a backward placeholder) holds a token now, not the saved tensor."""
    val = node.meta["val"]
    if tag(node).get("role") == "activation_token":
        return
    fake_mode = getattr(val, "fake_mode", None)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = torch.empty(1, dtype=torch.int64)
    else:
        node.meta["val"] = torch.empty(1, dtype=torch.int64, device="meta")
    set_tag(node, role="activation_token", saved=node.name)


def offload_activations(gm: torch.fx.GraphModule, ctx: PassContext, *, settings, **_) -> torch.fx.GraphModule:
    """Forward graph: offload the chosen saved tensors; backward graph: reload them (see the
    module docstring). ``settings``: the ``ActivationOffloadSettings``."""
    device, path = settings.device, settings.nvme_path or ""
    if device == "cpu" and (ctx.device is None or torch.device(ctx.device).type != "cuda"):
        if ctx.graph_kind == "forward":
            ctx.logger.info("[%s] offload_activations: device 'cpu' and the model is on the CPU already; "
                            "nothing to offload", ctx.frame)
            ctx.results["offload_activations"] = {"device": device, "offloaded": [], "offloaded_bytes": 0,
                                                  "kept": [], "groups": [], "note": "the model is on the CPU"}
        return gm
    if ctx.graph_kind == "forward":
        planned = settings.budget_mb is not None
        offloaded, kept, symints = offload_saved(gm.graph, ctx.num_fwd_outputs, device, path,
                                                 settings.min_kb * 1024, planned)
        moved = sum(e["bytes"] for e in offloaded)
        ctx.results["offload_activations"] = {
            "device": device, "offloaded": [e["name"] for e in offloaded], "entries": offloaded,
            "storages": len({e["root"] for e in offloaded}), "saved_symints": symints, "offloaded_bytes": moved,
            "kept": [{"name": n, "bytes": b, "why": w} for n, b, w in kept], "groups": []}
        ctx.logger.info("[%s] offload_activations: %d saved tensors (%d storages) offloaded to %s (%.2f MiB); %d kept "
                        "(%.2f MiB)", ctx.frame, len(offloaded), len({e["root"] for e in offloaded}), device,
                        moved / _MB, len(kept), sum(b for _, b, _ in kept) / _MB)
    elif ctx.graph_kind == "backward":
        result = ctx.results.get("offload_activations") or {}
        entries = result.get("entries")
        if entries:
            chosen = saved_placeholders(gm.graph, [e["position"] for e in entries], result["saved_symints"],
                                        [e["signature"] for e in entries])
            result["groups"] = reload_saved(gm.graph, chosen, entries, device, path)
    gm.graph.lint()
    gm.recompile()
    return gm
