"""The job's ledger: one Ray actor (no CPU, async) that the map actors of a tokenize job and
its driver share.

Invariant: it counts how often a worker started each unit (a unit whose actor died runs
again: its count says so), says whether the job has failed (units not started yet then
are not started), hands the map actors the job's JobShared once the driver publishes it
(after its self-check: the actors start meanwhile), takes a Dataset job's self-check rows
from the first map actor about to tokenize a block, and keeps each map actor's handle so
that the driver can end them with the job.

It never deserializes a map actor's handle: an actor gives its handle pickled (bytes), and
only the driver, where Ray Data is imported already, unpickles it. Measured on 2 cores, 200
MB job, fresh local Ray: a handle of a Ray Data map worker passed as itself took the ledger
~0.6 s to deserialize, during which it answered no call, and every map actor's first unit
waited for it. (Not `ray.put(handle)`: the actor owns that object, and once it has died
the driver's `ray.get` of it waited ~6 s for the owner's death to be known.)

Cost: this module imports nothing of raypipe and no Arrow: the ledger's worker (one of the
workers Ray starts with a session, `ray` imported already) imports it in ~2 ms, where the
executor's module took ~0.4 CPU-seconds on a machine whose two cores were starting the map
actors (only a Dataset job's sample rows, an Arrow table, bring pyarrow in, once they
arrive). Every call is O(1) or O(units asked about); the driver's cost per unit is
unchanged, and per job it unpickles and ends each map actor once.
"""

from __future__ import annotations

import asyncio
from typing import Any


class UnitLedger:
    """A unit's attempts, the job's failure, its JobShared, its first rows and its map
    actors; created by the driver as `ray.remote(num_cpus=0)(UnitLedger)`."""

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}
        self.map_actors: list[bytes] = []  # the map actors' handles, pickled
        self.failed = False
        self.shared: list[Any] | str | None = None  # [JobShared's ref], or why there is none
        self.published = asyncio.Event()
        self.sample: Any = None  # a pyarrow Table, kept as Ray gave it
        self.sampled = asyncio.Event()

    def joined(self, handle: bytes) -> None:
        """A map actor's own handle, pickled: the driver ends every map actor of the job
        when the job ends (a restarted actor joins again: its handle is the same actor)."""
        self.map_actors.append(handle)

    def actors(self) -> list[bytes]:
        return self.map_actors

    def offer_sample(self, rows: Any) -> None:
        """A Dataset job's self-check rows: the first rows of a block a map actor is about
        to tokenize (the first offer is kept; the driver waits for it)."""
        if not self.sampled.is_set():
            self.sample = rows
            self.sampled.set()

    async def first_sample(self) -> Any:
        await self.sampled.wait()
        return self.sample

    def publish(self, shared: list[Any] | str) -> None:
        """The JobShared's reference in a list (a reference inside a list is passed as
        itself), or the reason the job has none (its self-check failed)."""
        self.shared = shared
        self.published.set()

    async def job_shared(self) -> list[Any]:
        await self.published.wait()
        if isinstance(self.shared, str):
            raise RuntimeError(self.shared)
        assert self.shared is not None
        return self.shared

    def attempts_before(self, names: list[str]) -> list[int] | None:
        """How often each unit was started before (0 the first time; more: its actor died
        while a block held it), or None once the job has failed: start none of them."""
        if self.failed:
            return None
        return [self.attempts.get(name, 0) for name in names]

    def started(self, name: str) -> None:
        self.attempts[name] = self.attempts.get(name, 0) + 1

    def fail(self) -> None:
        self.failed = True

    def retries(self) -> int:
        return sum(count - 1 for count in self.attempts.values())
