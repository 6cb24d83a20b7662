"""The checkpoint directory on disk: its path, its atomic replacement, what an unfinished save
leaves, and reading DCP's metadata and the small entries in one process.

Saves are atomic: the ranks write ``<path>.tmp-<id>``; when DCP has written its ``.metadata``
(last, after every rank's data), rank 0 renames it to ``<path>``. A previous checkpoint at
``<path>`` is moved aside to ``<path>.old-<id>`` first and deleted once the new one is in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import uuid
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from zerocompile.checkpoint.layout import META_KEY

logger = logging.getLogger("zerocompile")

_LEFTOVER = re.compile(r"\.(tmp|old)-[0-9a-f]{12}$")


def clean_path(path) -> str:
    path = os.fspath(path)
    if not path:
        raise ValueError("checkpoint path is empty")
    return os.path.abspath(path.rstrip(os.sep) or os.sep)


def _leftovers(path: str) -> list[str]:
    parent, name = os.path.split(path)
    if not os.path.isdir(parent):
        return []
    return sorted(os.path.join(parent, n) for n in os.listdir(parent)
                  if n.startswith(name) and _LEFTOVER.fullmatch(n[len(name):]))


def read_metadata(path: str) -> Metadata:
    """DCP's metadata of the checkpoint at ``path``, after checking that it is a complete
    zerocompile checkpoint (raises ``FileNotFoundError`` / ``ValueError`` saying what is wrong)."""
    if not os.path.exists(path):
        hint = ""
        old = [p for p in _leftovers(path) if ".old-" in p]
        if old:
            hint = (f"; a save was interrupted while replacing it: the previous checkpoint is "
                    f"{old[-1]} (rename it to {path})")
        elif _leftovers(path):
            hint = f"; {_leftovers(path)[-1]} is a save that did not finish"
        raise FileNotFoundError(f"zerocompile: no checkpoint at '{path}'{hint}")
    if not os.path.isdir(path):
        raise ValueError(f"zerocompile: '{path}' is a file; a checkpoint is a directory written by "
                         "zerocompile.save_checkpoint")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        raise ValueError(f"zerocompile: '{path}' is not a complete checkpoint: it has no .metadata, which "
                         "a save writes last (a save that did not finish, or not a checkpoint "
                         "directory)") from None
    if META_KEY not in metadata.state_dict_metadata:
        raise ValueError(f"zerocompile: '{path}' is a torch.distributed.checkpoint directory but not one "
                         f"written by zerocompile.save_checkpoint (no '{META_KEY}' entry)")
    return metadata


def read_small(path: str, metadata: Metadata, keys: list) -> dict:
    """The small entries ``keys`` (metadata, extra, hyperparameters), read by this process alone."""
    state = {}
    for key in keys:
        md = metadata.state_dict_metadata[key]
        state[key] = None if isinstance(md, BytesStorageMetadata) else torch.empty(md.size, dtype=md.properties.dtype)
    with single_process():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state


def _is_checkpoint(path: str) -> bool:
    try:
        read_metadata(path)
        return True
    except (FileNotFoundError, ValueError):
        return False


def prepare_destination(path: str) -> str:
    """Rank 0, before a save: refuse to replace anything but a checkpoint; return the save's id."""
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise FileExistsError(f"save_checkpoint: '{path}' exists and is not a directory; "
                                  "choose another path")
        if os.listdir(path) and not _is_checkpoint(path):
            raise FileExistsError(f"save_checkpoint: '{path}' exists and is not a zerocompile checkpoint; "
                                  "refusing to replace it (choose another path or remove it)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return uuid.uuid4().hex[:12]


def swap_in(tmp: str, path: str, token: str) -> None:
    """Rank 0, after every rank wrote ``tmp``: make it ``path``; drop the one it replaces and
    leftovers of saves that did not finish."""
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    os.rename(tmp, path)
    for leftover in _leftovers(path):
        logger.info("zerocompile: removing %s (%s)", leftover,
                    "the checkpoint just replaced" if leftover == old else "left by an unfinished save")
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def failures_named(doing: str, path: str):
    """DCP reports a failure on any rank as a ``CheckpointException`` (a ``BaseException``) on
    every rank; raise a ``RuntimeError`` naming the ranks and the first error instead."""
    try:
        yield
    except CheckpointException as err:
        rank = min(err.failures)
        first = err.failures[rank][0]
        raise RuntimeError(f"zerocompile: {doing} checkpoint '{path}' failed on rank(s) {sorted(err.failures)}; "
                           f"rank {rank}: {type(first).__name__}: {first}") from err


@contextlib.contextmanager
def single_process(active: bool = True):
    """Silence DCP's warning that it runs in one process: without a process group it is meant to."""
    with warnings.catch_warnings():
        if active:
            warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable")
        yield
