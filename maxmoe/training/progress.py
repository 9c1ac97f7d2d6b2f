"""One progress display for the console: a live bar on a terminal, plain lines elsewhere.

The training log and the mesh sweep both report progress through `ProgressDisplay`. On a
terminal `rich` redraws one bar in place (lines printed meanwhile appear above it); when
the stream is a file, a pipe or a CI log, every update is one plain line, so redirected
output holds no carriage-return frames.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

MODES = ("auto", "bar", "plain", "off")


def format_duration(seconds: float) -> str:
    """0m12s, 4m05s or 2h07m: a duration for the console (whole seconds, rounded down)."""
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class ProgressDisplay:
    """Progress towards `total` with a line of text, shown as `mode` says.

    Args:
        total: the count that means done (steps, shapes).
        mode: "auto" (a live bar when `stream` is a terminal, else plain lines), "bar"
            (a live bar even when it is not), "plain" (plain lines) or "off" (nothing).
        stream: where to write; default sys.stdout.
        completed: the count already done (a resumed run).
        elapsed: also show the time since the display was made (a live clock on the bar,
            a prefix on plain lines).
    """

    def __init__(
        self,
        total: int,
        *,
        mode: str = "auto",
        stream: TextIO | None = None,
        completed: int = 0,
        elapsed: bool = False,
    ):
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}: expected one of {MODES}")
        self.stream = stream or sys.stdout
        self.enabled = mode != "off"
        self.live = self.enabled and (mode == "bar" or (mode == "auto" and self.stream.isatty()))
        self.elapsed = elapsed
        self.start = time.perf_counter()
        self._bar = None
        if self.live:
            columns = [BarColumn(bar_width=24)]
            if elapsed:
                columns.append(TimeElapsedColumn())
            columns.append(TextColumn("{task.description}", markup=False))
            console = Console(file=self.stream, force_terminal=True, highlight=False)
            # A clock needs redrawing between updates; a bar without one only on update.
            self._bar = Progress(*columns, console=console, auto_refresh=elapsed)
            self._task = self._bar.add_task("", total=max(total, 1), completed=completed)
            self._bar.start()

    def update(self, completed: int, text: str) -> None:
        """Show `completed` of the total with `text` (plain mode: one line of `text`)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, description=text)
            self._bar.refresh()
            return
        prefix = f"{time.perf_counter() - self.start:6.0f}s  " if self.elapsed else ""
        self._write(prefix + text)

    def log(self, completed: int, text: str) -> None:
        """A line that stays and moves the progress to `completed` (on a terminal: the line above, the bar below)."""
        if self._bar is not None:
            self.print(text)
        self.update(completed, text)

    def print(self, text: str) -> None:
        """A line that stays (above the live bar on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self._write(text)

    def close(self) -> None:
        """Leave the bar's last state on screen and stop redrawing; safe to call twice."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
