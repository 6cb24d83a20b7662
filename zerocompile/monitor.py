"""Monitors: DeepSpeed's TensorBoard, CSV, Weights & Biases and Comet monitors, written by rank 0
after every ``ZeroOptimizer.step()`` (``zerocompile/optim/monitoring.py`` collects the figures).

The ``monitor`` option (or DeepSpeed's top-level keys ``tensorboard``, ``csv_monitor``, ``wandb``
and ``comet``, with their own sub-keys) turns them on::

    options={"monitor": {"tensorboard": {"enabled": True, "output_path": "logs", "job_name": "run1"},
                         "csv_monitor": {"enabled": True, "output_path": "logs", "job_name": "run1"}}}

Both write under ``output_path/job_name/`` (DeepSpeed's layout): TensorBoard's event files
(``torch.utils.tensorboard``, which needs the ``tensorboard`` package), and one CSV file per tag,
named after the tag with ``/`` as ``_`` (``Train_Samples_lr.csv``), whose header is ``step`` and
the tag's last part and whose rows are ``x, value``. Tags follow DeepSpeed's
(``Train/Samples/lr``); x is the number of samples seen when ``samples_per_step`` is known (a
DeepSpeed config's ``train_batch_size``, or the option's own key), else the optimizer step.

W&B (``wandb``: ``project``, ``group``, ``team``) logs each step's figures with ``wandb.log(...,
step=x)`` into a run it starts with ``wandb.init`` (the ``WANDB_*`` environment applies:
``WANDB_MODE=offline`` keeps it on disk), or into the run the script already started (its own
steps stay: x is logged as ``Train/Samples/x``). Comet (``comet``: ``project``, ``workspace``,
``api_key``, ``experiment_name``, ``experiment_key``, ``online``, ``mode``,
``samples_log_interval``) starts an experiment with ``comet_ml.start`` (``online: false`` writes
an offline archive) and logs a tag when ``samples_log_interval`` x-units passed since it last
logged that tag, as DeepSpeed's does. Both are optional packages (``zerocompile[wandb]``,
``zerocompile[comet]``); their runs end with ``zerocompile.close_monitors()`` or at exit.
"""

from __future__ import annotations

import atexit
import csv
import os
from dataclasses import dataclass, field
from pathlib import Path

from zerocompile.errors import ZeroConfigError

__all__ = ["MonitorSettings", "MetricWriter", "parse_monitor", "MONITOR_KINDS", "WandbSettings", "CometSettings"]

MONITOR_KINDS = ("tensorboard", "csv_monitor", "wandb", "comet")
"""The monitors the ``monitor`` option (and a DeepSpeed config) can turn on."""
_SUBKEYS = ("enabled", "output_path", "job_name")
_DEFAULT_JOB_NAME = "DeepSpeedJobName"        # DeepSpeed's default, so a config's files land where they did


@dataclass(frozen=True)
class WandbSettings:
    """DeepSpeed's ``wandb`` sub-keys (their defaults are DeepSpeed's)."""

    project: str = "deepspeed"
    """The W&B project of the run started."""
    group: str | None = None
    """The run's group."""
    team: str | None = None
    """The W&B entity (team or user) the run belongs to; None: the logged-in user's default."""


@dataclass(frozen=True)
class CometSettings:
    """DeepSpeed's ``comet`` sub-keys, given to ``comet_ml.start`` (None: Comet's default or its
    ``COMET_*`` environment)."""

    project: str | None = None
    workspace: str | None = None
    api_key: str | None = field(default=None, repr=False)
    """Never shown in messages."""
    experiment_name: str | None = None
    experiment_key: str | None = None
    """Continue this experiment instead of starting one."""
    online: bool | None = None
    """False: an offline experiment (an archive under ``COMET_OFFLINE_DIRECTORY``)."""
    mode: str | None = None
    """Comet's ``"get"``, ``"create"`` or ``"get_or_create"``."""
    samples_log_interval: int = 100
    """Log a tag when at least this many x-units (samples, or steps) passed since it was last logged."""


@dataclass(frozen=True)
class MonitorSettings:
    """Where the enabled monitors write (None: that monitor is off)."""

    tensorboard: str | None = None
    """The directory of TensorBoard's event files (``output_path/job_name``)."""
    csv: str | None = None
    """The directory of the CSV files (``output_path/job_name``)."""
    samples_per_step: int | None = None
    """Samples per optimizer step over all ranks: x counts samples; None: x counts steps."""
    wandb: WandbSettings | None = None
    """The W&B run to log to (None: off)."""
    comet: CometSettings | None = None
    """The Comet experiment to log to (None: off)."""

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.tensorboard, self.csv, self.wandb, self.comet))

    def describe(self) -> str:
        """Where the figures go, for messages."""
        parts = [f"tensorboard {self.tensorboard}" if self.tensorboard else "", f"csv {self.csv}" if self.csv else "",
                 f"wandb project {self.wandb.project}" if self.wandb else "",
                 f"comet project {self.comet.project}" if self.comet else ""]
        return ", ".join(p for p in parts if p)


def parse_monitor(value) -> MonitorSettings | None:
    """The ``monitor`` option: None, a ``MonitorSettings``, or a dict with any of
    ``tensorboard`` and ``csv_monitor`` (each ``{"enabled", "output_path", "job_name"}``), ``wandb``
    and ``comet`` (DeepSpeed's sub-keys: ``WandbSettings``, ``CometSettings``) and
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
                               csv=_directory("csv_monitor", value.get("csv_monitor")), samples_per_step=samples,
                               wandb=_service("wandb", value.get("wandb"), WandbSettings),
                               comet=_service("comet", value.get("comet"), CometSettings))
    return settings if settings.enabled else None


def _enabled(kind: str, section, allowed: tuple) -> bool:
    """The ``enabled`` of a monitor's section, once the section is checked: a dict of ``allowed`` keys."""
    if not isinstance(section, dict):
        raise ZeroConfigError(f"monitor '{kind}' must be a dict with {', '.join(allowed)}; got {section!r}")
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ZeroConfigError(f"monitor '{kind}' has unknown key(s) {', '.join(unknown)}; allowed: "
                              f"{', '.join(allowed)}")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ZeroConfigError(f"monitor '{kind}.enabled' = {enabled!r} is invalid; give true or false")
    return enabled


def _service(kind: str, section, settings_class):
    """The settings of the ``wandb`` or ``comet`` section (None when absent or not enabled)."""
    if section is None:
        return None
    enabled = _enabled(kind, section, ("enabled", *settings_class.__dataclass_fields__))
    values = {k: v for k, v in section.items() if k != "enabled" and v is not None}
    for key, value in values.items():
        if key == "online":
            ok = isinstance(value, bool)
        elif key == "samples_log_interval":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        else:
            ok = isinstance(value, str)
        if not ok:
            want = {"online": "true or false", "samples_log_interval": "an integer >= 1"}.get(key, "a string")
            shown = "<hidden>" if key == "api_key" else repr(value)
            raise ZeroConfigError(f"monitor '{kind}.{key}' = {shown} is invalid; give {want}")
    if values.get("mode") not in (None, "get", "create", "get_or_create"):
        raise ZeroConfigError(f"monitor 'comet.mode' = {values['mode']!r} is invalid; allowed: get, create, "
                              "get_or_create")
    return settings_class(**values) if enabled else None


def _directory(kind: str, section) -> str | None:
    if section is None:
        return None
    enabled = _enabled(kind, section, _SUBKEYS)
    for key in ("output_path", "job_name"):
        if section.get(key) is not None and not isinstance(section[key], str):
            raise ZeroConfigError(f"monitor '{kind}.{key}' = {section[key]!r} is invalid; give a string")
    if not enabled:
        return None
    return os.path.join(section.get("output_path") or "", section.get("job_name") or _DEFAULT_JOB_NAME)


def _missing(module: str, kind: str, extra: str) -> ZeroConfigError:
    return ZeroConfigError(f"monitor '{kind}' needs the {module} package: pip install 'zerocompile[{extra}]' "
                           f"(or {module}), or set '{kind}.enabled' to false")


class MetricWriter:
    """Rank 0's writers of the enabled monitors. Creating one makes the directories, opens
    TensorBoard's writer, starts the W&B run and the Comet experiment: ``OSError`` (or
    ``ZeroConfigError`` without a monitor's package) when it cannot. ``close()`` (also at exit)
    flushes them and ends the run and experiment it started."""

    def __init__(self, settings: MonitorSettings):
        self.settings = settings
        self._tensorboard = None
        self._wandb = self._own_wandb_run = None
        self._comet = None
        self._comet_logged: dict = {}
        """Tag -> the x Comet last logged it at (``samples_log_interval``)."""
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
        if settings.wandb is not None:
            self._start_wandb(settings.wandb)
        if settings.comet is not None:
            self._start_comet(settings.comet)
        atexit.register(self.close)

    def _start_wandb(self, wb: WandbSettings) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb", "wandb") from None
        if wandb.run is not None:          # the script's own run (e.g. HF Trainer's report_to="wandb")
            self._wandb = wandb.run
            return
        try:
            self._wandb = self._own_wandb_run = wandb.init(project=wb.project, group=wb.group, entity=wb.team)
        except Exception as exc:      # wandb raises its own errors (no login, bad directory, network)
            raise OSError(f"wandb.init failed: {exc}") from exc

    def _start_comet(self, cm: CometSettings) -> None:
        try:
            import comet_ml
        except ImportError:
            raise _missing("comet_ml", "comet", "comet") from None
        try:
            self._comet = comet_ml.start(api_key=cm.api_key, project=cm.project, workspace=cm.workspace,
                                         experiment_key=cm.experiment_key, mode=cm.mode, online=cm.online,
                                         experiment_config=comet_ml.ExperimentConfig(name=cm.experiment_name))
        except Exception as exc:      # comet_ml raises its own errors (no API key, network)
            raise OSError(f"comet_ml.start failed: {exc}") from exc

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
        if self._wandb is not None:
            if self._own_wandb_run is not None:
                self._wandb.log(dict(metrics), step=x)
            else:                       # the script's run counts its own steps
                self._wandb.log({**metrics, "Train/Samples/x": x})
        if self._comet is not None:
            interval = self.settings.comet.samples_log_interval
            due = {tag: v for tag, v in metrics.items()
                   if tag not in self._comet_logged or x - self._comet_logged[tag] >= interval}
            if due:
                self._comet.log_metrics(due, step=x)
                self._comet_logged.update(dict.fromkeys(due, x))

    def close(self) -> None:
        """Flush and close the writers; end the W&B run and Comet experiment started here."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._own_wandb_run is not None:
            self._own_wandb_run.finish()
        self._wandb = self._own_wandb_run = None
        if self._comet is not None:
            comet, self._comet = self._comet, None
            comet.end()
        atexit.unregister(self.close)
