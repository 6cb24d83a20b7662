"""Pass (Dynamo graph, stage 3): cast shards to the compute dtype before the all-gather.

``insert_param_collectives`` gathers each shard in its own dtype and casts the full
parameter afterwards (``gather_param`` then ``cast_param``). With a 16-bit
``param_dtype`` that all-gathers twice the bytes needed. This pass folds each such
cast into the gather (``gather_param(shard, compute_dtype=...)`` casts the shard
first), which halves the all-gather bytes; the values are bitwise the same (a cast
commutes with concatenation), and the gradient still reaches the shard in
``reduce_dtype`` (the gather's backward casts it before the reduce-scatter).
"""

from __future__ import annotations

import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import tag
from zerocompile.runtime import param_ops


def cast_before_gather(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    graph = gm.graph
    folded = 0
    for cast in list(graph.find_nodes(op="call_function", target=param_ops.cast_param)):
        gather = cast.args[0]
        if tag(cast).get("role") != "gather_cast" or gather.target is not param_ops.gather_param:
            continue
        if len(gather.users) != 1:
            continue  # the uncast gathered value is used too: keep both
        shard, numel, shape, _, reduce_dtype, world, group_name = gather.args
        gather.args = (shard, numel, shape, cast.args[1], reduce_dtype, world, group_name)
        if "example_value" in cast.meta:
            gather.meta["example_value"] = cast.meta["example_value"]
        cast.replace_all_uses_with(gather)
        graph.erase_node(cast)
        folded += 1
    ctx.results["cast_before_gather"] = {"folded": folded}
    return gm
