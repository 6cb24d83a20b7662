"""Progress for long operations, drawn with ``rich`` on stderr: bars for consolidating a
checkpoint and loading or saving pretrained weights (``track``), and a status line while a
frame compiles (``compile_status``: the frame, the graph and the pass it is at, the seconds).

A bar is drawn only where someone watches: stderr is a terminal and this is global rank 0
(every rank of a job would otherwise draw its own). ``ZEROCOMPILE_PROGRESS=1`` forces the bars on
rank 0 (for example under a launcher that pipes stderr: each bar is then printed once, finished,
and each compiled frame gets its line), ``ZEROCOMPILE_PROGRESS=0`` turns them off.
"""

from __future__ import annotations

import sys
import contextlib
import time
from collections.abc import Iterable, Iterator

from zerocompile import env



def progress_enabled() -> bool:
    """Whether bars are drawn in this process (see the module docstring)."""
    setting = env.progress_setting()
    if setting is False:
        return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return False
    return setting or sys.stderr.isatty()


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


class CompileStatus:
    """The status of one frame's compile: ``update(graph_kind, pass_name)`` as the passes run
    (``PassContext.progress``), ``text()`` what the line says."""

    def __init__(self, frame: str, stage: int) -> None:
        self.frame = frame
        self.stage = stage
        self.start = time.perf_counter()
        self.where = "tracing"
        self.status = None          # the rich Status drawn on a terminal, else None

    def text(self) -> str:
        return f"zerocompile: compiling {self.frame}: {self.where} ({time.perf_counter() - self.start:.1f} s)"

    def update(self, graph_kind: str, pass_name: str) -> None:
        self.where = f"{graph_kind} graph, {pass_name}"
        if self.status is not None:
            self.status.update(self.text())

    def compiling(self, what: str) -> None:
        """The compile is at ``what`` (e.g. AOTAutograd and the inner compiler), not at a pass."""
        self.where = what
        if self.status is not None:
            self.status.update(self.text())


@contextlib.contextmanager
def compile_status(frame: str, stage: int, what: str = "") -> Iterator[CompileStatus]:
    """A status line while a frame compiles (its passes, AOTAutograd, the inner compiler), drawn
    where ``progress_enabled()``: on a terminal a spinner while it compiles; then, on a terminal
    or not (``ZEROCOMPILE_PROGRESS=1`` under a launcher that pipes stderr, a log, ``tee``), one
    line per frame once it compiled, ``zerocompile: compiled frame 0/0 (stage 3, <what>) in 12.3 s``,
    so logs are not flooded. ``what``: what the frame holds (its parameters, the inner compiler).
    Yields the ``CompileStatus`` to update."""
    status = CompileStatus(frame, stage)
    if not progress_enabled():
        yield status
        return
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal:
        with console.status(status.text()) as drawn:
            status.status = drawn
            yield status
            status.status = None
    else:
        yield status
    detail = f"stage {stage}, {what}" if what else f"stage {stage}"
    console.print(f"zerocompile: compiled {frame} ({detail}) in {time.perf_counter() - status.start:.1f} s",
                  highlight=False, soft_wrap=True)
