"""Progress bars on a terminal (rich), nothing when stderr is not one: a log file or a test gets
only the result lines."""

from __future__ import annotations

import sys


class Progress:
    """``task = progress.add(label, total)``; ``progress.advance(task)``; ``progress.note(task, text)``."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bars = None
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bars

            self._bars = Bars(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
                              console=Console(stderr=True), transient=False)

    def __enter__(self) -> Progress:
        if self._bars is not None:
            self._bars.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bars is not None:
            self._bars.stop()

    def add(self, label: str, total: float | None) -> int:
        return self._bars.add_task(label, total=total, note="") if self._bars is not None else 0

    def advance(self, task: int, amount: float = 1) -> None:
        if self._bars is not None:
            self._bars.advance(task, amount)

    def note(self, task: int, text: str) -> None:
        if self._bars is not None:
            self._bars.update(task, note=text)

    def finish(self, task: int) -> None:
        if self._bars is not None:
            total = self._bars.tasks[task].total if task < len(self._bars.tasks) else None
            self._bars.update(task, completed=total if total is not None else 1, total=total or 1)
