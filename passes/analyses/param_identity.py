"""Which graph nodes belong to which parameter: one answer for every pass.

``insert_param_collectives`` marks each node it inserts for a parameter (the gather, the
stage-2 gradient hook, the cast) with that parameter's identity in ``node.meta["custom"]``:
its index among the frame's parameter inputs and its name. ``custom`` is the metadata field
``torch.fx.traceback.annotate`` uses; AOTAutograd copies it to every node traced from the
marked node (the all-gather, its wait, the slice and view after it) and, through the
autograd sequence number, to the backward nodes of the same op (the gradient's
reduce-scatter and its wait). So the identity survives tracing, partitioning and
recomputation: no pass has to guess a collective's parameter from graph shape, input order
or node names.

The index is the parameter's position among the frame's parameter inputs (``plans``), which
``FrameRunner`` resolves by object at every call: the graph names a slot, the call fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from zerocompile.errors import ParamIdentityError

KEY = "zerocompile_param"

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class ParamId:
    index: int
    """Position among the frame's parameter inputs."""
    name: str
    """The parameter's name as the frame's first trace met it (for logs, dumps and errors)."""


def mark(node: torch.fx.Node, index: int, name: str) -> None:
    """Give ``node`` (inserted for the ``index``-th parameter input) that parameter's identity."""
    custom = dict(node.meta.get("custom") or {})
    custom[KEY] = {"index": index, "name": name}
    node.meta["custom"] = custom


def number_parameters(states) -> list:
    """The identity index of each entry of ``states`` (a frame's parameter states in input
    order; None for inputs that are not parameters): the k-th distinct state is parameter k.
    The pass that marks nodes and the checks that read the marks both count with this."""
    out, seen = [], {}
    for sp in states:
        out.append(None if sp is None else seen.setdefault(id(sp), len(seen)))
    return out


def identity(node: torch.fx.Node) -> ParamId | None:
    """The parameter ``node`` was traced from, or None."""
    value = (node.meta.get("custom") or {}).get(KEY)
    return ParamId(value["index"], value["name"]) if value else None


@dataclass
class ParamNodes:
    """The collectives of one parameter in one graph."""

    param: ParamId
    gathers: list = field(default_factory=list)
    """``all_gather_into_tensor`` nodes of the parameter."""
    reduces: list = field(default_factory=list)
    """``reduce_scatter_tensor`` nodes of its gradient."""


def parameter_collectives(graph: torch.fx.Graph) -> dict[int, ParamNodes]:
    """Every parameter's all-gathers and gradient reduce-scatters in ``graph``, by index."""
    out: dict[int, ParamNodes] = {}
    for target, attr in ((_c10d.all_gather_into_tensor.default, "gathers"),
                         (_c10d.reduce_scatter_tensor.default, "reduces")):
        for node in graph.find_nodes(op="call_function", target=target):
            pid = identity(node)
            if pid is None:
                continue
            getattr(out.setdefault(pid.index, ParamNodes(pid)), attr).append(node)
    return out


def check_at_most_one_each(graph: torch.fx.Graph, where: str) -> None:
    """Every parameter has at most one all-gather and one gradient reduce-scatter in ``graph``
    (before bucketing merges them): two gathers of one parameter would mean two copies of it
    alive, two reductions a gradient counted twice."""
    for nodes in parameter_collectives(graph).values():
        for kind, found in (("all-gathers", nodes.gathers), ("gradient reduce-scatters", nodes.reduces)):
            if len(found) > 1:
                raise ParamIdentityError(
                    f"zerocompile: the {where} graph has {len(found)} {kind} of parameter "
                    f"'{nodes.param.name}' ({', '.join(n.name for n in found)}); expected at most one")


def check_gathered_where_read(graph: torch.fx.Graph, expected: dict[int, str], where: str) -> None:
    """Every parameter in ``expected`` (index -> name: the stage-3 parameters the graph reads)
    has exactly one all-gather in ``graph``."""
    found = parameter_collectives(graph)
    missing = [name for index, name in expected.items() if index not in found or not found[index].gathers]
    if missing:
        raise ParamIdentityError(
            f"zerocompile: the {where} graph reads sharded parameter(s) {missing} without an all-gather "
            "of theirs; the graph would compute with a shard in place of the parameter")
    check_at_most_one_each(graph, where)
