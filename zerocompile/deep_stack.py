"""Calls run on one unbroken stretch of CPython's frame stack.

CPython 3.11 and later keep the frames of Python calls in chunks of 16 KiB, each mapped from the
operating system when a call does not fit in the current one and unmapped when that call returns
(``Python/pystate.c``: ``push_chunk``, ``_PyThreadState_PopFrame``). A loop that runs at a depth
where its callee's frame just crosses a chunk's end maps and unmaps a chunk, and takes its first
page fault, on every call: CPython issue gh-142183 ("Calls across stack chunks perform badly"),
fixed in 2026 for 3.13 and 3.14 by keeping one chunk per thread (gh-145789), not for 3.11 or 3.12
(the 3.11.7, 3.12.1 and 3.13.0 on this project's machine all thrash: ``tests/test_deep_stack.py``).
Dynamo's tracer, AOTAutograd, the partitioner and the passes run deep, recursive Python, and on
this machine (Python 3.11, ``perf record -a`` over a 2-rank stage-3 test) a fifth of all CPU time
went to mapping, faulting and unmapping those chunks. Started from ``on_a_deep_stack``, a 4-layer
HF Llama's compile and first steps took x0.84-0.93 of their time, paired
(``benchmarks/results/deep_stack.md``).

``on_a_deep_stack(fn, *args, **kwargs)`` calls ``fn`` from a frame that reserves ``RESERVED_BYTES``
of unused stack slots (its code is ``_call``'s with a larger ``co_stacksize``, through the public
``CodeType.replace``). CPython sizes a new chunk to the frame that needs it, rounded up to a power
of two, so that frame's chunk is 4 MiB, of which about 2 MiB are free for the frames ``fn`` calls:
thousands of nested Python calls with no chunk boundary between them, so no loop among
them can thrash. The cost: one 4 MiB mapping per call (only the pages used are ever touched; about 70 us
in all here) and one more frame in a traceback. Nothing else changes: the same call, arguments, return value and
exception, on the same thread. On a Python without chunked stacks it is an ordinary call.

Used around each ``backend="zero"`` compile (``backend.py``), the option-set recompiles of
``plan`` and the scripts that ``plan``, ``tune``, ``measure`` and ``dump`` run in their process
(``script_runner.py``): there the whole script, Dynamo's tracing included, runs on the deep
stack. A training loop of your own can be run the same way: ``on_a_deep_stack(main)``.
"""

from __future__ import annotations

import types

RESERVED_BYTES = 2 << 20
"""Stack bytes the calling frame reserves and never uses: CPython then gives it a chunk of
twice that, whose other half holds the frames of the call."""


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


_DEEP_CODE = _call.__code__.replace(co_stacksize=_call.__code__.co_stacksize + RESERVED_BYTES // 8)
"""``_call``'s code with ``RESERVED_BYTES`` more of (unused) value stack: a code object, immutable."""


def on_a_deep_stack(fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)``, called from a frame whose stack chunk leaves about 2 MiB for the
    frames under it (see the module's docstring)."""
    return types.FunctionType(_DEEP_CODE, globals(), "_call")(fn, args, kwargs)
