"""A restart that skips compiling: torch's compile caches for zerocompile's frames, and the
entry beside them that a cache hit needs.

With the inductor inner compiler a frame goes through AOTAutograd's cache and inductor's FX-graph
cache (both under ``TORCHINDUCTOR_CACHE_DIR``). AOTAutograd keys an entry on the frame's graph
after the Dynamo-graph passes (parameters already shards plus collectives), its inputs' shapes,
dtypes and strides, torch's configs and version, and, through inductor's config, the
partitioner's ``uuid()`` (zerocompile's source and every option) and the source digest of the
zerocompile functions the graph calls (``cacheable_functions``). A hit skips AOTAutograd's joint
trace, the partitioner with the joint, forward and backward passes, and inductor's code
generation.

What the partitioner computes besides the graphs is saved here, as a ``FrameEntry`` in
``<inductor cache dir>/zerocompile/frames``, keyed by ``frame_key`` (the same graph and inputs,
the partitioner's uuid, torch's version, the rank, world size and group): the collective
summaries that ``zerocompile.stats()`` and the ranks' fingerprint check read, the passes'
results, and the cost model the passes weighed. When the cost model is probed (a collective),
every rank must decide alike whether it reuses its entry (``agree``): a rank that compiled anew
would probe other rates and could choose other collectives than the cached graphs of its peers.

Frames that cannot be cached compile as before (``bypass_reason``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

import torch

from zerocompile import _torch_compat
from zerocompile.runtime.accounting import CollectiveSummary
from zerocompile.runtime.comm import CommGroup, agreement_digest, every_rank_holds, is_fake_group
from zerocompile.runtime.reduction_choice import SavedChoices

log = logging.getLogger("zerocompile")

ENTRY_VERSION = 1
"""Bumped when ``FrameEntry`` changes shape: older entries then miss."""


@dataclasses.dataclass
class FrameEntry:
    """What a frame's partitioner computed besides its graphs, for a compile that hits torch's
    caches and runs no partitioner."""

    forward_summary: CollectiveSummary | None
    backward_summary: CollectiveSummary
    inference_summary: CollectiveSummary | None
    results: dict
    """The passes' reports (``PassContext.results``)."""
    cost_model: dict | None
    """The rates the passes weighed (``CostModel.as_dict()``), or None when none was used."""

    def agreement_value(self) -> int:
        """A nonzero number that equal entries' cost models share (``agree`` compares it)."""
        return agreement_digest(sorted((self.cost_model or {}).items()))


def bypass_reason(inner_compiler: str, profile: bool, dumping: bool, hpz_partition_size: int,
                  timers: bool = False) -> str | None:
    """Why a frame with these settings compiles without the caches (None: it uses them)."""
    if inner_compiler != "inductor":
        return "the eager inner compiler compiles nothing to cache"
    if not _torch_compat.compile_caches_enabled():
        return "torch's FX-graph or AOTAutograd cache is disabled"
    if profile:
        return "profile=True measures the frame's ops at every compile"
    if dumping:
        return "dumping records every pass's graph, so the passes run"
    if hpz_partition_size > 1:
        return "zero_hpz_partition_size > 1: its passes create the process subgroups the graphs use"
    if timers:
        return "comms_logger and flops_profiler register their timers' call sites at every compile"
    return None


def frame_key(gm: torch.fx.GraphModule, inputs, group: CommGroup, partitioner_uuid: str) -> str:
    """The key of a frame's ``FrameEntry``: the graph's code (after the Dynamo-graph passes),
    each input's type, shape, stride, dtype, device and requires_grad, the partitioner's uuid
    (zerocompile's source and options), torch's version, and the rank, world size and group."""
    digest = hashlib.sha256()
    for part in (f"v{ENTRY_VERSION}", torch.__version__, partitioner_uuid,
                 f"rank {group.rank} of {group.world} in {group.name}", gm.code):
        digest.update(part.encode())
        digest.update(b"\0")
    for value in inputs:
        digest.update(_input_signature(value).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _input_signature(value) -> str:
    if isinstance(value, torch.Tensor):
        return (f"{type(value).__name__} {tuple(value.shape)} {value.stride()} {value.storage_offset()} "
                f"{value.dtype} {value.device} {value.requires_grad} {isinstance(value, torch.nn.Parameter)}")
    return f"{type(value).__name__} {value!r}"


def cacheable_functions(gm: torch.fx.GraphModule, source_digest: str) -> dict:
    """The zerocompile functions ``gm`` calls (``runtime/param_ops.py``: plain functions of
    tensors and printable constants), each named as AOTAutograd's cacheability check names it
    and mapped to ``source_digest``: the digest enters the cache key, so edited code misses."""
    names = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        module = getattr(node.target, "__module__", None) or ""
        if callable(node.target) and module.split(".")[0] == "zerocompile":
            names.add(f"{module}.{node.target.__name__}")
    return {name: source_digest for name in sorted(names)}


class FrameCache:
    """The ``FrameEntry`` files of one cache directory."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    @classmethod
    def in_inductor_cache(cls) -> "FrameCache":
        """The entries beside inductor's own (``TORCHINDUCTOR_CACHE_DIR``)."""
        return cls(Path(_torch_compat.inductor_cache_dir()) / "zerocompile" / "frames")

    def load(self, key: str) -> FrameEntry | None:
        """The entry saved under ``key``, or None (none, or unreadable: then the frame compiles)."""
        path = self.directory / f"{key}.pkl"
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception as err:  # noqa: BLE001 - a damaged entry is a miss, never a failure
            log.warning("zerocompile compile cache: ignoring unreadable entry %s (%s)", path, err)
            return None
        return entry if isinstance(entry, FrameEntry) else None

    def save(self, key: str, entry: FrameEntry) -> None:
        """Write ``entry`` under ``key`` atomically (a rename), so a reader never sees half of it."""
        try:
            data = pickle.dumps(entry)
        except Exception as err:  # noqa: BLE001 - a pass result that does not pickle: no entry
            log.debug("zerocompile compile cache: entry not saved (%s)", err)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self.directory / f"{key}.pkl")


def saved_choices() -> SavedChoices:
    """Where a measured ``gradient_reduction`` / ``parameter_gather`` choice is kept for a
    restart (beside inductor's cache), whatever the inner compiler: with inductor, AOTAutograd's
    cache keys on the choice (a choice measured anew could flip near a tie, and the restart
    would miss); with every inner compiler a restart then runs the same collectives (on more
    than 2 ranks they sum in an order the kind fixes) without timing them again (about 0.5 s per
    rank on 2 gloo ranks, more on a loaded machine). Where this rank's caches are off the store
    is disabled but still given: every rank takes part in the agreement on a saved choice,
    whatever its own environment."""
    return SavedChoices(str(Path(_torch_compat.inductor_cache_dir()) / "zerocompile" / "choices"),
                        enabled=_torch_compat.compile_caches_enabled())


def agree(entry: FrameEntry | None, group: CommGroup, device) -> bool:
    """Whether every rank of ``group`` holds an entry with the same cost model (an all-gather of
    one number per rank; run where the cost-model probe, also a collective, would run)."""
    value = 0 if entry is None else entry.agreement_value()
    if group.world == 1 or is_fake_group(group) or (device is not None and torch.device(device).type == "meta"):
        return value != 0          # nothing to agree with (on meta, the probe times nothing either)
    return every_rank_holds(value, group.world, group.name, device)
