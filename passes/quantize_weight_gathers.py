"""Pass (forward, backward and inference graphs, stage 3, ``zero_quantized_weights``): ZeRO++
qwZ, every parameter all-gather moves int8 values and their scales.

It runs after ``bucketing`` and before ``prefetch``, and rewrites each parameter all-gather
of the graph (role ``bucket_gather`` or ``param_gather``):

- a bucket's ``pack_shards(shards)`` becomes ``quantize_pack(shards, BLOCK)``: one ``uint8``
  buffer holding the rank's int8 values and float32 block scales (runtime/quantization.py);
  a lone parameter's all-gather gets one of its own, for its flat shard;
- the all-gather gathers that buffer (the same collective, a quarter of the float32 bytes);
- its wait is followed by ``dequantize_unpack``, which writes each parameter's full flat
  tensor in the dtype the all-gather had (``param_dtype`` where shards are cast before the
  gather), in place of ``unpack_gathered_bucket`` (or of the lone gather's result).

The new nodes keep the roles of the ones they replace (``bucket_pack``, the gather's role
with ``quantized=True``, its wait's role, ``bucket_unpack``), so ``prefetch`` moves the
quantization with its all-gather and the liveness simulation counts the buffers. Every rank
dequantizes the same gathered bytes, so the parameters are the same on every rank, and the
backward re-gathers give the same values as the forward's gathers. All-gathers of other
dtypes (integer buffers), and hpZ's re-gathers within a group of ranks (their shards are
already dequantized values; ``hierarchical_partition``), are left as they are.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from zerocompile.passes.context import PassContext
from zerocompile.passes.graph_utils import call, stable_topological_sort, tag
from zerocompile.runtime import bucket_ops  # noqa: F401 - registers zerocompile::unpack_gathered_bucket
from zerocompile.runtime import quantization

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
_GATHER = _c10d.all_gather_into_tensor.default
_WAIT = _c10d.wait_tensor.default
_PACK_SHARDS = torch.ops.zerocompile.pack_shards.default
_UNPACK = torch.ops.zerocompile.unpack_gathered_bucket.default
_QUANTIZE = torch.ops.zerocompile.quantize_pack.default
_DEQUANTIZE = torch.ops.zerocompile.dequantize_unpack.default


def _single_wait(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target is _WAIT else None


def _quantized_gather(graph: torch.fx.Graph, gather: torch.fx.Node, wait: torch.fx.Node, shards: list,
                      before_gather: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """The quantize, all-gather and wait replacing ``gather`` and ``wait``: returns the new
    gather and wait (the caller adds the dequantization)."""
    _, world, group_name = gather.args
    info = {k: v for k, v in tag(gather).items() if k != "role"}
    with graph.inserting_before(before_gather):
        packed = call(graph, _QUANTIZE, (shards, quantization.BLOCK), role="bucket_pack", quantized=True,
                      **{k: v for k, v in info.items() if k in ("bucket", "param", "params")})
    with graph.inserting_before(gather):
        new_gather = call(graph, _GATHER, (packed, world, group_name), role=tag(gather).get("role"), quantized=True,
                          **info)
    with graph.inserting_before(wait):
        new_wait = call(graph, _WAIT, (new_gather,), **tag(wait))
    return new_gather, new_wait


def _rewrite_bucket(graph: torch.fx.Graph, gather: torch.fx.Node, wait: torch.fx.Node) -> bool:
    packed = gather.args[0]
    unpacks = list(wait.users)
    if (packed.target is not _PACK_SHARDS or len(packed.users) != 1 or len(unpacks) != 1
            or unpacks[0].target is not _UNPACK):
        return False
    unpack = unpacks[0]
    shards = packed.args[0]
    dtype = wait.meta["val"].dtype
    if dtype not in quantization.FLOAT_DTYPES:
        return False
    world, chunks = unpack.args[1], unpack.args[2]
    _, new_wait = _quantized_gather(graph, gather, wait, shards, packed)
    with graph.inserting_before(unpack):
        dequantized = call(graph, _DEQUANTIZE, (new_wait, world, list(chunks), quantization.BLOCK, dtype),
                           **{**tag(unpack), "quantized": True})
    unpack.replace_all_uses_with(dequantized)
    for node in (unpack, wait, gather, packed):
        graph.erase_node(node)
    return True


def _rewrite_single(graph: torch.fx.Graph, gather: torch.fx.Node, wait: torch.fx.Node) -> bool:
    inp = gather.args[0]
    val = inp.meta["val"]
    if val.dtype not in quantization.FLOAT_DTYPES:
        return False
    world = gather.args[1]
    flat_shard = inp
    if val.dim() != 1:
        with graph.inserting_before(gather):
            flat_shard = call(graph, _aten.view.default, (inp, [-1]), role="gather_input")
    _, new_wait = _quantized_gather(graph, gather, wait, [flat_shard], gather)
    names = tag(gather).get("params") or [tag(gather).get("param")]
    with graph.inserting_after(new_wait):
        dequantized = call(graph, _DEQUANTIZE, (new_wait, world, [val.numel()], quantization.BLOCK, val.dtype),
                           role="bucket_unpack", params=names, quantized=True)
    with graph.inserting_after(dequantized):
        flat = call(graph, operator.getitem, (dequantized, 0), role="bucket_unpack", param=names[0])
    result = flat
    if val.dim() != 1:
        with graph.inserting_after(flat):
            result = call(graph, _aten.view.default, (flat, list(wait.meta["val"].shape)), role="bucket_unpack",
                          param=names[0])
    wait.replace_all_uses_with(result)
    graph.erase_node(wait)
    graph.erase_node(gather)
    return True


def quantize_gathers(graph: torch.fx.Graph, group_name: str | None = None) -> dict:
    """Rewrite the graph's parameter all-gathers over ``group_name`` (every group when None);
    returns what was quantized and what was not. Gathers over other groups (hpZ's re-gathers
    within a node, from shards that are already the dequantized weights) are left alone."""
    quantized, skipped = 0, 0
    for node in list(graph.nodes):
        role = tag(node).get("role")
        if node.target is not _GATHER or role not in ("bucket_gather", "param_gather") or tag(node).get("quantized"):
            continue
        if group_name is not None and node.args[2] != group_name:
            continue
        wait = _single_wait(node)
        done = False
        if wait is not None:
            done = _rewrite_bucket(graph, node, wait) if role == "bucket_gather" else _rewrite_single(graph, node, wait)
        quantized += done
        skipped += not done
    stable_topological_sort(graph)
    return {"quantized": quantized, "left": skipped, "block": quantization.BLOCK}


def quantize_weight_gathers(gm: torch.fx.GraphModule, ctx: PassContext, **_) -> torch.fx.GraphModule:
    report = quantize_gathers(gm.graph, ctx.group.name)
    ctx.results.setdefault("quantize_weight_gathers", {})[ctx.graph_kind] = report
    ctx.logger.debug("[%s] quantize_weight_gathers (%s): %s", ctx.frame, ctx.graph_kind, report)
    gm.recompile()
    return gm
