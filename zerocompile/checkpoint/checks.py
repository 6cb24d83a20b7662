"""What saving and loading refuse before anything is written or changed: an optimizer that is
not a ``ZeroOptimizer``, or one that holds parameters the model does not; and ``listed``, the
short lists their messages (and the load checks') name."""

from __future__ import annotations

from zerocompile.optimizer import ZeroOptimizer

_MAX_LISTED = 8


def check_optimizer(optimizer) -> None:
    if optimizer is not None and not isinstance(optimizer, ZeroOptimizer):
        raise TypeError(f"zerocompile checkpoints hold a zerocompile.ZeroOptimizer's state, got "
                        f"{type(optimizer).__name__}; for other optimizers use torch.distributed.checkpoint")


def check_optimizer_params(optimizer: ZeroOptimizer, fqns: dict, caller: str) -> None:
    strangers = [tuple(p.shape) for p in optimizer._params() if p not in fqns]
    if strangers:
        raise ValueError(f"{caller}: the optimizer holds {len(strangers)} parameter(s) that are not in the "
                         f"model (shapes {listed(strangers)}); pass the model the optimizer trains")


def listed(items: list) -> str:
    shown = ", ".join(str(i) for i in items[:_MAX_LISTED])
    return shown + (f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")
