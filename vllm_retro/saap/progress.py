"""A small text progress bar (no dependency): redrawn in place on a terminal, a line every
few seconds otherwise (logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else \
        f"{s // 60}:{s % 60:02d}"


class ProgressBar:
    """``desc  37% |#######-------------| 9/24 layers  0:42 < 1:10  note``.

    ``update(n)`` advances; ``note`` sets the trailing text; ``close()`` ends the line. The
    remaining time is estimated from the work done in this run (``skip`` marks units already
    done before it: resumed)."""

    def __init__(self, desc: str, total: int, unit: str = "", stream: TextIO | None = None,
                 enabled: bool = True, width: int = 24, every_s: float = 10.0):
        self.desc, self.total, self.unit = desc, max(total, 1), unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.every_s = every_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.n = 0
        self.skipped = 0
        self.text = ""
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._draw(force=True)

    def skip(self, n: int) -> None:
        """Count ``n`` units done before this run."""
        self.n += n
        self.skipped += n
        self._draw(force=True)

    def update(self, n: int = 1) -> None:
        """``n`` more units done."""
        self.n = min(self.total, self.n + n)
        self._draw(force=self.n == self.total)

    def note(self, text: str) -> None:
        """Set the text shown after the counts."""
        self.text = text
        self._draw()

    def line(self) -> str:
        """The bar as one line of text."""
        frac = self.n / self.total
        fill = int(frac * self.width)
        elapsed = time.perf_counter() - self.t0
        done = self.n - self.skipped
        left = ""
        if 0 < done < self.total - self.skipped:
            left = f" < {_clock(elapsed / done * (self.total - self.n))}"
        unit = f" {self.unit}" if self.unit else ""
        return (f"{self.desc} {frac:4.0%} |{'#' * fill}{'-' * (self.width - fill)}| "
                f"{self.n}/{self.total}{unit}  {_clock(elapsed)}{left}"
                + (f"  {self.text}" if self.text else ""))

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if force or now - self._last >= 0.1:
                self.stream.write("\r" + self.line() + "\x1b[K")
                self.stream.flush()
                self._last = now
        elif force or now - self._last >= self.every_s:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self._last = now

    def close(self) -> None:
        """Finish the bar's line."""
        if self.enabled:
            self._draw(force=True)
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()
