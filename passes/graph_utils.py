"""Small helpers the passes share: node classification, fake re-evaluation, stable sorting."""

from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.fx

from zerocompile import _torch_compat

_c10d = torch.ops._c10d_functional

COLLECTIVE_OPS = (
    _c10d.all_gather_into_tensor.default,
    _c10d.reduce_scatter_tensor.default,
    _c10d.all_reduce.default,
    _c10d.all_to_all_single.default,   # only as the quantized gradient reduce-scatter (qgZ)
)


def concrete_int(x) -> int:
    """An int from an int or a symbolic size (its hint). Never ``int(symint)``: that would
    specialise the size (a guard), and Dynamo would recompile for every new batch size."""
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return int(hint) if hint is not None else 0
    return int(x)


def tensor_nbytes(val) -> int:
    """Bytes of a (fake) tensor's elements; symbolic sizes count at their hints."""
    return concrete_int(val.numel()) * val.element_size()


def tag(node: torch.fx.Node) -> dict:
    """The ``node.meta["zerocompile"]`` dict of a node (empty if untagged)."""
    return node.meta.get("zerocompile", {})


def set_tag(node: torch.fx.Node, **values) -> None:
    node.meta.setdefault("zerocompile", {})
    node.meta["zerocompile"] = {**node.meta["zerocompile"], **values}


def is_backward_node(node: torch.fx.Node, tangent_descendants: set | None = None) -> bool:
    """Whether a joint-graph node belongs to the backward (depends on a tangent input).

    AOTAutograd tags joint nodes ``meta["partitioner_tag"]``; where a node lacks the tag,
    ``tangent_descendants`` (from ``backward_nodes``) decides.
    """
    tagged = node.meta.get("partitioner_tag")
    if tagged in ("is_forward", "is_backward"):
        return tagged == "is_backward"
    return tangent_descendants is not None and node in tangent_descendants


def backward_nodes(graph: torch.fx.Graph) -> set:
    """Every node of a joint graph that depends on a tangent (cotangent) input."""
    out: set = set()
    for node in graph.nodes:
        if node.op == "placeholder" and "tangent" in node.name:
            out.add(node)
        elif node.op != "placeholder" and any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def fake_value(target, args, kwargs=None):
    """Run ``target`` on the ``meta["val"]`` of node arguments (a shape/dtype computation)."""
    vals = []

    def val(a):
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            vals.append(v)
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a

    fargs = val(args)
    fkwargs = {k: val(v) for k, v in (kwargs or {}).items()}
    mode = _torch_compat.fake_mode_of(vals)
    if mode is None:
        return target(*fargs, **fkwargs)
    with mode:
        return target(*fargs, **fkwargs)


def call(graph: torch.fx.Graph, target, args, kwargs=None, **tags) -> torch.fx.Node:
    """Insert ``target(*args)`` at the graph's insertion point with ``meta["val"]`` and tags."""
    node = graph.call_function(target, tuple(args), kwargs or {})
    if target is operator.getitem:
        node.meta["val"] = args[0].meta["val"][args[1]]
    else:
        node.meta["val"] = fake_value(target, args, kwargs)
    if tags:
        set_tag(node, **tags)
    return node


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, moving as little as possible.

    Rewrites that hoist or merge nodes may leave a node before one of its inputs; this
    keeps the current order wherever it is already legal (lexicographic topological sort
    keyed by current position) and keeps placeholders first and the output last.
    """
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    for node in nodes:
        for inp in node.all_input_nodes:
            dag.add_edge(inp, node)
    order = list(nx.lexicographical_topological_sort(dag, key=position.__getitem__))
    if order == nodes:
        return
    placeholders = [n for n in order if n.op == "placeholder"]
    rest = [n for n in order if n.op not in ("placeholder", "output")]
    output = [n for n in order if n.op == "output"]
    cursor = None
    for node in placeholders + rest + output:
        if cursor is None:
            first = next(iter(graph.nodes))
            if node is not first:
                first.prepend(node)
        else:
            cursor.append(node)
        cursor = node
