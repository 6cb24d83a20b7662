"""The timer ops the comms logger and the flops profiler put into compiled graphs
(``passes/lowerings/comm_timers.py``, ``passes/lowerings/module_timers.py``): each stamps the time in the comms
logger or flops profiler of the model whose graph it is in (``runtime/comms_log.py``,
``runtime/module_times.py``; its site number names it, ``runtime/session.py``'s ``TimerSites``)
and changes no value.

- ``zerocompile::comm_timer_start(Tensor(a!) x, int site)``: right before a collective whose input is ``x``;
- ``zerocompile::comm_timer_end(Tensor(a!)[] xs, int site)``: right after its waits, ``xs`` their results;
- ``zerocompile::module_mark(Tensor(a!)[] xs, int site)``: at a module boundary, ``xs`` what the ops
  before it made that the ops after it read.

Their schemas say they write the tensors they are given. They write nothing: the ``(a!)`` keeps
each in place, since no compiler moves an op across a write of a tensor it reads, and none drops
an op that writes. They are defined with ``torch.library.Library`` and a kernel for
``CompositeExplicitAutograd`` only, not with ``torch.library.custom_op``: custom_op registers, for
an op that declares writes, a kernel that bumps each written tensor's version counter, as a real
in-place op must. A timer given a parameter (or a view of one) then made autograd refuse a
backward that had saved it in eager code ("modified by an inplace operation"); without that kernel
no version changes.
"""

from __future__ import annotations

import torch

from zerocompile.runtime.session import PROCESS

# the registration handle of these ops' definitions: it must live as long as the process does
_LIBRARY = torch.library.Library("zerocompile", "FRAGMENT")
_LIBRARY.define("comm_timer_start(Tensor(a!) x, int site) -> ()")
_LIBRARY.define("comm_timer_end(Tensor(a!)[] xs, int site) -> ()")
_LIBRARY.define("module_mark(Tensor(a!)[] xs, int site) -> ()")


def _comm_timer_start(x: torch.Tensor, site: int) -> None:
    log = PROCESS.sites.owner(site)
    if log is not None:
        log.start(site, x)


def _comm_timer_end(xs: list[torch.Tensor], site: int) -> None:
    log = PROCESS.sites.owner(site)
    if log is not None:
        log.end(site, xs[0].device)


def _module_mark(xs: list[torch.Tensor], site: int) -> None:
    times = PROCESS.sites.owner(site)
    if times is not None:
        times.mark(site, xs[0].device)


def _nothing(*_args) -> None:
    """The fake kernel (FakeTensor, meta): a timer makes no value."""


for _name, _kernel in (("comm_timer_start", _comm_timer_start), ("comm_timer_end", _comm_timer_end),
                       ("module_mark", _module_mark)):
    _LIBRARY.impl(_name, _kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"zerocompile::{_name}", _nothing, lib=_LIBRARY)
