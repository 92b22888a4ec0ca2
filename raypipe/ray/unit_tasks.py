"""What a tokenize job's Ray tasks run on the workers: the head start, the map stage's
units and blocks, and each worker process's latest job and encoder.

Invariant: a worker process imports this module and what a unit needs (the encoder, the
unit's reading and writing), never the driver's side of a job (its planning, summary,
progress, the loaders' sampling): Ray unpickles a task's function by importing
its module, and every module it imports is CPU on the worker's way to its first unit
(measured: raypipe.ray.executor pulled in 27 driver modules more, ~0.06-0.09 s a worker
process). The driver's side (the runner, the ledger's seat, the Dataset) is
raypipe.ray.executor. Cost: nothing on the driver (this runs on the workers); a worker
makes one ledger call a block (the attempts of its units) and sends one a unit as it
starts, and loads a job's settings and encoder once a process.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from raypipe.errors import InputError, RaypipeError
from raypipe.io.records import UnitRecord, WorkUnit
from raypipe.preprocess.encoding.encoder import DocumentEncoder
from raypipe.preprocess.encoding.self_check import first_rows
from raypipe.preprocess.encoding.tiktoken_backend import Conversion, adopt
from raypipe.preprocess.runners import encoder_for, same_encoder, unit_outcome, warmed_up
from raypipe.preprocess.unit import UnitSettings


@dataclasses.dataclass(frozen=True)
class JobShared:
    """What every map worker process reads once a job, before its first unit: the settings (with
    the tokenizer's JSON) and the tiktoken conversion the driver made."""

    settings: UnitSettings
    conversion: Conversion | None


@dataclasses.dataclass(frozen=True)
class LedgerJob:
    """One job's seat at the cluster's ledger: what its map tasks are handed."""

    ledger: Any
    job: str

    def attempts_before(self, units: list[WorkUnit]) -> list[int] | None:
        return ray.get(self.ledger.attempts_before.remote(self.job,
                                                          [unit.name for unit in units]))

    def starting(self, name: str) -> Callable[[], Any]:
        return lambda: self.ledger.started.remote(self.job, name)


@dataclasses.dataclass
class LoadedJob:
    """A job as a worker process holds it: its settings and the encoder it loaded (job
    WARMED_UP: no job yet, the encoder a head start built from the likely settings)."""

    job: str
    settings: UnitSettings
    encoder: DocumentEncoder


WARMED_UP = ""  # LoadedJob.job of an encoder built ahead of any job's settings


class WorkerJobs:
    """A map worker process's latest job: loaded at its first block of that job, kept for
    the job's other blocks; the encoder is kept for the next job too where it encodes alike
    (`same_encoder`: a session's jobs with one tokenizer load it once a process). One job
    and one encoder a process at most, so an idle worker holds one encoder until Ray ends
    it."""

    def __init__(self) -> None:
        self.loaded: LoadedJob | None = None
        self.committed: tuple[str, frozenset[str]] = ("", frozenset())

    def has(self, job: str) -> bool:
        return self.loaded is not None and self.loaded.job == job

    def load(self, seat: LedgerJob) -> LoadedJob:
        """The job's settings (waiting for them at the ledger) and an encoder for them."""
        if self.loaded is not None and self.loaded.job == seat.job:
            return self.loaded
        shared: JobShared = ray.get(ray.get(seat.ledger.job_shared.remote(seat.job))[0])
        if shared.conversion is not None:
            adopt(shared.settings.tokenizer.sha256, shared.conversion)
        before = self.loaded
        warm = None if before is None else (before.settings, before.encoder)
        self.loaded = LoadedJob(seat.job, shared.settings, encoder_for(shared.settings, warm))
        return self.loaded

    def warm_up(self, seat: LedgerJob) -> None:
        """Build the encoder of the settings the job will most likely have (waiting for
        the driver's guess at the ledger), before its first block reaches this process
        (`load` keeps it where the job's settings come back the same); nothing where there
        is no guess, the process holds such an encoder, or the guess cannot be built."""
        guess = ray.get(seat.ledger.likely.remote(seat.job))
        if guess is None:
            return
        likely: UnitSettings = ray.get(guess[0])
        if self.loaded is not None and same_encoder(self.loaded.settings, likely):
            return
        warm = warmed_up(likely)
        if warm is not None:
            self.loaded = LoadedJob(WARMED_UP, *warm)

    def committed_units(self, job: str, committed: list[Any]) -> frozenset[str]:
        """A Dataset job's committed unit names (`committed`: [their reference]), fetched
        once a process."""
        if self.committed[0] != job:
            self.committed = (job, ray.get(committed[0]))
        return self.committed[1]


WORKER_JOBS = WorkerJobs()  # this process's, where it runs map tasks


def warm_up_worker(seat: LedgerJob) -> None:
    """A job's head start on one worker process (a Ray task): Ray Data's modules imported
    and the likely encoder built while the driver still plans, imports Ray Data, builds
    the Dataset and self-checks; the job's map tasks then take the process ready (Ray
    hands a job's task an idle process of that job first)."""
    import ray.data  # noqa: F401  (what a map task's process imports first)

    WORKER_JOBS.warm_up(seat)


def unit_outcomes(seat: LedgerJob, units: list[WorkUnit], batches: Any = None
                  ) -> list[UnitRecord | RaypipeError | None]:
    """Each unit's record, a RaypipeError (bad input, or a unit that keeps killing its
    worker) as a value (Ray Data would retry a raised one and its wrapper loses the
    original, while the driver raises it as itself), or None: not started, the job has
    failed. One ledger call for the lot."""
    before = seat.attempts_before(units)
    if before is None:
        return [None] * len(units)
    job = WORKER_JOBS.load(seat)
    # no wait on the ledger: a death from `starting` on counts
    return [unit_outcome(unit, started + 1, job.settings, job.encoder, batches,
                         starting=seat.starting(unit.name))
            for unit, started in zip(units, before, strict=True)]


def _outcomes(outcomes: list[UnitRecord | RaypipeError | None]) -> dict[str, np.ndarray]:
    column = np.empty(len(outcomes), dtype=object)
    column[:] = outcomes
    return {"record": column}


def tokenize_units(batch: dict[str, np.ndarray], seat: LedgerJob) -> dict[str, np.ndarray]:
    """Map stage over planned units (rows {"unit": WorkUnit}, several a block): an outcome
    per unit."""
    return _outcomes(unit_outcomes(seat, list(batch["unit"])))


def block_digest(table: pa.Table, columns: list[str]) -> str:
    """sha256 of a block's rows in `columns` (Arrow IPC bytes of one contiguous chunk per
    column, without schema metadata): the same rows give the same digest."""
    selected = table.select(columns).replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, selected.schema) as writer:
        writer.write_table(selected)
    return hashlib.sha256(sink.getvalue()).hexdigest()[:20]


def tokenize_block(table: pa.Table, seat: LedgerJob, label: str, columns: list[str],
                   committed: list[Any]) -> dict[str, np.ndarray]:
    """Map stage over a user's Dataset: each block is one unit named by the hash of its
    `columns`' rows; a block whose unit is committed already is not tokenized again. Before
    its first block of the job to tokenize, a process offers that block's first rows to
    the ledger (the driver's self-check, in a Dataset job, runs on the first rows offered)
    and waits for the job's settings. `committed`: [a reference to the committed units'
    names]."""
    name, outcome = block_outcome(table, seat, label, columns, committed)
    return {**_outcomes([outcome]), "name": np.array([name])}


def block_outcome(table: pa.Table, seat: LedgerJob, label: str, columns: list[str],
                  committed: list[Any]) -> tuple[str, UnitRecord | RaypipeError | None]:
    missing = [name for name in columns if name not in table.column_names]
    if missing:
        return "", InputError(f"{label}: column(s) {missing} not found in a block; "
                              f"available columns: {table.column_names}")
    digest = block_digest(table, columns)
    unit = WorkUnit(label, 0, 1, table.num_rows, f"block-{digest}", 0, digest,
                    kind="block", size_bytes=int(table.nbytes))
    if unit.name in WORKER_JOBS.committed_units(seat.job, committed):
        return unit.name, None
    if not WORKER_JOBS.has(seat.job):
        seat.ledger.offer_sample.remote(seat.job, first_rows(table.select(columns)))
    rows = WORKER_JOBS.load(seat).settings.config.encode_batch_rows
    return unit.name, unit_outcomes(seat, [unit], table.select(columns).to_batches(
        max_chunksize=rows))[0]
