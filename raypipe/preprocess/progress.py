"""Progress of a tokenize job as its units commit: a live line on a terminal, else a line at
least every `every` seconds (logs, pipes, `ray job logs`), also while no unit commits.

Invariant: progress is computed from the commit records (units done of total, tokens,
input bytes read), counted as each unit commits (the job reports every unit once), so it
never runs ahead of what is committed nor behind it. Ray's start-up is a line of its own.
The ETA is the remaining input bytes at the rate the workers have shown: its window opens
when the workers' first unit commits (that unit's time was mostly workers starting, so it is
left out); it says "unknown" until there is a rate. A job whose
units are not known in advance (a ray.data.Dataset's blocks) reports blocks and tokens
without a share or ETA. Cost: one format
and one write per record or per interval, and a timer thread asleep in between.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from raypipe.io.records import UnitRecord, WorkUnit


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def unit_weight(unit: WorkUnit) -> int:
    """A unit's share of the job's work: its input bytes (rows if unknown)."""
    return unit.size_bytes or max(1, unit.num_rows)


class Progress:
    """Report committed units of a run of `units` (the pending ones; None: not known in
    advance). Use as a context manager: the timer thread runs inside it."""

    def __init__(self, units: list[WorkUnit] | None, every: float = 10.0,
                 stream: TextIO | None = None, noun: str = "units"):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.noun = noun
        self.total_units = None if units is None else len(units)
        self.weight_of = {unit.name: unit_weight(unit) for unit in units or ()}
        self.total_weight = sum(self.weight_of.values())
        self.every = every
        self.started = time.perf_counter()
        self.last_shown = self.started
        self.done_units = self.done_weight = self.tokens = 0
        self.waiting_for_workers = False  # Ray and its workers starting (`await_workers`)
        self.window = (self.started, 0)  # (time, done weight) the workers' rate is taken from
        self.lines = 0
        self.quiet_depth = 0  # open `quiet()` sections
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.timer: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.every > 0:  # 0: a line per commit, nothing in between
            self.timer = threading.Thread(target=self._tick, name="raypipe-progress",
                                          daemon=True)
            self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        if self.timer is not None:
            self.timer.join()

    def _tick(self) -> None:
        while not self.stopped.wait(min(self.every, 1.0)):
            with self.lock:
                now = time.perf_counter()
                if now - self.last_shown >= self.every and not self.quiet_depth:
                    self._show(now, finished=False)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """No timed line inside (Ray starting: a "0/N units" line before its "Ray up" line
        says nothing); commits are still shown."""
        with self.lock:
            self.quiet_depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.quiet_depth -= 1
                self.last_shown = time.perf_counter()  # the next timed line: `every` on

    def await_workers(self) -> None:
        """The workers are starting (Ray, its actors): hold the ETA until they commit, and
        measure their rate from then on."""
        with self.lock:
            self.waiting_for_workers = True

    def note(self, line: str | None) -> None:
        """A line of its own (Ray's start-up), between progress lines."""
        if not line:
            return
        with self.lock:
            self.stream.write(("\n" if self.live and self.lines else "") + f"raypipe: {line}\n")
            self.stream.flush()

    def update(self, record: UnitRecord) -> None:
        """Count a committed unit (each is reported once)."""
        with self.lock:
            self.done_units += 1
            self.done_weight += self.weight_of.get(record.unit.name, 0)
            self.tokens += record.tokens
            now = time.perf_counter()
            if self.waiting_for_workers:  # their first unit: the window opens
                self.waiting_for_workers = False
                self.window = (now, self.done_weight)
            finished = self.done_units == self.total_units
            if self.live or finished or now - self.last_shown >= self.every:
                self._show(now, finished)

    def _eta(self, now: float, share: float) -> str:
        if share >= 1.0:
            return _clock(0)
        if not self.done_units:
            return "unknown until a unit commits"
        since, weight = self.window
        gained, span = self.done_weight - weight, now - since
        if gained <= 0 or span <= 0:
            return "unknown until the workers commit a unit"
        return _clock((self.total_weight - self.done_weight) * span / gained)

    def _show(self, now: float, finished: bool) -> None:
        self.last_shown = now
        elapsed = now - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        if self.total_units is None:
            line = f"raypipe: {self.done_units} {self.noun} committed"
            share = None
        else:
            share = self.done_weight / self.total_weight if self.total_weight else 1.0
            eta = self._eta(now, share)
            line = (f"raypipe: {self.done_units}/{self.total_units} {self.noun} ({share:.0%})")
        line += (f", {self.tokens:,} tokens, {rate / 1e6:.2f} M tokens/s, elapsed "
                 f"{_clock(elapsed)}")
        if share is not None:
            line += f", ETA {eta}"
        if self.live:  # a bar, redrawn in place
            filled = int(round(20 * (share or 0.0)))
            bar = "[" + "#" * filled + "." * (20 - filled) + "] "
            self.stream.write("\r" + bar + line + "\x1b[K" + ("\n" if finished else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.lines += 1
