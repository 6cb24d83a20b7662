"""Pass (forward, then backward graph): offload the activations the forward saves for backward.

After the min-cut partitioner, the forward graph returns its real outputs followed by the
tensors (then the SymInts) it saves for backward, and the backward graph takes them as its
first placeholders (the SymInts first, then the tensors, in the same order; AOTAutograd pairs
them by position, and a forward pass may have renamed a node). For each saved tensor chosen
(below), this pass

- in the **forward** graph, inserts ``zerocompile::offload_activation`` right after the node
  that makes it (role ``activation_offload``) and saves the op's token in its place, so the
  tensor is freed as soon as the forward's last use of it is done;
- in the **backward** graph, makes that placeholder the token and inserts
  ``zerocompile::reload_activation`` (role ``activation_reload``) ahead of the first use, and a
  ``wait_tensor`` of it (role ``activation_reload_wait``) right before the first use.

**Which saved tensors.** Tensors the forward computes, not graph inputs or views of them (the
shards and the batch exist anyway), not among the forward's real outputs (the caller holds
those), of at least ``min_kb``, dense (contiguous up to a permutation of dimensions), on the
CPU or a CUDA device. Without a budget every such tensor is offloaded. With one, only the
tensors of the blocks the ``plan_activations`` pass chose to offload (their nodes carry the
tag ``offload_activation``).

**When reloads start.** Offloaded tensors are grouped by the numbered block that made them
(``blocks.3``; a tensor in no block is a group of its own), and the groups are ordered by their
first use in backward. The reloads of a group start where the backward begins to use the group
before it, i.e. the reads of block k run while the backward of block k+1 computes; the first
group's start at the beginning of the backward. One group ahead keeps the reloaded bytes live
at once to about two blocks' worth.

The decision is recorded in ``ctx.results["offload_activations"]`` (``offloaded``: the saved
tensors' names, ``positions`` among the saved tensors and ``saved_symints``; ``offloaded_bytes``;
``kept``: the saved tensors left in memory, with why; ``groups``, in reload order) and logged at
INFO on ``zerocompile.passes``.
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import call, concrete_int, set_tag, tag, tensor_nbytes
from zerocompile.passes.recompute import numbered_block_of, storage_root
from zerocompile.runtime import activation_offload

_OFFLOAD = torch.ops.zerocompile.offload_activation.default
_RELOAD = torch.ops.zerocompile.reload_activation.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_MB = 2**20


def why_kept(val, min_bytes: float) -> str | None:
    """Why a saved tensor of (fake) value ``val`` cannot move, whatever made it, or None."""
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    if val.device.type not in ("cpu", "cuda"):
        return f"on {val.device.type}"
    if any(isinstance(x, torch.SymInt) for x in (*val.shape, *val.stride())):
        return "symbolic shape"
    if activation_offload.dense_span([concrete_int(s) for s in val.shape],
                                     [concrete_int(s) for s in val.stride()]) is None:
        return "not dense"
    if tensor_nbytes(val) < max(min_bytes, 1):
        return "smaller than min_kb"
    return None


def eligible(node: torch.fx.Node, outputs: set, min_bytes: float, planned: bool) -> str | None:
    """Why the saved ``node`` stays in memory, or None when it may be offloaded."""
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return "not a tensor"
    root = storage_root(node)
    if root.op == "placeholder":
        return "a graph input or a view of one"
    if node in outputs or root in outputs:
        return "a forward output"
    why = why_kept(node.meta["val"], min_bytes)
    if why is not None:
        return why
    if planned and not (tag(node).get("offload_activation") or tag(root).get("offload_activation")):
        return "kept by the plan"
    return None


def offload_saved(graph: torch.fx.Graph, num_fwd_outputs: int, device: str, nvme_path: str, min_bytes: float,
                  planned: bool) -> tuple[list, list, int]:
    """Forward graph: tokens saved in place of the chosen saved tensors. Returns (offloaded
    ``(position, name, bytes, signature)``, kept ``(name, bytes, why)``, the number of saved SymInts).
    ``position`` is the tensor's index among the saved tensors, which is how AOTAutograd pairs
    them with the backward's placeholders (a forward pass may have renamed the node)."""
    output = next(iter(graph.find_nodes(op="output")))
    outs = list(output.args[0])
    real = {a for a in outs[:num_fwd_outputs] if isinstance(a, torch.fx.Node)}
    offloaded, kept = [], []
    position = symints = 0
    for i in range(num_fwd_outputs, len(outs)):
        node = outs[i]
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            symints += 1
            continue
        j, position = position, position + 1
        why = eligible(node, real, min_bytes, planned)
        nbytes = tensor_nbytes(node.meta["val"])
        if why is not None:
            kept.append((node.name, nbytes, why))
            continue
        with graph.inserting_after(node):
            token = call(graph, _OFFLOAD, (node, device, nvme_path), role="activation_offload", saved=node.name)
        outs[i] = token
        offloaded.append((j, node.name, nbytes, _signature(node.meta["val"])))
    output.args = (tuple(outs),) + tuple(output.args[1:])
    return offloaded, kept, symints


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


def reload_saved(graph: torch.fx.Graph, chosen: list, device: str, nvme_path: str) -> list:
    """Backward graph: each placeholder of ``chosen`` becomes a token, reloaded one block ahead
    of its first use (see the module docstring). Returns the groups, in reload order."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    chosen = [n for n in chosen if n.users]
    first = {n: min(n.users, key=index.__getitem__) for n in chosen}     # before any rewiring
    groups: dict = {}
    for node in chosen:
        key = numbered_block_of(node) or f"#{node.name}"
        groups.setdefault(key, []).append(node)
    order = sorted(groups, key=lambda k: min(index[first[n]] for n in groups[k]))
    first_compute = next(n for n in nodes if n.op != "placeholder")
    for g, key in enumerate(order):
        start_before = first_compute if g == 0 else min((first[n] for n in groups[order[g - 1]]),
                                                        key=index.__getitem__)
        for node in sorted(groups[key], key=lambda n: index[first[n]]):
            val = node.meta["val"]
            users = list(node.users)
            with graph.inserting_before(start_before):
                reload = call(graph, _RELOAD, (node, device, nvme_path, list(val.shape), list(val.stride()),
                                               val.dtype, val.device), role="activation_reload", saved=node.name)
            with graph.inserting_before(first[node]):
                waited = call(graph, _WAIT, (reload,), role="activation_reload_wait", saved=node.name)
            for user in users:
                user.replace_input_with(node, waited)
            fake_mode = getattr(val, "fake_mode", None)
            if fake_mode is not None:
                with fake_mode:
                    node.meta["val"] = torch.empty(1, dtype=torch.int64)
            else:
                node.meta["val"] = torch.empty(1, dtype=torch.int64, device="meta")
            set_tag(node, role="activation_token", saved=node.name)
    return [[n.name for n in groups[k]] for k in order]


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
        ctx.results["offload_activations"] = {
            "device": device, "offloaded": [n for _, n, _, _ in offloaded],
            "positions": [j for j, _, _, _ in offloaded], "signatures": [g for _, _, _, g in offloaded],
            "saved_symints": symints, "offloaded_bytes": sum(b for _, _, b, _ in offloaded),
            "kept": [{"name": n, "bytes": b, "why": w} for n, b, w in kept], "groups": []}
        ctx.logger.info("[%s] offload_activations: %d saved tensors offloaded to %s (%.2f MiB); %d kept (%.2f MiB)",
                        ctx.frame, len(offloaded), device, sum(b for _, _, b, _ in offloaded) / _MB, len(kept),
                        sum(b for _, b, _ in kept) / _MB)
    elif ctx.graph_kind == "backward":
        result = ctx.results.get("offload_activations") or {}
        if result.get("positions"):
            chosen = saved_placeholders(gm.graph, result["positions"], result["saved_symints"], result["signatures"])
            result["groups"] = reload_saved(gm.graph, chosen, device, path)
    gm.graph.lint()
    gm.recompile()
    return gm
