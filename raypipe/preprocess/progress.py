"""Progress of a tokenize job as its units commit: a live line on a terminal, else a line at
least every `every` seconds (logs, pipes, `ray job logs`).

Invariant: progress is computed from the commit records that reach the driver (units done of
total, tokens, bytes of input read), so it never runs ahead of what is committed; the ETA is
the remaining input rows at the rate measured since the run started. Cost: one
format and one write per record (or per interval), nothing per token.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from raypipe.io.manifest import UnitRecord, WorkUnit


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Report committed units of a run of `units` (the pending ones)."""

    def __init__(self, units: list[WorkUnit], every: float = 10.0,
                 stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.total_units = len(units)
        self.rows_of = {unit.name: max(1, unit.num_rows) for unit in units}
        self.total_rows = sum(self.rows_of.values())
        self.every = every
        self.started = time.perf_counter()
        self.last_shown = self.started
        self.done_units = self.done_rows = self.tokens = 0
        self.lines = 0

    def update(self, record: UnitRecord) -> None:
        self.done_units += 1
        self.done_rows += self.rows_of.get(record.unit.name, record.rows)
        self.tokens += record.tokens
        now = time.perf_counter()
        finished = self.done_units == self.total_units
        if self.live or finished or now - self.last_shown >= self.every:
            self.last_shown = now
            self._show(now, finished)

    def _show(self, now: float, finished: bool) -> None:
        elapsed = now - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        share = self.done_rows / self.total_rows if self.total_rows else 1.0
        eta = elapsed * (1 - share) / share if share > 0 else 0.0
        line = (f"raypipe: {self.done_units}/{self.total_units} units ({share:.0%}), "
                f"{self.tokens:,} tokens, {rate / 1e6:.2f} M tokens/s, elapsed "
                f"{_clock(elapsed)}, ETA {_clock(eta)}")
        if self.live:  # a bar, redrawn in place
            filled = int(round(20 * share))
            bar = "[" + "#" * filled + "." * (20 - filled) + "] "
            self.stream.write("\r" + bar + line + ("\n" if finished else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.lines += 1
