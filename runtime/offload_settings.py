"""The ``offload_optimizer`` and ``offload_param`` options, named and shaped as in DeepSpeed's
``zero_optimization`` section: parsed into ``OffloadSettings`` (``parse_offload``), with every
unknown key or bad value a ``ValueError`` that names it and what is allowed."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class OffloadSettings:
    """Where one kind of model state lives between uses, and how it travels."""

    device: str = "none"
    """``"none"``: where the model is; ``"cpu"``: host memory (a no-op, logged, when the model
    is already on the CPU); ``"nvme"``: files under ``nvme_path``, one per rank."""

    nvme_path: str | None = None
    """Directory of the swap files (``"nvme"``); created if missing; the files are deleted at
    exit."""

    pin_memory: bool = True
    """Page-lock the host buffers that CUDA tensors are copied through (no effect on CPU)."""

    buffer_count: int = 4
    """Buffers in flight in the optimizer step's pipeline: while one tile is updated, the next
    ``buffer_count - 2`` are being read and the previous one written (at least 2)."""

    buffer_size: int = 1 << 22
    """Elements per buffer (one tile of a flat shard); the buffers hold ``buffer_count`` tiles of
    each state tensor streamed through the step."""

    ratio: float | str = 1.0
    """Fraction of the optimizer state (by bytes, parameters in order) to offload; the rest stays
    resident (DeepSpeed's partial offload). ``"auto"``: as little as keeps this rank's model
    state plus the largest simulated transient peak of its compiled graphs under the
    ``memory_limit_mb`` option (required then), chosen when the optimizer binds."""

    memory_limit_mb: float | None = None
    """The ``memory_limit_mb`` option of the frame, for ``ratio="auto"`` (set by ``ZeroConfig``)."""

    threads: int = 8
    """I/O threads per swap file, i.e. requests in flight (DeepSpeed's ``aio.thread_count``)."""

    block_size: int = 1 << 20
    """Bytes per read or write request (a multiple of 4096; DeepSpeed's ``aio.block_size``)."""

    @property
    def enabled(self) -> bool:
        return self.device != "none"


_ACCEPTED_NO_EFFECT = ("pipeline_read", "pipeline_write", "fast_init", "max_in_cpu")
"""DeepSpeed keys accepted for config compatibility: reads and writes are always overlapped
with compute here, and state is never staged through a CPU copy first."""


def _device_and_path(name: str, kw: dict) -> tuple:
    """The checked ``device`` and ``nvme_path`` of option ``name``'s dict ``kw`` (the path made a
    ``str`` in ``kw``)."""
    device = kw.get("device", "none")
    if device not in DEVICES:
        raise ValueError(f"option '{name}.device' = {device!r} is invalid; allowed: {', '.join(map(repr, DEVICES))}")
    path = kw.get("nvme_path")
    if device == "nvme" and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"option '{name}.device' = 'nvme' needs '{name}.nvme_path', a directory for the swap files")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"option '{name}.nvme_path' = {path!r} is invalid; allowed: a directory path")
    if path is not None:
        kw["nvme_path"] = os.fspath(path)
    return device, path


def parse_offload(name: str, value) -> OffloadSettings:
    """``value`` (None, an ``OffloadSettings`` or a dict of the fields above) -> settings;
    ``name`` is the option's name for error messages."""
    if value is None:
        return OffloadSettings()
    if isinstance(value, OffloadSettings):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"option '{name}' = {value!r} is invalid; allowed: None or a dict like "
                         "{'device': 'nvme', 'nvme_path': '/local_nvme'}")
    fields = set(OffloadSettings.__dataclass_fields__)
    for key in value:
        if key not in fields and key not in _ACCEPTED_NO_EFFECT:
            raise ValueError(f"unknown key '{name}.{key}'; allowed: {', '.join(sorted(fields | set(_ACCEPTED_NO_EFFECT)))}")
    kw = {k: v for k, v in value.items() if k in fields}
    device, path = _device_and_path(name, kw)
    for key, low in (("buffer_count", 2), ("buffer_size", 1), ("threads", 1), ("block_size", 4096)):
        v = kw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < low):
            raise ValueError(f"option '{name}.{key}' = {v!r} is invalid; allowed: an integer >= {low}")
        if v is not None:
            kw[key] = int(v)
    if kw.get("block_size", 4096) % 4096:
        raise ValueError(f"option '{name}.block_size' = {kw['block_size']} is invalid; allowed: a multiple of 4096")
    ratio = kw.get("ratio", 1.0)
    if ratio != "auto" and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or math.isnan(ratio)
                            or not 0 < ratio <= 1):
        raise ValueError(f"option '{name}.ratio' = {ratio!r} is invalid; allowed: a fraction in (0, 1], or 'auto'")
    if "memory_limit_mb" in value:
        raise ValueError(f"unknown key '{name}.memory_limit_mb': the memory limit is the option memory_limit_mb")
    if not isinstance(kw.get("pin_memory", True), bool):
        raise ValueError(f"option '{name}.pin_memory' = {kw['pin_memory']!r} is invalid; allowed: True, False")
    return OffloadSettings(**kw)


@dataclass(frozen=True)
class ActivationOffloadSettings:
    """Where the activations a forward saves for backward wait for it (the ``offload_activations``
    option; see docs/offload.md)."""

    device: str = "none"
    """``"none"``: they stay in memory; ``"nvme"``: files under ``nvme_path``, one per process;
    ``"cpu"``: page-locked host memory for a CUDA model (a logged no-op for a CPU model)."""

    nvme_path: str | None = None
    """Directory of the swap files (``"nvme"``); created if missing; the files are deleted at exit."""

    budget_mb: float | str | None = None
    """None: offload every saved activation worth it (at least ``min_kb``). A number: MiB per rank
    of saved activations that may stay in memory; the planner (``plan_activations`` pass) chooses
    per saved tensor among keep, recompute (whole blocks) and offload, least estimated time
    first, until the rest fits.
    ``"auto"``: that budget is what ``memory_limit_mb`` leaves after the other transient tensors of
    the simulated step."""

    min_kb: float = 64.0
    """Smaller saved tensors stay in memory (a transfer's latency outweighs their bytes)."""

    memory_limit_mb: float | None = None
    """The ``memory_limit_mb`` option of the frame, for ``budget_mb="auto"`` (set by ``ZeroConfig``)."""

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def parse_activation_offload(value) -> ActivationOffloadSettings:
    """``value`` (None, ``"none"``, an ``ActivationOffloadSettings`` or a dict of its fields) -> settings;
    every unknown key or bad value a ``ValueError`` naming it and what is allowed."""
    name = "offload_activations"
    if value is None or value == "none":
        return ActivationOffloadSettings()
    if isinstance(value, ActivationOffloadSettings):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"option '{name}' = {value!r} is invalid; allowed: None or a dict like "
                         "{'device': 'nvme', 'nvme_path': '/local_nvme'}")
    fields = set(ActivationOffloadSettings.__dataclass_fields__) - {"memory_limit_mb"}
    for key in value:
        if key not in fields:
            raise ValueError(f"unknown key '{name}.{key}'; allowed: {', '.join(sorted(fields))}"
                             + ("; the memory limit is the option memory_limit_mb" if key == "memory_limit_mb" else ""))
    kw = dict(value)
    device, path = _device_and_path(name, kw)
    budget = kw.get("budget_mb")
    if budget is not None and budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                                     or math.isnan(budget) or budget < 0):
        raise ValueError(f"option '{name}.budget_mb' = {budget!r} is invalid; allowed: None, a number of MiB >= 0, "
                         "or 'auto'")
    min_kb = kw.get("min_kb", 64.0)
    if isinstance(min_kb, bool) or not isinstance(min_kb, (int, float)) or math.isnan(min_kb) or min_kb < 0:
        raise ValueError(f"option '{name}.min_kb' = {min_kb!r} is invalid; allowed: a number of KiB >= 0")
    if device == "none" and (budget is not None or path is not None):
        raise ValueError(f"option '{name}' = {value!r} gives no 'device' to offload to; add 'device': 'nvme' "
                         "(with nvme_path) or 'cpu'")
    return ActivationOffloadSettings(**kw)
