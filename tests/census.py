"""Independent measurements for the memory and communication tests.

``StorageCensus`` is ``zerocompile.runtime.memory_tracker.LiveStorageTracker``: a
TorchDispatchMode that records every storage any op creates while it is active (a weak
reference each), so ``live_bytes()`` is the current size of every storage created under
it that is still alive, freed storages (``resize_(0)``) counting zero. Build the model
under it so parameters are seen too.

``CollectiveCounter`` is a TorchDispatchMode that counts the c10d collectives it sees,
with the bytes of their full buffers (all-gather output, reduce-scatter input,
all-reduce tensor), independently of zerocompile's own accounting.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerocompile.runtime.memory_tracker import LiveStorageTracker

_c10d = torch.ops._c10d_functional


class _RuntimeMode(TorchDispatchMode):
    """A mode that sees what compiled graphs run, not the tracing that compiles them
    (``ignore_compile_internals``: without it Dynamo would not compile under the mode)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class StorageCensus(LiveStorageTracker):
    """The package's ``zerocompile.runtime.memory_tracker.LiveStorageTracker`` under the name
    these tests use: storages of op outputs, incremental peak."""


_KINDS = {
    _c10d.all_gather_into_tensor.default: ("all_gather", "out"),
    _c10d.reduce_scatter_tensor.default: ("reduce_scatter", "in"),
    _c10d.all_reduce.default: ("all_reduce", "in"),
}


class CollectiveCounter(_RuntimeMode):
    def __init__(self):
        super().__init__()
        self.count = defaultdict(int)
        self.bytes = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _KINDS:
            kind, which = _KINDS[func]
            t = out if which == "out" else args[0]
            self.count[kind] += 1
            self.bytes[kind] += t.numel() * t.element_size()
        return out


class GatheredBytes(_RuntimeMode):
    """Peak bytes of all-gather outputs (gathered parameters) alive at the same time."""

    def __init__(self):
        super().__init__()
        self.alive = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _freed(self, key: int, nbytes: int) -> None:
        self.alive -= nbytes
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _c10d.all_gather_into_tensor.default:
            st = out.untyped_storage()
            key, nbytes = st._cdata, st.nbytes()
            if key not in self._refs:
                self._refs[key] = weakref.ref(st, lambda _, key=key, n=nbytes: self._freed(key, n))
                self.alive += nbytes
                self.peak = max(self.peak, self.alive)
        return out
