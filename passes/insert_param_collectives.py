"""Pass: turn each parameter input of a Dynamo graph into its stage's sharded form.

Runs on the torch-IR graph Dynamo captured, before AOTAutograd. For a parameter
placeholder ``p`` with shard state ``sp`` it creates one placeholder per tensor of
``sp.graph_inputs()`` (at the same position) and replaces every use of ``p`` with:

- stage 0: the parameter, cast to the compute dtype if that differs (``cast_param``);
- stage 1: the compute-dtype replica itself (autograd accumulates full gradients);
- stage 2: ``replica_with_sharded_grad(shard, replica)``: backward reduce-scatters into the shard.
  A graph output that is a view of a stage-2 parameter (``w = self.l.weight.t()`` before a
  graph break, used after it) is cloned: AOTAutograd rebuilds an output that aliases an input
  outside the compiled function, from the input, and the replica input has no gradient, so
  the gradient that reaches the view would be dropped without a word;
- stage 3: ``gather_param(shard)``: all-gather, view as the parameter, then
  ``cast_param`` to the compute dtype if that differs (``cast_before_gather`` moves
  the cast in front of the all-gather). With ``offload_param`` the shard is first read
  from its file: ``gather_param(fetch_shard(shard, file_number, directory))``, the file's
  number a graph input of its own (a frame runs for many blocks' parameters).

What each stage inserts is its ``Stage.insert_param_op`` (``runtime/stages.py``); this pass
places it and marks it. The inserted op goes right before the parameter's first use, so that a gathered
parameter is alive only from its first use to its last.

Every inserted node is tagged ``node.meta["zerocompile"] = {"role": ..., "param": name}`` and
carries the parameter's identity (``passes/analyses/param_identity.py``), which reaches every node
AOTAutograd traces from it, forward and backward.
"""

from __future__ import annotations

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from zerocompile.passes.analyses import param_identity
from zerocompile.passes.context import PassContext

_INPUT_ROLES = {"": "param", "_replica": "param_replica", "_shard": "param_shard", "_file": "param_file"}


def insert_param_collectives(gm: torch.fx.GraphModule, ctx: PassContext, plans=None, **_) -> torch.fx.GraphModule:
    """``plans[i]`` is the ``ShardedParam`` of the i-th placeholder, or None for other inputs."""
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    if plans is None or len(plans) != len(placeholders):
        raise ValueError("insert_param_collectives needs one plan entry per placeholder")
    order = {n: i for i, n in enumerate(graph.nodes)}
    group = ctx.group
    indices = param_identity.number_parameters(plans)
    alias_storages = {}     # storage of a stage-2 parameter's example value -> its plan
    fake_mode = next((v.fake_mode for n in placeholders
                      if isinstance(v := n.meta.get("example_value"), FakeTensor)), None)
    for node, sp, index in zip(placeholders, plans, indices):
        if sp is None:
            continue
        users = sorted(node.users, key=order.__getitem__)
        new_inputs = []
        with graph.inserting_before(node):
            for suffix, tensor in zip(sp.rules.input_suffixes, sp.graph_inputs()):
                ph = graph.placeholder(f"{node.name}{suffix}" if suffix else f"{node.name}_param")
                ph._dynamo_source = None  # read by AOTAutograd's Dynamo-metadata check
                ph.meta["zerocompile"] = {"role": _INPUT_ROLES[suffix], "param": sp.name}
                if fake_mode is not None:   # what later passes propagate fake tensors from
                    ph.meta["example_value"] = fake_mode.from_tensor(tensor, static_shapes=True)
                new_inputs.append(ph)
        # just before the first use, so a gathered parameter lives from its first use to its
        # last, not from the start of the graph (placeholders come before every user)
        with graph.inserting_before(users[0]) if users else graph.inserting_after(new_inputs[-1]):
            out = sp.rules.insert_param_op(graph, new_inputs, sp, group)
        if out is not new_inputs[0]:
            out.meta.setdefault("zerocompile", {"role": sp.rules.op_role, "param": sp.name})
            for inserted in _inserted_nodes(out, new_inputs):
                param_identity.mark(inserted, index, sp.name)
            if "example_value" in node.meta:
                out.meta["example_value"] = node.meta["example_value"]
        if sp.rules.output_alias_drops_grad and "example_value" in node.meta:
            alias_storages[_storage(node.meta["example_value"])] = sp
        node.replace_all_uses_with(out)
        graph.erase_node(node)
    _clone_outputs_aliasing(graph, alias_storages)
    return gm


def _inserted_nodes(out: torch.fx.Node, inputs: list) -> list[torch.fx.Node]:
    """``out`` and the nodes between it and the new placeholders ``inputs`` (what a stage's
    ``insert_param_op`` added: a fetch, a gather, a cast)."""
    found, frontier = [], [out]
    while frontier:
        node = frontier.pop()
        if node in inputs or node in found:
            continue
        found.append(node)
        frontier.extend(node.all_input_nodes)
    return found


def _storage(t) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _clone_outputs_aliasing(graph: torch.fx.Graph, storages: dict) -> None:
    """Replace each graph output that shares storage with a stage-2 parameter (a view of it,
    or the parameter itself) by a clone of it (see the module docstring)."""
    if not storages:
        return
    output = graph.find_nodes(op="output")[0]
    cloned = {}

    def fix(arg):
        if not isinstance(arg, torch.fx.Node):
            return arg
        value = arg.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or _storage(value) not in storages:
            return arg
        if arg not in cloned:
            with graph.inserting_before(output):
                clone = graph.call_function(torch.clone, (arg,))
            clone.meta["example_value"] = value.clone()
            clone.meta["zerocompile"] = {"role": "param_view_output",
                                         "param": storages[_storage(value)].name}
            cloned[arg] = clone
        return cloned[arg]

    output.args = torch.fx.node.map_arg(output.args, fix)
