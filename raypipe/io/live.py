"""A tokenize job's output while it runs: the units committed so far, as a manifest a
loader can train on (`follow`), and the job's status.

Invariant: while a job runs, its driver keeps `_live/manifest.json`, the manifest of every
unit committed so far, in the order their records reached the driver (the document
formats only: batch formats are packed at the end), rewritten atomically at most
LIVE_UPDATES times a job (a Dataset's, whose blocks are not known ahead: at 1, 2, 4, ...
units) and no more often than LIVE_SECONDS, each one's unit order kept
as every manifest's is (raypipe.io.views), so a run that trained on it replays. Beside it,
`_live/status.json` (`LiveStatus`) names the newest unit order and says whether the job
runs, finished (the manifest is written: its order is the status's) or failed (its error;
what was committed stays, and a rerun goes on from it). A live manifest only ever gains
units while its job's config holds (a unit is committed once: raypipe.io.manifest), so a
loader adds what it lacks and loses nothing. Cost on the driver, per update: the manifest
built, its view kept and it written, O(units): measured at ~2 * 10^4 units of two formats,
71 + 48 + 25 us a unit (the last is Manifest.to_json, as the final manifest's write; 359
before it built each format's section once): ~2.5 minutes at 10^6 units. So an update
begins no sooner than 9 times the last one took after it (LIVE_SHARE: the driver spends
at most a tenth of its time on them); on disk ~40 bytes a unit per kept view. For a
follower: one small status read per check, and one manifest read when it changed.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from raypipe.errors import FormatError
from raypipe.io.manifest import read_manifest
from raypipe.io.records import LiveStatus, Manifest, UnitRecord
from raypipe.io.store import Store
from raypipe.io.views import keep_view, unit_names, view_key

LIVE_DIR = "_live"
LIVE_MANIFEST = f"{LIVE_DIR}/manifest.json"
LIVE_STATUS = f"{LIVE_DIR}/status.json"
LIVE_UPDATES = 32  # live manifests a job writes at most (each O(units), its view kept)
LIVE_SECONDS = 0.5  # and no two closer than this
LIVE_SHARE = 0.1  # nor more than this share of the driver's time since the job began
logger = logging.getLogger("raypipe")

__all__ = ["LIVE_DIR", "LiveOutput", "LiveStatus", "LiveWriter", "settle"]


class LiveWriter:
    """The driver's side: `committed(record)` as each unit's record arrives (those committed
    by an earlier run too), `finished(manifest)` once the manifest is written, `failed(error)`
    when the job ends otherwise. `build(records)` makes the manifest of `records` (called
    only when one is written; it may wait for the job's settings)."""

    def __init__(self, output: Store, units_planned: int,
                 build: Callable[[list[UnitRecord]], Manifest],
                 ready: Callable[[], bool] = lambda: True):
        self.output, self.units_planned, self.build, self.ready = (output, units_planned,
                                                                   build, ready)
        self.job = uuid.uuid4().hex[:12]
        self.records: list[UnitRecord] = []
        self.written, self.last_write, self.updates = 0, 0.0, 0
        self.pause = LIVE_SECONDS  # until the next write may begin: LIVE_SHARE of the time
        # a live manifest every `every` units (units unknown: at 1, 2, 4, ... units)
        self.every = max(1, math.ceil(units_planned / LIVE_UPDATES)) if units_planned else 0
        self.view = ""
        self._status("running")

    def committed(self, record: UnitRecord) -> None:
        """One more unit committed: the live manifest is rewritten when it is due."""
        self.records.append(record)
        count = len(self.records)
        due = (count - self.written >= (self.every or self.written)
               and time.monotonic() - self.last_write >= self.pause)
        if (due or not self.written) and (count < self.units_planned or not self.every) \
                and self.ready():
            self._write()

    def _write(self) -> None:
        began = time.monotonic()
        manifest = self.build(list(self.records))
        self.view = keep_view(self.output, manifest)
        self.output.write_json(LIVE_MANIFEST, manifest.to_json())
        self.written, self.last_write = len(self.records), time.monotonic()
        self.pause = max(LIVE_SECONDS, (self.last_write - began) * (1 / LIVE_SHARE - 1))
        self.updates += 1
        self._status("running")

    def finished(self, manifest: Manifest) -> None:
        """The manifest is written: followers take its units (its order is kept)."""
        self.view = view_key(unit_names(manifest))
        self._status("finished", committed=len(manifest.units))

    def failed(self, error: BaseException) -> None:
        """The job ended without its manifest: what was committed stays for followers."""
        try:
            if len(self.records) > self.written and self.ready():
                self._write()  # every unit committed, for followers and the rerun
            self._status("failed", error=f"{type(error).__name__}: {error}"[:500])
        except Exception as exc:  # noqa: BLE001  (the job's own error is the one raised)
            logger.warning("%s: could not record the job's failure in %s (%s)", self.output,
                           LIVE_STATUS, exc)

    def _status(self, state: str, committed: int | None = None, error: str = "") -> None:
        status = LiveStatus(self.job, state, self.units_planned,
                            len(self.records) if committed is None else committed,
                            self.view, time.time(), error)
        self.output.write_json(LIVE_STATUS, status.to_json())


def settle(output: Store, manifest: Manifest) -> None:
    """A job that found nothing to run: its status says finished with the manifest's order
    (written only where it said otherwise: a rerun of a finished job writes nothing)."""
    status = LiveOutput(output).status()
    view = view_key(unit_names(manifest))
    if status is None or (status.state, status.view) != ("finished", view):
        LiveWriter(output, len(manifest.units), lambda records: manifest).finished(manifest)


@dataclass(frozen=True)
class LiveOutput:
    """The follower's side: an output, and what its job's status says."""

    store: Store

    def status(self) -> LiveStatus | None:
        """The status a job wrote (None: no job wrote one: an output from before, or one
        whose job has not started)."""
        if not self.store.exists(LIVE_STATUS):
            return None
        return LiveStatus.from_json(self._read(LIVE_STATUS), self.store.uri_of(LIVE_STATUS))

    def manifest(self, state: str) -> Manifest:
        """The newest manifest of a job in `state` (a status's): the output's once
        finished, else the live one (it holds every unit of any order a status named before:
        it only gains units)."""
        if state == "finished":
            return read_manifest(self.store)
        try:
            return Manifest.from_json(self._read(LIVE_MANIFEST),
                                      self.store.uri_of(LIVE_MANIFEST))
        except FileNotFoundError:
            raise FormatError(self.store.uri_of(LIVE_MANIFEST),
                              "the job's status names a live manifest that is missing") \
                from None

    def _read(self, relative: str) -> dict:
        """A live file: the job replaces it in place while we read it."""
        return self.store.read_json(relative, replaced_in_place=True)

    def describe(self, status: LiveStatus) -> str:
        """The job's status, in words."""
        said = {"running": "is running", "finished": "finished",
                "failed": f"failed ({status.error})"}[status.state]
        return (f"the tokenize job writing {self.store} {said}: {status.units_committed} of "
                f"{status.units_planned} unit(s) committed")
