"""Parameter offload (``offload_param``, stage 3): master shards in files between uses.

With ``offload_param={"device": "nvme", "nvme_path": DIR}`` each stage-3 parameter's master
shard lives in a file of its own under ``DIR`` (``ShardFile``); the shard tensor the optimizer
and autograd know (``ShardedParam.shard``) keeps its identity, shape and ``.grad`` but holds no
storage. With ``"cpu"`` and a CUDA model the files are in host memory (``/dev/shm``); with a
CPU model ``"cpu"`` changes nothing (the shards are in host memory already) and says so in the log.

Who reads the values, and how:

- the compiled graphs, through ``fetch_shard``: before the parameter's all-gather the op
  ``zerocompile::fetch_shard`` starts reading the file into a new tensor on one of the
  process's file threads (``FileThreads``), and ``wait_tensor`` waits for the read; the prefetch pass moves the fetch with the
  all-gather it feeds and then starts each bucket's reads one bucket ahead
  (``passes/prefetch.py: prefetch_fetches``), and ``reshard_after_forward`` has the backward
  fetch again rather than keep the fetched shard alive from forward to backward. Its backward
  passes the gradient to the shard unchanged, so it still lands in ``shard.grad``.
- everything outside the graphs (the optimizer step, gathering a parameter for eager code,
  ``write_full``, checkpoints) inside ``resident_shards(states)``: the shards are read back
  into their own storage, used, written back to their files if anything changed them (or if
  asked), and freed again.

The file is the one true copy between uses: nothing else holds the values, so no stale copy
can be read. Files are plain buffered files (no ``O_DIRECT``): the graph op and the runtime
read and write them through the page cache, which keeps every reader coherent with every
writer; the kernel may keep recently used pages cached, which is memory it can reclaim, not
this process's. Each file is opened for each transfer and closed after it (no descriptor is
held per parameter, so a model of thousands of parameters needs no raised file limit), its
space is allocated when it is created (a full disk is an error then), and it is deleted when
its parameter's shard state goes away or at exit. A process killed before that leaves its
directory behind; the next run on the same host removes the directories of processes that
are gone (``remove_stale_directories``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import shutil
import socket
import tempfile
import weakref

import torch

from zerocompile import _torch_compat
from zerocompile.runtime.offload_settings import OffloadSettings
from zerocompile.errors import SwapFileError
from zerocompile.runtime.session import PROCESS
from zerocompile.runtime.swap_file import _host_bytes, move_all

log = logging.getLogger("zerocompile")


_PREFIX = "zerocompile-params-"


def param_directory(settings: OffloadSettings) -> str:
    """The directory of this process's parameter files for ``settings`` (device ``nvme``:
    under ``nvme_path``; ``cpu``: host memory, ``/dev/shm`` where it exists), named after
    this host and process."""
    if settings.device == "nvme":
        base = settings.nvme_path
    else:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(os.path.abspath(base), f"{_PREFIX}{_host()}-pid{os.getpid()}")


def _host() -> str:
    return socket.gethostname().replace("-pid", "_pid").replace(os.sep, "_")


def remove_stale_directories(base: str) -> list[str]:
    """Delete the parameter directories under ``base`` left by processes of this host that are
    gone (killed, or ended with ``os._exit``, before their files could be deleted); return
    their paths. Directories of other hosts (a shared file system) are left alone."""
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    mine = f"{_PREFIX}{_host()}-pid"
    for name in names:
        pid = name[len(mine):]
        if not name.startswith(mine) or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        path = os.path.join(base, name)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("zerocompile offload_param: removed %d parameter directories of ended processes under %s",
                 len(removed), base)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _error(err: OSError, path: str, what: str, nbytes: int = 0) -> SwapFileError:
    directory = os.path.dirname(path)
    if err.errno == errno.ENOSPC:
        free = shutil.disk_usage(directory).free if os.path.isdir(directory) else 0
        msg = (f"zerocompile offload_param: not enough space in {directory!r} to {what} {nbytes} bytes "
               f"({free} bytes free); free space or point offload_param.nvme_path elsewhere")
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        msg = (f"zerocompile offload_param: {directory!r} is not writable ({err.strerror}); give "
               "offload_param.nvme_path a writable directory")
    elif err.errno == errno.ENOENT and what == "read":
        msg = (f"zerocompile offload_param: the parameter file {path!r} is gone (deleted outside "
               "zerocompile, or its shard state was released); the parameter's values are lost")
    else:
        msg = f"zerocompile offload_param: cannot {what} {path!r}: {err.strerror or err}"
    return SwapFileError(err.errno, msg)


def read_file(path: str, dst: torch.Tensor) -> None:
    """Fill contiguous CPU tensor ``dst`` with the first bytes of the file at ``path``."""
    _transfer(path, dst, "read")


def write_file(path: str, src: torch.Tensor) -> None:
    """Write contiguous CPU tensor ``src`` to the start of the existing file at ``path``."""
    _transfer(path, src, "write")


def _transfer(path: str, t: torch.Tensor, what: str) -> None:
    """Move the bytes of ``t`` from (``what="read"``) or to (``"write"``) the start of ``path``,
    opening the file for this transfer only."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    view = _host_bytes(t, nbytes)
    try:
        fd = os.open(path, os.O_RDONLY if what == "read" else os.O_WRONLY)
    except OSError as err:
        raise _error(err, path, what) from None
    try:
        move_all(fd, view, 0, what == "write", path)
    except SwapFileError:
        raise
    except OSError as err:
        raise _error(err, path, what, nbytes) from None
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        os.rmdir(os.path.dirname(path))     # the per-process directory, once it is empty
    except OSError:
        pass


class ShardFile:
    """The file holding one parameter's master shard (see the module docstring)."""

    def __init__(self, directory: str, name: str, shard: torch.Tensor):
        self.nbytes = shard.numel() * shard.element_size()
        try:
            if not os.path.isdir(directory):
                remove_stale_directories(os.path.dirname(directory))
            os.makedirs(directory, exist_ok=True)
        except OSError as err:
            raise SwapFileError(err.errno, f"zerocompile offload_param: cannot create the directory {directory!r} "
                                           f"({err.strerror}); give offload_param.nvme_path a writable directory") from None
        self.name = name
        self.number = id(self)
        """The file's number in ``directory``, unique while this object lives (its address)."""
        self.number_tensor = torch.tensor(self.number, dtype=torch.int64)
        """The number as the graph input that tells ``fetch_shard`` which file to read."""
        self.path = shard_path(directory, self.number)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as err:
            raise _error(err, self.path, "create") from None
        try:
            if self.nbytes:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, self.nbytes)
                else:
                    os.ftruncate(fd, self.nbytes)
        except OSError as err:
            os.close(fd)
            _remove(self.path)
            raise _error(err, self.path, "reserve", self.nbytes) from None
        os.close(fd)
        self._finalizer = weakref.finalize(self, _remove, self.path)
        self.write(shard)

    def read_into(self, dst: torch.Tensor) -> None:
        """Copy the stored shard into ``dst`` (a tensor of the shard's size, any device)."""
        if dst.device.type == "cpu" and dst.is_contiguous():
            read_file(self.path, dst)
        else:
            host = torch.empty(dst.shape, dtype=dst.dtype)
            read_file(self.path, host)
            dst.copy_(host)

    def write(self, src: torch.Tensor) -> None:
        """Store the values of ``src`` (a tensor of the shard's size, any device)."""
        src = src.detach()
        if src.numel() * src.element_size() != self.nbytes:
            raise ValueError(f"zerocompile offload_param: writing {src.numel() * src.element_size()} bytes "
                             f"into the file of a {self.nbytes}-byte shard")
        write_file(self.path, src if src.device.type == "cpu" and src.is_contiguous() else src.cpu().contiguous())

    def close(self) -> None:
        """Delete the file (also done when this object is collected, and at exit)."""
        self._finalizer()


def shard_path(directory: str, number: int) -> str:
    """The path of shard file ``number`` in ``directory``."""
    return os.path.join(directory, f"shard-{number}.bin")


# ---------------------------------------------------------------------------- the graph op
# A torch.library op: fake tensors pass through it, and inductor calls it as an extern kernel.
# It only *starts* the read: the file is read into the tensor it returns on one of the
# process's file threads (``FileThreads``; ``os.preadv`` releases the GIL), and
# ``torch.ops._c10d_functional.wait_tensor`` of that
# tensor waits for the read, as it waits for a functional collective (the read is registered
# in c10d's registry of pending work: ``_torch_compat.register_pending``). Between the two the
# graph computes: the prefetch pass issues the reads of the next bucket's shards before the
# current bucket is waited for (``passes/prefetch.py: prefetch_fetches``). No state outlives a
# read but the threads: the future and the registry entry are the read's own.
#
# Which file to read is a graph *input* (the file's number, a 0-dim int64 tensor), never a
# constant of the graph: Dynamo runs one compiled frame for every block its guards accept
# (a graph break inside a layer loop), each with its own shards, so a path baked in when the
# frame was traced would read the first block's parameters for every block. The directory is
# a constant: it is the frame's option, the same for every parameter the frame may meet.
@torch.library.custom_op("zerocompile::fetch_shard", mutates_args=())
def fetch_shard_op(shard: torch.Tensor, number: torch.Tensor, directory: str) -> torch.Tensor:
    """A new tensor like ``shard`` (which holds no storage) that a thread is filling with the
    values of shard file ``number`` in ``directory``: read it only after ``wait_tensor``."""
    path = shard_path(directory, int(number.item()))
    host = torch.empty(shard.shape, dtype=shard.dtype)
    out = host if shard.device.type == "cpu" else torch.empty(shard.shape, dtype=shard.dtype, device=shard.device)
    future = torch.futures.Future()

    def read() -> None:
        try:
            read_file(path, host)
            if out is not host:
                # on this thread's stream of the device; the wait may not return before the
                # copy has landed, whatever stream the graph runs on
                out.copy_(host)
                torch.cuda.current_stream(out.device).synchronize()
        except BaseException as err:    # noqa: BLE001 - raised by wait_tensor on the graph's thread
            future.set_exception(err)
            return
        future.set_result(None)

    _torch_compat.register_pending(out, future)
    PROCESS.service(FileThreads).pool(OffloadSettings().threads).submit(read)
    return out


@fetch_shard_op.register_fake
def _fetch_shard_fake(shard, number, directory):
    return torch.empty_like(shard)


class _FetchShard(torch.autograd.Function):
    """The fetch and its wait; the gradient of the result goes to the shard unchanged."""

    @staticmethod
    def forward(ctx, shard, number, directory):
        return torch.ops._c10d_functional.wait_tensor(torch.ops.zerocompile.fetch_shard(shard, number, directory))

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fetch_shard(shard: torch.Tensor, number: torch.Tensor, directory: str) -> torch.Tensor:
    """Stage 3 with ``offload_param``: the shard's values, read from shard file ``number``
    (a graph input) in ``directory``: ``zerocompile::fetch_shard`` starts the read and a
    ``wait_tensor`` waits for it; the gradient of the result goes to ``shard`` as it is."""
    return _FetchShard.apply(shard, number, directory)


# ---------------------------------------------------------------------------- outside the graphs
@contextlib.contextmanager
def resident_shards(states, write: bool = False, threads: int = 8):
    """Inside, the shard of every offloaded state in ``states`` (``ShardedParam``s; others are
    ignored) holds its values in its own storage. On exit each is written back to its file
    when ``write`` is True or when an in-place op changed it (its version counter moved), and
    freed. Nested uses keep the shards resident until the outermost exits."""
    states = list(states)
    mine = []
    for sp in states:
        if getattr(sp, "shard_file", None) is None or sp in mine:
            continue
        if sp.shard_resident == 0:
            mine.append(sp)
        sp.shard_resident += 1
    loaded = []
    try:
        _parallel(threads, [lambda sp=sp: _load(sp, loaded) for sp in mine])
        yield
    finally:
        for sp in states:
            if getattr(sp, "shard_file", None) is not None:
                sp.shard_resident = max(0, sp.shard_resident - 1)
        try:
            _parallel(threads, [lambda sp=sp: _store(sp, write) for sp in loaded])
        finally:
            for sp in mine:
                sp.shard.untyped_storage().resize_(0)


def _load(sp, loaded: list) -> None:
    shard = sp.shard
    shard.untyped_storage().resize_(sp.shard_file.nbytes)
    sp.shard_file.read_into(shard.detach())
    sp.shard_version = shard._version
    loaded.append(sp)


def _store(sp, write: bool) -> None:
    if write or sp.shard._version != sp.shard_version:
        sp.shard_file.write(sp.shard)


def _parallel(threads: int, jobs: list) -> None:
    """Run ``jobs`` (file transfers, which release the GIL) on the process's file threads (at
    least ``threads`` of them); raise the first error once all have finished."""
    if len(jobs) <= 1 or threads <= 1:
        for job in jobs:
            job()
        return
    pool = PROCESS.service(FileThreads).pool(threads)
    futures = [pool.submit(job) for job in jobs]
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()


class FileThreads:
    """The threads that read and write shard files, kept for the process (a ``PROCESS``
    service): the graph's ``fetch_shard`` reads and the optimizer step's read-backs and
    write-backs. A thread started per read cost about 0.2 ms of the graph's own thread per
    parameter and pass (the 4M GPT's step spent 18 ms on it), and a pool per step as much
    again. Made again in a forked child (a pool's threads do not survive the fork) and when
    more threads are asked for."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._size = 0
        self._pid = None

    def pool(self, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid() or threads > self._size:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.shutdown(wait=False)     # its queued transfers still run
            self._size = max(threads, self._size if self._pid == os.getpid() else 0)
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=self._size,
                                                               thread_name_prefix="zerocompile-param-io")
            self._pid = os.getpid()
        return self._pool
