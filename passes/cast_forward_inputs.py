"""Pass: cast a frame's floating-point inputs to ``param_dtype`` (mixed precision).

With a 16-bit ``param_dtype`` the parameters are computed in 16 bits; a float32 input
(an image batch, features, an activation handed over from an earlier frame) would
meet them in a matmul of mixed dtypes and fail. Like FSDP2's ``cast_forward_inputs``,
this pass casts every floating-point graph input that is neither a parameter nor a
buffer to the compute dtype (buffers keep their dtype, as the module owns them). The
cast is differentiable, so gradients flow back in the input's own dtype.
"""

from __future__ import annotations

import torch
import torch.fx

from zerocompile.passes.context import PassContext


def cast_forward_inputs(gm: torch.fx.GraphModule, ctx: PassContext, *, param_dtype, input_kinds=None,
                        **_) -> torch.fx.GraphModule:
    """``input_kinds[i]`` is "param", "buffer", "input" or "other" for the i-th placeholder
    of the *original* Dynamo graph; "input" placeholders holding floating-point tensors of
    another dtype than ``param_dtype`` get a cast."""
    dtype = param_dtype
    if dtype is None or input_kinds is None:
        return gm
    graph = gm.graph
    # insert_param_collectives tagged the placeholders it created; the rest are the originals
    originals = [n for n in graph.find_nodes(op="placeholder") if "zerocompile" not in n.meta]
    if len(originals) != sum(k != "param" for k in input_kinds):
        raise ValueError("cast_forward_inputs: input kinds do not match the graph's placeholders")
    kinds = [k for k in input_kinds if k != "param"]
    last = list(graph.find_nodes(op="placeholder"))[-1]
    for node, kind in zip(originals, kinds):
        val = node.meta.get("example_value")
        if kind != "input" or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if val.dtype == dtype:
            continue
        with graph.inserting_after(last):
            cast = graph.call_method("to", (node, dtype))
        node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
        cast.meta["zerocompile"] = {"role": "input_cast"}
    return gm
