"""The comms logger's timer ops, which ``passes/comm_timers.py`` puts around each collective of a
compiled graph: each stamps the time in ``ACCOUNTING.comms`` (``runtime/comms_log.py``)."""

from __future__ import annotations

import torch

from zerocompile.runtime.accounting import ACCOUNTING


@torch.library.custom_op("zerocompile::comm_timer_start", mutates_args=("x",))
def comm_timer_start(x: torch.Tensor, site: int) -> None:
    """Stamp the start of the collective at ``site`` whose input is ``x`` (which it does not
    change: declared written so that no compiler moves it after the collective or drops it)."""
    ACCOUNTING.comms.start(site, x)


@comm_timer_start.register_fake
def _comm_timer_start_fake(x, site):
    return None


@torch.library.custom_op("zerocompile::comm_timer_end", mutates_args=("xs",))
def comm_timer_end(xs: list[torch.Tensor], site: int) -> None:
    """Stamp the end of the collective at ``site``: ``xs`` are its waited results (unchanged)."""
    ACCOUNTING.comms.end(site, xs[0].device)


@comm_timer_end.register_fake
def _comm_timer_end_fake(xs, site):
    return None
