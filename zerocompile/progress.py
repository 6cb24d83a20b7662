"""Progress bars for long operations (consolidating a checkpoint, loading and saving
pretrained weights), drawn with ``rich`` on stderr.

A bar is drawn only where someone watches: stderr is a terminal and this is global rank 0
(every rank of a job would otherwise draw its own). ``ZEROCOMPILE_PROGRESS=1`` forces the bars
(for example under a launcher that pipes stderr: each bar is then printed once, finished),
``ZEROCOMPILE_PROGRESS=0`` turns them off.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator

from zerocompile import env



def progress_enabled() -> bool:
    """Whether bars are drawn in this process (see the module docstring)."""
    setting = env.progress_setting()
    if setting is not None:
        return setting
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return False
    return sys.stderr.isatty()


def track(items: Iterable, description: str, total: int | None = None) -> Iterator:
    """Yield ``items``, advancing a bar of ``total`` steps (default ``len(items)``) labelled
    ``description`` while they are consumed; the bar is removed when done."""
    if not progress_enabled():
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = total if total is not None else len(items)      # type: ignore[arg-type]
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # on a terminal the bar moves and disappears when done; elsewhere (forced) it is printed
    # once, finished, as a log line
    with Progress(*columns, console=console, transient=console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
