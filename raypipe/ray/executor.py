"""The tokenize job on Ray Data: one Dataset per job, whose map stage tokenizes and writes.

Invariant: Ray Data only moves work (WorkUnit dataclasses, or a user Dataset's blocks) in
and small commit records (UnitRecord) out; all reading, tokenizing and writing is
`raypipe.preprocess.unit.tokenize_unit`, so output is byte-identical to the serial runner
at any worker count. Planned units run as `from_items(units, up to UNITS_PER_BLOCK a
block)` -> `map_batches(TokenizeUnits, actor pool)` (the driver pays per block, not per
unit: `units_per_block`); a user's Dataset runs as `dataset.map_batches(TokenizeBlocks,
actor pool)`, one unit per block, named by the hash of its rows. Each map actor loads the
tokenizer once (adopting the tiktoken conversion the driver made for its self-check, both
read from one object-store copy) and encodes with one thread; token arrays never cross the
object store. The actors start while the driver's self-check still runs: each waits for the
job's settings at the ledger, where the driver publishes them (or the check's failure,
which fails the job with the check's own error) once the check ends; measured on a running
2-CPU cluster, 20 MB, 5 rounds alternating: the first unit starts 0.15 s sooner (median
3.89 s against 4.05 s from launch), where the check and the actors share 2 cores (where the
actors run on other nodes than the driver, the check's ~0.6 s should overlap them whole:
not measured, one machine here). A user's Dataset runs once, as the job: no `take_batch` or
schema fetch runs it before (measured on a 2-CPU local Ray, a 900-row parquet Dataset
repartitioned into 6 blocks, 3 jobs each: 8.4-11.4 s a job with such a first execution,
5.4-6.9 s without); its self-check rows are the first rows of the first block a map actor
is about to tokenize, offered to the driver at the ledger (per job: an offer an actor, the
first kept, each at most 4,096 rows or ~512 KB, and one `ray.put` of the committed block
names; nothing per unit on the driver). Ray Data restarts a killed actor and runs its block
again; the job's `UnitLedger` actor (raypipe.ray.ledger) counts every unit's attempts, so
retries are reported, and a unit that killed its worker UNIT_RETRIES + 1 times fails the
job naming its file and rows instead of restarting forever (committed units stay). Bad
input (a RaypipeError) comes back as the unit's result and is raised on the driver as
itself: Ray Data neither retries it nor wraps it. It is raised once the stage drains: the
ledger then starts no further unit, and the units in flight on other actors finish and
commit. A unit whose block runs again after its actor died is taken as it was committed,
if it was. A job's map actors end with it, however it ends (each gives the ledger its
handle, pickled; a failed Ray Data execution would otherwise leave them, and their
CPUs, to garbage collection). Every pending unit runs here, whatever Ray's start-up costs
(there is no driver-side head start), so every job with work leaves its execution plan,
with the tokenize map stage, in Ray Data's log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from raypipe import _faults as faults
from raypipe.config import TokenizeConfig
from raypipe.errors import InputError, RaypipeError
from raypipe.io.records import UnitRecord, WorkUnit
from raypipe.preprocess.encoding.encoder import DocumentEncoder
from raypipe.preprocess.encoding.self_check import first_rows
from raypipe.preprocess.encoding.tiktoken_backend import Conversion, adopt, converted
from raypipe.preprocess.job import JobSummary, run_dataset_job, run_job
from raypipe.preprocess.runners import (
    BlockRun,
    Failures,
    LaterSettings,
    Settings,
    make_encoder,
    unit_outcome,
)
from raypipe.preprocess.unit import UnitSettings
from raypipe.ray.ledger import UnitLedger
from raypipe.ray.session import cluster_cpus, ensure_ray, quiet_ray_notices
from raypipe.ray.stderr_lines import dropping_ray_noise

logger = logging.getLogger("raypipe")


@dataclasses.dataclass(frozen=True)
class JobShared:
    """What every map actor of a job reads once, before its first unit: the settings (with
    the tokenizer's JSON) and the tiktoken conversion the driver made."""

    settings: UnitSettings
    conversion: Conversion | None


class MapTokenizer:
    """What both map stages share: the encoder loaded once per actor, and the ledger. The
    job's JobShared comes from the ledger, as an object reference: the constructor's own
    arguments stay small, so Ray inlines them instead of keeping an object-store copy for
    actor restarts (which it logs at error level for every actor)."""

    settings: UnitSettings
    encoder: DocumentEncoder

    def __init__(self, ledger: Any):
        self.ledger = ledger
        # the handle's pickle: the ledger never deserializes it (raypipe.ray.ledger)
        ledger.joined.remote(pickle.dumps(ray.get_runtime_context().current_actor))

    def load(self) -> None:
        """Wait for the job's JobShared at the ledger; load the encoder."""
        job: JobShared = ray.get(ray.get(self.ledger.job_shared.remote())[0])
        if job.conversion is not None:
            adopt(job.settings.tokenizer.sha256, job.conversion)
        self.settings = job.settings
        self.encoder = make_encoder(job.settings)

    def outcomes(self, units: list[WorkUnit], batches: Any = None
                 ) -> list[UnitRecord | RaypipeError | None]:
        """Each unit's record, a RaypipeError (bad input, or a unit that keeps killing its
        worker) as a value (Ray Data would retry a raised one and its wrapper loses the
        original, while the driver raises it as itself), or None: not started, the job
        has failed. One ledger call for the lot."""
        before = ray.get(self.ledger.attempts_before.remote([unit.name for unit in units]))
        if before is None:
            return [None] * len(units)
        return [self.outcome(unit, started + 1, batches)
                for unit, started in zip(units, before, strict=True)]

    def outcome(self, unit: WorkUnit, attempt: int, batches: Any = None
                ) -> UnitRecord | RaypipeError:
        # no wait on the ledger: a death from `starting` on counts
        return unit_outcome(unit, attempt, self.settings, self.encoder, batches,
                            starting=lambda: self.ledger.started.remote(unit.name))


def _outcomes(outcomes: list[UnitRecord | RaypipeError | None]) -> dict[str, np.ndarray]:
    column = np.empty(len(outcomes), dtype=object)
    column[:] = outcomes
    return {"record": column}


class Outcomes(Failures):
    """The driver's side of the map stage's outcomes: records pass, and the first error
    stops new units (the ledger) while the units in flight finish and commit (Failures)."""

    def __init__(self, ledger: Any):
        super().__init__()
        self.ledger = ledger

    def record(self, outcome: Any) -> UnitRecord | None:
        """A unit's record from the map stage's column (None: no record: not started, or
        the block's unit was committed before; Ray Data turns a block of Nones into NaN)."""
        if isinstance(outcome, RaypipeError):
            if not self.errors:
                ray.get(self.ledger.fail.remote())
            self.add(outcome)
            return None
        return outcome if isinstance(outcome, UnitRecord) else None


class TokenizeUnits(MapTokenizer):
    """Map stage over planned units (rows {"unit": WorkUnit}, several a block): an outcome
    per unit. The actor loads the encoder as it starts."""

    def __init__(self, ledger: Any):
        super().__init__(ledger)
        self.load()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _outcomes(self.outcomes(list(batch["unit"])))


def block_digest(table: pa.Table, columns: list[str]) -> str:
    """sha256 of a block's rows in `columns` (Arrow IPC bytes of one contiguous chunk per
    column, without schema metadata): the same rows give the same digest."""
    selected = table.select(columns).replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, selected.schema) as writer:
        writer.write_table(selected)
    return hashlib.sha256(sink.getvalue()).hexdigest()[:20]


class TokenizeBlocks(MapTokenizer):
    """Map stage over a user's Dataset: each block is one unit named by the hash of its
    `columns`' rows; a block whose unit is committed already is not tokenized again. Before
    its first block to tokenize, the actor offers that block's first rows to the ledger
    (the driver's self-check, in a Dataset job, runs on the first rows offered) and waits
    for the job's settings. `committed`: [a reference to the committed units' names]."""

    def __init__(self, ledger: Any, label: str, columns: list[str], committed: list[Any]):
        super().__init__(ledger)
        self.label = label
        self.columns = columns
        self.committed: frozenset[str] = ray.get(committed[0])
        self.loaded = False

    def __call__(self, table: pa.Table) -> dict[str, np.ndarray]:
        name, outcome = self.block_outcome(table)
        return {**_outcomes([outcome]), "name": np.array([name])}

    def block_outcome(self, table: pa.Table) -> tuple[str, UnitRecord | RaypipeError | None]:
        columns = self.columns
        missing = [name for name in columns if name not in table.column_names]
        if missing:
            return "", InputError(f"{self.label}: column(s) {missing} not found in a block; "
                                  f"available columns: {table.column_names}")
        digest = block_digest(table, columns)
        unit = WorkUnit(self.label, 0, 1, table.num_rows, f"block-{digest}", 0, digest,
                        kind="block", size_bytes=int(table.nbytes))
        if unit.name in self.committed:
            return unit.name, None
        if not self.loaded:
            self.ledger.offer_sample.remote(first_rows(table.select(columns)))
            self.load()
            self.loaded = True
        return unit.name, self.outcomes([unit], table.select(columns).to_batches(
            max_chunksize=self.settings.config.encode_batch_rows))[0]


class RayDataRunner:
    """Runs a job's units (or a Dataset's blocks) as one Ray Data Dataset; connects to (or
    starts) Ray only when there is work to run."""

    def __init__(self, num_workers: int | None, address: str | None = None):
        self.num_workers = num_workers
        self.address = address
        self.startup_seconds = 0.0
        self.data_startup_seconds = 0.0  # pipeline launched -> first record on the driver
        self.retries = 0
        self.ledger: Any = None
        self.joined = False  # a Ray session that was running already
        self.run_over = threading.Event()  # set once run/run_blocks has ended, either way

    def connect(self) -> None:
        """Connect to (or start) Ray, and start the job's ledger."""
        quiet_ray_notices()  # also in a session the caller started
        if not ray.is_initialized():
            self.startup_seconds = ensure_ray(self.address, self.num_workers)
        elif not self.startup_seconds:
            self.joined = True
        if self.ledger is None:
            self.ledger = ray.remote(num_cpus=0)(UnitLedger).remote()

    def startup_line(self) -> str | None:
        how = ("joined the running Ray session" if self.joined
               else f"Ray up in {self.startup_seconds:.2f} s")
        return f"{how} ({cluster_cpus()} CPUs); the units run on Ray Data"

    def _map_options(self, workers: int, actor_cpus: float) -> dict[str, Any]:
        options: dict[str, Any] = {"compute": ray.data.ActorPoolStrategy(size=workers),
                                   "num_cpus": actor_cpus, "batch_size": 1}
        if faults.environment():  # tests only: the workers see the same injected fault
            options["runtime_env"] = {"env_vars": faults.environment()}
        return options

    def _start(self, settings: Settings) -> None:
        """The job's ledger running; the job's JobShared published there once the settings
        are ready (now, or when the self-check ends: the map actors start meanwhile)."""
        self.connect()
        ledger = self.ledger

        def publish(ready: UnitSettings | BaseException) -> None:
            """Never raises (the actors would wait for ever): a failure is published."""
            try:
                if isinstance(ready, BaseException):
                    raise ready
                conversion = converted(ready.tokenizer.sha256)
                shared: list[Any] | str = [ray.put(JobShared(ready, conversion))]
            except BaseException as exc:  # noqa: BLE001  (handed to the actors as words)
                shared = f"the job's settings could not be made: {exc}"
            ledger.publish.remote(shared)

        if isinstance(settings, LaterSettings):
            settings.when_ready(publish)
        else:
            publish(settings)

    def _finish(self) -> None:
        """The job's ledger and map actors ended, however the run ended: Ray Data ends the
        actors of an execution that failed only once their handles are garbage collected
        (measured: they sat in reference cycles, holding their CPUs in the caller's
        session until a `gc.collect()`; a Ray Train run waited 15 minutes for them)."""
        self.run_over.set()
        if self.ledger is not None:
            self.retries = ray.get(self.ledger.retries.remote())
            for handle in ray.get(self.ledger.actors.remote()):
                ray.kill(pickle.loads(handle))
            ray.kill(self.ledger)
            self.ledger = None

    def run(self, units: list[WorkUnit], settings: Settings) -> Iterator[UnitRecord]:
        """Records of `units` as they commit; the first failure is raised once the units
        in flight have finished (and committed)."""
        self._start(settings)
        workers = max(1, min(self.num_workers or cluster_cpus(), len(units)))
        per_block = units_per_block(len(units), workers)
        outcomes = Outcomes(self.ledger)
        try:
            with objects_as_pickles():
                dataset = ray.data.from_items([{"unit": unit} for unit in units],
                                              override_num_blocks=-(-len(units) // per_block))
            # no reads compete for CPUs here: a whole CPU per actor cannot starve them
            mapped = dataset.map_batches(TokenizeUnits, fn_constructor_args=(
                self.ledger,), batch_format="numpy",
                **{**self._map_options(workers, 1.0), "batch_size": per_block})
            mapped.context.enable_progress_bars = False  # raypipe's own line has the ETA
            mapped.context.enable_fallback_to_arrow_object_ext_type = True
            launched = time.perf_counter()
            # dropping_ray_noise: Ray's error line for every actor (ray#57733)
            with dropping_ray_noise(), closing_batches(mapped) as batches:
                for batch in batches:
                    self.data_startup_seconds = self.data_startup_seconds or \
                        time.perf_counter() - launched
                    for outcome in batch["record"]:
                        record = outcomes.record(outcome)
                        if record is not None:
                            yield record
            outcomes.raise_first()
        finally:
            self._finish()

    def run_blocks(self, dataset: Any, settings: Settings, committed: frozenset[str],
                   label: str, columns: list[str]) -> Iterator[BlockRun]:
        """(unit name, its new record or None if committed before) per block, in the
        Dataset's block order: the Dataset's one execution."""
        self._start(settings)
        cpus = cluster_cpus()
        workers = max(1, self.num_workers or cpus)
        # leave a CPU to the Dataset's own read and map tasks: an actor pool holding every
        # CPU starves them (measured on 2 CPUs: the read tasks never got scheduled)
        actor_cpus = min(1.0, max(cpus - 1, 0.5) / workers)
        context = dataset.context  # shared with the Dataset derived below: restored after
        saved = (context.execution_options.preserve_order,
                 context.enable_fallback_to_arrow_object_ext_type)
        try:
            mapped = dataset.map_batches(TokenizeBlocks, fn_constructor_args=(
                self.ledger, label, columns, [ray.put(committed)]), batch_format="pyarrow",
                **{**self._map_options(workers, actor_cpus), "batch_size": None})
            context.execution_options.preserve_order = True  # the manifest's order
            context.enable_fallback_to_arrow_object_ext_type = True
            launched = time.perf_counter()
            outcomes = Outcomes(self.ledger)
            # dropping_ray_noise: Ray's error line for every actor (ray#57733)
            with dropping_ray_noise(), closing_batches(mapped) as batches:
                for batch in batches:
                    self.data_startup_seconds = self.data_startup_seconds or \
                        time.perf_counter() - launched
                    for name, outcome in zip(batch["name"].tolist(), batch["record"],
                                             strict=True):
                        record = outcomes.record(outcome)
                        if not outcomes.errors:
                            yield BlockRun(str(name), record)
            outcomes.raise_first()
        finally:
            (context.execution_options.preserve_order,
             context.enable_fallback_to_arrow_object_ext_type) = saved
            self._finish()

    def check_columns(self, dataset: Any, columns: list[str]) -> None:
        """Refuse a Dataset without one of `columns`, naming its columns, where Ray Data
        knows its schema without running it (a read, `from_items`, a repartition of them);
        otherwise each block checks its own (`TokenizeBlocks`), so the Dataset runs once."""
        self.connect()  # raypipe's session (loopback, address), before Ray Data would init one
        schema = dataset.schema(fetch_if_missing=False)
        if schema is None:
            return
        available = list(schema.names)
        missing = [name for name in columns if name not in available]
        if missing:
            role = "text column" if len(columns) == 1 else "column(s)"
            shown = repr(missing[0]) if len(missing) == 1 else str(missing)
            raise InputError(f"{describe_dataset(dataset)}: {role} {shown} not found; "
                             f"available columns: {available}")

    def first_rows(self) -> pa.Table | None:
        """The rows the first map actor about to tokenize a block offered (waits for them
        while the run goes on); None once the run has ended without an offer (every block
        committed before, or none)."""
        ledger = self.ledger
        if ledger is None:  # the run has ended already
            return None
        offered = ledger.first_sample.remote()
        while not self.run_over.is_set():
            if ray.wait([offered], timeout=0.1)[0]:
                try:
                    return ray.get(offered)
                except ray.exceptions.RayActorError:  # the run ended: the ledger is gone
                    return None
        return None


UNITS_PER_BLOCK = 64  # units one Ray Data block carries at most
BLOCKS_PER_WORKER = 4  # blocks each actor gets at least, for balance at the job's end


def units_per_block(units: int, workers: int) -> int:
    """How many units one Ray Data block carries: the driver pays ~10 ms of CPU per block
    (its executor, the block's object), so at 10^4 units several share a block, while every
    actor still gets BLOCKS_PER_WORKER blocks or more."""
    return max(1, min(UNITS_PER_BLOCK, units // (workers * BLOCKS_PER_WORKER)))


@contextlib.contextmanager
def closing_batches(dataset: Any) -> Iterator[Iterator[dict[str, np.ndarray]]]:
    """The Dataset's batches (numpy, as they come), its execution shut down as the block
    ends, however it ends (an error, an interrupt, a job that stopped consuming them), not
    whenever its iterator is garbage collected."""
    batches = iter(dataset.iter_batches(batch_size=None, batch_format="numpy"))
    try:
        yield batches
    finally:
        batches.close()  # type: ignore[attr-defined]  (a generator)


@contextlib.contextmanager
def objects_as_pickles() -> Iterator[None]:
    """Let Ray Data store Python objects (WorkUnit) in a column without its warning that
    it falls back to pickles (the fallback is what raypipe wants)."""
    context = ray.data.DataContext.get_current()
    before = context.enable_fallback_to_arrow_object_ext_type
    context.enable_fallback_to_arrow_object_ext_type = True
    try:
        yield
    finally:
        context.enable_fallback_to_arrow_object_ext_type = before


def describe_dataset(dataset: Any) -> str:
    """A Dataset's name in messages, records and the job record: `ray.data.Dataset` or,
    for one named with `set_name`, `ray.data.Dataset(<name>)`. Stable across runs: a
    rerun with the same (or same-named) Dataset is the same job."""
    name = getattr(dataset, "name", None)
    return f"ray.data.Dataset({name})" if name else "ray.data.Dataset"


def raypipe_cause(exc: BaseException) -> BaseException:
    """The RaypipeError inside a Ray task error chain (so the CLI prints one clear line),
    or the exception itself."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RaypipeError) and type(seen).__module__.startswith("raypipe"):
            return seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return exc


def _with_ray_errors_unwrapped(run: Any) -> JobSummary:
    try:
        return run()
    except Exception as exc:
        cause = raypipe_cause(exc)
        if cause is exc:
            raise
        raise cause from None


def run_on_ray(config: TokenizeConfig, dataset: Any = None) -> JobSummary:
    """Run the job on Ray Data, inside the caller's Ray session or a new one (left
    running): over `config.inputs`' files, or over `dataset` (a ray.data.Dataset) when
    given. A rerun of a file job with nothing left to do never touches Ray."""
    runner = RayDataRunner(config.num_workers, config.address)
    if dataset is None:
        summary = _with_ray_errors_unwrapped(lambda: run_job(config, runner))
    else:
        summary = _with_ray_errors_unwrapped(
            lambda: run_dataset_job(dataset, describe_dataset(dataset), config, runner))
    return dataclasses.replace(summary, startup_seconds=runner.startup_seconds,
                               data_startup_seconds=runner.data_startup_seconds,
                               unit_retries=runner.retries, executor="ray")
