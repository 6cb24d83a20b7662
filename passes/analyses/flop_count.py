"""Analysis (no rewrite): the FLOPs of a partitioned graph, by torch's own formulas.

``graph_flops(graph)`` sums ``torch.utils.flop_counter.flop_registry``'s formula of every op
node (matmuls, convolutions, attention: what ``FlopCounterMode`` counts) on its arguments'
metadata (``node.meta["val"]``), so the count is what ``FlopCounterMode`` would count running
the graph. In a backward graph the forward ops the partitioner moved there (recomputed:
AOTAutograd tags the backward's own nodes ``partitioner_tag="is_backward"``) are counted apart.

With symbolic shapes (a dynamic batch) a count is an expression of the size symbols, as a
string (``"2048*s0"``): the formulas run with the shape environment's guards suppressed (a count
must not specialize the graph), and ``evaluate`` gives the number for a call's sizes.
``zerocompile.stats().flops_per_step`` adds the counts up per compiled-frame call.
"""

from __future__ import annotations

import contextlib
import re

import sympy
import torch
import torch.fx
from torch.utils.flop_counter import flop_registry

from zerocompile import _torch_compat


def graph_flops(graph: torch.fx.Graph, backward: bool = False) -> dict:
    """``{"flops": total, "recompute": the recomputed forward ops' share, "modules": {module path:
    [FLOPs, class name]}}`` of ``graph``: ints, or expressions of the size symbols (strings) where
    shapes are symbolic (those ops are left out of ``modules``). A module path is the innermost
    module the op ran in, as Dynamo recorded it (``nn_module_stack``), relative to the frame's
    (``""``: the frame's own module, also where Dynamo recorded none)."""
    total = recompute = sympy.Integer(0)
    modules: dict = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target, args = node.target, node.args
        wrapped = _torch_compat.rng_wrapped_op(target, args)
        if wrapped is not None:             # a random op of a recomputed region, under a saved RNG state
            target, args = wrapped
        packet = getattr(target, "overloadpacket", None)
        formula = flop_registry.get(packet) if packet is not None else None
        if formula is None:
            continue
        out = node.meta.get("val")
        missing = []

        def value(n: torch.fx.Node):
            if "val" not in n.meta:
                missing.append(n)
            return n.meta.get("val")

        values = torch.fx.node.map_arg((tuple(args), dict(node.kwargs)), value)
        if out is None or missing:
            continue
        try:
            with _no_guards(out):
                flops = formula(*values[0], **values[1], out_val=out)
        except (TypeError, ValueError, RuntimeError, AttributeError):
            continue            # a formula that cannot read these arguments: not counted
        flops = flops.node.expr if isinstance(flops, torch.SymInt) else sympy.Integer(int(flops))
        total += flops
        if backward and node.meta.get("partitioner_tag") != "is_backward":
            recompute += flops
        # a backward op carries its forward op's modules (AOTAutograd copies them by seq_nr)
        # (an op Dynamo recorded no module for, such as the code of a resume function after a
        # graph break, counts for the frame's own module, "")
        stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
        if flops.is_number:
            path, cls = list(stack.values())[-1] if stack else ("", "")
            entry = modules.setdefault(module_path(path), [0, getattr(cls, "__name__", str(cls))])
            entry[0] += int(flops)
    return {"flops": _plain(total), "recompute": _plain(recompute), "modules": modules}


def module_path(dynamo_path: str) -> str:
    """``blocks.0.qkv`` from Dynamo's ``L['self'].blocks.0.qkv`` (or ``L['self']._modules['blocks']``
    ``._modules['0']...``, ``L['self'].blocks[0]``); ``""`` for the frame's own module."""
    path = re.sub(r"^L\['[^']*'\]\.?", "", dynamo_path)
    path = re.sub(r"_modules\['([^']*)'\]", r"\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".").replace("..", ".")


def _no_guards(val):
    """Where ``val`` has symbolic sizes: its shape environment's guards suppressed."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]
    env = next((t.fake_mode.shape_env for t in tensors
                if getattr(t, "fake_mode", None) is not None and t.fake_mode.shape_env is not None), None)
    return env.suppress_guards() if env is not None else contextlib.nullcontext()


def _plain(expr):
    return int(expr) if expr.is_number else str(expr)


def size_symbols(example_inputs) -> list:
    """Where each size symbol of a frame's inputs comes from: ``(input index, dim or None,
    symbol name)`` for a symbolic int input or a tensor input's symbolic dimension."""
    where = []
    for i, ex in enumerate(example_inputs):
        if isinstance(ex, torch.SymInt) and isinstance(ex.node.expr, sympy.Symbol):
            where.append((i, None, str(ex.node.expr)))
        elif isinstance(ex, torch.Tensor):
            for d, size in enumerate(ex.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    where.append((i, d, str(size.node.expr)))
    return where


def evaluate(count, bindings: dict) -> int:
    """A count of ``graph_flops`` for one call: ``bindings`` maps symbol names to sizes."""
    if isinstance(count, int):
        return count
    return int(sympy.sympify(count).subs({sympy.Symbol(name): value for name, value in bindings.items()}))
