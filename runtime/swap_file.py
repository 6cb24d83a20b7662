"""Tensors in a file: the I/O engine of NVMe offload.

``SwapFile`` is one file per rank and purpose under ``nvme_path``. Each tensor it holds has a
region at a page-aligned offset (``reserve``). ``write`` and ``read`` move bytes between a
region and a page-aligned host buffer (``aligned_empty``) asynchronously: the transfer is cut
into ``block_bytes`` pieces (1 MiB by default), each a ``os.pwrite`` / ``os.preadv`` on a
thread pool of ``threads`` workers (both calls release the GIL), so about ``threads`` requests
are in flight, as measured best in ``shared/research/round2.md`` (a). The file is opened with
``O_DIRECT`` where the filesystem allows it (the page cache is bypassed: what is offloaded does
not come back as cached memory); otherwise buffered, said once in the log.

Space is reserved with ``posix_fallocate`` when a region is created, so a full disk is an
error at setup (``SwapFileError`` naming the path, the bytes asked and the bytes free), not a
short write in the middle of an optimizer step. The file is deleted when the ``SwapFile`` is
closed, garbage-collected, or at interpreter exit.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import itertools
import logging
import os
import shutil
import threading
import weakref
from dataclasses import dataclass

import torch

from zerocompile.errors import SwapFileError

log = logging.getLogger("zerocompile")

PAGE = 4096
"""Alignment of buffers, offsets and lengths (what ``O_DIRECT`` asks of all three)."""


def round_up(nbytes: int, to: int = PAGE) -> int:
    return -(-nbytes // to) * to


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised 1-D host tensor whose data starts on a page boundary and whose storage
    extends to a whole number of pages past it (``O_DIRECT`` transfers of it are legal)."""
    nbytes = round_up(numel * torch.empty((), dtype=dtype).element_size())
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin_memory)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip : skip + nbytes].view(dtype)[:numel]


def move_all(fd: int, view: memoryview, offset: int, write: bool, path: str) -> None:
    """Write ``view`` to (``write``) or read it from file descriptor ``fd`` at byte ``offset``,
    looping over partial transfers. A transfer that moves nothing (a read past the end of the
    file) raises ``SwapFileError(EIO)`` naming ``path``; other ``OSError``s are the caller's to explain."""
    done, total = 0, len(view)
    while done < total:
        n = os.pwrite(fd, view[done:], offset + done) if write else os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise SwapFileError(errno.EIO, f"zerocompile offload: {path!r} ended at byte {offset + done} of "
                                           f"{offset + total}; it was changed outside zerocompile")
        done += n


def _host_bytes(t: torch.Tensor, nbytes: int):
    """A writable buffer over the first ``nbytes`` of host tensor ``t``'s data (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("swap_file: transfers need a contiguous CPU tensor")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


@dataclass(frozen=True)
class Region:
    offset: int
    nbytes: int
    """Bytes of the tensor; the region spans ``round_up(nbytes)`` bytes of the file."""


class Transfer:
    """The pending pieces of one ``read`` or ``write``; ``wait()`` returns once all are done and
    raises the first error (a ``SwapFileError`` for a failed read or write)."""

    def __init__(self, futures: list, keep_alive):
        self._futures = futures
        self._keep_alive = keep_alive      # the host tensor must live until the I/O is done, not longer
        self._left = len(futures)
        self._lock = threading.Lock()
        self._then: list = []
        for f in futures:
            f.add_done_callback(self._one_done)

    def _one_done(self, _future) -> None:
        with self._lock:
            self._left -= 1
            finished = self._left == 0
            if finished:
                self._keep_alive = None
                then, self._then = self._then, []
        if finished:
            for fn in then:
                fn()

    def then(self, fn) -> None:
        """Call ``fn()`` once every piece is done (failed or not), on the I/O thread that finished
        last, or now if all are done already."""
        with self._lock:
            if self._left:
                self._then.append(fn)
                return
        fn()

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        for f in self._futures:
            f.result()
        self._keep_alive = None


def _cleanup(fd: int, path: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SwapFile:
    """One swap file (see the module docstring)."""

    def __init__(self, directory: str, name: str, *, threads: int = 8, block_bytes: int = 1 << 20,
                 direct: bool = True):
        if block_bytes <= 0 or block_bytes % PAGE:
            raise ValueError(f"swap_file: block_bytes must be a positive multiple of {PAGE}, got {block_bytes}")
        self.directory = os.path.abspath(os.fspath(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as err:
            raise SwapFileError(err.errno, f"zerocompile offload: cannot create nvme_path {self.directory!r} "
                                           f"({err.strerror}); give a writable directory") from None
        # O_EXCL: a second SwapFile of this process with the same name and directory (two
        # optimizers offloading to one nvme_path) gets a file of its own (``...-2.swap``); with
        # O_TRUNC it would have truncated the first's and shared its regions, silently
        base = os.path.join(self.directory, f"zerocompile-{name}-pid{os.getpid()}")
        for n in itertools.count(1):
            self.path = base + (".swap" if n == 1 else f"-{n}.swap")
            try:
                fd = self._create(direct)
                break
            except FileExistsError:
                continue
        self.fd = fd
        self.block_bytes = block_bytes
        self.size = 0
        self.regions: dict[object, Region] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerocompile-io")
        self._finalizer = weakref.finalize(self, _cleanup, fd, self.path)

    def _create(self, direct: bool) -> int:
        """Create ``self.path`` (``FileExistsError`` if it exists), with ``O_DIRECT`` where
        asked and the filesystem allows it (``self.direct`` says which); its descriptor."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                self.direct = True
                return fd
            except FileExistsError:
                raise
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise self._error(err, "create") from None
                log.info("zerocompile offload: %s does not support O_DIRECT; using buffered I/O", self.directory)
        try:
            return os.open(self.path, flags, 0o600)
        except FileExistsError:
            raise
        except OSError as err:
            raise self._error(err, "create") from None

    def _error(self, err: OSError, what: str, nbytes: int | None = None) -> SwapFileError:
        if err.errno == errno.ENOSPC:
            free = shutil.disk_usage(self.directory).free
            msg = (f"zerocompile offload: not enough space in nvme_path {self.directory!r} to {what} "
                   f"{nbytes or 0} bytes ({free} bytes free); free space or point nvme_path elsewhere")
        elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            msg = (f"zerocompile offload: nvme_path {self.directory!r} is not writable ({err.strerror}); "
                   "give a writable directory")
        else:
            msg = f"zerocompile offload: cannot {what} {self.path!r}: {err.strerror or err}"
        return SwapFileError(err.errno, msg)

    # ------------------------------------------------------------------ regions
    def reserve(self, key, nbytes: int) -> Region:
        """A region of ``nbytes`` for ``key`` at the end of the file, with its disk space
        allocated now. Reserving an existing key returns its region (same size only)."""
        if key in self.regions:
            region = self.regions[key]
            if region.nbytes != nbytes:
                raise ValueError(f"swap_file: region {key!r} has {region.nbytes} bytes, not {nbytes}")
            return region
        region = Region(self.size, nbytes)
        span = round_up(max(nbytes, 1))
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, region.offset, span)
            else:
                os.ftruncate(self.fd, region.offset + span)
        except OSError as err:
            raise self._error(err, "reserve", span) from None
        self.size += span
        self.regions[key] = region
        return region

    # ------------------------------------------------------------------ transfers
    def write(self, key, src: torch.Tensor, start: int = 0) -> Transfer:
        """Start writing host tensor ``src`` (contiguous; page-aligned and page-padded, as from
        ``aligned_empty``, when the file is ``O_DIRECT``) into ``key``'s region from byte
        ``start`` (a multiple of 4096 when ``O_DIRECT``) on; it must end at or before the
        region's end."""
        view, offset, pieces = self._plan(key, src, start, "writing")
        futures = [self._pool.submit(self._move, view[a : a + n], offset + a, True) for a, n in pieces]
        return Transfer(futures, src)

    def read(self, key, dst: torch.Tensor, start: int = 0) -> Transfer:
        """Start reading ``key``'s region from byte ``start`` into host tensor ``dst`` (as ``write``)."""
        view, offset, pieces = self._plan(key, dst, start, "reading")
        futures = [self._pool.submit(self._move, view[a : a + n], offset + a, False) for a, n in pieces]
        return Transfer(futures, dst)

    def _plan(self, key, t: torch.Tensor, start: int, what: str):
        region = self.regions[key]
        nbytes = t.numel() * t.element_size()
        if start < 0 or start + nbytes > region.nbytes:
            raise ValueError(f"swap_file: {what} {nbytes} bytes at byte {start} of region {key!r} of {region.nbytes}")
        if self.direct and start % PAGE:
            raise ValueError(f"swap_file: O_DIRECT transfers start at multiples of {PAGE} bytes, not {start}")
        span = round_up(nbytes) if self.direct else nbytes
        return self._buffer(t, nbytes), region.offset + start, [
            (a, min(self.block_bytes, span - a)) for a in range(0, span, self.block_bytes)]

    def _buffer(self, t: torch.Tensor, nbytes: int):
        if not self.direct:
            return _host_bytes(t, nbytes)
        if t.data_ptr() % PAGE:
            raise ValueError("swap_file: O_DIRECT transfers need a page-aligned buffer (use aligned_empty)")
        span = round_up(nbytes)
        if t.untyped_storage().nbytes() - t.storage_offset() * t.element_size() < span:
            raise ValueError("swap_file: O_DIRECT transfers need the buffer padded to whole pages (use aligned_empty)")
        return _host_bytes(t, span)

    def _move(self, view, offset: int, write: bool) -> None:
        try:
            move_all(self.fd, view, offset, write, self.path)
        except SwapFileError:
            raise
        except OSError as err:
            raise self._error(err, "write" if write else "read", len(view)) from None

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for pending transfers, close and delete the file."""
        self._pool.shutdown(wait=True)
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
