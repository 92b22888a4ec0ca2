"""The cluster's ledger: one Ray actor (no CPU, async, detached and named) per cluster, that
the map tasks of every tokenize job on the cluster and their drivers share.

Invariant: per job (a token the driver opens and closes), it counts how often a worker
started each unit (a unit whose worker died runs again: its count says so), says whether
the job has failed (units not started yet then are not started), hands the job's
head-start task the settings the job most likely has (published as the job starts, before
its self-check), hands the map tasks the job's JobShared once the driver publishes it
(after its self-check: the tasks start meanwhile), and takes a Dataset job's self-check
rows from the first map task about to tokenize a block. A job opens at its first call,
whoever makes it (Ray orders the calls of one caller only: a map task's may arrive before
the driver's `open`); a call about a job that has closed changes nothing: a unit of it is
not started, its guess is none, and its settings are an error.

One actor for the cluster, not one a job or a driver: a new actor takes a worker process
of its own, whose place in the pool Ray then refills by starting another (several times a
job's fixed cost on tasks: docs/benchmarks.md), and a new driver on a running cluster would
start one more process while its first worker starts.
The first job's driver makes it (`raypipe.ray.executor.cluster_ledger`); it outlives that
driver, and a driver killed before closing its job leaves that job's counts in it (a few
bytes a unit).

Cost: this module imports nothing of raypipe and no Arrow: the ledger's worker imports it
in ~2 ms, while the machine's cores are starting the map workers (only a Dataset job's sample
rows, an Arrow table, bring
pyarrow in, once they arrive). Every call is O(1) or O(units asked about); a closed job's
state is dropped, but for its token (32 bytes a job).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any


class JobEntries:
    """One open job's state in the ledger."""

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}
        self.failed = False
        self.shared: list[Any] | str | None = None  # [JobShared's ref], or why there is none
        self.published = asyncio.Event()
        self.likely: list[Any] | None = None  # [the likely settings' ref], or no guess
        self.guessed = asyncio.Event()
        self.sample: Any = None  # a pyarrow Table, kept as Ray gave it
        self.sampled = asyncio.Event()


ENDED = "the job has ended"


class UnitLedger:
    """Per open job: a unit's attempts, the job's failure, its JobShared and its first
    rows; created by the driver as `ray.remote(num_cpus=0)(UnitLedger)`."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobEntries] = {}
        self.closed: set[str] = set()

    def entries(self, job: str) -> JobEntries | None:
        """The job's state (made at its first call), or None once it has closed."""
        if job in self.closed:
            return None
        return self.jobs.setdefault(job, JobEntries())

    def open(self, job: str) -> None:
        self.entries(job)

    def close(self, job: str) -> int:
        """End `job`: its state is dropped (a waiting call gets ENDED); returns how many
        times its units were started again after a worker died."""
        self.closed.add(job)
        entries = self.jobs.pop(job, None)
        if entries is None:
            return 0
        if not entries.published.is_set():
            entries.shared = ENDED
            entries.published.set()
        entries.sampled.set()
        entries.guessed.set()
        return sum(count - 1 for count in entries.attempts.values())

    def offer_sample(self, job: str, rows: Any) -> None:
        """A Dataset job's self-check rows: the first rows of a block a map task is about
        to tokenize (the first offer is kept; the driver waits for it)."""
        entries = self.entries(job)
        if entries is not None and not entries.sampled.is_set():
            entries.sample = rows
            entries.sampled.set()

    async def first_sample(self, job: str) -> Any:
        """The first rows offered, or None once the job has ended without an offer."""
        entries = self.entries(job)
        if entries is None:
            return None
        await entries.sampled.wait()
        return entries.sample

    def publish(self, job: str, shared: list[Any] | str) -> None:
        """The JobShared's reference in a list (a reference inside a list is passed as
        itself), or the reason the job has none (its self-check failed)."""
        entries = self.entries(job)
        if entries is not None:
            entries.shared = shared
            entries.published.set()

    async def job_shared(self, job: str) -> list[Any]:
        entries = self.entries(job)
        if entries is None:
            raise RuntimeError(ENDED)
        await entries.published.wait()
        if isinstance(entries.shared, str):
            raise RuntimeError(entries.shared)
        assert entries.shared is not None
        return entries.shared

    def guess(self, job: str, likely: list[Any] | None) -> None:
        """The settings the job most likely has (their reference in a list), or None: no
        guess; published as the job starts, before its settings."""
        entries = self.entries(job)
        if entries is not None:
            entries.likely = likely
            entries.guessed.set()

    async def likely(self, job: str) -> list[Any] | None:
        """The guess once the driver made it; None if there is none, or the job ended."""
        entries = self.entries(job)
        if entries is None:
            return None
        await entries.guessed.wait()
        return entries.likely

    def attempts_before(self, job: str, names: list[str]) -> list[int] | None:
        """How often each unit was started before (0 the first time; more: its worker died
        while a block held it), or None once the job has failed or ended: start none."""
        entries = self.entries(job)
        if entries is None or entries.failed:
            return None
        return [entries.attempts.get(name, 0) for name in names]

    def started(self, job: str, name: str) -> None:
        entries = self.entries(job)
        if entries is not None:
            entries.attempts[name] = entries.attempts.get(name, 0) + 1

    def fail(self, job: str) -> None:
        entries = self.entries(job)
        if entries is not None:
            entries.failed = True


def ledger_name() -> str:
    """The cluster's ledger actor's name, from its code: a driver whose ledger code differs
    (another raypipe) gets its own. Made from the methods' bytecode, constants and names,
    not from the source file, which a job's working directory may no longer hold."""
    digest = hashlib.sha256()
    for cls in (JobEntries, UnitLedger):
        for name, member in sorted(vars(cls).items()):
            if hasattr(member, "__code__"):
                digest.update(f"{cls.__name__}.{name}".encode())
                add_code(digest, member.__code__)
    return f"raypipe-ledger-{digest.hexdigest()[:12]}"


def add_code(digest: Any, code: Any) -> None:
    """A code object's bytecode, constants and names into `digest`, nested code included
    (a code object's repr holds its address, so it is walked, not printed)."""
    digest.update(code.co_code)
    digest.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            add_code(digest, const)
        else:
            digest.update(repr(const).encode())
