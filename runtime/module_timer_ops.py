"""The flops profiler's ``zerocompile::module_mark`` op, which ``passes/module_timers.py`` puts at
each module boundary of a compiled graph: it stamps the time in ``ACCOUNTING.module_times``
(``runtime/module_times.py``)."""

from __future__ import annotations

import torch

from zerocompile.runtime.accounting import ACCOUNTING


@torch.library.custom_op("zerocompile::module_mark", mutates_args=("xs",))
def module_mark(xs: list[torch.Tensor], site: int) -> None:
    """Stamp the time at ``site``. ``xs``, which it does not change, are the results of the ops
    before it that ops after it read: declared written, so that no compiler moves those ops across
    the mark or drops it."""
    ACCOUNTING.module_times.mark(site, xs[0].device)


@module_mark.register_fake
def _module_mark_fake(xs, site):
    return None
