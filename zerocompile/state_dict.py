"""Full (unsharded) views of a sharded model: ``full_state_dict`` and ``gathered_parameters``."""

from __future__ import annotations

import contextlib

import torch

from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.sharded_param import get_state


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module behind a ``torch.compile`` wrapper (``OptimizedModule``)."""
    return getattr(model, "_orig_mod", model)


def full_state_dict(model: torch.nn.Module, rank0_only: bool = True) -> dict:
    """The full state dict, keys exactly as the original ``model.state_dict()``.

    A collective: every rank must call it. Parameters come from the master shards (their
    original dtype, e.g. fp32 under bf16 training). With ``rank0_only`` (the default) only
    global rank 0 gets the tensors; the other ranks get an empty dict.
    """
    with PROCESS.watch.scope("full_state_dict"):       # its collectives' label in a mismatch report
        return _full_state_dict(_unwrap(model), rank0_only)


def _full_state_dict(module: torch.nn.Module, rank0_only: bool) -> dict:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    keep = rank == 0 or not rank0_only
    gathered: dict[int, torch.Tensor | None] = {}    # a tensor shared by several names gathers once
    out = {}
    for name, value in module.state_dict(keep_vars=True).items():
        state = get_state(value) if isinstance(value, torch.nn.Parameter) else None
        if id(value) not in gathered:
            full = state.full_from_shards() if state is not None else value.detach().clone() if keep else None
            gathered[id(value)] = full if keep else None    # the other ranks drop each gathered value at once
        if keep:
            out[name] = gathered[id(value)]
    return out


@contextlib.contextmanager
def gathered_parameters(model: torch.nn.Module):
    """Full parameters on every rank inside the block; writes are scattered back on exit.

    A collective on entry (an all-gather of each freed parameter). Inside, every parameter
    of ``model`` holds its full current value in its own dtype, so eager code may read it
    (evaluation, inspection, initialisation). Writes made inside must be the same on every
    rank (e.g. a seeded init); on exit each rank keeps its own chunk of the new values.
    """
    module = _unwrap(model)
    with PROCESS.watch.scope("gathered_parameters"):   # its collectives' label in a mismatch report
        states = _materialize_all(module)
    try:
        yield module
    finally:
        for state, was_materialized in states:
            state.write_full(state.param.detach())
            if not was_materialized:
                state.release()


def _materialize_all(module: torch.nn.Module) -> list:
    """Gather every sharded parameter of ``module``; ``(state, was it materialized before)``."""
    states, seen = [], set()
    for p in module.parameters():
        state = get_state(p)
        if state is None or id(p) in seen:
            continue
        seen.add(id(p))
        states.append((state, state.materialized))
        state.materialize()
    return states
