"""The driver's head start: units it tokenizes itself while the runner starts.

Invariant: every unit runs exactly once, on the driver or on the runner. While the runner
connects (a local Ray starts in 3-5 s on 2 cores), the driver self-checks the encoder and
then takes units from the front of the queue, which is closed (under its lock) before the
runner gets the rest. Once the runner runs them, the driver goes on with units from the back
of the runner's list, each claimed through `runner.claim` first (Ray Data's actors take
another ~2.5 s to start), until the runner's first record arrives or a claim is refused.
Records of the driver's units reach progress as soon as they exist; a driver unit that
fails (bad input) raises at the runner's next record, which stops the runner. Cost: a
thread, and one claim (a small actor call) per driver unit after Ray is up.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from raypipe.io.records import UnitRecord, WorkUnit
from raypipe.preprocess.encoding.self_check import BackendChoice
from raypipe.preprocess.unit import UnitSettings


class UnitRunner(Protocol):
    """Where a job's units run: the serial runner here, Ray Data in raypipe.ray."""

    startup_seconds: float  # spent connecting to (or starting) what it runs on
    retries: int  # unit runs lost to a dead worker and run again
    starts_slowly: bool  # connecting takes long enough for the driver to run units meanwhile

    def connect(self) -> None:
        """Connect to what the units run on (may take seconds: the head start overlaps)."""

    def claim(self, unit: WorkUnit) -> bool:
        """True if the driver may run `unit` itself while `run` starts up."""

    def run(self, units: list[WorkUnit], settings: UnitSettings) -> Iterator[UnitRecord]:
        """Records of `units` as they commit, except those the driver claimed."""


class HeadStart:
    """The driver's own units: from the front of `queue` until `close()`, then claimed
    from the back of the runner's list until the runner's first record."""

    def __init__(self, queue: deque[WorkUnit]):
        self.queue = queue
        self.lock = threading.Lock()
        self.open = True
        self.back: list[WorkUnit] = []
        self.claim: Callable[[WorkUnit], bool] | None = None

    def take(self) -> WorkUnit | None:
        with self.lock:
            if self.open and self.queue:
                return self.queue.popleft()
            if self.claim is None or not self.back:
                return None
            unit, claim = self.back.pop(), self.claim
        return unit if claim(unit) else None

    def close(self) -> list[WorkUnit]:
        """Stop taking from the front; the units left are the runner's."""
        with self.lock:
            self.open = False
            return list(self.queue)

    def claim_from_back(self, units: list[WorkUnit], claim: Callable[[WorkUnit], bool]
                        ) -> None:
        with self.lock:
            self.back, self.claim = list(units), claim


@dataclass
class Start:
    """How a job's run began: the settings with the backend its self-check chose, the
    runner's units, and the records of the units the driver tokenizes itself."""

    settings: UnitSettings
    choice: BackendChoice
    units: list[WorkUnit]
    head_start: Future[list[UnitRecord]] | None = None


def start_run(check: Callable[[], tuple[UnitSettings, BackendChoice]], runner: UnitRunner,
              queue: deque[WorkUnit],
              tokenize: Callable[[Iterable[WorkUnit], UnitSettings], list[UnitRecord]]
              ) -> Start:
    """The encoder's self-check (`check`, ~1 s) on a thread while the runner connects on
    this one; then, on that thread, the driver tokenizes units (`tokenize`) as HeadStart
    hands them out. Returns once the check is done and the runner connected."""
    checked: Future[tuple[UnitSettings, BackendChoice]] = Future()
    head = HeadStart(queue)

    head_start: Future[list[UnitRecord]] = Future()

    def check_then_tokenize() -> None:
        try:
            checked.set_result(check())
        except BaseException as exc:
            checked.set_exception(exc)
            head_start.set_exception(exc)
            return
        try:
            head_start.set_result(tokenize(iter(head.take, None), checked.result()[0]))
        except BaseException as exc:
            head_start.set_exception(exc)

    # a daemon thread: an interrupted job exits without waiting for the driver's unit (its
    # temp files are swept by the rerun), where an executor's thread is joined at exit
    threading.Thread(target=check_then_tokenize, name="raypipe-head-start",
                     daemon=True).start()
    try:
        runner.connect()
    finally:
        units = head.close()
    head.claim_from_back(units, runner.claim)
    return Start(*checked.result(), units=units, head_start=head_start)


def records_of(runner: UnitRunner, units: list[WorkUnit], settings: UnitSettings,
               head_start: Future[list[UnitRecord]] | None) -> Iterator[UnitRecord]:
    """The runner's records as they come, with those of the driver's head start as soon as
    it has finished."""
    records = runner.run(units, settings)
    try:
        for record in records:
            yield record
            if head_start is not None and head_start.done():
                yield from head_start.result()
                head_start = None
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()  # a generator runner's own cleanup
    if head_start is not None:
        yield from head_start.result()
