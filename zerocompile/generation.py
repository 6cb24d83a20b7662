"""``zerocompile.generate``: Hugging Face ``generate`` on a sharded (stage 3) model.

Generation runs the model's forward many times, one token at a time. On a stage-3 model
every parameter's values live in shards across the ranks, so each forward must gather them,
and that gathering is collective: **every rank must call generate, and every rank must run
the same number of forward passes**, even when its own sequences finished earlier (a rank
that stops while the others run their next forward would leave them waiting in an
all-gather forever). Hugging Face's ``synced_gpus=True`` is exactly that rule: a finished
rank keeps running dummy forward passes until all ranks are done. ``generate`` passes it
(and refuses ``synced_gpus=False`` on more than one rank).

How the parameters are gathered:

- a model compiled in place (``model.compile(backend="zero", ...)``): ``model.generate``
  calls the compiled forward, whose graphs gather each bucket of parameters as the layers
  need it and free it after (as in training, but without the backward). Nothing else is
  needed; ``generate`` only enforces ``synced_gpus``;
- otherwise (``compiled = torch.compile(model, ...)`` wraps the model, and HF's generate calls
  the unwrapped model): the forward runs eagerly, and ``generate`` gathers module by module:
  a forward pre-hook on each module that owns sharded parameters gathers them (an
  all-gather each, in the parameters' master dtype), and a forward hook frees them when
  the module returns. At most the parameters of the modules being run (a layer and its
  parents' own parameters) are whole at any time, never the whole model.
"""

from __future__ import annotations

import contextlib

import torch

from zerocompile.runtime.sharded_param import get_state
from zerocompile.state_dict import _unwrap


def _sharded_own_parameters(module: torch.nn.Module) -> list:
    states, seen = [], set()
    for p in module.parameters(recurse=False):
        state = get_state(p)
        if state is not None and state.storage_freed and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


@contextlib.contextmanager
def gather_module_by_module(model: torch.nn.Module):
    """Within the block, each module of ``model`` that owns freed (stage-3) parameters gathers
    them when its forward starts and frees them when it returns. Collective: every rank must
    run the same modules in the same order."""
    module = _unwrap(model)
    handles = []
    opened: dict[int, list] = {}          # id(module) -> the states its pre-hook gathered

    def gather(mod, args):
        mine = opened.setdefault(id(mod), [])
        for state in _sharded_own_parameters(mod):
            if not state.materialized:
                state.materialize()
                mine.append(state)

    def free(mod, args, output):
        for state in opened.pop(id(mod), []):
            state.release()

    try:
        for mod in module.modules():
            if _sharded_own_parameters(mod):
                handles.append(mod.register_forward_pre_hook(gather))
                handles.append(mod.register_forward_hook(free, always_call=True))
        yield module
    finally:
        for handle in handles:
            handle.remove()
        for states in opened.values():
            for state in states:
                state.release()


def _world_of(module: torch.nn.Module) -> int:
    for p in module.parameters():
        state = get_state(p)
        if state is not None:
            return state.group.world
    return 1


def generate(model: torch.nn.Module, *args, **kwargs):
    """``model.generate(*args, **kwargs)`` (Hugging Face) on a zerocompile model, on every rank.

    Collective: every rank must call it. On more than one rank it passes ``synced_gpus=True``
    (refusing ``False``), so ranks whose sequences end at different lengths keep running
    forward passes together. A model compiled in place (``model.compile(backend="zero")``)
    generates through its compiled graphs; any other (a ``torch.compile`` wrapper, or a model
    whose parameters were sharded by a compiled copy) runs eagerly with its parameters
    gathered module by module (``gather_module_by_module``). Returns what ``generate`` returns.
    """
    module = _unwrap(model)
    if not hasattr(module, "generate"):
        raise TypeError(f"zerocompile.generate: {type(module).__name__} has no generate method (a Hugging Face "
                        "GenerationMixin model is needed)")
    if _world_of(module) > 1:
        if kwargs.get("synced_gpus") is False:
            raise ValueError("zerocompile.generate: synced_gpus=False on more than one rank would hang when the "
                             "ranks' sequences end at different lengths (a finished rank would stop gathering "
                             "parameters the others wait for); leave it unset")
        kwargs["synced_gpus"] = True
    if getattr(module, "_compiled_call_impl", None) is not None:
        return module.generate(*args, **kwargs)
    with gather_module_by_module(module):
        return module.generate(*args, **kwargs)
