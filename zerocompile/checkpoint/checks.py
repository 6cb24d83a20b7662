"""What saving and loading refuse before anything is written or changed: an optimizer that is
not a ``ZeroOptimizer``, or one that holds parameters the model does not; and ``listed``, the
short lists their messages (and the load checks') name."""

from __future__ import annotations

from zerocompile.optimizer import ZeroOptimizer
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.comm import CommGroup, agreement_digest, every_rank_holds

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


def check_every_rank_called(group: CommGroup, caller: str, path: str) -> None:
    """One small collective before any other: every rank of ``group`` called ``caller`` with the
    same ``path``. A rank that did not call it makes the others' wait end in the collective
    watchdog's ``CollectiveMismatchError`` (labelled ``caller``), not in a hang inside DCP's
    collectives, which the watchdog does not see."""
    if group.world == 1:
        return
    with PROCESS.watch.scope(caller):
        same = every_rank_holds(agreement_digest(str(path)), group.world, group.name)
    if not same:
        raise ValueError(f"{caller}: the ranks gave different paths (this rank: {str(path)!r}); every rank must "
                         "call it with the same path, on a file system they share")


def listed(items: list) -> str:
    shown = ", ".join(str(i) for i in items[:_MAX_LISTED])
    return shown + (f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")
