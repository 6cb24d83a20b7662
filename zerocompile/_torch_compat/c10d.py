"""The private torch APIs of torch.distributed's c10d that zerocompile depends on: process groups
by name, their backends and timeouts, the registry of pending work that ``wait_tensor``
consults, the default group's store, and the fake process group.

Part of ``zerocompile._torch_compat``, which re-exports every name; each function says why it
needs a private API, and ``tests/test_torch_compat.py`` exercises each.
"""

from __future__ import annotations

import torch


def collective_backend(group_name: str, device: torch.device) -> str | None:
    """The name of the backend (``"gloo"``, ``"nccl"``, ``"fake"``...) that runs collectives on
    ``device`` tensors for the process group named ``group_name`` (what functional collectives
    take), or None if no such group exists in this process.

    Why private: functional collectives name their group by string; only
    ``torch.distributed.distributed_c10d._resolve_process_group`` maps it back to the group, and
    ``ProcessGroup._get_backend(device)`` gives the backend that serves a device.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
        return group._get_backend(torch.device(device)).name()
    except (RuntimeError, ValueError):
        return None


DEFAULT_GROUP_TIMEOUT_S = 1800.0
"""What ``group_timeout_s`` answers where the group's own timeout cannot be read: the default
of torch's non-NCCL process groups (30 minutes)."""


def group_timeout_s(process_group) -> float:
    """The timeout, in seconds, that ``process_group``'s CPU backend applies to its operations
    (``init_process_group(timeout=...)``): how long ``runtime/shared_memory.py`` waits for a rank
    before raising, as gloo would.

    Why private: torch has no public reader of a group's timeout; its backend's ``options._timeout``
    holds it (gloo). Where that is missing, ``DEFAULT_GROUP_TIMEOUT_S``."""
    try:
        return process_group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return DEFAULT_GROUP_TIMEOUT_S


def pending_collectives() -> int:
    """How many functional collectives of this process were started and not yet waited for.

    Why private: c10d keeps started functional collectives in a registry until their
    ``wait_tensor``; ``torch._C._distributed_c10d._get_work_registry_size`` is its only reader.
    """
    return torch._C._distributed_c10d._get_work_registry_size()


def register_pending(tensor: torch.Tensor, future: "torch.futures.Future") -> None:
    """Make ``torch.ops._c10d_functional.wait_tensor(tensor)`` wait for ``future`` (an
    ``offload_param`` file read filling ``tensor`` on another thread), as it waits for a
    functional collective's result, and raise the error the future was set with.

    Why private: the registry ``wait_tensor`` consults (a tensor's storage -> its pending
    ``Work``) is written only by ``torch._C._distributed_c10d._register_work``; the ``Work``
    is a Python subclass of c10d's (``_FutureWork``), whose ``wait`` c10d calls back. (c10d's
    own ``_create_work_from_future`` would drop the future's error: a read that failed would
    leave garbage in ``tensor`` without a word.)"""
    torch._C._distributed_c10d._register_work(tensor, _FutureWork(future))


def register_pending_works(tensor: torch.Tensor | list, works: list, then=None) -> None:
    """Make ``torch.ops._c10d_functional.wait_tensor(tensor)`` wait for every ``Work`` of
    ``works`` (the point-to-point transfers of ``runtime/point_to_point.py`` filling ``tensor``),
    then call ``then()`` (what makes ``tensor`` from what they moved), as it waits for a
    functional collective's result. ``tensor`` may be a list of tensors that the same transfers
    fill: the first of their waits waits for the transfers, the others find them done (a gloo
    ``Work`` must be waited for once: a second ``wait`` of a send blocks for a send that never
    comes). Private for the reason ``register_pending`` gives."""
    done = _WorksDone(works, then)
    for t in tensor if isinstance(tensor, (list, tuple)) else [tensor]:
        torch._C._distributed_c10d._register_work(t, done)


class _WorksDone(torch._C._distributed_c10d.Work):
    """A c10d ``Work`` done when every one of ``works`` is and ``then()`` has run."""

    def __init__(self, works: list, then=None):
        super().__init__()
        self.works = works
        self.then = then

    def wait(self, timeout=None) -> bool:
        works, self.works = self.works, []       # each waited for once
        for work in works:
            work.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True


def process_group_named(group_name: str):
    """The ``ProcessGroup`` that functional collectives call ``group_name``. Private for the
    reason ``collective_backend`` gives."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


class _FutureWork(torch._C._distributed_c10d.Work):
    """A c10d ``Work`` done when ``future`` is; ``wait`` raises the future's error."""

    def __init__(self, future: "torch.futures.Future"):
        super().__init__()
        self.future = future

    def wait(self, timeout=None) -> bool:
        self.future.wait()
        return True


# Why private: torch's "fake" c10d backend is registered only when
# ``torch.testing._internal.distributed.fake_pg`` is imported (without it, init_process_group
# raises "Unknown c10d backend type FAKE"), and that module also holds its ``FakeStore``.
def init_fake_process_group(world_size: int) -> None:
    """Initialise torch.distributed's default group as torch's fake process group of
    ``world_size`` ranks, this process being rank 0 (``zerocompile dump --world-size``).

    Its collectives move no data (an all-gather repeats this rank's input), so one process
    builds and runs the graphs of an N-rank job, shapes and collective sizes included.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


# Why private: ``torch.distributed`` re-exports ``init_process_group`` and
# ``destroy_process_group`` from ``torch.distributed.distributed_c10d``, and code calls either
# name; which modules hold the two is torch's layout, not an API.
def process_group_function_modules() -> tuple:
    """The modules whose ``init_process_group`` and ``destroy_process_group`` a script may call
    (``zerocompile.script_runner`` replaces both while a script runs on the fake group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return (dist, distributed_c10d)


def register_work(tensor: torch.Tensor, work: "torch._C._distributed_c10d.Work") -> None:
    """Make ``torch.ops._c10d_functional.wait_tensor(tensor)`` call ``work.wait()`` (a Python
    subclass of c10d's ``Work``: ``runtime/watched_collectives.py``'s watched wait). Private for
    the reason ``register_pending`` gives."""
    torch._C._distributed_c10d._register_work(tensor, work)


def new_default_store_client(timeout_s: float | None = None):
    """A new client of the default process group's store, or None where that store is not a
    ``TCPStore`` (e.g. a ``FileStore`` from ``init_method="file://..."``). Each thread that
    blocks on the store needs a client of its own: one ``TCPStore`` client serialises its
    calls, so a thread blocked in ``wait`` on it holds up every other thread's ``get``.
    ``timeout_s``: how long its connection and operations may take (default: the store's).

    Why private: torch has no public reader of the default group's store;
    ``distributed_c10d._get_default_store()`` returns it (a ``PrefixStore`` around the
    ``TCPStore`` that ``init_process_group`` made, reached by ``underlying_store``)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    import datetime

    timeout = store.timeout if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False, timeout=timeout)
