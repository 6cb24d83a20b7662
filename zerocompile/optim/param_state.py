"""``ParamState``: one parameter's optimizer state as checkpoints carry it, and the keys under
which state loaded before the optimizer binds waits for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParamState:
    """One parameter's optimizer state as checkpoints carry it."""

    values: dict
    """State name -> value, as the inner optimizer keeps it (``exp_avg``, ``step``, ...)."""
    sharded: bool
    """Element-wise tensors are this rank's flat shard (``chunk`` elements, zero-padded), as the
    inner optimizer holds them for a sharded parameter; otherwise every tensor is whole (the
    element-wise ones in the parameter's shape)."""
    owned: bool = False
    """Whole state of a sharded parameter that this rank alone holds: it owns the parameter for a
    whole-parameter optimizer (Muon, Adafactor), so it is the one that writes it to a checkpoint."""


PARAM_STATES = "zerocompile_param_states"
"""Key of a pending state (``InnerBinding.pending``) that holds ``{param: ParamState}`` from a checkpoint."""
TORCH_LAYOUT = "zerocompile_torch_layout"
"""Key of a pending state (``InnerBinding.pending``) that holds a state dict with sharded values of
parameters that were not sharded when it was loaded."""
