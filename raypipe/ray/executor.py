"""The tokenize job on Ray Data: one Dataset per job, whose map stage tokenizes and writes.

Invariant: Ray Data only moves work (WorkUnit dataclasses, or a user Dataset's blocks) in
and small commit records (UnitRecord) out; all reading, tokenizing and writing is
`raypipe.preprocess.unit.tokenize_unit`, so output is byte-identical to the serial runner at
any worker count. Planned units run as `from_items(units, one block each)` ->
`map_batches(TokenizeUnits, actor pool)`; a user's Dataset runs as
`dataset.map_batches(TokenizeBlocks, actor pool)`, one unit per block, named by the hash of
its rows. Each map actor loads the tokenizer once (adopting the tiktoken conversion the
driver made for its self-check) and encodes with one thread; token arrays never cross the
object store. Ray Data restarts a killed actor and runs its block again; the job's
`UnitLedger` actor counts every unit's attempts, so retries are reported, and a unit that
killed its worker UNIT_RETRIES + 1 times fails the job naming its file and rows instead of
restarting forever (committed units stay). Bad input (a RaypipeError) comes back as the
unit's result and is raised on the driver as itself: Ray Data neither retries it nor wraps
it. The ledger also hands out units exactly once:
while Ray Data's actors start (~2.5 s after `ray.init` on 2 cores, against 0.8 s for a
plain actor) the driver keeps tokenizing units from the back of the plan, each claimed in
the ledger first, so no unit runs twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
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
from raypipe.preprocess.encoding.tiktoken_backend import Conversion, adopt, converted
from raypipe.preprocess.job import (
    BlockRun,
    JobSummary,
    make_encoder,
    run_dataset_job,
    run_job,
)
from raypipe.preprocess.texts import clean_texts
from raypipe.preprocess.unit import UnitSettings, tokenize_unit
from raypipe.ray.session import cluster_cpus, ensure_ray

logger = logging.getLogger("raypipe")
UNIT_RETRIES = 3  # runs of a unit after its worker died, before the job fails
DRIVER, WORKER = "driver", "worker"


class UnitLedger:
    """A Ray actor (no CPU): who runs each unit, and how often a worker started it."""

    def __init__(self) -> None:
        self.owner: dict[str, str] = {}
        self.attempts: dict[str, int] = {}

    def claim(self, name: str, claimant: str) -> int:
        """0 if another claimant has the unit, else the claimant's attempt (1 the first
        time; a worker's later attempts are runs again after its actor died)."""
        owner = self.owner.setdefault(name, claimant)
        if owner != claimant:
            return 0
        self.attempts[name] = self.attempts.get(name, 0) + 1
        return self.attempts[name]

    def retries(self) -> int:
        return sum(count - 1 for count in self.attempts.values())


class MapTokenizer:
    """What both map stages share: the encoder loaded once per actor, and the ledger."""

    def __init__(self, settings: UnitSettings, conversion: list[Any], ledger: Any):
        converted_vocabulary: Conversion | None = ray.get(conversion[0])
        if converted_vocabulary is not None:
            adopt(settings.tokenizer.sha256, converted_vocabulary)
        self.settings = settings
        self.encoder: DocumentEncoder = make_encoder(settings)
        self.ledger = ledger

    def claimed(self, unit: WorkUnit) -> bool:
        """Claim `unit` for this worker; False if the driver runs it. Raises once the unit
        has killed its worker more than UNIT_RETRIES times."""
        attempt = ray.get(self.ledger.claim.remote(unit.name, WORKER))
        if attempt > 1:
            if attempt > UNIT_RETRIES + 1:
                raise InputError(f"{unit.location}: the worker tokenizing them died "
                                 f"{attempt - 1} times (out of memory?)")
            logger.warning("%s: the worker died; running the unit again (%d of %d)",
                           unit.location, attempt - 1, UNIT_RETRIES)
        return attempt > 0


    def outcome(self, unit: WorkUnit, batches: Any = None) -> UnitRecord | RaypipeError | None:
        """The unit's record; None if the driver claimed it; a RaypipeError (bad input, or
        a unit that keeps killing its worker) as a value: Ray Data would retry a raised one
        and its wrapper loses the original, while the driver raises it as itself."""
        try:
            if not self.claimed(unit):
                return None
            return tokenize_unit(unit, self.settings, self.encoder, batches)
        except RaypipeError as exc:
            return exc


def _outcomes(outcomes: list[UnitRecord | RaypipeError | None]) -> dict[str, np.ndarray]:
    column = np.empty(len(outcomes), dtype=object)
    column[:] = outcomes
    return {"record": column}


def _record_or_raise(outcome: Any) -> UnitRecord | None:
    """A unit's record from the map stage's column (None: no record: the driver ran it,
    or it was committed before; Ray Data turns a block of Nones into NaN)."""
    if isinstance(outcome, RaypipeError):
        raise outcome
    return outcome if isinstance(outcome, UnitRecord) else None


class TokenizeUnits(MapTokenizer):
    """Map stage over planned units (rows {"unit": WorkUnit}): an outcome per unit."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return _outcomes([self.outcome(unit) for unit in batch["unit"]])


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
    rows; a block whose unit is committed already is not tokenized again."""

    def __init__(self, settings: UnitSettings, conversion: list[Any], ledger: Any,
                 committed: frozenset[str], label: str):
        super().__init__(settings, conversion, ledger)
        self.committed = committed
        self.label = label

    def __call__(self, table: pa.Table) -> dict[str, np.ndarray]:
        name, outcome = self.block_outcome(table)
        return {**_outcomes([outcome]), "name": np.array([name])}

    def block_outcome(self, table: pa.Table) -> tuple[str, UnitRecord | RaypipeError | None]:
        columns = self.settings.columns
        missing = [name for name in columns if name not in table.column_names]
        if missing:
            return "", InputError(f"{self.label}: column(s) {missing} not found in a block; "
                                  f"available columns: {table.column_names}")
        digest = block_digest(table, columns)
        unit = WorkUnit(self.label, 0, 1, table.num_rows, f"block-{digest}", 0, digest,
                        kind="block", size_bytes=int(table.nbytes))
        if unit.name in self.committed:
            return unit.name, None
        return unit.name, self.outcome(unit, table.select(columns).to_batches(
            max_chunksize=self.settings.config.encode_batch_rows))


class RayDataRunner:
    """Runs a job's units (or a Dataset's blocks) as one Ray Data Dataset; connects to (or
    starts) Ray only when there is work to run."""

    starts_slowly = True  # a local Ray starts in 3-5 s: the driver tokenizes meanwhile

    def __init__(self, num_workers: int | None, address: str | None = None):
        self.num_workers = num_workers
        self.address = address
        self.startup_seconds = 0.0
        self.data_startup_seconds = 0.0  # pipeline launched -> first record on the driver
        self.retries = 0
        self.ledger: Any = None
        self.first_record = threading.Event()  # the driver stops claiming units then

    def connect(self) -> None:
        """Connect to (or start) Ray, and start the job's ledger."""
        if not ray.is_initialized():
            self.startup_seconds = ensure_ray(self.address, self.num_workers)
        if self.ledger is None:
            self.ledger = ray.remote(num_cpus=0)(UnitLedger).remote()
            self.first_record.clear()

    def claim(self, unit: WorkUnit) -> bool:
        """For the driver: True if it may run `unit` (no worker has claimed it), until the
        first record has come from Ray Data."""
        if self.first_record.is_set() or self.ledger is None:
            return False
        return ray.get(self.ledger.claim.remote(unit.name, DRIVER)) > 0

    def _map_options(self, workers: int, actor_cpus: float) -> dict[str, Any]:
        options: dict[str, Any] = {"compute": ray.data.ActorPoolStrategy(size=workers),
                                   "num_cpus": actor_cpus, "batch_size": 1}
        if faults.environment():  # tests only: the workers see the same injected fault
            options["runtime_env"] = {"env_vars": faults.environment()}
        return options

    def _start(self, settings: UnitSettings) -> list[Any]:
        """The job's ledger running; the tiktoken conversion in the object store (passed
        inside a list: a constructor argument Ray would otherwise keep for restarts)."""
        self.connect()
        return [ray.put(converted(settings.tokenizer.sha256))]

    def _finish(self) -> None:
        if self.ledger is not None:
            self.retries = ray.get(self.ledger.retries.remote())
            ray.kill(self.ledger)
            self.ledger = None

    def run(self, units: list[WorkUnit], settings: UnitSettings) -> Iterator[UnitRecord]:
        """Records of `units` as they commit (None-free; units the driver claimed are left
        out: the driver has their records)."""
        if not units:  # the driver ran them all while Ray started
            self._finish()
            return
        conversion = self._start(settings)
        workers = max(1, min(self.num_workers or cluster_cpus(), len(units)))
        try:
            with objects_as_pickles():
                dataset = ray.data.from_items([{"unit": unit} for unit in units],
                                              override_num_blocks=len(units))
            # no reads compete for CPUs here: a whole CPU per actor cannot starve them
            mapped = dataset.map_batches(TokenizeUnits, fn_constructor_args=(
                settings, conversion, self.ledger), batch_format="numpy",
                **self._map_options(workers, 1.0))
            mapped.context.enable_progress_bars = False  # raypipe's own line has the ETA
            mapped.context.enable_fallback_to_arrow_object_ext_type = True
            launched = time.perf_counter()
            for batch in mapped.iter_batches(batch_size=None, batch_format="numpy"):
                if not self.first_record.is_set():
                    self.data_startup_seconds = time.perf_counter() - launched
                    self.first_record.set()
                for outcome in batch["record"]:
                    record = _record_or_raise(outcome)
                    if record is not None:
                        yield record
        finally:
            self.first_record.set()
            self._finish()

    def run_blocks(self, dataset: Any, settings: UnitSettings,
                   committed: frozenset[str], label: str) -> Iterator[BlockRun]:
        """(unit name, its new record or None if committed before) per block, in the
        Dataset's block order."""
        conversion = self._start(settings)
        self.first_record.set()  # the driver runs no blocks
        cpus = cluster_cpus()
        workers = max(1, self.num_workers or cpus)
        # leave a CPU to the Dataset's own read and map tasks (an actor pool holding every
        # CPU would starve them: NOTES-RAY.md)
        actor_cpus = min(1.0, max(cpus - 1, 0.5) / workers)
        context = dataset.context  # shared with the Dataset derived below: restored after
        saved = (context.execution_options.preserve_order,
                 context.enable_fallback_to_arrow_object_ext_type)
        try:
            mapped = dataset.map_batches(TokenizeBlocks, fn_constructor_args=(
                settings, conversion, self.ledger, committed, label), batch_format="pyarrow",
                **{**self._map_options(workers, actor_cpus), "batch_size": None})
            context.execution_options.preserve_order = True  # the manifest's order
            context.enable_fallback_to_arrow_object_ext_type = True
            launched = time.perf_counter()
            for batch in mapped.iter_batches(batch_size=None, batch_format="numpy"):
                self.data_startup_seconds = self.data_startup_seconds or \
                    time.perf_counter() - launched
                for name, outcome in zip(batch["name"].tolist(), batch["record"],
                                         strict=True):
                    yield BlockRun(str(name), _record_or_raise(outcome))
        finally:
            (context.execution_options.preserve_order,
             context.enable_fallback_to_arrow_object_ext_type) = saved
            self._finish()

    def sample_texts(self, dataset: Any, text_column: str, rows: int) -> list[str]:
        """Up to `rows` texts from the Dataset's first rows (for the encoder's self-check);
        refuses a Dataset without the text column, naming its columns."""
        self.connect()  # raypipe's session (loopback, address), before Ray Data would init one
        columns = dataset.columns()
        if text_column not in columns:
            raise InputError(f"{describe_dataset(dataset)}: text column {text_column!r} not "
                             f"found; available columns: {columns}")
        sample = dataset.select_columns([text_column]).take_batch(rows, batch_format="pyarrow")
        return clean_texts(sample.column(text_column))[0]


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


def run_tokenize(config: TokenizeConfig) -> JobSummary:
    """Run the job inside the caller's Ray session, or a new one (left running); a rerun
    with nothing left to do never touches Ray."""
    runner = RayDataRunner(config.num_workers, config.address)
    summary = _with_ray_errors_unwrapped(lambda: run_job(config, runner))
    return dataclasses.replace(summary, startup_seconds=runner.startup_seconds,
                               data_startup_seconds=runner.data_startup_seconds,
                               unit_retries=runner.retries)


def run_tokenize_dataset(dataset: Any, config: TokenizeConfig) -> JobSummary:
    """Tokenize a ray.data.Dataset's text column (`config.inputs` names it)."""
    runner = RayDataRunner(config.num_workers, config.address)
    summary = _with_ray_errors_unwrapped(
        lambda: run_dataset_job(dataset, describe_dataset(dataset), config, runner))
    return dataclasses.replace(summary, startup_seconds=runner.startup_seconds,
                               data_startup_seconds=runner.data_startup_seconds,
                               unit_retries=runner.retries)
