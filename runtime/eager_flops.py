"""The FLOPs of code Dynamo leaves to eager (``runtime/eager_regions.py``), counted per module.

Compiled graphs are counted once per compile from their FX graphs (``passes/analyses/flop_count.py``) and
added at each run. Eager code has no graph to count, so while an eager unit's forward runs (the
model's forward around a graph break in its layer loop, an eager root calling compiled blocks, a
leaf module) a dispatch mode counts each op with torch's own FLOP formulas (the ones
``torch.utils.flop_counter.FlopCounterMode`` uses), for the innermost eager module running. A
compiled frame run from there runs with the mode off (``EagerRegions.frame_runs``): its ops are
the frame's, counted from its graphs.

The backward of those ops runs in the autograd engine, where no mode of the forward applies. So
each counted op whose output needs a gradient gets a hook on its autograd node, which adds that
node's backward FLOPs when it runs: what ``FlopCounterMode`` counts for the op's backward, found
once per op and input signature by running the op and its backward on meta tensors under
``FlopCounterMode`` (the same formulas, the same autograd formulas, no data). So
``stats().flops_per_step`` equals ``FlopCounterMode`` over a step of a model with graph breaks, and
the flops profiler has a row for each eager module.

Not counted: a ``torch.compiler.disable``d module called from inside a compiled frame (Dynamo
inlined its ``Module.__call__``: no hook runs there), and code outside the model's forward (a loss
computed in the training loop), as for a model compiled whole.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger("zerocompile")


class EagerFlops(TorchDispatchMode):
    """Counts the FLOPs of eager ops while an eager unit's forward runs (see the module
    docstring). ``record(module, type, flops, backward)`` receives each count."""

    def __init__(self, record):
        super().__init__()
        self.record = record
        self.paused = 0
        """> 0 while a signature's backward is traced on meta tensors (``_backward_flops``)."""
        self.module = ("", "")
        """``(path, type)`` of the innermost eager module running: what the ops count for."""
        self.pending: list = []
        """Counted ops whose outputs need a gradient: ``(outputs, module, signature)``, until
        their autograd nodes exist (``settle``)."""
        self.backward_flops: dict = {}
        """Backward FLOPs per op and input signature (``_backward_flops``)."""
        self.formulas = FlopCounterMode(display=False).flop_registry
        """torch's FLOP formulas by op packet, ``FlopCounterMode``'s own."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True     # a frame Dynamo compiles while it is on stays compiled

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.pending:
            self.settle()       # the ops before this one returned to autograd: their nodes exist
        if self.paused:
            return out
        formula = self.formulas.get(func._overloadpacket)
        if formula is None:
            return out
        try:
            flops = formula(*args, **kwargs, out_val=out)
        except (TypeError, ValueError, RuntimeError, AttributeError):
            return out          # a formula that cannot read these arguments: not counted (as in a graph)
        self.record(self.module, flops, False)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tree_leaves((args, kwargs))):
            self.pending.append((out, self.module, (func, _signature(args, kwargs))))
        return out

    def settle(self) -> None:
        """Hook the autograd nodes of the ops counted since the last call (a node exists once
        its op returned to autograd: at the next op, or when the eager forward ends)."""
        pending, self.pending = self.pending, []
        for out, module, key in pending:
            node = next((t.grad_fn for t in tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
            if node is not None:
                node.register_prehook(functools.partial(self._backward_ran, module, key))

    def _backward_ran(self, module, key, grads) -> None:
        flops = self._backward_flops(*key)
        if flops:
            self.record(module, flops, True)

    def _backward_flops(self, func, signature) -> int:
        """What ``FlopCounterMode`` counts for the backward of ``func`` on inputs like
        ``signature``'s, from one run on meta tensors (cached; 0, logged, where the op has no meta
        kernel)."""
        if (func, signature) in self.backward_flops:
            return self.backward_flops[(func, signature)]
        specs, values = signature
        self.paused += 1
        try:
            with torch.enable_grad(), FlopCounterMode(display=False) as counter:   # in a backward: off
                leaves = [torch.empty_strided(v[0], v[1], dtype=v[2], device="meta").requires_grad_(v[4])
                          if isinstance(v, _TensorMeta) else v for v in values]
                args, kwargs = tree_unflatten(leaves, specs)
                out = func(*args, **kwargs)
                forward = counter.get_total_flops()
                outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
                if outputs and inputs:
                    torch.autograd.grad(outputs, inputs, [torch.ones_like(t) for t in outputs], allow_unused=True)
                flops = counter.get_total_flops() - forward
        except Exception as exc:        # noqa: BLE001 - an op without a meta backward: counted forward only
            log.warning("zerocompile: the backward FLOPs of eager %s are not counted (%s)", func, exc)
            flops = 0
        finally:
            self.paused -= 1
        self.backward_flops[(func, signature)] = flops
        return flops


class _TensorMeta(tuple):
    """``(shape, stride, dtype, device, requires_grad)`` of a tensor argument."""


def _signature(args, kwargs):
    leaves, specs = tree_flatten((args, kwargs))
    values = tuple(_TensorMeta((tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad))
                   if isinstance(t, torch.Tensor) else t for t in leaves)
    return specs, values
