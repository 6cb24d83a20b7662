"""Monitors: DeepSpeed's TensorBoard and CSV monitors, written by rank 0 after every
``ZeroOptimizer.step()`` (``zerocompile/optim/monitoring.py`` collects the figures).

The ``monitor`` option (or DeepSpeed's top-level keys ``tensorboard`` and ``csv_monitor``, with
their sub-keys ``enabled``, ``output_path`` and ``job_name``) turns them on::

    options={"monitor": {"tensorboard": {"enabled": True, "output_path": "logs", "job_name": "run1"},
                         "csv_monitor": {"enabled": True, "output_path": "logs", "job_name": "run1"}}}

Both write under ``output_path/job_name/`` (DeepSpeed's layout): TensorBoard's event files
(``torch.utils.tensorboard``, which needs the ``tensorboard`` package), and one CSV file per tag,
named after the tag with ``/`` as ``_`` (``Train_Samples_lr.csv``), whose header is ``step`` and
the tag's last part and whose rows are ``x, value``. Tags follow DeepSpeed's
(``Train/Samples/lr``); x is the number of samples seen when ``samples_per_step`` is known (a
DeepSpeed config's ``train_batch_size``, or the option's own key), else the optimizer step.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from zerocompile.errors import ZeroConfigError

__all__ = ["MonitorSettings", "MetricWriter", "parse_monitor", "MONITOR_KINDS"]

MONITOR_KINDS = ("tensorboard", "csv_monitor")
"""The monitors the ``monitor`` option (and a DeepSpeed config) can turn on."""
_SUBKEYS = ("enabled", "output_path", "job_name")
_DEFAULT_JOB_NAME = "DeepSpeedJobName"        # DeepSpeed's default, so a config's files land where they did


@dataclass(frozen=True)
class MonitorSettings:
    """Where the enabled monitors write (None: that monitor is off)."""

    tensorboard: str | None = None
    """The directory of TensorBoard's event files (``output_path/job_name``)."""
    csv: str | None = None
    """The directory of the CSV files (``output_path/job_name``)."""
    samples_per_step: int | None = None
    """Samples per optimizer step over all ranks: x counts samples; None: x counts steps."""

    @property
    def enabled(self) -> bool:
        return self.tensorboard is not None or self.csv is not None


def parse_monitor(value) -> MonitorSettings | None:
    """The ``monitor`` option: None, a ``MonitorSettings``, or a dict with any of
    ``tensorboard`` and ``csv_monitor`` (each ``{"enabled", "output_path", "job_name"}``) and
    ``samples_per_step``. None when no monitor is enabled."""
    if value is None or isinstance(value, MonitorSettings):
        return value if value is None or value.enabled else None
    if not isinstance(value, dict):
        raise ZeroConfigError(f"option 'monitor' = {value!r} is invalid; give a dict such as "
                              "{'tensorboard': {'enabled': True, 'output_path': 'logs', 'job_name': 'run'}}")
    unknown = sorted(set(value) - {*MONITOR_KINDS, "samples_per_step"})
    if unknown:
        raise ZeroConfigError(f"option 'monitor' has unknown key(s) {', '.join(unknown)}; allowed: "
                              f"{', '.join(MONITOR_KINDS)}, samples_per_step")
    samples = value.get("samples_per_step")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
        raise ZeroConfigError(f"option 'monitor.samples_per_step' = {samples!r} is invalid; give an integer >= 1 "
                              "(samples per optimizer step over all ranks) or leave it out (x counts steps)")
    settings = MonitorSettings(tensorboard=_directory("tensorboard", value.get("tensorboard")),
                               csv=_directory("csv_monitor", value.get("csv_monitor")), samples_per_step=samples)
    return settings if settings.enabled else None


def _directory(kind: str, section) -> str | None:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ZeroConfigError(f"monitor '{kind}' must be a dict with {', '.join(_SUBKEYS)}, got {section!r}")
    unknown = sorted(set(section) - set(_SUBKEYS))
    if unknown:
        raise ZeroConfigError(f"monitor '{kind}' has unknown key(s) {', '.join(unknown)}; allowed: "
                              f"{', '.join(_SUBKEYS)}")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ZeroConfigError(f"monitor '{kind}.enabled' = {enabled!r} is invalid; give true or false")
    for key in ("output_path", "job_name"):
        if section.get(key) is not None and not isinstance(section[key], str):
            raise ZeroConfigError(f"monitor '{kind}.{key}' = {section[key]!r} is invalid; give a string")
    if not enabled:
        return None
    return os.path.join(section.get("output_path") or "", section.get("job_name") or _DEFAULT_JOB_NAME)


class MetricWriter:
    """Rank 0's writers of the enabled monitors. Creating one makes the directories and opens
    TensorBoard's writer: ``OSError`` (or ``ZeroConfigError`` without the ``tensorboard``
    package) when it cannot."""

    def __init__(self, settings: MonitorSettings):
        self.settings = settings
        self._tensorboard = None
        if settings.tensorboard is not None:
            try:
                import tensorboard  # noqa: F401  (torch.utils.tensorboard writes through it)
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ZeroConfigError("monitor 'tensorboard' needs the tensorboard package: pip install "
                                      "'zerocompile[monitor]' (or tensorboard), or use csv_monitor") from None
            Path(settings.tensorboard).mkdir(parents=True, exist_ok=True)
            self._tensorboard = SummaryWriter(log_dir=settings.tensorboard)
        if settings.csv is not None:
            folder = Path(settings.csv)
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / ".zerocompile_write_test"
            probe.write_text("")        # fails now, not at the first metric, where it cannot write
            probe.unlink()

    def write(self, metrics: dict, x: int) -> None:
        """One value per tag at ``x``."""
        if self._tensorboard is not None:
            for tag, value in metrics.items():
                self._tensorboard.add_scalar(tag, value, x)
            self._tensorboard.flush()
        if self.settings.csv is not None:
            for tag, value in metrics.items():
                path = Path(self.settings.csv) / (tag.replace("/", "_") + ".csv")
                new = not path.exists()
                with open(path, "a", newline="") as f:
                    writer = csv.writer(f)
                    if new:
                        writer.writerow(["step", tag.split("/")[-1]])
                    writer.writerow([x, value])

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
