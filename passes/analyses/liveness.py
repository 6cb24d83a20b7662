"""Analysis: a liveness simulation of a graph's tensors, node by node.

Walks the graph in its order and keeps a set of live *buffers*: each node that
allocates (an op that is not a view) creates one buffer per tensor it returns, of the
bytes of ``node.meta["val"]``; views, ``getitem`` of a tuple, ``wait_tensor`` and
in-place ops alias the buffer they read. A buffer dies after the last node that reads
it or any alias of it; buffers reaching the graph's output (forward outputs, saved
activations, gradients) live to the end. Graph inputs count only with
``count_inputs=True`` (in a backward graph the saved activations and tangents are
inputs the graph frees as it goes; in a forward graph the inputs are shards and user
data that outlive the graph).

``live[i]`` is the bytes live while node ``i`` runs (its inputs and its outputs), and
``peak`` the largest of those. Buffers are put in a category by the node that made
them: ``gathered_params`` (parameter all-gathers and the copies out of a bucket),
``comm`` (other collective buffers) or ``activations``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from zerocompile.passes.graph_utils import COLLECTIVE_OPS, tag, tensor_nbytes

_c10d = torch.ops._c10d_functional
_ALIASING = {_c10d.wait_tensor.default, operator.getitem}
_GATHER_ROLES = ("param_gather", "bucket_gather", "bucket_unpack", "param_fetch")


@dataclass
class Liveness:
    """Result of ``simulate``."""

    nodes: list = field(default_factory=list)
    """Node names in graph order."""
    live: list = field(default_factory=list)
    """Bytes live while each node runs."""
    peak: int = 0
    peak_node: str = ""
    peak_breakdown: dict = field(default_factory=dict)
    """Bytes live at the peak, by category (gathered_params, comm, activations, inputs)."""
    collectives: list = field(default_factory=list)
    """``(index, kind)`` of each collective node, for plots."""


def is_view(node: torch.fx.Node) -> bool:
    target = node.target
    if target in _ALIASING:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None


def storage_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose buffer ``node`` aliases: views alias their base, and so does a
    ``getitem`` of a view op that returns several (``split``, ``unbind``); a ``getitem`` of
    another multi-output op (``native_layer_norm``) is its own buffer."""
    base = node
    while base.op == "call_function" and base.args and isinstance(base.args[0], torch.fx.Node):
        source = base.args[0]
        if base.target is operator.getitem:
            if source.op != "call_function" or not is_view(source):
                break
        elif not is_view(base):
            break
        base = source
    return base


def _category(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return "inputs"
    role = tag(node).get("role", "")
    if role in _GATHER_ROLES:
        return "gathered_params"
    if node.target in COLLECTIVE_OPS:
        return "comm"
    return "activations"


def tensors_of(val) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def simulate(graph: torch.fx.Graph, count_inputs: bool = False, zero_nodes: set | None = None) -> Liveness:
    """Simulate live bytes node by node (see the module docstring). Buffers made by
    ``zero_nodes`` count zero bytes (to ask "what if these were not kept")."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    # buffer of each node: (defining node, element index); a view maps to its base's buffers
    buffers_of: dict = {}
    size: dict = {}
    category: dict = {}
    for node in nodes:
        if node.op == "output":
            continue
        val = node.meta.get("val", node.meta.get("example_value"))
        if node.op == "placeholder":
            tensors = tensors_of(val)
            bufs = [(node, i) for i in range(len(tensors))]
            for b, t in zip(bufs, tensors):
                size[b] = tensor_nbytes(t) if count_inputs else 0
                category[b] = "inputs"
            buffers_of[node] = bufs
        elif node.op == "call_function" and is_view(node):
            src = node.args[0] if node.args else None
            if node.target is operator.getitem and isinstance(src, torch.fx.Node) and src in buffers_of:
                base = buffers_of[src]
                idx = node.args[1]
                buffers_of[node] = [base[idx]] if isinstance(idx, int) and idx < len(base) else list(base)
            else:
                buffers_of[node] = list(buffers_of.get(src, [])) if isinstance(src, torch.fx.Node) else []
        else:
            tensors = tensors_of(val)
            bufs = [(node, i) for i in range(len(tensors))]
            for b, t in zip(bufs, tensors):
                size[b] = 0 if zero_nodes and node in zero_nodes else tensor_nbytes(t)
                category[b] = _category(node)
            buffers_of[node] = bufs
    last_use: dict = {}
    end = len(nodes)
    for node in nodes:
        for inp in node.all_input_nodes:
            for b in buffers_of.get(inp, ()):
                last_use[b] = end if node.op == "output" else max(last_use.get(b, -1), index[node])
    frees: dict = {}
    for b in size:
        frees.setdefault(last_use.get(b, index[b[0]]), []).append(b)
    result = Liveness(nodes=[n.name for n in nodes])
    live_set: set = set()
    current = 0
    for i, node in enumerate(nodes):
        if node.op != "output":
            for b in buffers_of.get(node, ()):
                if b[0] is node and b not in live_set:
                    live_set.add(b)
                    current += size[b]
        result.live.append(current)
        if node.target in COLLECTIVE_OPS:
            result.collectives.append((i, str(node.target).split(".")[1]))
        if current > result.peak or not result.peak_node:
            result.peak, result.peak_node = current, node.name
            breakdown: dict = {}
            for b in live_set:
                breakdown[category[b]] = breakdown.get(category[b], 0) + size[b]
            result.peak_breakdown = breakdown
        for b in frees.get(i, ()):
            if b in live_set:
                live_set.discard(b)
                current -= size[b]
    return result


def saved_activation_bytes(forward: torch.fx.Graph, num_fwd_outputs: int) -> int:
    """Bytes of the tensors a partitioned forward graph saves for backward, not counting
    graph inputs it saves (shards, user inputs: they exist anyway) and counting each
    storage once (a saved view of a saved tensor costs nothing more)."""
    output = next(iter(forward.find_nodes(op="output")))
    outs = output.args[0]
    saved = [a for a in outs[num_fwd_outputs:] if isinstance(a, torch.fx.Node)]
    seen: set = set()
    total = 0
    for node in saved:
        base = storage_root(node)
        if base.op == "placeholder" or base in seen:
            continue
        seen.add(base)
        total += sum(tensor_nbytes(t) for t in tensors_of(node.meta.get("val") if base is node else base.meta.get("val")))
    return total
