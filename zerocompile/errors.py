"""The errors zerocompile raises for the user to catch, in one leaf module.

It imports nothing of the package, so every layer (runtime, passes, the front end, the tools)
raises these without importing the module that happens to detect the problem. The modules
that raise them re-export their names where users met them before (``zerocompile.config.
ZeroConfigError``, ``zerocompile.runtime.zero_parameter.ParameterNotGatheredError``, ...).
Errors private to one tool (the CLI's, ``plan``'s) stay in that tool.
"""

from __future__ import annotations

import difflib


class ZeroConfigError(ValueError):
    """A bad ``options`` dict: unknown key, bad value, or an untranslatable DeepSpeed key."""


class ParamIdentityError(RuntimeError):
    """A graph breaks an invariant about its parameter collectives."""


class ParameterNotGatheredError(RuntimeError):
    """Eager code used the values of a parameter whose storage zerocompile freed."""


class GradientNotGatheredError(RuntimeError):
    """Eager code read ``p.grad`` of a parameter whose gradient no ``ZeroOptimizer`` averages."""


class UnshardedParametersError(RuntimeError):
    """Stage 3: parameters no compiled frame uses would stay whole on every rank
    (``allow_unsharded`` accepts them)."""


class LossScaleError(FloatingPointError):
    """Gradients are not finite even at the minimum loss scale."""


class SwapFileError(OSError):
    """The swap file cannot be created, grown or written: a path, permission or space problem."""


class CollectiveMismatchError(RuntimeError):
    """A zerocompile collective waited past ``collective_timeout_s`` because the ranks are at
    different collectives (or one is gone); the message holds every rank's position and the
    likely cause. ``reports``: each rank's position as the ranks gave it (None: no answer);
    ``cause``: the likely cause's text ("" where none of the known ones fits)."""

    def __init__(self, message: str, reports: dict | None = None, cause: str = ""):
        super().__init__(message)
        self.reports = reports or {}
        self.cause = cause


def unknown_key_message(key, names) -> str:
    """``unknown option 'stgae'; did you mean 'stage'?`` (or the valid names when none is close)."""
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid options: {', '.join(names)}"
    return f"unknown option '{key}'{hint}"


class DeepSpeedCheckpointError(ValueError):
    """A DeepSpeed checkpoint ``load_deepspeed_checkpoint`` cannot read (pipeline or tensor
    parallel, MoE experts, NVMe swap files, a universal checkpoint), or that does not fit the
    model or its optimizer."""
