"""Point-to-point transfers between the ranks of one host through one shared-memory segment,
instead of gloo's sockets (``runtime/point_to_point.py`` takes either; ``"shared_memory"`` in
``gradient_reduction`` / ``parameter_gather``, chosen by measurement under ``"auto"``).

Why: on gloo every byte crosses the loopback TCP stack and gloo's worker threads. On this
project's 2-core machine, 2 ranks gathering 80 MiB each took 79-88 ms through gloo's sends and
receives, 39 ms through shared memory (a copy in by the sender, a copy out by each receiver), and
a message's signal 3 us instead of gloo's 177 us (``benchmarks/collectives.py`` has the rows).
This is what NCCL's shared-memory transport does for GPUs of one host.

How: one segment per process group, made the first time the group needs it (``open_channel``,
a collective) as a file in ``/dev/shm`` that every rank maps and rank 0 unlinks once all have:
nothing is left behind, even when a process dies. Each rank owns a ring of ``CAPACITY`` bytes in
it that only it writes and the others only read. Every transfer is cut into records of at most
``CHUNK`` bytes; since every rank starts the same transfers in the same order with the same
sizes (what a collective is), a record sits at the same position in every rank's ring, and two
counters per rank say all there is to say: ``head`` (bytes this rank wrote to its ring) and
``done`` (bytes of the other rings this rank has read). A record is read once every other
rank's head is past it; it is written once every other rank's done is past what it
overwrites. So a transfer larger than the ring flows through it record by record.

Waits: a rank progresses every transfer it started, in the order started, whenever it starts a
transfer or waits for one (``_ChannelWork.wait``): writes what fits, reads what arrived, and
polls the counters until the transfer waited for is read (spinning for a few microseconds, then
yielding the core, then sleeping; a peer whose process exited is a ``RuntimeError`` naming it
within half a second, as gloo's closed socket would be, and one that does not come within the
process group's timeout too: never a hang).

Memory order: the counters are aligned 64-bit words written after the data they announce and
read before it; x86-64 keeps stores in order and loads in order, which is all this needs, so
the transport is offered on x86-64 only (``unavailable_reason``).

Exact: bytes are only copied, so a transfer delivers what the socket would.
"""

from __future__ import annotations

import collections
import ctypes
import os
import platform
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from zerocompile import _torch_compat
from zerocompile.runtime.session import PROCESS

__all__ = ["CAPACITY", "CHUNK", "SharedMemoryChannel", "SharedMemoryUnavailable", "host_identity", "make_channel",
           "channel_of", "open_channel", "release_channel", "unavailable_reason"]

CAPACITY = 4 * 2**20
"""Bytes of each rank's ring: the segment holds ``world * CAPACITY`` bytes (plus a few cache
lines of counters), mapped by every rank of the host (``SharedMemoryChannel.nbytes``). Larger
rings bought nothing measurable: the 6-block GPT's stage 3 step (``benchmarks/stage3_vs_fsdp2.py
--n-layers 6 --inner-compiler eager``) took 0.73-0.80x FSDP2's with 8 MiB, 0.77x with 4 and
0.75x with 2, within this machine's noise."""
CHUNK = 2**20
"""The most bytes one record holds: a transfer larger than the ring flows through it in records
of this size, four to a ring, each written as soon as the other ranks have read the one it
overwrites."""
_LINE = 64
"""Each counter on its own cache line: ranks writing their own do not slow each other's reads."""
_X86_64 = ("x86_64", "amd64")


class SharedMemoryUnavailable(RuntimeError):
    """The ranks of a group cannot share memory (another host, another architecture, no
    ``/dev/shm``, CUDA tensors); the message says which."""


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why this process cannot use the transport, or None (a local check; ``open_channel``
    checks that every rank of the group is on this host)."""
    if torch.device(device).type != "cpu":
        return f"shared-memory transfers move CPU tensors; these are on {torch.device(device).type} (NCCL has its own)"
    if platform.machine().lower() not in _X86_64:
        return (f"shared-memory transfers rely on x86-64's memory order; this machine is {platform.machine()}: "
                "use 'point_to_point'")
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        return "there is no writable /dev/shm to make the shared segment in"
    return None


@dataclass
class _Step:
    """One record of a transfer: ``write(record)`` fills this rank's record, ``read(sender,
    record)`` takes what this rank needs from ``sender``'s (``record``: a uint8 view of the ring)."""

    pos: int
    nbytes: int
    write: Callable[[torch.Tensor], None]
    read: Callable[[int, torch.Tensor], None]
    sources: list
    """The tensors ``write`` reads (the transfer's, replaced by copies if the caller may reuse them)."""


class _ChannelWork:
    """What ``SharedMemoryChannel.exchange`` returns: ``wait()`` progresses the channel until
    the transfer's last record is written and read."""

    def __init__(self, channel: "SharedMemoryChannel", until: int):
        self.channel, self.until = channel, until

    def wait(self, timeout=None) -> bool:
        """Progress until done; with ``timeout`` (a ``timedelta``: the collective watchdog's
        polling), raise ``RuntimeError("Operation timed out!")`` past it, as gloo's ``wait`` does,
        the transfer going on at the next ``wait``."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        self.channel.progress(self.until, deadline)
        return True

    def is_completed(self) -> bool:
        return min(self.channel._read, self.channel._written) >= self.until


class SharedMemoryChannel:
    """The rings of one process group's ranks (see the module's docstring). ``segment``: the
    mapped segment (uint8), ``world * CAPACITY`` bytes after ``2 * world`` cache lines of
    counters; ``timeout_s``: how long a rank waits for another before raising."""

    def __init__(self, segment: torch.Tensor, rank: int, world: int, group_name: str, timeout_s: float,
                 capacity: int = CAPACITY, chunk: int = CHUNK, pids: list[int] | None = None):
        if chunk > capacity:
            raise ValueError(f"chunk ({chunk}) must fit the ring ({capacity})")
        self.segment, self.rank, self.world, self.group_name = segment, rank, world, group_name
        self.timeout_s, self.capacity, self.chunk = timeout_s, capacity, chunk
        self.pids = pids
        """Each rank's process id (same host): a wait notices a rank that exited."""
        base = segment.data_ptr()
        # views of the counters (the segment keeps the memory mapped as long as this object lives)
        self._head = [ctypes.c_int64.from_address(base + _LINE * r) for r in range(world)]
        self._done = [ctypes.c_int64.from_address(base + _LINE * (world + r)) for r in range(world)]
        rings = 2 * world * _LINE
        self.rings = [segment[rings + r * capacity : rings + (r + 1) * capacity] for r in range(world)]
        self._peers = [r for r in range(world) if r != rank]
        self._tail = 0                       # position (in bytes ever written) of the next record
        self._unwritten: collections.deque[_Step] = collections.deque()
        self._unread: collections.deque[_Step] = collections.deque()
        self.needed = False
        """Set where a choice of collectives takes this channel (``release_channel`` keeps it)."""
        self._steps = 0                      # records started
        self._written = 0                    # records written
        self._read = 0                       # records read

    @property
    def nbytes(self) -> int:
        """Bytes of the segment (every rank of the host maps all of it; it exists once)."""
        return self.segment.numel()

    # ----------------------------------------------------------------------------- transfers

    def exchange(self, pairs: list, copy_input: bool = False) -> list:
        """The transfers of ``runtime/point_to_point.py``'s ``_exchange``, through the rings: for
        every other rank ``peer`` and each ``(send, receive)`` of ``pairs``, ``send(peer)`` goes to
        ``peer``, and what ``peer`` sends this rank lands in ``receive(peer)``; every rank calls it
        with the same pairs' sizes (``send(peer)`` of one size for every peer; a pair whose
        ``send`` is one tensor for every peer is written once and read by all). Returns one work
        whose ``wait`` completes them. What could not be written yet is sent later from the
        tensors themselves, or from a copy of them with ``copy_input`` (the caller may then
        reuse their memory as soon as this returns)."""
        deferred = []
        for send, receive in pairs:
            sends = [_bytes(send(peer)) for peer in self._peers]
            receives = {peer: _bytes(receive(peer)) for peer in self._peers}
            if not sends or sends[0].numel() == 0:
                continue
            one = all(s.data_ptr() == sends[0].data_ptr() for s in sends)
            sources = [sends[0]] if one else sends
            per = max(1, self.chunk // len(sources))
            for a in range(0, sends[0].numel(), per):
                self._add(sources, receives, a, min(a + per, sends[0].numel()), one)
            deferred.append(sources)
        until = self._steps
        self.progress(None)
        if copy_input:
            for sources in deferred:
                # whatever of this pair is still unwritten is sent from a copy (started steps of
                # the pair are a tail of the queue, so any unwritten one is still in it)
                if any(step.sources is sources for step in self._unwritten):
                    sources[:] = [s.clone() for s in sources]
        return [_ChannelWork(self, until)]

    def _add(self, sources: list, receives: dict, a: int, b: int, one: bool) -> None:
        n = b - a
        nbytes = n * len(sources)
        offset = self._tail % self.capacity
        if offset + nbytes > self.capacity:            # records never wrap: skip to the ring's start
            self._tail += self.capacity - offset
        pos, self._tail = self._tail, self._tail + nbytes
        rank = self.rank

        def write(record):
            for i, src in enumerate(sources):
                record[i * n : (i + 1) * n].copy_(src[a:b])

        def read(sender, record):
            slot = 0 if one else rank - (rank > sender)
            receives[sender][a:b].copy_(record[slot * n : (slot + 1) * n])

        step = _Step(pos, nbytes, write, read, sources)
        self._unwritten.append(step)
        self._unread.append(step)
        self._steps += 1

    def progress(self, until: int | None, deadline: float | None = None) -> None:
        """Write every started record that fits and read every one that arrived, in order;
        with ``until``, repeat until the first ``until`` records are written and read (polling,
        see the module): a rank returns from a wait only when the others no longer need it for
        that transfer. Past ``deadline`` (``time.monotonic()``), ``RuntimeError("Operation timed out!")``."""
        patience = _Patience(self)
        while True:
            moved = False
            while self._unwritten and self._can_write(self._unwritten[0]):
                step = self._unwritten.popleft()
                step.write(self.rings[self.rank][self._at(step)])
                self._head[self.rank].value = step.pos + step.nbytes
                self._written += 1
                moved = True
            while self._unread and self._can_read(self._unread[0]):
                step = self._unread.popleft()
                for peer in self._peers:
                    step.read(peer, self.rings[peer][self._at(step)])
                self._done[self.rank].value = step.pos + step.nbytes
                self._read += 1
                moved = True
            if until is None or min(self._read, self._written) >= until:
                return
            if moved:
                patience = _Patience(self)
            else:
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError("Operation timed out!")
                patience.pause()

    def _at(self, step: _Step) -> slice:
        offset = step.pos % self.capacity
        return slice(offset, offset + step.nbytes)

    def _can_write(self, step: _Step) -> bool:
        oldest = step.pos + step.nbytes - self.capacity       # what it overwrites must be read by all
        return all(self._done[peer].value >= oldest for peer in self._peers)

    def _can_read(self, step: _Step) -> bool:
        end = step.pos + step.nbytes
        return all(self._head[peer].value >= end for peer in self._peers)

    def lagging(self) -> list[int]:
        """The ranks whose record this rank waits for (for the timeout's message)."""
        waiting = []
        if self._unread:
            end = self._unread[0].pos + self._unread[0].nbytes
            waiting += [p for p in self._peers if self._head[p].value < end]
        if self._unwritten:
            oldest = self._unwritten[0].pos + self._unwritten[0].nbytes - self.capacity
            waiting += [p for p in self._peers if self._done[p].value < oldest]
        return sorted(set(waiting))


class _Patience:
    """Polling: a few hundred spins (a peer that is already on its way answers in microseconds),
    then yielding the core, then 50 us sleeps; every half second a look whether the ranks waited
    for still run (a ``RuntimeError`` naming one that exited, as gloo's closed socket would); past
    the channel's timeout, a ``RuntimeError``."""

    SPINS, YIELDS, LOOK_S = 256, 4096, 0.5

    def __init__(self, channel: SharedMemoryChannel):
        self.channel, self.count, self.deadline, self.look = channel, 0, None, None

    def pause(self) -> None:
        self.count += 1
        if self.count <= self.SPINS:
            return
        now = time.monotonic()
        if self.deadline is None:
            self.deadline, self.look = now + self.channel.timeout_s, now + self.LOOK_S
        elif now > self.look:
            self.look = now + self.LOOK_S
            self._raise_if_a_rank_exited()
        if now > self.deadline:
            c = self.channel
            raise RuntimeError(
                f"zerocompile: a shared-memory transfer on process group {c.group_name!r} (rank {c.rank} of "
                f"{c.world}) waited {c.timeout_s:g} s for rank(s) {c.lagging()}: they stopped, or run other "
                "transfers than this rank (every rank must compile and run the same graphs). The process group's "
                "timeout bounds this wait.")
        time.sleep(0 if self.count <= self.YIELDS else 50e-6)

    def _raise_if_a_rank_exited(self) -> None:
        c = self.channel
        for peer in c.lagging() if c.pids else ():
            try:
                os.kill(c.pids[peer], 0)             # signal 0: only asks whether the process exists
            except ProcessLookupError:
                raise RuntimeError(
                    f"zerocompile: rank {peer} of process group {c.group_name!r} (process {c.pids[peer]}) exited "
                    f"while rank {c.rank} waited for its shared-memory transfer; see that rank's error") from None
            except PermissionError:                  # exists, under another user
                pass


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat uint8 view (``t`` contiguous)."""
    if not t.is_contiguous():
        raise ValueError("shared-memory transfers move contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------------- the segment


class OpenChannels:
    """The channel each process group has open in this process (keyed by the group object: a
    group destroyed and made anew gets a new segment); one per process (``PROCESS.service``)."""

    def __init__(self) -> None:
        self._by_group: dict[int, tuple[object, SharedMemoryChannel]] = {}

    def get(self, process_group, group_name: str) -> SharedMemoryChannel:
        entry = self._by_group.get(id(process_group))
        if entry is None or entry[0] is not process_group:
            channel = make_channel(process_group, group_name, dist.get_rank(process_group),
                                   dist.get_world_size(process_group))
            PROCESS.channels.add(channel)           # zerocompile.stats().shared_memory_bytes
            entry = self._by_group[id(process_group)] = (process_group, channel)
        return entry[1]

    def release(self, process_group) -> None:
        entry = self._by_group.get(id(process_group))
        if entry is not None and entry[0] is process_group and not entry[1].needed:
            del self._by_group[id(process_group)]      # its segment is unmapped once nothing holds it




def make_channel(process_group, group_name: str, rank: int, world: int, capacity: int = CAPACITY,
                 chunk: int = CHUNK) -> SharedMemoryChannel:
    """A new channel for ``process_group`` (this process is ``rank`` of ``world``), rings of
    ``capacity`` bytes and records of at most ``chunk``: a collective, at the same point on every
    rank (``open_channel`` makes one per group and keeps it open). Every rank learns every other's
    answer, so all of them raise ``SharedMemoryUnavailable`` or none does."""
    here = (host_identity(), unavailable_reason("cpu"), f"/dev/shm/zerocompile-{os.getpid()}-{uuid.uuid4().hex}",
            os.getpid())
    everyone = _each_rank(here, world, process_group)
    reasons = [reason for _, reason, _, _ in everyone if reason]
    if reasons:
        raise SharedMemoryUnavailable(reasons[0])
    hosts = sorted({host for host, _, _, _ in everyone})
    if len(hosts) > 1:
        raise SharedMemoryUnavailable(
            f"the ranks of process group {group_name!r} are on {len(hosts)} hosts "
            f"({', '.join(name for name, _ in hosts)}); shared-memory transfers need them on one")
    path = everyone[0][2]
    size = 2 * world * _LINE + world * capacity
    made = _make_segment_file(path, size) if rank == 0 else None
    failed = [m for m in _each_rank(made, world, process_group) if m]
    if failed:
        raise SharedMemoryUnavailable(failed[0])
    segment = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    dist.barrier(group=process_group)                  # every rank has it mapped: the name can go
    if rank == 0:
        os.unlink(path)
    return SharedMemoryChannel(segment, rank, world, group_name, _torch_compat.group_timeout_s(process_group),
                               capacity, chunk, pids=[pid for _, _, _, pid in everyone])


def _each_rank(value, world: int, process_group) -> list:
    everyone = [None] * world
    dist.all_gather_object(everyone, value, group=process_group)
    return everyone


def _make_segment_file(path: str, size: int) -> str | None:
    """Make the segment's file with all its pages reserved (a ``/dev/shm`` too small for it is an
    error here, not a ``SIGBUS`` at the first write into a page it has no room for); returns why
    it could not be made, or None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        return f"cannot make {path}: {err}"
    try:
        os.posix_fallocate(fd, 0, size)
        return None
    except OSError as err:
        os.unlink(path)
        return f"/dev/shm has no room for the {size / 2**20:.0f} MiB segment ({err}); make it larger (docker: --shm-size)"
    finally:
        os.close(fd)


def host_identity() -> tuple[str, str]:
    """What tells hosts apart: the host name and the kernel's boot id (two containers of one host
    name on different machines differ in the latter)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def open_channel(group_name: str) -> SharedMemoryChannel:
    """The channel of the process group c10d calls ``group_name``; made on first use, which is a
    collective (every rank of the group calls it at the same point: the probe, the choice of the
    collectives, or the first transfer). ``SharedMemoryUnavailable`` on every rank when one of
    them cannot share memory with the others."""
    return channel_of(_torch_compat.process_group_named(group_name))


def channel_of(process_group) -> SharedMemoryChannel:
    """``open_channel`` for the ``ProcessGroup`` itself (the transfers hold it already)."""
    return PROCESS.service(OpenChannels).get(process_group, process_group.group_name)


def release_channel(group_name: str) -> None:
    """Drop the group's channel unless a choice of collectives needs it (``SharedMemoryChannel.needed``):
    the probe's segment, when nothing chose it, is not kept for the process's life. Every rank
    calls it at the same point (a later transfer would make a new segment, a collective)."""
    PROCESS.service(OpenChannels).release(_torch_compat.process_group_named(group_name))
