"""Replay of repeated graph runs under ``zerocompile plan``.

A model's identical blocks run the same compiled graph, once per block, and under ``plan``
every run is a walk over fake tensors that produces only shapes and storage sizes. The
first run of a graph with a given *signature* is executed and recorded; a later run with the
same signature is replayed: its outputs are made directly (same shapes, strides, dtypes and
storage sharing), and the measurements advance as the recorded run advanced them. On
Llama-3-70B (80 identical layers) this is most of ``plan``'s time.

Why a replay gives the figures an execution would:

- **Outputs.** An op on fake tensors computes metadata from metadata. A graph of such ops
  run on inputs with the same metadata (shape, stride, offset, dtype, device, storage size,
  which inputs share a storage) gives outputs with the same metadata and the same aliasing.
  Only graphs whose every op is an ATen, prims, functional-collective or zerocompile op that
  writes none of its arguments (per its schema) are replayed, so no input is changed.
- **Peak live bytes.** Inside a graph the ``LiveStorageTracker``'s count moves by what the
  ops allocate, which depends only on the graph and the metadata, and by the inputs that die
  after their last use, which depends on whether anything outside the graph still holds
  them. The signature includes, for each input, whether a tensor other than the run's inputs
  holds its storage (``_held_outside``), its Python references, and how the tracker counts its
  storage; after a replay the inputs that died are
  compared with the recorded run's. The peak then is the entry count plus the recorded rise.
  (torch keeps a Python reference to a tensor that C++, such as autograd, holds, so those
  count too.) If the dead inputs ever differ, the replay cannot vouch for that peak:
  ``mismatch`` says why, replay stops, and ``plan`` fails with an error that says to plan
  again without replay (``--no-replay``).
- **Step time.** The ``StepTimer``'s clocks move only by the events (compute seconds,
  collectives issued and waited) of the ops, which the replay applies in the same order.
  Graphs that issue a collective they do not wait for, or wait for one they did not issue,
  are never replayed.
- **Collective bytes** are counted per frame call outside the graphs (``stats()``), so
  replay does not touch them.

Anything else (a non-fake input, a symbolic shape, an output that is not a tensor or a
number, an output aliasing an input with another dtype) runs the graph as usual.
"""

from __future__ import annotations

import operator
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerocompile import _torch_compat

__all__ = ["GraphReplay", "active"]

_PURE_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "zerocompile"})
_SCALARS = (bool, int, float, str, type(None))


def active() -> "GraphReplay | None":
    """The ``GraphReplay`` active on this thread, if any."""
    for mode in _torch_compat.active_dispatch_modes():
        if isinstance(mode, GraphReplay):
            return mode
    return None


def replayable_graph(graph: torch.fx.GraphModule) -> bool:
    """Whether every op of ``graph`` is one a replay may skip: an ATen, prims, functional
    collective or zerocompile op that writes none of its arguments, or only tensors the graph
    made itself (``_made_in_graph``), also when activation checkpointing runs it under a saved
    RNG state; or ``getitem``."""
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.op != "call_function":
            return False
        target = node.target
        if target is operator.getitem:
            continue
        wrapped = _torch_compat.rng_wrapped_op(target, node.args)
        if wrapped is not None:     # a random op of a recomputed region, under a saved RNG state
            target = wrapped[0]
        if not isinstance(target, torch._ops.OpOverload) or target.namespace not in _PURE_NAMESPACES:
            return False
        written = [node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                   for i, a in enumerate(target._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        if any(not _made_in_graph(w) for w in written):
            return False
    return True


def _made_in_graph(value) -> bool:
    """Whether ``value`` (an argument an op writes) is a tensor the graph itself made, which
    nothing outside the run sees: the new result of a zerocompile op (its schema returns no alias
    of an input), e.g. the gradient bucket ``reduce_scatter_in_place`` reduces."""
    return (isinstance(value, torch.fx.Node) and value.op == "call_function"
            and isinstance(value.target, torch._ops.OpOverload) and value.target.namespace == "zerocompile"
            and all(r.alias_info is None for r in value.target._schema.returns))


@dataclass
class _Record:
    """What one executed run did, for the runs with its signature."""

    container: type
    outputs: list
    """Per output: ``("value", v)``, ``("same", i)`` (input ``i`` itself), ``("view", i,
    geometry)`` (on input ``i``'s storage) or ``("new", group, geometry, is_view)``."""
    groups: list
    """Per fresh output storage: ``(numel, dtype, device)``."""
    dead: frozenset
    """The input storages (by first input index) that died during the run."""
    peak_rise: int
    """Largest tracked live bytes during the run minus those at its start."""
    events: list | None
    """The ``StepTimer`` events of the run, collective keys numbered from 0 within it."""


_NEVER = object()      # the record of a signature whose runs are always executed


class GraphReplay(TorchDispatchMode):
    """Active while ``plan`` runs a script: compiled graphs (``_torch_compat``'s eager inner
    compiler) hand their runs to ``run``. It passes every op through unchanged.

    ``tracker`` and ``timer``: ``plan``'s ``LiveStorageTracker`` and ``StepTimer``, whose
    figures a replay advances while ``measuring`` is True."""

    # higher-order operators (activation checkpointing's RNG ones) pass through, as every op does
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, tracker=None, timer=None):
        super().__init__()
        self.tracker = tracker
        self.timer = timer
        self.measuring = False
        self.executed = 0
        """Graph runs executed (including the recorded ones)."""
        self.replayed = 0
        """Graph runs replayed."""
        self.mismatch: str | None = None
        """Why a replay could not vouch for its figures (then replay stops)."""
        self._records: dict = {}
        self._graph_ok: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    def start_measuring(self, tracker, timer) -> None:
        """From now on a replay advances ``tracker`` and ``timer``: ``plan``'s, new for each
        measured step. What was recorded before is forgotten (the graphs it was recorded from may
        have been compiled anew since, ``FrameRunner.recompile``), and so is a mismatch."""
        self.tracker, self.timer = tracker, timer
        self.measuring = True
        self.mismatch = None
        self._records.clear()
        self._graph_ok.clear()

    # ---------------------------------------------------------------------------- runs
    def run(self, graph: torch.fx.GraphModule, execute, args: list):
        """Run ``graph`` on the boxed ``args`` (cleared, as ``execute`` clears them): replay an
        earlier run with the same signature, else ``execute(args)`` (recording it if it may be
        replayed later)."""
        ok = self._graph_ok.get(id(graph))
        if ok is None:
            ok = self._graph_ok[id(graph)] = (graph, replayable_graph(graph))
        key = self._signature(graph, args) if ok[1] and self.mismatch is None else None
        record = self._records.get(key) if key is not None else _NEVER
        if record is _NEVER:
            self.executed += 1
            return execute(args)
        if record is None:
            return self._record(key, execute, args)
        return self._replay(record, args)

    def _signature(self, graph, args) -> tuple | None:
        measuring = self.measuring and self.tracker is not None
        parts = [id(graph), self.measuring]
        first: dict[int, int] = {}
        on_storage: dict[int, int] = {}
        for a in args:
            if isinstance(a, torch.Tensor):
                key = a.untyped_storage()._cdata
                on_storage[key] = on_storage.get(key, 0) + 1
        for a in args:
            if isinstance(a, _SCALARS):
                parts.append((type(a), a))
                continue
            rng = _rng_state(a)
            if not rng and (not _torch_compat.is_fake_tensor(a) or not _static(a)):
                return None
            storage = a.untyped_storage()
            j = first.setdefault(storage._cdata, len(first))
            # ``fake_device``, not ``device``: reading that dispatches ``prim.device``, which
            # plan's modes would see
            parts.append((tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device if rng else a.fake_device,
                          a.requires_grad,
                          storage.nbytes(), j, _held_outside(storage, on_storage[storage._cdata]), sys.getrefcount(a),
                          self.tracker.recorded_size(storage) if measuring else None))
        return tuple(parts)

    def _record(self, key, execute, args):
        tensors, storages, first_input = _weak_inputs(args)
        tracker = self.tracker if self.measuring else None
        timer = self.timer if self.measuring else None
        if tracker is not None:
            saved_peak, entry = tracker.peak, tracker.current
            tracker.peak = entry
        if timer is not None:
            timer.recording = []
        try:
            self.executed += 1
            out = execute(args)
        finally:
            rise = 0
            if tracker is not None:
                rise = tracker.peak - entry
                tracker.peak = max(saved_peak, tracker.peak)
            events = None
            if timer is not None:
                events, timer.recording = timer.recording, None
        dead = frozenset(j for j, ref in enumerate(storages) if ref() is None)
        described = _describe(out, tensors, storages, first_input, tracker)
        if timer is not None:
            events = _numbered(events)
        if described is None or (timer is not None and events is None):
            self._records[key] = _NEVER
        else:
            self._records[key] = _Record(type(out), described[0], described[1], dead, rise, events)
        return out

    def _replay(self, record: _Record, args):
        tracker = self.tracker if self.measuring else None
        timer = self.timer if self.measuring else None
        if tracker is not None:
            saved_peak, entry = tracker.peak, tracker.current
        if timer is not None:
            keys = [object() for _ in range(sum(1 for e in record.events if e[0] == "collective"))]
            for event in record.events:
                timer.apply(event if event[0] == "compute" else (*event[:-1], keys[event[-1]]))
        _, storages, _ = _weak_inputs(args)
        outputs = _make_outputs(record, args, tracker)
        args.clear()
        dead = frozenset(j for j, ref in enumerate(storages) if ref() is None)
        if dead != record.dead and self.mismatch is None:
            self.mismatch = (f"a replayed graph run freed inputs {sorted(dead)} where the recorded run "
                             f"freed {sorted(record.dead)}")
        if tracker is not None:
            tracker.peak = max(saved_peak, entry + record.peak_rise)
        self.replayed += 1
        return record.container(outputs)


# ------------------------------------------------------------------------------- helpers
def _held_outside(storage, args_on_it: int) -> bool:
    """Whether a tensor other than the run's arguments holds ``storage`` (then it outlives the run
    whatever the run frees). Only that enters the signature, not how many do: the layers of a
    model compiled whole read one attention mask, which every layer's saved views make one owner
    more of, and runs that differ only there free the same inputs (checked after each replay)."""
    return _torch_compat.storage_owners(storage) - 1 - args_on_it > 0     # 1: the caller's ``storage``


def _rng_state(t) -> bool:
    """Whether ``t`` is an RNG state activation checkpointing saved (``run_and_save_rng_state``
    returns ``torch.get_rng_state()``, a real tensor even under plan's fake mode, since it is not
    dispatched): a real 1-D ``uint8`` tensor on the CPU. No shape depends on its values: a
    replayed run makes a fresh one of its size, and runs that receive one match on its metadata."""
    return (isinstance(t, torch.Tensor) and not _torch_compat.is_fake_tensor(t) and t.dtype == torch.uint8
            and t.dim() == 1 and t.device.type == "cpu" and not t.requires_grad)


def _static(t: torch.Tensor) -> bool:
    return all(type(v) is int for v in (*t.shape, *t.stride(), t.storage_offset()))


def _span(size, stride) -> int:
    """Elements from the first to one past the last element a view of this geometry reaches."""
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _make_outputs(record: _Record, inputs: list, tracker=None) -> list:
    """Fresh outputs as ``record`` describes them, on ``inputs`` where they alias one."""
    bases: list = [None] * len(record.groups)
    outputs = []
    for spec in record.outputs:
        kind = spec[0]
        if kind == "value":
            outputs.append(spec[1])
        elif kind == "same":
            outputs.append(inputs[spec[1]])
        elif kind == "view":
            outputs.append(inputs[spec[1]].as_strided(*spec[2]))
        elif kind == "rng_state":
            with _torch_compat.no_dispatch():     # real, as torch.get_rng_state() gives it
                outputs.append(torch.empty(spec[1], dtype=torch.uint8))
            if tracker is not None:
                tracker.track(outputs[-1])
        else:
            _, g, (size, stride, offset), is_view = spec
            numel, dtype, device = record.groups[g]
            if bases[g] is None and not is_view and offset == 0 and _span(size, stride) == numel:
                bases[g] = torch.empty_strided(size, stride, dtype=dtype, device=device)
                outputs.append(bases[g])
                continue
            if bases[g] is None:
                bases[g] = torch.empty(numel, dtype=dtype, device=device)
            outputs.append(bases[g].as_strided(size, stride, offset))
    return outputs


def _weak_inputs(args):
    """Weak references to each input tensor (``None`` for other values) and to each distinct
    input storage, and the first input index of each storage."""
    tensors, storages, first_input, seen = [], [], [], {}
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            tensors.append(None)
            continue
        tensors.append(weakref.ref(a))
        storage = a.untyped_storage()
        if storage._cdata not in seen:
            seen[storage._cdata] = len(storages)
            storages.append(weakref.ref(storage))
            first_input.append(i)
    return tensors, storages, first_input


def _describe(out, tensors, storages, first_input, tracker):
    """The output specs and fresh storage groups of ``out`` (``_Record``), or None when it
    cannot be replayed."""
    if type(out) not in (list, tuple):
        return None
    alive = {}
    for j, ref in enumerate(storages):
        storage = ref()
        if storage is not None:
            alive[storage._cdata] = j
    fresh: dict[int, int] = {}
    groups, specs = [], []
    for o in out:
        if isinstance(o, _SCALARS):
            specs.append(("value", o))
            continue
        same = next((i for i, ref in enumerate(tensors) if ref is not None and ref() is o), None)
        if same is not None:
            specs.append(("same", same))
            continue
        if _rng_state(o) and o.storage_offset() == 0 and o.is_contiguous():
            specs.append(("rng_state", o.numel()))      # a fresh one per run, as execution makes
            continue
        if not _torch_compat.is_fake_tensor(o) or not _static(o) or o.requires_grad:
            return None
        storage = o.untyped_storage()
        geometry = (tuple(o.shape), o.stride(), o.storage_offset())
        j = alive.get(storage._cdata)
        if j is not None:
            i = first_input[j]
            source = tensors[i]()
            if source is None or source.dtype != o.dtype:
                return None
            specs.append(("view", i, geometry))
            continue
        if tracker is not None and tracker.recorded_size(storage) != storage.nbytes():
            return None          # counted as another storage (a fake wait_tensor's result) or not at all
        g = fresh.get(storage._cdata)
        if g is None:
            if storage.nbytes() % o.element_size():
                return None
            g = fresh[storage._cdata] = len(groups)
            groups.append((storage.nbytes() // o.element_size(), o.dtype, o.fake_device))
        elif groups[g][1] != o.dtype:
            return None
        specs.append(("new", g, geometry, o._is_view()))
    return specs, groups


def _numbered(events: list) -> list | None:
    """``events`` with each collective's key replaced by its number within the run; None if a
    collective is left unwaited or a wait is for a collective issued before the run."""
    numbers: dict = {}
    pending = set()
    out = []
    issued = 0
    for event in events:
        if event[0] == "collective":
            numbers[event[2]] = n = issued
            issued += 1
            pending.add(n)
            out.append((*event[:2], n))
        elif event[0] == "wait":
            n = numbers.get(event[1])
            if n is None or n not in pending:
                return None
            pending.discard(n)
            out.append(("wait", n))
        else:
            out.append(event)
    return None if pending else out
