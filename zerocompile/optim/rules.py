"""Which optimizer classes ``ZeroOptimizer`` may run on flat shards.

``ZeroOptimizer`` hands the inner optimizer a flat 1-D slice of each flattened, padded
parameter instead of the parameter. That gives the same result as plain torch only when the
optimizer is *element-wise*: every element's update depends on that element's value,
gradient and state alone, plus scalars shared by the whole param group (lr, betas, the step
count). An optimizer that reads a parameter's shape, or reduces over it (a norm, a row or
column mean), sees a different tensor on each rank and gives a different result, silently.

The allow-list holds exact classes, not subclasses: a subclass may override ``step``. Each
entry was checked against torch 2.13's source, for every option of the class (``amsgrad``,
``foreach``, ``fused``, ``capturable``, ``differentiable``, ``decoupled_weight_decay``...):
they all update tensors element by element. Any other class needs the user's promise,
``assume_elementwise=True``; the classes in ``NOT_ELEMENTWISE`` are refused even then.
"""

from __future__ import annotations

import torch

ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
"""torch optimizers known to be exact on flat shards (exact classes)."""

NOT_ELEMENTWISE: dict[type, str] = {
    torch.optim.Adafactor: "it factors the second moment of every matrix over its rows and columns, "
                           "and scales each step by the RMS of the whole parameter; a flat shard has "
                           "neither the rows and columns nor the whole parameter",
    torch.optim.LBFGS: "it needs a closure that re-evaluates the model and keeps one flat history of "
                       "all parameters together (curvature pairs, line search), not one per shard",
    torch.optim.SparseAdam: "it only takes sparse gradients; shard gradients are dense",
    torch.optim.Muon: "it orthogonalizes each 2-D weight matrix as a whole; a shard is a 1-D slice "
                      "of the flattened matrix",
}
"""torch optimizers that cannot run on flat shards, with the reason (subclasses included)."""


def _name(cls: type) -> str:
    module = cls.__module__
    public = "torch.optim" if module.startswith("torch.optim") else module
    return f"{public}.{cls.__qualname__}"


def check_elementwise(optimizer_class: type, assume_elementwise: bool = False) -> None:
    """Raise ``ValueError`` unless ``optimizer_class`` may run on flat shards: it is one of
    ``ELEMENTWISE``, or the caller vouches for it with ``assume_elementwise=True`` and it is not
    (a subclass of) one of ``NOT_ELEMENTWISE``."""
    if getattr(optimizer_class, "zerocompile_reduces_gradients", False):
        return      # 1-bit Adam / 0/1 Adam: whole parameters at stage 0 (optim/local_gradients.py checks)
    for unsafe, reason in NOT_ELEMENTWISE.items():
        if issubclass(optimizer_class, unsafe):
            via = "" if optimizer_class is unsafe else f" (a subclass of {_name(unsafe)})"
            raise ValueError(
                f"ZeroOptimizer: {_name(optimizer_class)}{via} cannot run on flat parameter shards: "
                f"{reason}. ZeroOptimizer supports element-wise optimizers such as "
                f"{', '.join(c.__name__ for c in ELEMENTWISE)}")
    if optimizer_class in ELEMENTWISE or assume_elementwise:
        return
    raise ValueError(
        f"ZeroOptimizer: {_name(optimizer_class)} is not known to be element-wise. ZeroOptimizer runs "
        "it on a flat 1-D slice of each flattened parameter, which is exact only when every element's "
        "update depends on that element's value, gradient and state alone, never on the parameter's "
        "shape or on norms or means over it. Known element-wise (these exact classes, not subclasses, "
        f"which may override step): {', '.join(c.__name__ for c in ELEMENTWISE)}. If "
        f"{optimizer_class.__name__} is element-wise, say so: "
        "ZeroOptimizer(..., assume_elementwise=True)")
