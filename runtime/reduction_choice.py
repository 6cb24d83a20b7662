"""Which collective reduces the gradients (stages 1-3) and which gathers the parameters.

Reductions: a reduce-scatter; an all-reduce of which each rank keeps its own slice (stages 1
and 2); or point-to-point transfers (``runtime/point_to_point.py``): row ``r`` of each rank's
bucket sent to rank ``r``, which sums what it received in rank order; or the same transfers
through a shared-memory segment (``"shared_memory"``, ``runtime/shared_memory.py``; timed only
where every rank is on one host and the tensors are on the CPU, else infinite). All give each rank the sum
over ranks of its slice of the padded flat gradient bucket; on two ranks each is the same single
addition, so the values are bitwise equal (on more ranks the same terms, in an order the backend
or the rank order fixes). What differs is the time: NCCL's ring reduce-scatter moves half an
all-reduce's bytes, while gloo's reduce-scatter costs about 1.5x its all-reduce of the same
buffer (``benchmarks/collectives.py``), and the transfers move the reduce-scatter's bytes. The
all-reduce's full result is a transient: at stage 1 the eager step reads its slice out of the
bucket buffer it reuses anyway, at stage 2 the backward graph slices it and frees it, so the
model state each rank keeps between steps is the same either way.

``gradient_reduction(option, group, device)`` answers per process group and message size:

- ``"reduce_scatter"`` / ``"all_reduce"`` / ``"point_to_point"`` / ``"shared_memory"``: that one
  at every size (the option forced; ``"shared_memory"`` where the ranks cannot share memory is a
  ``ZeroConfigError`` naming why);
- ``"auto"``: measured once per process group (and device) in the process, the first time a
  stage 1-3 frame compiles: a short timing of each (``REDUCTIONS``) at ``PROBE_BYTES`` on the
  real group, each rank's times max-reduced over the group, so every rank holds the same
  figures and makes the same choice; a bucket takes the choice of the probed size nearest to
  its own (in ratio); stage 3, which has no all-reduce path, takes the faster of the others
  (``without_all_reduce``). Where nothing can be measured (world size 1, torch's fake process
  group of ``zerocompile plan`` / ``dump --world-size``, meta tensors) it is ``DEFAULT_KIND``,
  without any collective.

The same probe times the parameters' all-gathers (``parameter_gather``): after the optimizer
step at stages 1 and 2 (the replicas' refresh), in the compiled graphs at stage 3. Either the
all-gather collective, or point-to-point transfers of each rank's shard to every other rank
(the same bytes, copied, so the same result bit for bit; gloo's all-gather costs 1.2-3x that
at 16-64 MiB). ``"auto"`` takes the faster per size. A measured choice can be kept for a
restart (``SavedChoices``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass

import torch

from zerocompile import _torch_compat
from zerocompile.errors import ZeroConfigError
from zerocompile.runtime import point_to_point  # noqa: F401  (registers zerocompile::all_gather_point_to_point_out)
from zerocompile.runtime import shared_memory
from zerocompile.runtime.comm import (CommGroup, agreement_digest, all_reduce, every_rank_holds, is_fake_group,
                                      start_all_gather_flat, start_reduce_scatter)

_c10d = torch.ops._c10d_functional
log = logging.getLogger("zerocompile")

GRADIENT_REDUCTIONS = ("auto", "reduce_scatter", "all_reduce", "point_to_point", "shared_memory")
"""Values of the ``gradient_reduction`` option."""
PARAMETER_GATHERS = ("auto", "all_gather", "point_to_point", "shared_memory")
"""Values of the ``parameter_gather`` option."""
DEFAULT_GATHER = "all_gather"
"""What ``"auto"`` takes for the step's gathers where nothing is measured."""
DEFAULT_KIND = "reduce_scatter"
"""What ``"auto"`` takes where nothing is measured (world size 1, a fake process group, meta
tensors): the ZeRO papers' collective, which moves half an all-reduce's bytes on a ring."""
REDUCTIONS = ("reduce_scatter", "all_reduce", "point_to_point", "shared_memory")
"""The gradient reductions the probe times, in the order of ``ReductionChoice.ms``."""
GATHERS = ("all_gather", "point_to_point", "shared_memory")
"""The parameter gathers the probe times, in the order of ``ReductionChoice.gather_ms``."""


PROBE_BYTES = (256 * 1024, 4 * 2**20, 16 * 2**20)
"""Full-buffer sizes the ``"auto"`` probe times both collectives at (float32 elements)."""
PROBE_REPEATS = 3
"""Timed runs of each collective per size (after one warm-up), taking turns; the fastest counts
(``probe_figure``)."""


def probe_figure(runs: list[float]) -> float:
    """What a collective's timed runs count for in the choice: the fastest. Other work on the
    machine (another job, a data loader, a second group of ranks) only adds time, and to whichever
    run it happens to meet: with the median, one busy moment during the probe decided the choice,
    and the choice is saved for every restart. Measured on 2 gloo ranks here, a probe taken while
    other work ran saved point-to-point transfers for 16 MiB reductions (median 35.5 ms
    against shared memory's 56.2), which take 14.1 ms against 7.9 on the machine alone; the
    42M GPT's stage 3 step took 6% longer with that choice (``benchmarks/run.py``). The fastest
    runs keep the order the machine shows alone (timeit reports the fastest for the same reason)."""
    return min(runs)


@dataclass(frozen=True)
class ReductionChoice:
    """The collective that reduces a gradient bucket of each size on one process group (the
    same on every rank of it)."""

    sizes: tuple[int, ...]
    """Bucket sizes in bytes the choice was made at (ascending); one entry for a fixed choice."""
    kinds: tuple[str, ...]
    """``"reduce_scatter"``, ``"all_reduce"``, ``"point_to_point"`` or ``"shared_memory"`` at each of ``sizes``."""
    source: str
    """How it was chosen: ``"option"``, ``"measured"``, or why it was not measured."""
    ms: tuple[tuple[float, ...], ...] = ()
    """Measured: the ms of each of ``REDUCTIONS`` at each of ``sizes`` (the slowest rank's;
    infinite for ``"shared_memory"`` where the ranks cannot share memory)."""
    gather_kinds: tuple[str, ...] = (DEFAULT_GATHER,)
    """How the step's all-gather buckets travel: ``"all_gather"``, ``"point_to_point"`` or ``"shared_memory"``, at
    each of ``sizes`` (one entry: at every size)."""
    gather_ms: tuple[tuple[float, ...], ...] = ()
    """Measured: the ms of each of ``GATHERS`` at each of ``sizes`` (the slowest rank's)."""
    gather_source: str = ""
    """How ``gather_kinds`` was chosen, where not as ``kinds`` (``source``)."""

    def kind_for(self, nbytes: int) -> str:
        """The collective for a bucket of ``nbytes``: that of the nearest size in ratio."""
        return self._nearest(self.kinds, nbytes)

    def gather_kind_for(self, nbytes: int) -> str:
        """How a bucket of ``nbytes`` (the gathered size) is gathered: that of the
        nearest size in ratio."""
        return self._nearest(self.gather_kinds, nbytes)

    def _nearest(self, kinds: tuple[str, ...], nbytes: int) -> str:
        if len(kinds) == 1:
            return kinds[0]
        distance = [abs(math.log(max(nbytes, 1) / size)) for size in self.sizes]
        return kinds[distance.index(min(distance))]

    def uses_all_reduce(self) -> bool:
        """Whether some bucket size is all-reduced."""
        return "all_reduce" in self.kinds

    def without_all_reduce(self) -> "ReductionChoice":
        """The choice where an all-reduce cannot be taken (stage 3's backward): the faster of
        the others where measured, else a reduce-scatter in its place."""
        if self.ms and len(self.ms) == len(self.sizes):
            kinds = tuple(_fastest(REDUCTIONS[:len(t)], t, ("reduce_scatter", "point_to_point", "shared_memory"))
                          for t in self.ms)
        else:
            kinds = tuple("reduce_scatter" if k == "all_reduce" else k for k in self.kinds)
        return dataclasses.replace(self, kinds=kinds)

    def describe(self) -> str:
        """One line for ``zerocompile show`` / ``plan``: the choice per size and why."""
        return self._describe(self.kinds, self.ms, self.source, REDUCTIONS)

    def describe_gather(self) -> str:
        """The same for the step's all-gathers."""
        return self._describe(self.gather_kinds, self.gather_ms, self.gather_source or self.source, GATHERS)

    def _describe(self, kinds, ms_list, source: str, names: tuple[str, ...]) -> str:
        if len(set(kinds)) == 1 and not ms_list:
            return f"{kinds[0]} ({source})"
        parts = []
        for size, kind, ms in zip(self.sizes, kinds if len(kinds) > 1 else kinds * len(self.sizes),
                                  ms_list or [None] * len(self.sizes)):
            timing = ": " + ", ".join(f"{name} {t:.2f} ms" if math.isfinite(t) else f"{name} n/a"
                                      for name, t in zip(names, ms)) if ms else ""
            parts.append(f"{_size(size)} {kind}{timing}")
        return f"{source}; " + "; ".join(parts)

    def as_dict(self) -> dict:
        """JSON-serialisable form (the dump's frame summary)."""
        return {"source": self.source, "sizes": list(self.sizes), "kinds": list(self.kinds),
                "ms": [list(m) for m in self.ms], "description": self.describe(),
                "parameter_gather": {"kinds": list(self.gather_kinds), "ms": [list(m) for m in self.gather_ms],
                                "description": self.describe_gather()}}


def fixed_choice(kind: str, source: str, gather: str = DEFAULT_GATHER) -> ReductionChoice:
    """``kind`` at every size, and ``gather`` for the step's all-gathers."""
    return ReductionChoice(sizes=(PROBE_BYTES[0],), kinds=(kind,), source=source, gather_kinds=(gather,))


def check_gradient_reduction(value) -> str:
    """``value`` if it is a valid ``gradient_reduction`` option, else ``ValueError`` naming the choices."""
    if value not in GRADIENT_REDUCTIONS:
        raise ValueError(f"option 'gradient_reduction' = {value!r} is invalid; allowed: "
                         f"{', '.join(repr(v) for v in GRADIENT_REDUCTIONS)}")
    return value


def check_parameter_gather(value) -> str:
    """``value`` if it is a valid ``parameter_gather`` option, else ``ValueError`` naming the choices."""
    if value not in PARAMETER_GATHERS:
        raise ValueError(f"option 'parameter_gather' = {value!r} is invalid; allowed: "
                         f"{', '.join(repr(v) for v in PARAMETER_GATHERS)}")
    return value


def sites(stage: int) -> tuple[str, str]:
    """Where a stage runs its gradient reductions and its parameter gathers: ``"graph"`` or
    ``"step"``, which decides what the probe times for each (``probe_times``,
    ``probe_gather_times``). Stage 1 reduces the full gradients in the optimizer step, stage 2
    in the backward graph; stages 1-2 gather the updated shards into the replicas in the step,
    stage 3 gathers parameters in its graphs."""
    return ("step" if stage == 1 else "graph", "step" if stage in (1, 2) else "graph")


def gradient_reduction(option: str, group: CommGroup, device=None, parameter_gather: str = "auto",
                       saved: SavedChoices | None = None, stage: int = 3) -> ReductionChoice:
    """The ``ReductionChoice`` for options ``gradient_reduction=option`` and ``parameter_gather`` on
    ``group``, whose gradients live on ``device`` (default CPU). Where either is ``"auto"`` on a
    real group of several ranks this is a collective the first time per group and device (every
    rank must call it at the same point: the first stage 1-3 frame's compile), then cached;
    with ``saved``, a choice saved there by an earlier run that every rank holds is taken
    instead of measuring, and a measured one is saved. ``stage``: the ZeRO stage, which says
    where the collectives run and so what is timed (``sites``). Where the choice sends
    something through shared memory, the group's segment is opened here (a collective too) and
    kept; else the probe's is let go."""
    check_gradient_reduction(option)
    check_parameter_gather(parameter_gather)
    gather = DEFAULT_GATHER if parameter_gather == "auto" else parameter_gather
    device = torch.device(device or "cpu")
    real = group.world > 1 and not is_fake_group(group) and device.type != "meta"   # transfers that run
    if real and "shared_memory" in (option, parameter_gather):
        _require_shared_memory(group.name, device, "gradient_reduction" if option == "shared_memory"
                               else "parameter_gather")
    if option != "auto" and parameter_gather != "auto":
        choice = fixed_choice(option, "option", gather)
        if real:
            _keep_shared_memory_if_chosen(choice, group.name, device)
        return choice
    kind = DEFAULT_KIND if option == "auto" else option
    if group.world == 1:
        return fixed_choice(kind, "not measured: world size 1", gather)
    if is_fake_group(group):
        return fixed_choice(kind, "not measured: fake process group", gather)
    if device.type == "meta":
        return fixed_choice(kind, "not measured: meta tensors", gather)
    measured = _measured(group.group, group.name, group.world, str(device), saved, sites(stage))
    # an option given keeps its value at every size, the other is what was measured
    if option != "auto":
        measured = dataclasses.replace(measured, kinds=(option,), ms=(), source="option", gather_source="measured")
    elif parameter_gather != "auto":
        measured = dataclasses.replace(measured, gather_kinds=(parameter_gather,), gather_ms=(), gather_source="option")
    # stage 3 reduces without all-reduces (its caller takes ``without_all_reduce``)
    _keep_shared_memory_if_chosen(measured.without_all_reduce() if stage == 3 else measured, group.name, device)
    return measured


def uses_shared_memory(choice: ReductionChoice) -> bool:
    """Whether ``choice`` sends something through shared memory, at some size."""
    return "shared_memory" in (*choice.kinds, *choice.gather_kinds)


def _keep_shared_memory_if_chosen(choice: ReductionChoice, group_name: str, device: torch.device) -> None:
    """Open the group's shared-memory segment and keep it where ``choice`` uses it, else let the
    probe's go (it is not held for nothing). Every rank holds the same choice, so every rank
    opens or releases at this same point."""
    if device.type != "cpu":
        return
    if uses_shared_memory(choice):
        shared_memory.open_channel(group_name).needed = True
    else:
        shared_memory.release_channel(group_name)


def _require_shared_memory(group_name: str, device: torch.device, option: str) -> None:
    """``ZeroConfigError`` naming the reason where option ``option`` = ``"shared_memory"`` cannot be
    had (``_shared_memory_unavailable``: a collective on CPU groups)."""
    reason = _shared_memory_unavailable(group_name, device)
    if reason is not None:
        raise ZeroConfigError(f"option {option!r} = 'shared_memory' cannot be used: {reason}; use 'point_to_point' "
                              "(the same transfers through the process group's sockets) or 'auto'")


def _shared_memory_unavailable(group_name: str, device: torch.device) -> str | None:
    """Why the group's ranks cannot share memory, or None (its segment then opened): a collective
    on CPU groups, so every rank answers the same."""
    if device.type != "cpu":
        return shared_memory.unavailable_reason(device)
    try:
        shared_memory.open_channel(group_name)
        return None
    except shared_memory.SharedMemoryUnavailable as err:
        return str(err)


SAVED_VERSION = 5
"""Bumped when what the probe times or how it weighs the runs changes (``REDUCTIONS``, ``GATHERS``,
``probe_figure``): older saved choices are then not found, and measured anew (version 4 took the
median of the runs, which a busy moment could decide)."""


@dataclass(frozen=True)
class SavedChoices:
    """Where measured choices are kept for a restart (``directory``, beside the compile caches):
    one JSON file per world size, backend, device type and where the collectives run (``sites``). A restart takes the saved choice
    when every rank holds the same one, so its graphs (which AOTAutograd's cache keys on the
    choice) are the cached ones; timings near a tie would otherwise flip between runs. Delete
    the files to measure anew."""

    directory: str
    enabled: bool = True
    """False where this rank's compile caches are off: it loads and saves nothing, but still
    takes part in the ranks' agreement (so a rank whose environment differs cannot hang the
    others: they then all measure)."""

    def path(self, world: int, backend: str, device: str, where: tuple[str, str] = ("graph", "graph")) -> str:
        return os.path.join(self.directory, f"v{SAVED_VERSION}-world{world}-{backend}-{torch.device(device).type}"
                                            f"-reduce-in-{where[0]}-gather-in-{where[1]}.json")

    def load(self, world: int, backend: str, device: str,
             where: tuple[str, str] = ("graph", "graph")) -> "ReductionChoice | None":
        if not self.enabled:
            return None
        try:
            with open(self.path(world, backend, device, where)) as f:
                d = json.load(f)
            return ReductionChoice(sizes=tuple(d["sizes"]), kinds=tuple(d["kinds"]), source="measured",
                                   ms=tuple(tuple(m) for m in d["ms"]), gather_kinds=tuple(d["gather_kinds"]),
                                   gather_ms=tuple(tuple(m) for m in d["gather_ms"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:   # damaged: measured anew
            log.warning("zerocompile: ignoring unreadable saved collective choice (%s)", err)
            return None

    def save(self, choice: "ReductionChoice", world: int, backend: str, device: str,
             where: tuple[str, str] = ("graph", "graph")) -> None:
        """Write atomically (ranks sharing the directory write the same content)."""
        if not self.enabled:
            return
        data = {"sizes": list(choice.sizes), "kinds": list(choice.kinds), "ms": [list(m) for m in choice.ms],
                "gather_kinds": list(choice.gather_kinds), "gather_ms": [list(m) for m in choice.gather_ms]}
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".choice.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path(world, backend, device, where))
        except OSError as err:
            log.debug("zerocompile: collective choice not saved (%s)", err)


@functools.cache
def _measured(process_group, group_name: str, world: int, device: str,
              saved: SavedChoices | None = None, where: tuple[str, str] = ("graph", "graph")) -> ReductionChoice:
    # once per process group object and device for the process's life (keyed by the object:
    # a group destroyed and made anew is measured anew)
    backend = _torch_compat.collective_backend(group_name, torch.device(device)) or "unknown"
    if saved is not None:
        earlier = saved.load(world, backend, device, where)
        if _every_rank_holds(earlier, group_name, world, torch.device(device)):
            return dataclasses.replace(earlier, source="measured (saved)")
    choice = _measure(group_name, world, device, where)
    if saved is not None:
        saved.save(choice, world, backend, device, where)
    return choice


def _fastest(kinds: tuple[str, ...], times: tuple[float, ...], allowed: tuple[str, ...] | None = None) -> str:
    """The kind of the smallest time (the first on a tie), among ``allowed`` (default: all)."""
    pairs = [(t, i) for i, (kind, t) in enumerate(zip(kinds, times)) if allowed is None or kind in allowed]
    return kinds[min(pairs)[1]]


def _every_rank_holds(choice: "ReductionChoice | None", group_name: str, world: int, device: torch.device) -> bool:
    """Whether every rank holds this same saved choice (an all-gather of a digest per rank)."""
    digest = 0 if choice is None else agreement_digest((choice.sizes, choice.kinds, choice.gather_kinds))
    return every_rank_holds(digest, world, group_name, device)


def _measure(group_name: str, world: int, device: str, where: tuple[str, str]) -> ReductionChoice:
    unavailable = _shared_memory_unavailable(group_name, torch.device(device))
    if unavailable is not None:
        log.info("zerocompile: shared-memory transfers not measured on process group %r: %s", group_name, unavailable)
    skip = () if unavailable is None else ("shared_memory",)
    ms = probe_times(group_name, world, torch.device(device), site=where[0], skip=skip)
    gather_ms = probe_gather_times(group_name, world, torch.device(device), site=where[1], skip=skip)
    kinds = tuple(_fastest(REDUCTIONS, times) for times in ms)
    gather_kinds = tuple(_fastest(GATHERS, times) for times in gather_ms)
    return ReductionChoice(sizes=PROBE_BYTES, kinds=kinds, source="measured", ms=ms, gather_kinds=gather_kinds,
                           gather_ms=gather_ms)


def probe_times(group_name: str, world: int, device: torch.device, sizes: tuple[int, ...] = PROBE_BYTES,
                repeats: int = PROBE_REPEATS, site: str = "graph", skip: tuple[str, ...] = ()) -> tuple[tuple[float, ...], ...]:
    """The ms of each of ``REDUCTIONS`` on a float32 buffer of each of ``sizes`` bytes on the
    group (``_timed``), as it runs at ``site`` (``sites``): in the ``"step"``, the collectives
    with the packing of the gradients into their bucket, the transfers sent from the gradients'
    own memory (``zerocompile::reduce_scatter_point_to_point_into``). ``skip``: kinds not timed
    (infinite; ``"shared_memory"`` where the ranks cannot share memory). A collective: every rank
    calls it."""
    def run(kind, n):
        buf = torch.zeros(max(world, n // world * world), device=device)
        grad = torch.zeros_like(buf) if site == "step" else None
        chunk = grad.new_empty(buf.numel() // world) if site == "step" else None
        shm = kind == "shared_memory"

        def once():
            if site == "step" and kind in ("point_to_point", "shared_memory"):
                torch.ops.zerocompile.reduce_scatter_point_to_point_into([grad], [chunk], world, group_name, shm)
                _c10d.wait_tensor(chunk)
                return
            if site == "step":
                buf.copy_(grad)                     # the bucket's packing
            if kind == "reduce_scatter":
                _c10d.wait_tensor(start_reduce_scatter(buf, "sum", world, group_name))
            elif kind == "all_reduce":
                all_reduce(buf, "sum", group_name)
            else:
                _c10d.wait_tensor(torch.ops.zerocompile.reduce_scatter_point_to_point(buf, "sum", world, group_name,
                                                                                       True, shm))
        return once
    return _timed(REDUCTIONS, run, group_name, device, sizes, repeats, skip)


def probe_gather_times(group_name: str, world: int, device: torch.device, sizes: tuple[int, ...] = PROBE_BYTES,
                       repeats: int = PROBE_REPEATS, site: str = "graph",
                       skip: tuple[str, ...] = ()) -> tuple[tuple[float, ...], ...]:
    """The ms of each of ``GATHERS`` gathering a float32 buffer of each of ``sizes`` bytes (the
    gathered size) on the group (``_timed``), as it runs at ``site`` (``sites``): in the
    ``"step"``, the all-gather with its packing and its copy into a replica, the transfers
    straight into the replica (``zerocompile::all_gather_point_to_point_into``); in a
    ``"graph"``, the all-gather as it is, the transfers sending a copy of their input. ``skip``:
    as ``probe_times``'. A collective: every rank calls it."""
    rank = torch.distributed.get_rank(_torch_compat.process_group_named(group_name))

    def run(kind, n):
        chunk = max(1, n // world)
        shard, out = torch.zeros(chunk, device=device), torch.empty(chunk * world, device=device)
        replica = torch.zeros(chunk * world, device=device) if site == "step" else None
        shm = kind == "shared_memory"

        def once():
            if site == "step" and kind == "all_gather":
                shard.copy_(replica.view(world, chunk)[rank])            # the bucket's packing
                _c10d.wait_tensor(start_all_gather_flat(shard, world, group_name, out=out))
                replica.copy_(out)                                          # the write into the replica
            elif site == "step":
                own = replica.view(world, chunk)[rank]
                torch.ops.zerocompile.all_gather_point_to_point_into([own], [replica], world, group_name, shm)
                _c10d.wait_tensor(replica)
            elif kind == "all_gather":
                _c10d.wait_tensor(start_all_gather_flat(shard, world, group_name, out=out))
            else:
                torch.ops.zerocompile.all_gather_point_to_point_out(shard, world, group_name, out, True, shm)
                _c10d.wait_tensor(out)
        return once
    return _timed(GATHERS, run, group_name, device, sizes, repeats, skip)


def _timed(kinds: tuple[str, ...], run, group_name: str, device: torch.device, sizes: tuple[int, ...],
           repeats: int, skip: tuple[str, ...] = ()) -> tuple[tuple[float, ...], ...]:
    """For each of ``sizes`` (bytes of float32) and each of ``kinds``, ``run(kind, elements)()``
    timed ``repeats`` times after one warm-up round, taking turns: the fastest on this rank
    (``probe_figure``), then the maximum over ranks (an all-reduce), so every rank returns the same
    figures. Kinds in ``skip`` are not run: infinite."""
    mine = []
    for nbytes in sizes:
        calls = {kind: run(kind, nbytes // 4) for kind in kinds if kind not in skip}
        times = {kind: [math.inf] if kind in skip else [] for kind in kinds}
        for rep in range(repeats + 1):             # the first round warms up
            for kind, once in calls.items():
                _sync(device)
                start = time.perf_counter()
                once()
                _sync(device)
                if rep:
                    times[kind].append((time.perf_counter() - start) * 1e3)
        mine += [probe_figure(times[kind]) for kind in kinds]
    worst = all_reduce(torch.tensor(mine, dtype=torch.float64, device=device), "max", group_name).cpu().tolist()
    k = len(kinds)
    return tuple(tuple(worst[k * i: k * i + k]) for i in range(len(sizes)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:g} KiB"
