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
compiled frames are unaffected.
"""

from __future__ import annotations

import torch

from zerocompile.runtime.sharded_param import get_state


def _gather_on_demand(module: torch.nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    for param in module.parameters(recurse=False):
        state = get_state(param)
        if state is not None:
            state.materialize()


def install_eager_fallback(module: torch.nn.Module) -> None:
    """Give ``module`` the gather-on-demand pre-hook (once)."""
    if any(h is _gather_on_demand for h in module._forward_pre_hooks.values()):
        return
    module.register_forward_pre_hook(_gather_on_demand)
