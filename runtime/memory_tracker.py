"""Live tensor-storage bytes, measured independently of any allocator.

``LiveStorageTracker`` is a ``TorchDispatchMode``. While it is active it records, by weak
reference, the storage of every tensor that an op returns (and of any tensor passed to
``track()``). ``live_bytes()`` is then the current size of every recorded storage that is
still alive. It is what the tests and the benchmarks use to check memory claims on CPU,
where ``torch.cuda.memory_allocated()`` does not exist and the process RSS reflects the
allocator's caching rather than the tensors in use.

What it measures:

- Every storage created by an op dispatched while the tracker is active: parameters (if
  the model is built under it), gradients, optimizer state, activations, collective
  buffers; and every storage an op writes in place (per its schema), which also records
  storages created while the tracker did not look, once an op updates them. A storage counts its current ``nbytes()``, so one freed by
  ``untyped_storage().resize_(0)`` counts zero and one resized later counts its new size.
- Each storage once, however many tensors (views) use it.
- Inner tensors of traceable wrapper subclasses (such as ``DTensor``, which FSDP2's sharded
  parameters are): their storages are recorded, not the wrapper.

Its limits:

- Storages created while it is not active are invisible unless passed to ``track()``.
- Allocations that bypass the dispatcher are invisible: temporaries inside one C++ kernel
  and, notably, buffers that inductor-generated code allocates directly
  (``empty_strided_cpu``) and frees before returning. Tensors that such code *returns*
  are invisible too, unless ``track_inputs=True``: then they are recorded as soon as an op
  that the tracker sees reads them (which also records storages created before the
  tracker started, once an op uses them).
- ``peak`` is sampled at op boundaries. By default it is kept incrementally (a storage adds
  its size when recorded, follows a resize when an op next reads or writes it, and removes
  its size when it dies), which is cheap but sees a storage resized outside any op
  (``untyped_storage().resize_``) only once an op touches it again; ``reset_peak()``
  resynchronises. With ``exact_peak=True`` the tracker recomputes ``live_bytes()`` after
  every op instead, which sees every resize but costs a pass over all recorded storages per op.
- A collective's buffers can outlive its ``wait_tensor`` for a moment: gloo's worker thread
  drops its reference to the finished work (which holds the input and output tensors) after
  it has woken the waiting thread, and later still on a loaded machine. A peak sampled in that
  moment counts a buffer the program has let go of, so two runs of the same program can
  report different peaks. With ``settle_collectives=S`` (seconds) the tracker waits, after
  each functional ``wait_tensor``, until the live bytes have not changed for ``S`` seconds
  (``settled_live_bytes``) before it samples. This makes a real run's peak repeatable (it
  is the figure ``zerocompile plan`` computes); it costs at least ``S`` per collective. Waits on c10d ``Work`` objects
  (``dist.all_gather(..., async_op=True).wait()``, as FSDP2 uses) are not dispatched ops
  and are not settled.
- A functional ``wait_tensor`` returns its argument, so the two are one storage. Under a
  ``FakeTensorMode`` (``zerocompile plan``) it returns a new fake tensor instead; the tracker
  counts that tensor as the storage it stands for, alive while either is, as in the real run.
- The dispatch mode adds Python overhead to every op, so do not time code under it.

``ignore_compile_internals()`` is True: Dynamo still compiles while the tracker is active,
and the tracker sees what the compiled code runs, not the fake tensors of tracing.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["AllocatorPeak", "LiveStorageTracker", "PeakAnatomy"]


def _plain_tensors(value, fake_mode=None):
    """Yield the plain (storage-backed) tensors in ``value``, unwrapping traceable subclasses;
    with ``fake_mode``, also the fake tensors of that ``FakeTensorMode``."""
    if not isinstance(value, torch.Tensor):
        return
    if is_traceable_wrapper_subclass(value):
        inner_names, _ = value.__tensor_flatten__()
        for name in inner_names:
            yield from _plain_tensors(getattr(value, name), fake_mode)
    elif type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
        if not value.is_meta:
            yield value
    elif fake_mode is not None and getattr(value, "fake_mode", None) is fake_mode:
        yield value


def _written_arguments(func, args, kwargs) -> list:
    """The tensors an op writes in place, from its schema (``Tensor(a!)``, ``Tensor(a!)[]``).
    torch's in-place ops also return them; an op that returns nothing (a custom op such as
    ``zerocompile::fused_adam_step``) does not, yet the storages it writes are in use."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(tree_flatten(value)[0])
    return out


class LiveStorageTracker(TorchDispatchMode):
    """Track the storages of tensors created under this mode and report their live bytes.

    Use it as a context manager around everything to be counted (build the model under
    it so its parameters count)::

        tracker = LiveStorageTracker()
        with tracker:
            model = build()
            ...
            tracker.reset_peak()
            step()
            print(tracker.peak, tracker.live_bytes())

    Attributes:
        peak: the largest number of live bytes seen since construction or ``reset_peak()``.
        current: the running total the incremental peak is kept from (see the module
            docstring for how it can lag behind storage resizes).
    """

    # higher-order operators (activation checkpointing's RNG ones) run on the modes below;
    # their outputs are recorded here like any op's
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, exact_peak: bool = False, track_inputs: bool = False, fake_mode=None,
                 settle_collectives: float = 0.0):
        """``exact_peak``: recompute live bytes after every op (sees storage resizes; slow).
        ``track_inputs``: also record storages of op inputs, not just outputs.
        ``settle_collectives``: after each functional ``wait_tensor``, wait until the live
        bytes have not changed for this many seconds before sampling (0: do not wait; see the
        module docstring).
        ``fake_mode``: also record the fake tensors of this ``FakeTensorMode`` (``zerocompile
        plan`` runs a whole script under one), never those of Dynamo's own tracing."""
        super().__init__()
        self.exact_peak = exact_peak
        self.track_inputs = track_inputs
        self.fake_mode = fake_mode
        self.settle_collectives = settle_collectives
        self._refs: dict[int, weakref.ref] = {}
        """Recorded storages by address (``storage._cdata``)."""
        self._sizes: dict[int, int] = {}
        """The size each recorded storage had when it was recorded (for ``current``)."""
        self._aliases: dict[int, tuple[weakref.ref, torch.UntypedStorage]] = {}
        """Storages that stand for another one (a fake ``wait_tensor``'s result), by address:
        a weak reference to each and the storage it keeps alive (counted in its place)."""
        self.current = 0
        self.peak = 0

    # ------------------------------------------------------------------ bookkeeping
    def _forget(self, key: int, ref: weakref.ref) -> None:
        """Weak-reference callback: a recorded storage died."""
        if self._refs.get(key) is ref:
            del self._refs[key]
            self.current -= self._sizes.pop(key)

    def track(self, tensor: torch.Tensor) -> None:
        """Record the storage(s) behind ``tensor`` (a no-op for ones already recorded)."""
        for t in _plain_tensors(tensor, self.fake_mode):
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._aliases:
                continue
            old = self._refs.get(key)
            if old is not None:
                if old() is not None:
                    # recorded already: follow a resize an op made (resize_storage_bytes_)
                    nbytes = storage.nbytes()
                    if nbytes != self._sizes[key]:
                        self.current += nbytes - self._sizes[key]
                        self._sizes[key] = nbytes
                        self.peak = max(self.peak, self.current)
                    continue
                self.current -= self._sizes[key]          # a dead one at a reused address
            nbytes = storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda ref, key=key: self._forget(key, ref))
            self._sizes[key] = nbytes
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current

    def _alias(self, result: torch.Tensor, argument: torch.Tensor) -> None:
        """Count ``result`` as the storage of ``argument`` (a ``wait_tensor`` that did not
        return its argument itself): that storage stays counted while ``result`` lives."""
        if not isinstance(result, torch.Tensor) or not isinstance(argument, torch.Tensor):
            return
        storage, stands_for = result.untyped_storage(), argument.untyped_storage()
        if storage._cdata == stands_for._cdata:
            return
        self.track(argument)
        key = storage._cdata
        self._aliases[key] = (weakref.ref(storage, lambda ref, key=key: self._aliases.pop(key, None)), stands_for)

    def recorded_size(self, storage) -> int | None:
        """The size ``storage`` counts with now (``None``: not recorded, or dead); a storage that
        stands for another (a fake ``wait_tensor``'s result) gives -1."""
        key = storage._cdata
        if key in self._aliases:
            return -1
        ref = self._refs.get(key)
        if ref is None or ref() is None:
            return None
        return self._sizes[key]

    def live_bytes(self) -> int:
        """Current bytes of every recorded storage that is still alive."""
        total = 0
        for ref in list(self._refs.values()):
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def settled_live_bytes(self, quiet_s: float = 0.1, timeout_s: float = 2.0, poll_s: float = 0.01) -> int:
        """``live_bytes()`` once it has stopped changing for ``quiet_s`` (at most ``timeout_s``).

        Call it with nothing else running. A collective's buffers can outlive its ``wait()``
        for a moment: gloo's worker thread drops its reference to the finished work (which
        holds the input and output tensors) after it has woken the waiting thread, and later
        still on a loaded machine. Reading right after a step can therefore count a buffer
        the program has already let go of; waiting for the figure to settle does not."""
        last, quiet_since = self.live_bytes(), time.monotonic()
        deadline = quiet_since + timeout_s
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            now = self.live_bytes()
            if now != last:
                last, quiet_since = now, time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_s:
                break
        return last

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now (this also resynchronises ``current``
        after storage resizes, which happen outside any op)."""
        for key, ref in list(self._refs.items()):
            storage = ref()
            if storage is not None:
                self._sizes[key] = storage.nbytes()
        self.current = sum(self._sizes[key] for key in self._refs)
        self.peak = self.current

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.track_inputs:
            for value in tree_flatten((args, kwargs))[0]:
                self.track(value)
        out = func(*args, **kwargs)
        if self.settle_collectives > 0 and func is torch.ops._c10d_functional.wait_tensor.default:
            self.settled_live_bytes(quiet_s=self.settle_collectives, timeout_s=10 * self.settle_collectives + 1.0,
                                    poll_s=min(0.001, self.settle_collectives))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            self._alias(out, args[0])
        for value in tree_flatten(out)[0]:
            self.track(value)
        for value in _written_arguments(func, args, kwargs):
            self.track(value)
        if self.exact_peak:
            self.current = self.live_bytes()
            self.peak = max(self.peak, self.current)
        return out


class PeakAnatomy(LiveStorageTracker):
    """A ``LiveStorageTracker`` (exact peak, inputs tracked) that also says what was live at the
    peak: ``at_peak`` = ``(op, groups)``, where ``op`` is the op after which the peak was
    reached and ``groups`` maps each op name to ``[bytes, storages]`` of the storages alive then
    that the op produced (a storage made while the tracker did not look counts under "made
    earlier, first read by" the first op that used it). It answers "whose memory is the peak", e.g. between two systems that train
    the same model (``benchmarks/stage3_vs_fsdp2.py --peak-anatomy``). A snapshot is taken at
    every new peak, so it is slower than the plain tracker: for diagnosis, not for timing."""

    def __init__(self, fake_mode=None):
        super().__init__(exact_peak=True, track_inputs=True, fake_mode=fake_mode)
        self._born: dict[int, str] = {}
        self._op = "before tracking"
        self.at_peak: tuple[str, dict[str, list[int]]] | None = None

    def track(self, tensor: torch.Tensor) -> None:
        for t in _plain_tensors(tensor, self.fake_mode):
            key = t.untyped_storage()._cdata
            ref = self._refs.get(key)
            if key not in self._aliases and (ref is None or ref() is None):
                self._born[key] = self._op
        super().track(tensor)

    def _snapshot(self) -> None:
        groups: dict[str, list[int]] = {}
        for key, ref in list(self._refs.items()):
            storage = ref()
            if storage is not None and storage.nbytes():
                entry = groups.setdefault(self._born.get(key, "before tracking"), [0, 0])
                entry[0] += storage.nbytes()
                entry[1] += 1
        self.at_peak = (self._op, dict(sorted(groups.items(), key=lambda kv: -kv[1][0])))

    def reset_peak(self) -> None:
        super().reset_peak()
        self._snapshot()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.peak
        self._op = f"made earlier, first read by {func}"
        for value in tree_flatten((args, kwargs or {}))[0]:
            self.track(value)
        self._op = str(func)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak > before:
            self._snapshot()
        return out


class AllocatorPeak:
    """The peak of a piece of code's memory as the CPU allocator saw it, including what
    ``LiveStorageTracker`` cannot see: buffers that inductor's generated code allocates and frees
    without the dispatcher, and temporaries inside kernels.

    Around the code (e.g. one training step)::

        with AllocatorPeak(start=tracker.live_bytes()) as alloc:
            step()
        alloc.peak                      # start + the largest rise of allocated bytes

    It runs ``torch.profiler.profile(profile_memory=True)``, whose allocator hook reports every
    allocation and free of c10's CPU allocator made on this thread
    (``_torch_compat.profiled_allocations``); ``rise`` is the largest sum of those over the code's
    prefixes, and ``peak`` that plus ``start``, the bytes live when the code began (the tracker's
    figure then, exact where only the model's state is alive: between steps).

    Limits: allocations of other threads (gloo's workers, file I/O threads) are not reported, as
    the dispatch mode does not see them either; memory not from c10's allocator (a mapped
    shared-memory segment) is not counted; a free made on another thread is not seen, so the
    block counts as live to the end (the figure errs high, never low). ``at_peak`` groups the
    blocks live at the peak that the code allocated by the op that allocated them. For
    measurements, not for timing: the profiler slows every op."""

    def __init__(self, start: int = 0):
        self.start = start
        self.rise = 0
        self.net = 0
        self.at_peak: dict[str, int] = {}
        self._profile = None

    @property
    def peak(self) -> int:
        return self.start + self.rise

    def __enter__(self) -> "AllocatorPeak":
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from zerocompile import _torch_compat

        self._profile.__exit__(*exc)
        events = _torch_compat.profiled_allocations(self._profile)
        self._profile = None
        total, best, best_at = 0, 0, -1
        for i, (_, nbytes, _, _) in enumerate(events):
            total += nbytes
            if total > best:
                best, best_at = total, i
        self.rise, self.net = best, total
        live: dict[int, tuple[int, str]] = {}
        for _, nbytes, address, op in events[: best_at + 1]:
            if nbytes > 0:
                live[address] = (nbytes, op)
            else:
                live.pop(address, None)
        groups: dict[str, int] = {}
        for nbytes, op in live.values():
            groups[op] = groups.get(op, 0) + nbytes
        self.at_peak = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
