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

from zerocompile.runtime import in_place_reduction, point_to_point, watched_collectives  # noqa: F401  (registers the ops counted here)
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


_P2P = torch.ops.zerocompile
_GATHERS = (_c10d.all_gather_into_tensor.default,
            _c10d.all_gather_into_tensor_out.default,  # the form all-gathers run in on gloo
            _P2P.all_gather_point_to_point.default,    # parameter_gather="point_to_point"
            _P2P.all_gather_point_to_point_unpacked.default,   # a bucket's, through shared memory
            _P2P.watched_all_gather.default,           # with the collective watchdog (collective_timeout_s)
            _P2P.watched_all_gather_into.default)

_KINDS = {
    _c10d.all_gather_into_tensor.default: ("all_gather", "out"),
    _c10d.all_gather_into_tensor_out.default: ("all_gather", "out"),
    _c10d.reduce_scatter_tensor.default: ("reduce_scatter", "in"),
    _c10d.all_reduce.default: ("all_reduce", "in"),
    _c10d.all_reduce_.default: ("all_reduce", "in"),   # in place: the optimizer step's buckets
    _c10d.all_to_all_single.default: ("all_to_all", "in"),   # the quantized reduce-scatter (qgZ)
    _P2P.all_gather_point_to_point.default: ("all_gather", "out"),
    _P2P.all_gather_point_to_point_unpacked.default: ("all_gather", "out"),
    _P2P.all_gather_point_to_point_out.default: ("all_gather", "out"),
    _P2P.reduce_scatter_point_to_point.default: ("reduce_scatter", "in"),
    _P2P.reduce_scatter_in_place.default: ("reduce_scatter", "in"),    # a gradient bucket, in its own memory
    _P2P.all_gather_point_to_point_into.default: ("all_gather", "outs"),
    _P2P.reduce_scatter_point_to_point_into.default: ("reduce_scatter", "xs"),
    # the collective watchdog's forms of the collectives above (runtime/watched_collectives.py)
    _P2P.watched_all_gather.default: ("all_gather", "out"),
    _P2P.watched_all_gather_into.default: ("all_gather", "out"),
    _P2P.watched_reduce_scatter.default: ("reduce_scatter", "in"),
    _P2P.watched_all_reduce.default: ("all_reduce", "in"),
    _P2P.watched_all_reduce_.default: ("all_reduce", "in"),
    _P2P.watched_all_to_all.default: ("all_to_all", "in"),
}


def _written(func, args: tuple, out):
    """The result of a collective op that writes into a buffer it is given, else ``out``."""
    if func is _P2P.all_gather_point_to_point_out.default:
        return args[3]
    if func is _P2P.watched_all_gather_into.default:
        return args[4]
    return out


class CollectiveCounter(_RuntimeMode):
    """Counts by kind (point-to-point transfers as the collective they replace: the all-gathers
    of ``parameter_gather``, the reduce-scatters of ``gradient_reduction="point_to_point"``)."""

    def __init__(self):
        super().__init__()
        self.count = defaultdict(int)
        self.bytes = defaultdict(int)
        self.point_to_point = 0
        """How many of the collectives ran as point-to-point transfers."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (_P2P.all_gather_point_to_point.default, _P2P.all_gather_point_to_point_unpacked.default,
                    _P2P.all_gather_point_to_point_out.default,
                    _P2P.reduce_scatter_point_to_point.default, _P2P.all_gather_point_to_point_into.default,
                    _P2P.reduce_scatter_point_to_point_into.default):
            self.point_to_point += 1
        if func is _P2P.reduce_scatter_in_place.default and args[4] != "reduce_scatter":
            self.point_to_point += 1     # a bucket's point-to-point reduce-scatter, in its own memory
        if func in _KINDS:
            kind, which = _KINDS[func]
            if which in ("outs", "xs"):     # many tensors at once, one collective
                tensors = args[1] if which == "outs" else args[0]
            else:
                tensors = [_written(func, args, out) if which == "out" else args[0]]
                if func is _P2P.all_gather_point_to_point_unpacked.default:
                    tensors = out               # one tensor per member of the bucket
            self.count[kind] += 1
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in tensors)
        return out


class GatherGroupSizes(_RuntimeMode):
    """How many all-gathers ran over groups of each size (``{group_size: count}``)."""

    def __init__(self):
        super().__init__()
        self.sizes = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _GATHERS:
            self.sizes[args[1]] += 1
        return out


class AllToAlls(_RuntimeMode):
    """The all-to-alls that ran (qgZ's quantized reductions): ``{(group_name, group_size):
    [count, bytes sent]}``, the input's bytes."""

    def __init__(self):
        super().__init__()
        self.groups = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (_c10d.all_to_all_single.default, _P2P.watched_all_to_all.default):
            entry = self.groups[(args[3], len(args[1]))]
            entry[0] += 1
            entry[1] += args[0].numel() * args[0].element_size()
        return out


class GatheredBytes(_RuntimeMode):
    """Peak bytes of all-gather outputs (gathered parameters) alive at the same time, and
    peak bytes of all-gathers in flight (started, their ``wait_tensor`` not yet run).

    ``peak`` follows storages, so it depends on when gloo's worker thread lets go of a
    finished collective's buffers (a moment after ``wait()``, later on a loaded machine);
    ``inflight_peak`` follows the program's own order of ops, so it is exact."""

    def __init__(self):
        super().__init__()
        self.alive = 0
        self.peak = 0
        self.inflight_peak = 0
        self.started_behind_another = 0  # all-gathers started while another was in flight
        self._refs: dict[int, weakref.ref] = {}
        self._pending: dict[int, int] = {}  # storage key of a started all-gather -> bytes

    def _freed(self, key: int, nbytes: int) -> None:
        self.alive -= nbytes
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _GATHERS:
            self.started_behind_another += bool(self._pending)
            # a bucket's gather through shared memory returns its members, each waited for apart
            out_ = _written(func, args, out)
            for t in out_ if isinstance(out_, (list, tuple)) else [out_]:
                st = t.untyped_storage()
                key, nbytes = st._cdata, st.nbytes()
                if key not in self._refs:
                    self._refs[key] = weakref.ref(st, lambda _, key=key, n=nbytes: self._freed(key, n))
                    self.alive += nbytes
                    self.peak = max(self.peak, self.alive)
                self._pending[key] = nbytes
            self.inflight_peak = max(self.inflight_peak, sum(self._pending.values()))
        elif func is _c10d.wait_tensor.default:
            self._pending.pop(args[0].untyped_storage()._cdata, None)
        return out
