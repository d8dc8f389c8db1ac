"""Per-step progress: a rich progress bar on a terminal, one plain line per step otherwise."""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["StepReporter"]


class StepReporter:
    """Shows step, loss and tokens/s. Plain lines when ``stream`` is not a terminal (logs, CI, pipes)."""

    def __init__(self, total: int, *, title: str = "training", stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self._progress: Any = None
        self._task: Any = None
        if not self.stream.isatty():
            print(title, file=self.stream, flush=True)  # what the bar's label says on a terminal
        else:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            except ImportError:  # rich is optional: fall back to plain lines
                print(title, file=self.stream, flush=True)
                return
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tokens/s"),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
            )
            self._progress.start()
            self._task = self._progress.add_task(title, total=total, loss="-", tps="-")

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Report step ``step`` (0-based) finished with ``loss`` at ``tokens_per_s``."""
        if self._progress is not None:
            self._progress.update(self._task, completed=step + 1, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")
        else:
            print(
                f"step {step + 1:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
