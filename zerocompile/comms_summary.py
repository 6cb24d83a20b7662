"""``zerocompile.log_summary()``: the comms logger's table (DeepSpeed's ``deepspeed.comm.log_summary``).

The figures come from ``runtime/comms_log.py`` (``stats().comm_latency``): per collective kind and
message size (and call site with ``debug``), the count, latencies and bandwidths this rank
measured. ``show_straggler`` adds, per row, how much longer this rank's collectives took than the
fastest rank's: a rank that reaches a collective early waits there for the last one, so the
spread is time spent waiting for stragglers, not moving bytes.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from zerocompile.runtime.session import PROCESS

log = logging.getLogger("zerocompile")

_ROW_KEY = ("kind", "site", "group_size", "msg_bytes")


def log_summary(show_straggler: bool = False, file=None, model=None) -> list[dict]:
    """Print the comms logger's table on rank 0 and return this rank's rows (those of
    ``stats().comm_latency``, with ``straggler_ms`` when ``show_straggler``).

    ``show_straggler``: every rank must call it at the same point (one all-gather of the rows).
    ``file``: where rank 0 prints (default: standard output). ``model``: one compiled model's
    comms logger (default: every model's of the process, each with its own settings)."""
    logs = [s.comms for s in PROCESS.all()] if model is None else [_session_of(model).comms]
    on = [c for c in logs if c.settings is not None]
    if not on:
        log.warning("zerocompile.log_summary: the comms logger is off, so there is nothing to show; turn it on "
                    "with options={'comms_logger': {'enabled': True}} (or DeepSpeed's comms_logger key)")
    rows = [row for c in logs for row in c.rows()]
    distributed = dist.is_available() and dist.is_initialized()
    if show_straggler:
        everyone = [rows]
        if distributed and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, rows)
        fastest: dict = {}
        for rank_rows in everyone:
            for row in rank_rows:
                key = tuple(row[k] for k in _ROW_KEY)
                fastest[key] = min(fastest.get(key, float("inf")), row["total_ms"])
        for row in rows:
            row["straggler_ms"] = row["total_ms"] - fastest[tuple(row[k] for k in _ROW_KEY)]
    if not distributed or dist.get_rank() == 0:
        blocking = all(c.settings.blocking for c in on)
        Console(file=file or sys.stdout, width=160).print(summary_table(rows, show_straggler, blocking))
    return rows


def _session_of(model):
    session = PROCESS.session_of_model(model)
    if session is None:
        raise ValueError(f"zerocompile.log_summary: {type(model).__name__} has no zerocompile session: compile it "
                         "with torch.compile(model, backend='zero') and run it first")
    return session


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def summary_table(rows: list[dict], show_straggler: bool = False, blocking: bool = True) -> Table:
    """The rows as a table: one line per kind, message size (and site). ``blocking``: the
    logger's setting, which says what the latencies include."""
    debug = any(row["site"] for row in rows)
    latency = ("issue to completion, each collective blocking" if blocking
               else "issue to the wait's return, overlapped work included")
    table = Table(title=f"zerocompile comms logger (this rank; latency: {latency})")
    columns = ["collective", *(["site"] if debug else []), "msg size", "ranks", "count", "total ms", "avg ms",
               "min ms", "max ms", "algbw GB/s", "busbw GB/s", *(["straggler ms"] if show_straggler else [])]
    for name in columns:
        table.add_column(name, justify="left" if name in ("collective", "site") else "right",
                         overflow="fold")
    for row in rows:
        cells = [row["kind"], *([row["site"]] if debug else []), _size(row["msg_bytes"]), str(row["group_size"]),
                 str(row["count"]), f"{row['total_ms']:.3f}", f"{row['avg_ms']:.3f}", f"{row['min_ms']:.3f}",
                 f"{row['max_ms']:.3f}", f"{row['algbw_gbps']:.3f}", f"{row['busbw_gbps']:.3f}"]
        if show_straggler:
            cells.append(f"{row['straggler_ms']:.3f}")
        table.add_row(*cells)
    return table
