"""Eager access to parameters whose storage the runtime freed.

Stage 3 (and stages 1/2 with a 16-bit ``param_dtype``) free each parameter's own
storage; compiled frames use the shards instead. Code that Dynamo does not compile
but that calls a module owning such parameters (a ``torch.compiler.disable``d
submodule, a frame Dynamo skipped, an eager evaluation loop) would otherwise read an
empty storage. A forward pre-hook on each owning module gathers the parameters back
into their storage first (a collective: every rank runs the same eager code). They
stay gathered until the next optimizer step, which reduces any gradient they
collected into the shards and frees them again.

Under Dynamo tracing the hook does nothing (``torch.compiler.is_compiling()``), so
compiled frames are unaffected. It is never a Dynamo frame of its own
(``_torch_compat.never_a_frame``): eager code inside a compiled model's call (a frame Dynamo
skipped) runs under Dynamo's frame callback, and compiled as a frame the hook would see
``is_compiling()`` True and gather nothing.

A parameter that eager code used in the step before a frame sharded it stays gathered the same
way until the next optimizer step, when an autograd graph holds it (``ShardedParam``).

A module whose ``forward`` is ``torch.compiler.disable``d runs eagerly inside a
compiled frame's graph break, where Dynamo has already inlined ``Module.__call__``
(and so its hooks) at trace time: no hook can run there. Parameters owned by such
modules are therefore never freed (``ShardedParam.keep_full``): they keep their full
value, refreshed from the shards after every optimizer step, like DeepSpeed's
persistent parameters.
"""

from __future__ import annotations

import torch

from zerocompile import _torch_compat
from zerocompile.runtime.leaf_modules import is_leaf
from zerocompile.runtime.sharded_param import get_state


@_torch_compat.never_a_frame
def _gather_on_demand(module: torch.nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    for param in module.parameters(recurse=False):
        state = get_state(param)
        if state is not None:
            state.materialize()


def _runs_eagerly(module: torch.nn.Module) -> bool:
    # a leaf module's forward is disabled too, but it gathers its parameters itself on entry
    # (runtime/leaf_modules.py): they are sharded like any other
    return bool(getattr(module.forward, "_torchdynamo_disable", False)) and not is_leaf(module)


def eager_only_parameters(root: torch.nn.Module) -> set:
    """ids of the parameters owned by modules under ``root`` (or their children) whose
    ``forward`` Dynamo never compiles (``torch.compiler.disable``)."""
    out = set()
    for module in root.modules():
        if _runs_eagerly(module):
            out.update(id(p) for p in module.parameters())
    return out


def install_eager_fallback(root: torch.nn.Module) -> None:
    """Give every module under ``root`` that directly owns a freed parameter the
    gather-on-demand pre-hook (once per module)."""
    for module in root.modules():
        owns_freed = any(
            (state := get_state(p)) is not None and state.storage_freed
            for p in module.parameters(recurse=False))
        if not owns_freed:
            continue
        if any(h is _gather_on_demand for h in module._forward_pre_hooks.values()):
            continue
        module.register_forward_pre_hook(_gather_on_demand)
