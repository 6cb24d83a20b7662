"""Which optimizer classes ``ZeroOptimizer`` runs on flat shards, which on whole parameters.

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
``assume_elementwise=True``.

Optimizers that read a parameter as a whole (``WHOLE_PARAMETER``: Muon, Adafactor, and any class
given with ``whole_parameter=True``) run on whole parameters instead, each at one owner rank
(``zerocompile/optim/whole_param.py``). That is exact for any optimizer whose update of a
parameter depends on that parameter alone (its values, gradient and state). The classes in
``REFUSED`` couple all parameters together, or take no dense gradient, and are refused.
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

WHOLE_PARAMETER: dict[type, str] = {
    torch.optim.Adafactor: "it factors the second moment of every matrix over its rows and columns, "
                           "and scales each step by the RMS of the whole parameter",
    torch.optim.Muon: "it orthogonalizes each 2-D weight matrix as a whole (Newton-Schulz)",
}
"""torch optimizers that need whole parameters (subclasses included), with the reason: they run
on whole parameters at owner ranks."""

WHOLE_PARAMETER_BY_NAME: dict[str, str] = {
    "transformers.optimization.Adafactor": "it factors the second moment of every matrix over its rows and "
                                           "columns, and scales each update by its RMS and the parameter's",
}
"""Third-party whole-parameter optimizers (subclasses included), by ``module.QualifiedName`` so
that their packages need not be imported: Hugging Face's Adafactor (``TrainingArguments(optim=
"adafactor")``), checked against transformers 5's source (per parameter, skips missing gradients)."""

REFUSED: dict[type, str] = {
    torch.optim.LBFGS: "it needs a closure that re-evaluates the model and keeps one flat history of "
                       "all parameters together (curvature pairs, line search), not one per parameter",
    torch.optim.SparseAdam: "it only takes sparse gradients; zerocompile's gradients are dense",
}
"""torch optimizers ZeroOptimizer cannot run, with the reason (subclasses included)."""

NOT_ELEMENTWISE: dict[type, str] = {**WHOLE_PARAMETER, **REFUSED}
"""Every class known not to be element-wise (the two tables above)."""


def _name(cls: type) -> str:
    module = cls.__module__
    public = "torch.optim" if module.startswith("torch.optim") else module
    return f"{public}.{cls.__qualname__}"


def needs_whole_parameter(optimizer_class: type, whole_parameter: bool = False) -> bool:
    """Whether ``optimizer_class`` runs on whole parameters: it is (a subclass of) one of
    ``WHOLE_PARAMETER``, or the caller says so with ``whole_parameter=True``."""
    return (whole_parameter or any(issubclass(optimizer_class, cls) for cls in WHOLE_PARAMETER)
            or any(class_name(cls) in WHOLE_PARAMETER_BY_NAME for cls in optimizer_class.__mro__))


def check_optimizer_class(optimizer_class: type, assume_elementwise: bool = False,
                          whole_parameter: bool = False) -> None:
    """Raise ``ValueError`` unless ``ZeroOptimizer`` can run ``optimizer_class``: not (a subclass
    of) one of ``REFUSED``; on whole parameters (``needs_whole_parameter``); or on flat shards,
    being one of ``ELEMENTWISE`` or vouched for with ``assume_elementwise=True``."""
    for unsafe, reason in REFUSED.items():
        if issubclass(optimizer_class, unsafe):
            via = "" if optimizer_class is unsafe else f" (a subclass of {_name(unsafe)})"
            raise ValueError(
                f"ZeroOptimizer: {_name(optimizer_class)}{via} cannot run on sharded parameters: {reason}. "
                f"ZeroOptimizer runs element-wise optimizers on shards (such as "
                f"{', '.join(c.__name__ for c in ELEMENTWISE)}) and whole-parameter ones (such as "
                f"{', '.join(c.__name__ for c in WHOLE_PARAMETER)}) at owner ranks")
    if whole_parameter and assume_elementwise:
        raise ValueError("ZeroOptimizer: assume_elementwise=True and whole_parameter=True contradict each other: "
                         "say which one your optimizer is")
    if assume_elementwise:
        known = {**WHOLE_PARAMETER, **{cls: WHOLE_PARAMETER_BY_NAME[class_name(cls)] for cls in optimizer_class.__mro__
                                       if class_name(cls) in WHOLE_PARAMETER_BY_NAME}}
        for cls, reason in known.items():
            if issubclass(optimizer_class, cls):
                raise ValueError(
                    f"ZeroOptimizer: {_name(optimizer_class)} is not element-wise ({reason}), so "
                    "assume_elementwise=True would run it on flat shards and give wrong results; drop "
                    "assume_elementwise: ZeroOptimizer runs it on whole parameters at owner ranks")
    if getattr(optimizer_class, "zerocompile_reduces_gradients", False):
        return      # DeepSpeed's 1-bit optimizers (zerocompile.OneBitAdam...): stage 0, they reduce themselves
    if optimizer_class in ELEMENTWISE or assume_elementwise or needs_whole_parameter(optimizer_class, whole_parameter):
        return
    raise ValueError(
        f"ZeroOptimizer: {_name(optimizer_class)} is not known to be element-wise. ZeroOptimizer runs "
        "it on a flat 1-D slice of each flattened parameter, which is exact only when every element's "
        "update depends on that element's value, gradient and state alone, never on the parameter's "
        "shape or on norms or means over it. Known element-wise (these exact classes, not subclasses, "
        f"which may override step): {', '.join(c.__name__ for c in ELEMENTWISE)}. If "
        f"{optimizer_class.__name__} is element-wise, say so: ZeroOptimizer(..., assume_elementwise=True); "
        "if it reads each parameter as a whole (a matrix optimizer), say that: "
        "ZeroOptimizer(..., whole_parameter=True), and it runs on whole parameters at owner ranks")


def check_elementwise(optimizer_class: type, assume_elementwise: bool = False) -> None:
    """The check of earlier versions: ``check_optimizer_class`` without ``whole_parameter``."""
    check_optimizer_class(optimizer_class, assume_elementwise)


def check_class_argument(optimizer_class, where: str = "optimizer_class") -> None:
    """Raise ``TypeError`` unless ``optimizer_class`` is a ``torch.optim.Optimizer`` subclass."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"ZeroOptimizer: {where} must be a torch.optim.Optimizer subclass "
                        f"(e.g. torch.optim.AdamW), got {optimizer_class!r}")


def class_name(cls: type) -> str:
    """``module.QualifiedName`` of a class: how checkpoints record a param group's own class."""
    return f"{cls.__module__}.{cls.__qualname__}"
