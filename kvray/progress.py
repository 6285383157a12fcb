"""A progress bar on stderr for the long commands (`kvray demo`, `kvray bench`); no part of the
data flow."""

from __future__ import annotations

import sys

#: Characters the bar itself spans.
_WIDTH = 30


class Progress:
    """One bar of `total` steps on stderr: redrawn in place on a terminal, else a line per tenth
    (so a log is not flooded). `label` names what is running; `step` may change it."""

    def __init__(self, total: int, label: str = "") -> None:
        self.total = max(1, total)
        self.done = 0
        self.label = label
        self.tty = sys.stderr.isatty()
        self._last_tenth = -1

    def step(self, label: str | None = None) -> None:
        if self.done == self.total:  # full, and its line ended: stays as it is
            return
        self.done += 1
        if label is not None:
            self.label = label
        filled = _WIDTH * self.done // self.total
        line = f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {self.done}/{self.total} {self.label}"
        if self.tty:
            finished = self.done == self.total
            print(f"\r\033[K{line}", end="\n" if finished else "", file=sys.stderr, flush=True)
        elif 10 * self.done // self.total != self._last_tenth:
            self._last_tenth = 10 * self.done // self.total
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the bar's line on a terminal when it stopped short of `total`."""
        if self.tty and self.done < self.total:
            print(file=sys.stderr, flush=True)
