"""Loss scaling inside the compiled backward: the ``loss_scale`` option.

With ``options={"loss_scale": "dynamic"}`` (or a number, for a static scale) the training
loop stays ``loss.backward(); opt.step()``: every compiled frame's backward runs on
gradients multiplied by the scale S, and ``ZeroOptimizer`` divides them by S, skips the
step on every rank when any rank's gradients are not finite, and adjusts S as DeepSpeed's
dynamic loss scaler does.

Where S is applied (exact for any arrangement of frames, graph breaks and eager code):

- **Entering a frame's backward.** A pre-hook on the frame's compiled backward node
  multiplies each incoming output gradient by S, so the backward's activation gradients
  (in the compute dtype: float16) are scaled, which is what keeps them from underflowing.
- **Leaving it.** A hook on the same node divides by S every gradient the backward hands
  to something outside zerocompile: activations from an earlier frame or from eager code,
  inputs, and the user's parameters themselves (stage 0, and stage 1 when the replica is
  the parameter). Outside compiled frames gradients are therefore the ordinary, unscaled
  ones: eager code that shares a parameter (a tied eager head, a regulariser computed
  outside the model) adds true gradients to true gradients, and ``p.grad``, where it is
  readable, holds the true value.
- **Kept scaled.** Gradients the backward writes into zerocompile's own tensors (the flat
  master shards at stages 2/3, the compute-dtype replica at stage 1 with a 16-bit
  ``param_dtype``) stay scaled, in 16 bits where they are 16-bit; ``ZeroOptimizer``
  divides them by S after reducing them, in the master dtype (``float32``).

Frames chained through a graph break each scale and unscale on their own: the activation
gradient handed across the break is unscaled there (in the compute dtype), the one place
this design is not as good as scaling the whole backward at once.

S itself belongs to the ``ZeroOptimizer`` that steps the frame's parameters
(``opt.loss_scale``; it claims them when it is built); a frame reads it when its backward
runs. Until the optimizer has a scale (its first step, or a loaded state dict), frames use
the initial scale, which is also where the optimizer's scaler starts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from zerocompile import _torch_compat
from zerocompile.errors import LossScaleError
from zerocompile.runtime.session import PROCESS

log = logging.getLogger("zerocompile")

_DICT_KEYS = ("initial_scale", "window", "hysteresis", "min_scale", "consecutive_hysteresis", "dynamic")


@dataclass(frozen=True)
class LossScaleSettings:
    """What the ``loss_scale`` option asks for. Defaults are DeepSpeed's ``fp16`` defaults."""

    dynamic: bool = True
    """Lower the scale after overflows and raise it after ``window`` clean steps; False keeps
    ``initial_scale`` for good (steps with non-finite gradients are still skipped)."""
    initial_scale: float = 2.0**16
    window: int = 1000
    """Clean steps after the last overflow before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated (steps skipped, scale kept) before the scale halves."""
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every clean step (not only when the scale grows)."""


def parse_loss_scale(value) -> LossScaleSettings | None:
    """The ``loss_scale`` option: None (off), ``"dynamic"``, a number > 0 (a static scale)
    or a dict of ``LossScaleSettings`` fields (``dynamic`` defaults to True). Raises ``ValueError`` naming the
    problem."""
    allowed = ("allowed: None, 'dynamic', a static scale > 0, or a dict with keys "
               + ", ".join(_DICT_KEYS))
    if value is None or isinstance(value, LossScaleSettings):
        return value
    if value == "dynamic":
        return LossScaleSettings()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"option 'loss_scale' = {value!r} is invalid; {allowed}")
        return LossScaleSettings(dynamic=False, initial_scale=float(value))
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(_DICT_KEYS))
        if unknown:
            raise ValueError(f"unknown key '{unknown[0]}' in option 'loss_scale'; {allowed}")
        settings = LossScaleSettings(**value)
        _check_settings(settings)
        return settings
    raise ValueError(f"option 'loss_scale' = {value!r} is invalid; {allowed}")


def _check_settings(s: LossScaleSettings) -> None:
    def number(name, v, minimum, integer=False):
        ok = (isinstance(v, int) if integer else isinstance(v, (int, float))) and not isinstance(v, bool)
        if not ok or not math.isfinite(v) or v < minimum:
            kind = "an integer" if integer else "a number"
            raise ValueError(f"option 'loss_scale.{name}' = {v!r} is invalid; allowed: {kind} >= {minimum}")

    if not isinstance(s.dynamic, bool):
        raise ValueError(f"option 'loss_scale.dynamic' = {s.dynamic!r} is invalid; allowed: True, False")
    number("initial_scale", s.initial_scale, 1e-30)
    number("min_scale", s.min_scale, 1e-30)
    number("window", s.window, 1, integer=True)
    number("hysteresis", s.hysteresis, 1, integer=True)
    if not isinstance(s.consecutive_hysteresis, bool):
        raise ValueError(f"option 'loss_scale.consecutive_hysteresis' = {s.consecutive_hysteresis!r} "
                         "is invalid; allowed: True, False")
    if s.min_scale > s.initial_scale:
        raise ValueError(f"option 'loss_scale': min_scale {s.min_scale} is above initial_scale {s.initial_scale}")


class LossScaler:
    """A ``ZeroOptimizer``'s scale and its history, under DeepSpeed's dynamic rules:

    - overflow: the step is skipped; with hysteresis left, one unit of it is used up and
      the scale stays; otherwise the scale halves (not below ``min_scale``; an overflow
      already at ``min_scale`` raises ``LossScaleError``);
    - no overflow: when the number of clean steps since the last overflow, not counting
      this one, is a positive multiple of ``window``, the scale doubles and the hysteresis
      is refilled (``consecutive_hysteresis``: refilled after every clean step).

    Every rank calls ``update`` with the same, all-reduced overflow flag, so the scale is
    the same everywhere. The settings arrive with the first compiled frame that scales
    (``configure``); a state loaded before that is kept and wins over the initial scale.
    """

    def __init__(self, settings: LossScaleSettings | None = None):
        self.settings: LossScaleSettings | None = None
        self.scale: float | None = None
        self.iteration = 0
        self.last_overflow = -1
        self.hysteresis_left: int | None = None
        if settings is not None:
            self.configure(settings)

    def configure(self, settings: LossScaleSettings) -> None:
        self.settings = settings
        if self.scale is None:
            self.scale = float(settings.initial_scale)
        if self.hysteresis_left is None:
            self.hysteresis_left = settings.hysteresis

    def update(self, overflow: bool) -> None:
        s = self.settings
        if s.dynamic:
            if overflow:
                if self.hysteresis_left <= 1:
                    if self.scale <= s.min_scale:
                        raise LossScaleError(
                            f"zerocompile: gradients are not finite even at the minimum loss scale "
                            f"{s.min_scale}: the step was skipped, but training cannot recover by "
                            "scaling. Look for the source of inf/nan (learning rate, data, a "
                            "float16 overflow in the forward), or lower loss_scale.min_scale")
                    self.scale = max(self.scale / 2.0, s.min_scale)
                    log.info("loss scale lowered to %g after non-finite gradients", self.scale)
                else:
                    self.hysteresis_left -= 1
                self.last_overflow = self.iteration
            else:
                if s.consecutive_hysteresis:
                    self.hysteresis_left = s.hysteresis
                clean = self.iteration - self.last_overflow - 1
                if clean > 0 and clean % s.window == 0:
                    self.hysteresis_left = s.hysteresis
                    self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "iteration": self.iteration, "last_overflow": self.last_overflow,
                "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = None if state["scale"] is None else float(state["scale"])
        self.iteration = int(state["iteration"])
        self.last_overflow = int(state["last_overflow"])
        self.hysteresis_left = None if state["hysteresis_left"] is None else int(state["hysteresis_left"])


# ---------------------------------------------------------------------- who scales what
# The settings are the model's (its session's options, runtime/session.py), and the scaler is
# that of the ZeroOptimizer that steps a parameter (PROCESS.optimizer_of): nothing is set on
# the parameters themselves.


def current_scale(params: list, settings: LossScaleSettings, frame: str) -> float:
    """The scale a frame's backward applies now: the one of the optimizer that steps its
    parameters, or the initial scale while that optimizer has none yet."""
    owners = {id(s): s for p in params if (opt := PROCESS.optimizer_of(p)) is not None
              and (s := opt.scaler) is not None}
    if len(owners) > 1:
        raise RuntimeError(
            f"zerocompile [{frame}]: this compiled frame uses parameters of several ZeroOptimizers "
            "that each scale the loss; a frame's backward has one scale. Step the frame's "
            "parameters with one ZeroOptimizer, or use torch.amp.GradScaler (one scaler for all)")
    scale = next(iter(owners.values())).scale if owners else None
    return float(settings.initial_scale) if scale is None else scale


def holds_scaled_gradient(state) -> bool:
    """Whether ``state``'s gradient, as the compiled backward leaves it, is scaled: it is in
    one of zerocompile's own tensors (shard, separate replica), not the parameter itself."""
    return not state.rules.grad_on_param(state) and state.rules.shards_master


# ---------------------------------------------------------------------- frame hooks
def install_frame_scaling(outputs, args, states: list, settings: LossScaleSettings, frame: str) -> None:
    """Scale the backward of one run of a compiled frame (see the module docstring).

    ``outputs`` are what the compiled callable returned, ``args`` what Dynamo passed to the
    frame (its non-parameter inputs bound the search for the frame's backward node) and
    ``states`` the ``ShardedParam`` of each parameter the run used."""
    trainable = [sp for sp in states if sp.requires_grad]
    if not trainable:
        return      # no parameter gradient: scaling would change nothing but the rounding
    tensors = [t for t in (outputs if isinstance(outputs, (list, tuple)) else [outputs])
               if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    stop = {id(a.grad_fn) for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None}
    node = _torch_compat.compiled_backward_node(tensors, stop)
    if node is None:
        return      # every output aliases an input: the frame's backward computes nothing
    internal = {id(t) for sp in trainable for t in (sp.shard, sp.replica)
                if t is not None and t is not sp.param}
    keep_scaled = [fn is not None and id(getattr(fn, "variable", None)) in internal
                   for fn, _ in node.next_functions]
    params = [sp.param for sp in trainable]
    used = []

    def scale_outputs(grad_outputs):
        scale = current_scale(params, settings, frame)
        used.append(scale)
        return tuple(None if g is None else g * scale for g in grad_outputs)

    def unscale_inputs(grad_inputs, _grad_outputs):
        scale = used.pop()
        return tuple(g if g is None or keep else g / scale for g, keep in zip(grad_inputs, keep_scaled))

    node.register_prehook(scale_outputs)
    node.register_hook(unscale_inputs)
