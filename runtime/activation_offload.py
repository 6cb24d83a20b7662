"""Saved activations out of memory between forward and backward: the ops of the
``offload_activations`` pass and the stores behind them.

The pass (passes/offload_activations.py) puts two ops into the compiled graphs:

- ``zerocompile::offload_activation(t, device, nvme_path)`` in the forward graph, right after
  ``t`` is made: copies ``t``'s bytes out (to a file under ``nvme_path``, or to pinned host
  memory for a CUDA tensor) and returns a *token*, a one-element int64 CPU tensor naming the
  copy. The forward graph saves the token for backward instead of ``t``, so ``t``'s memory is
  freed as soon as the forward's last use of it is done. The op returns once ``t`` has been
  copied into a page-aligned staging buffer (a memory copy; for CUDA, a copy queued on a side
  stream that the allocator waits for), so inductor may reuse ``t``'s buffer at once; the
  write to the file runs on the store's I/O threads.
- ``zerocompile::reload_activation(token, device, nvme_path, size, stride, dtype, target)`` in
  the backward graph, started ahead of the first use (the pass places it), and a
  ``_c10d_functional.wait_tensor`` of its result right before that use: the read runs on the
  I/O threads while the backward computes, and the wait blocks until the bytes are in (as a
  functional collective's wait does; ``_torch_compat.register_pending_works``). The copy is
  kept until autograd drops the token (after the backward, or with ``retain_graph=True`` after
  the last one), and then released: its file region goes back to the store's free list, for
  the next forward's copies. A token no backward reads (a loss never backpropagated) is
  released the same way.

**Stores.** One ``FileStore`` per ``nvme_path`` and process (a ``SwapFile``, ``O_DIRECT``
where the filesystem allows it, deleted at exit) and one ``HostStore`` per process; the ops
find theirs by their arguments (``stores``), so graphs replayed from the compile cache after a
restart find one too. Regions are reserved with ``posix_fallocate`` the first time a copy of
their size is made (the first step): a full disk is a ``SwapFileError`` naming the directory
and the bytes there, raised by the first forward, not a short write later. Regions are reused
by later copies of the same size (the same tensor in the next micro-batch), so the file grows
to the bytes one forward offloads (times the forwards in flight before their backward).

**Host memory in flight.** A tensor is copied, in pieces of at most ``CHUNK_BYTES``, into
page-aligned staging buffers, each written by the I/O threads and given back to the store's
pool when its write is done. The pool keeps them by size for the rest of the forward (whose
copies are of like sizes) and frees the idle ones when the backward's first reload starts, so
they do not add to the backward's memory; it holds at most ``IN_FLIGHT_BYTES``: when the buffers waiting to
be written fill it, the next copy waits for one, so a forward that makes activations faster
than the disk takes them is slowed down rather than growing memory. A reload reads straight
into the page-aligned tensor it returns.

The values are the bytes that were written: a reloaded tensor is bitwise the saved one.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

from zerocompile import _torch_compat
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.swap_file import SwapFile, aligned_empty, round_up

IN_FLIGHT_BYTES = 16 << 20
"""Most bytes of staging buffers (copies waiting to be written) a file store holds."""
CHUNK_BYTES = 4 << 20
"""Bytes of one staging buffer; a larger tensor is copied and written in pieces of this size."""


def dense_span(size, stride) -> int | None:
    """Elements of the storage span of a tensor of ``size`` and ``stride`` when it is
    non-overlapping and dense (contiguous up to a permutation of its dimensions), else None.
    Such a tensor is its span's bytes in memory order, whatever its strides."""
    dims = sorted((int(st), int(sz)) for sz, st in zip(size, stride) if int(sz) != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return None
        expected *= sz
    numel = 1
    for sz in size:
        numel *= int(sz)
    return numel


def _flat_span(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in memory order, as a 1-D view (``t`` dense, see ``dense_span``)."""
    return t.as_strided((t.numel(),), (1,))


class _StagingPool:
    """Page-aligned host buffers that copies wait in until written, by size (page-rounded; a step
    copies tensors of the sizes the last one did, so after the first step it allocates none).
    The buffers in use plus the idle ones hold at most ``max_bytes``: idle buffers of other sizes
    are freed to make room, and when the ones in use fill it, ``acquire`` waits for one to be
    given back (its write done)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._idle: dict[int, list] = {}
        self._idle_bytes = 0
        self._in_use_bytes = 0
        self._ready = threading.Condition()

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = round_up(max(nbytes, 1))
        with self._ready:
            while True:
                idle = self._idle.get(size)
                if idle:
                    self._idle_bytes -= size
                    self._in_use_bytes += size
                    return idle.pop()
                while self._idle_bytes and self._in_use_bytes + self._idle_bytes + size > self.max_bytes:
                    other = next(k for k, v in self._idle.items() if v)
                    self._idle[other].pop()               # freed here, on the thread that copies
                    self._idle_bytes -= other
                if self._in_use_bytes == 0 or self._in_use_bytes + size <= self.max_bytes:
                    self._in_use_bytes += size
                    break
                self._ready.wait()
        return aligned_empty(size, torch.uint8)

    def trim(self) -> None:
        """Free the idle buffers (the backward has begun: no copy needs them until the next forward)."""
        with self._ready:
            self._idle.clear()
            self._idle_bytes = 0

    def give_back(self, chunk: torch.Tensor) -> None:
        size = chunk.numel()
        with self._ready:
            self._in_use_bytes -= size
            self._idle.setdefault(size, []).append(chunk)
            self._idle_bytes += size
            self._ready.notify_all()

    @property
    def nbytes(self) -> int:
        """Bytes of the staging buffers held now (in use and idle)."""
        with self._ready:
            return self._in_use_bytes + self._idle_bytes


class FileStore:
    """Copies of activations in one swap file under ``nvme_path`` (see the module docstring)."""

    def __init__(self, nvme_path: str, in_flight_bytes: int = IN_FLIGHT_BYTES, chunk_bytes: int = CHUNK_BYTES):
        self.file = SwapFile(nvme_path, "activations")
        self.staging = _StagingPool(in_flight_bytes)
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list] = {}          # region bytes -> free region keys
        self._writes: dict[int, list] = {}        # slot -> the writes of its pieces (a read waits for them)
        self._region_of: dict[int, int] = {}      # slot -> region key
        self._next_slot = 0
        self._next_region = 0

    def _region(self, nbytes: int) -> int:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        key = self._next_region
        self._next_region += 1
        self.file.reserve(key, nbytes)
        return key

    def offload(self, t: torch.Tensor) -> int:
        """Copy ``t`` (dense) piece by piece into staging buffers and start writing each; its slot."""
        nbytes = t.numel() * t.element_size()
        with self._lock:
            region = self._region(nbytes)
            slot = self._next_slot
            self._next_slot += 1
        source = _flat_span(t).view(torch.uint8) if nbytes else None
        writes = []
        for start in range(0, nbytes, self.chunk_bytes):
            n = min(self.chunk_bytes, nbytes - start)
            chunk = self.staging.acquire(n)
            chunk[:n].copy_(source[start:start + n])
            write = self.file.write(region, chunk[:n], start)
            write.then(lambda chunk=chunk: self.staging.give_back(chunk))
            writes.append(write)
        with self._lock:
            self._writes[slot] = writes
            self._region_of[slot] = region
        return slot

    def reload(self, slot: int, size, stride, dtype: torch.dtype, target: torch.device) -> torch.Tensor:
        """A tensor of ``size``/``stride`` on ``target`` that the read of ``slot`` fills; its wait is
        registered. The copy stays until ``release`` (a second backward may read it again)."""
        with self._lock:
            writes, region = self._writes[slot], self._region_of[slot]
        self.staging.trim()
        numel = dense_span(size, stride)
        raw = aligned_empty(numel, dtype)
        for write in writes:
            write.wait()                           # the bytes are in the file (or this raises)
        read = self.file.read(region, raw) if numel else None
        if target.type == "cpu":
            out = raw.as_strided(tuple(size), tuple(stride))
            _torch_compat.register_pending_works(out, [], then=read.wait if read is not None else None)
            return out
        on_device = torch.empty_strided(tuple(size), tuple(stride), dtype=dtype, device=target)

        def done():
            if read is not None:
                read.wait()
            _flat_span(on_device).copy_(raw)

        _torch_compat.register_pending_works(on_device, [], then=done)
        return on_device

    def release(self, slot: int) -> None:
        """The copy of ``slot`` is no longer needed: its region goes back to the free list."""
        with self._lock:
            region = self._region_of.pop(slot, None)
            writes = self._writes.pop(slot, ())
            if region is None:
                return
        for write in writes:
            write.wait()                           # never reuse a region a write still fills
        with self._lock:
            self._free.setdefault(self.file.regions[region].nbytes, []).append(region)

    def live_slots(self) -> int:
        with self._lock:
            return len(self._region_of)

    def held_bytes(self) -> int:
        """Bytes of the copies held now (in the file, waiting for their backward)."""
        with self._lock:
            return sum(self.file.regions[r].nbytes for r in self._region_of.values())

    def buffer_bytes(self) -> int:
        """Bytes of the staging buffers held now."""
        return self.staging.nbytes


class HostStore:
    """Copies of CUDA activations in page-locked host memory (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._copies: dict[int, tuple] = {}
        self._next_slot = 0
        self._streams: dict = {}

    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def offload(self, t: torch.Tensor) -> int:
        stream = self._stream(t.device)
        host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(_flat_span(t), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        t.record_stream(stream)                   # its memory is not reused before the copy is done
        with self._lock:
            slot = self._next_slot
            self._next_slot += 1
            self._copies[slot] = (host, done)
        return slot

    def reload(self, slot: int, size, stride, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with self._lock:
            host, written = self._copies[slot]
        stream = self._stream(device)
        out = torch.empty_strided(tuple(size), tuple(stride), dtype=dtype, device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        stream.wait_event(written)
        with torch.cuda.stream(stream):
            _flat_span(out).copy_(host, non_blocking=True)
            read = torch.cuda.Event()
            read.record(stream)
        out.record_stream(stream)

        def done():
            # the pinned copy may be freed at once: its allocator waits for the copy's event
            torch.cuda.current_stream(device).wait_event(read)

        _torch_compat.register_pending_works(out, [], then=done)
        return out

    def release(self, slot: int) -> None:
        with self._lock:
            self._copies.pop(slot, None)

    def live_slots(self) -> int:
        with self._lock:
            return len(self._copies)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(host.numel() * host.element_size() for host, _ in self._copies.values())

    def buffer_bytes(self) -> int:
        return 0


class Stores:
    """This process's stores, by what the ops name them with (``("nvme", path)`` or ``("cpu", "")``):
    one per process (``stores()``, ``PROCESS.service``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple, object] = {}

    def get(self, device: str, nvme_path: str):
        key = (device, os.path.abspath(nvme_path) if device == "nvme" else "")
        with self._lock:
            store = self._by_key.get(key)
            if store is None:
                store = self._by_key[key] = FileStore(key[1]) if device == "nvme" else HostStore()
            return store

    def all(self) -> list:
        with self._lock:
            return list(self._by_key.values())

    def process_figures(self) -> dict:
        """``zerocompile.stats()``' activation figures: what the stores hold now, and their buffers."""
        held = self.all()
        return {"offloaded_activation_bytes": sum(s.held_bytes() for s in held),
                "activation_buffer_bytes": sum(s.buffer_bytes() for s in held)}


def stores() -> Stores:
    """The stores of this process (the ops' only state; files are deleted at exit by ``SwapFile``)."""
    return PROCESS.service(Stores)


def _release_later(token: torch.Tensor, store, slot: int) -> None:
    # a token autograd drops without a backward (a loss never backpropagated) frees its copy
    weakref.finalize(token, store.release, slot)


@torch.library.custom_op("zerocompile::offload_activation", mutates_args=())
def offload_activation(t: torch.Tensor, device: str, nvme_path: str) -> torch.Tensor:
    """Copy ``t`` out (see the module docstring); the token naming the copy."""
    store = stores().get(device, nvme_path)
    slot = store.offload(t)
    token = torch.tensor([slot], dtype=torch.int64)
    _release_later(token, store, slot)
    return token


@offload_activation.register_fake
def _offload_activation_fake(t, device, nvme_path):
    return torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.custom_op("zerocompile::reload_activation", mutates_args=())
def reload_activation(token: torch.Tensor, device: str, nvme_path: str, size: list[int], stride: list[int],
                      dtype: torch.dtype, target: torch.device) -> torch.Tensor:
    """Start reading the copy ``token`` names back into a new tensor of ``size``/``stride``/``dtype``
    on ``target``; ``_c10d_functional.wait_tensor`` of the result waits for it."""
    store = stores().get(device, nvme_path)
    slot = int(token.item())
    return store.reload(slot, size, stride, dtype, target)


@reload_activation.register_fake
def _reload_activation_fake(token, device, nvme_path, size, stride, dtype, target):
    return torch.empty_strided(size, stride, dtype=dtype, device=target)


__all__ = ["FileStore", "HostStore", "Stores", "dense_span", "offload_activation", "reload_activation", "stores"]
