"""Python's automatic garbage collection paused while a frame compiles.

A compile allocates millions of short-lived Python objects (FX nodes, fake tensors, sympy
expressions, inductor's IR). Python's collector runs after every 700 more container objects
made than freed, every tenth run takes the next generation too, and a full run, whenever a
quarter more objects have outlived two collections since the last one, walks every object the
process holds (torch, transformers, sympy, inductor: half a million, 0.25 s a walk here). On a
4-layer HF Llama at stage 3 (eager inner compiler, 2 CPUs, 3 steps) the collector took 1.3 s of
a 5.1 s first run and 0.8 s of a 3.2 s second one (Dynamo reset between), most of it in full
walks. Paused while the backend compiles, nothing is collected meanwhile; the reference cycles
a compile leaves are collected once after the step that compiled (``optim/update.py:
collect_compile_garbage``), a full collection that ran anyway. The same runs then took x0.90
and x0.91 of the time, paired, with the process's peak RSS 625 MB against 642
(``benchmarks/compile_collection.py``, ``benchmarks/results/compile_collection.md``); the plan of
the 80-layer Llama-3-70B script kept its 0.62 GiB (``benchmarks/results/plan_llama70b.md``).
torch's ``torch.distributed.checkpoint.state_dict`` pauses the collector the same way around its
own allocation-heavy work. The cost: cyclic garbage made during one compile stays until the
compile ends. Inductor's code generation runs with the collector on (``collection_resumed``):
paused through it as well, a cold first step of the 4M GPT took longer.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc

_PAUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("zerocompile_collection_paused", default=False)
"""Whether an enclosing ``collection_paused`` turned the collector off in this context."""


@contextlib.contextmanager
def collection_paused():
    """While open, Python's automatic garbage collection does not run (``gc.disable()``); on
    leaving, by return or by exception, it runs again as before: where it was already off (the
    user's ``gc.disable()``, or an enclosing pause) it stays off. ``gc.collect()`` still
    collects when called."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    token = _PAUSED.set(True)
    try:
        yield
    finally:
        _PAUSED.reset(token)
        gc.enable()


@contextlib.contextmanager
def collection_resumed():
    """Inside ``collection_paused``: the collector runs again while open (and is paused again
    after). Inductor's code generation of each graph runs under it: paused through inductor's
    own work too, a cold first step of the 4M GPT took 0.4-1.2 s longer (three runs in turn),
    although the collector itself took less time. Elsewhere (no pause, or the user's
    ``gc.disable()``) nothing changes."""
    if not _PAUSED.get() or gc.isenabled():
        yield
        return
    gc.enable()
    try:
        yield
    finally:
        gc.disable()
