"""The tokenize job on Ray Data: one Dataset per job, whose map stage tokenizes and writes.

Invariant: Ray Data only moves work (WorkUnit dataclasses, or a user Dataset's blocks) in
and small commit records (UnitRecord) out; all reading, tokenizing and writing is
`raypipe.preprocess.unit.tokenize_unit`, so output is byte-identical to the serial runner
at any worker count. Planned units run as `from_items(units, up to UNITS_PER_BLOCK a
block)` -> `map_batches(tokenize_units)` (the driver pays per block, not per unit:
`units_per_block`); a user's Dataset runs as `dataset.map_batches(tokenize_block)`, one
unit per block, named by the hash of its rows. Both are Ray tasks (1 CPU each, at most
`num_workers` at once), not an actor pool: a task runs on one of the session's pooled
worker processes, which keeps its latest job and encoder (WorkerJobs, in
raypipe.ray.unit_tasks: what the tasks run, without the driver's modules), so a process loads
the tokenizer once a job, and once a session where the session's jobs encode alike
(adopting the tiktoken conversion the driver made for its self-check, both read from one
object-store copy); it encodes with one thread; token arrays never cross the object store.
Tasks, not actors, because a pool's actors start new worker processes each job (a job's
fixed cost on tasks: 0.19-0.30 s, several times less; docs/benchmarks.md, "Measurements
from the code's docstrings").

A job's head start: as the runner connects, one task (`warm_up_worker`, with a map task's
resources) starts a worker process that imports Ray Data and builds the encoder of the
settings the self-check most likely returns (published at the ledger once the job is
planned), and the Dataset launches once it is done (at most HEAD_START_WAIT_S), so the
first map task takes that process ready; its cost on the driver is per job: one task, one
`ray.put` of the likely settings, two ledger calls, nothing per unit. The tasks start while
the driver's self-check still runs: each waits for the job's settings at the ledger, where
the driver publishes them (or the check's failure, which fails the job with the check's own
error) once the check ends. A user's Dataset runs once, as the job: no `take_batch` or
schema fetch runs it before; its self-check rows are the first rows of the first block a
map task is about to tokenize, offered to the driver at the ledger (per job: an offer a
worker process, the first kept, each at most 4,096 rows or ~512 KB, and one `ray.put` of
the committed block names; nothing per unit on the driver).

Ray runs a task again when its worker died; the cluster's `UnitLedger` actor
(raypipe.ray.ledger) counts every unit's attempts, per job, so retries are reported, and a
unit that killed its worker UNIT_RETRIES + 1 times fails the job naming its file and rows
instead of restarting forever (committed units stay). Bad input (a RaypipeError) comes back
as the unit's result and is raised on the driver as itself: Ray Data neither retries it nor
wraps it. It is raised once the stage drains: the ledger then starts no further unit of the
job, and the units in flight on other workers finish and commit. A unit whose block runs
again after its worker died is taken as it was committed, if it was. A job's tasks hold no
CPU after it, however it ends (an actor pool of a failed execution kept its actors until
their handles were garbage collected). Every pending unit runs here, whatever Ray's
start-up costs (no unit runs on the driver), so every job with work leaves its execution
plan, with the tokenize map stage, in Ray Data's log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from raypipe import _faults as faults
from raypipe.config import TokenizeConfig
from raypipe.errors import InputError, RaypipeError
from raypipe.io.records import UnitRecord, WorkUnit
from raypipe.preprocess.encoding.tiktoken_backend import converted
from raypipe.preprocess.job import JobSummary, run_dataset_job, run_job
from raypipe.preprocess.runners import BlockRun, Failures, LaterSettings, Settings
from raypipe.preprocess.unit import UnitSettings
from raypipe.ray.ledger import UnitLedger, ledger_name
from raypipe.ray.session import cluster_cpus, ensure_ray, quiet_ray_notices, worker_niceness
from raypipe.ray.stderr_lines import dropping_ray_noise
from raypipe.ray.unit_tasks import (
    JobShared,
    LedgerJob,
    tokenize_block,
    tokenize_units,
    warm_up_worker,
)

logger = logging.getLogger("raypipe")


def head_start_settings(settings: Settings) -> UnitSettings | None:
    """The settings workers may build their encoder from before the job's are published:
    the settings where ready, else those the self-check most likely returns; None where
    there is no guess, and for tiktoken, whose conversion the workers adopt from the
    driver."""
    likely = settings.guess() if isinstance(settings, LaterSettings) else settings
    return None if likely is None or likely.tokenizer.backend == "tiktoken" else likely


class Outcomes(Failures):
    """The driver's side of the map stage's outcomes: records pass, and the first error
    stops new units (the ledger) while the units in flight finish and commit (Failures)."""

    def __init__(self, seat: LedgerJob):
        super().__init__()
        self.seat = seat

    def record(self, outcome: Any) -> UnitRecord | None:
        """A unit's record from the map stage's column (None: no record: not started, or
        the block's unit was committed before; Ray Data turns a block of Nones into NaN)."""
        if isinstance(outcome, RaypipeError):
            if not self.errors:
                ray.get(self.seat.ledger.fail.remote(self.seat.job))
            self.add(outcome)
            return None
        return outcome if isinstance(outcome, UnitRecord) else None


class RayDataRunner:
    """Runs a job's units (or a Dataset's blocks) as one Ray Data Dataset; connects to (or
    starts) Ray only when there is work to run."""

    def __init__(self, num_workers: int | None, address: str | None = None):
        self.num_workers = num_workers
        self.address = address
        self.startup_seconds = 0.0
        self.data_startup_seconds = 0.0  # pipeline launched -> first record on the driver
        self.retries = 0
        self.seat: LedgerJob | None = None  # the job's, at the cluster's ledger
        self.head_start: list[Any] = []  # the job's warm-up task (warm_up_worker)
        self.joined = False  # a Ray session that was running already
        self.check_niceness = worker_niceness()  # Ray's workers'

    def connect(self) -> None:
        """Connect to (or start) Ray, open the job at the cluster's ledger, and submit its
        head start (`warm_up_worker`)."""
        quiet_ray_notices()  # also in a session the caller started
        if not ray.is_initialized():
            self.startup_seconds = ensure_ray(self.address, self.num_workers)
        elif not self.startup_seconds:
            self.joined = True
        if self.seat is None:
            seat = LedgerJob(cluster_ledger(), uuid.uuid4().hex)
            seat.ledger.open.remote(seat.job)
            self.seat = seat
            self.head_start = [ray.remote(max_retries=0)(warm_up_worker).options(
                **self._task_options()).remote(seat)]

    def startup_line(self) -> str | None:
        how = ("joined the running Ray session" if self.joined
               else f"Ray up in {self.startup_seconds:.2f} s")
        return f"{how} ({cluster_cpus()} CPUs); the units run on Ray Data"

    @staticmethod
    def _task_options() -> dict[str, Any]:
        """A map task's resources and environment; the head start's tasks take the same,
        or Ray would not hand their processes to the map tasks."""
        options: dict[str, Any] = {"num_cpus": 1}
        if faults.environment():  # tests only: the workers see the same injected fault
            options["runtime_env"] = {"env_vars": faults.environment()}
        return options

    def _map_options(self, workers: int) -> dict[str, Any]:
        return {"compute": ray.data.TaskPoolStrategy(size=workers), "batch_size": 1,
                **self._task_options()}

    def _guess(self, settings: Settings) -> None:
        """The job's likely settings published at the ledger (or that there are none):
        what its head-start task builds its encoder from."""
        assert self.seat is not None
        likely = head_start_settings(settings)
        self.seat.ledger.guess.remote(self.seat.job,
                                      None if likely is None else [ray.put(likely)])

    def _start(self, settings: Settings) -> None:
        """The job open at the ledger, its head start told what to build; its JobShared
        published there once the settings are ready (now, or when the self-check ends: the
        map tasks start meanwhile)."""
        self.connect()
        self._guess(settings)
        seat = self.seat
        assert seat is not None

        def publish(ready: UnitSettings | BaseException) -> None:
            """Never raises (the tasks would wait for ever): a failure is published."""
            try:
                if isinstance(ready, BaseException):
                    raise ready
                conversion = converted(ready.tokenizer.sha256)
                shared: list[Any] | str = [ray.put(JobShared(ready, conversion))]
            except BaseException as exc:  # noqa: BLE001  (handed to the tasks as words)
                shared = f"the job's settings could not be made: {exc}"
            seat.ledger.publish.remote(seat.job, shared)

        if isinstance(settings, LaterSettings):
            settings.when_ready(publish)
        else:
            publish(settings)

    def _await_head_start(self) -> None:
        """Wait (at most HEAD_START_WAIT_S) for the job's head start to end, so that its
        first map task takes that process: launched while it still ran, Ray gave the map
        tasks other processes, still importing (measured on a 2-CPU cluster)."""
        if self.head_start:
            import_execution_modules()  # while the head start still runs
            ray.wait(self.head_start, timeout=HEAD_START_WAIT_S)

    def close(self) -> None:
        """The job closed at the ledger if it is open there, however it ended: after its
        run, or failed after the runner connected, before its run (its retries counted; a
        map task of it that still asks starts nothing)."""
        if self.seat is not None and ray.is_initialized():
            self.retries = ray.get(self.seat.ledger.close.remote(self.seat.job))
            self.seat = None

    def run(self, units: list[WorkUnit], settings: Settings) -> Iterator[UnitRecord]:
        """Records of `units` as they commit; the first failure is raised once the units
        in flight have finished (and committed)."""
        self._start(settings)
        workers = max(1, min(self.num_workers or cluster_cpus(), len(units)))
        per_block = units_per_block(len(units), workers)
        outcomes = Outcomes(self.seat)
        try:
            with objects_as_pickles():
                dataset = ray.data.from_items([{"unit": unit} for unit in units],
                                              override_num_blocks=-(-len(units) // per_block))
            mapped = dataset.map_batches(tokenize_units, fn_args=(self.seat,),
                                         batch_format="numpy", **{
                                             **self._map_options(workers),
                                             "batch_size": per_block})
            mapped.context.enable_progress_bars = False  # raypipe's own line has the ETA
            mapped.context.enable_fallback_to_arrow_object_ext_type = True
            self._await_head_start()
            launched = time.perf_counter()
            with closing_batches(mapped) as batches:
                for batch in batches:
                    self.data_startup_seconds = self.data_startup_seconds or \
                        time.perf_counter() - launched
                    for outcome in batch["record"]:
                        record = outcomes.record(outcome)
                        if record is not None:
                            yield record
            outcomes.raise_first()
        finally:
            self.close()

    def run_blocks(self, dataset: Any, settings: Settings, committed: frozenset[str],
                   label: str, columns: list[str]) -> Iterator[BlockRun]:
        """(unit name, its new record or None if committed before) per block, in the
        Dataset's block order: the Dataset's one execution."""
        self._start(settings)
        workers = max(1, self.num_workers or cluster_cpus())
        context = dataset.context  # shared with the Dataset derived below: restored after
        saved = (context.execution_options.preserve_order,
                 context.enable_fallback_to_arrow_object_ext_type)
        try:
            mapped = dataset.map_batches(
                tokenize_block, fn_args=(self.seat, label, columns, [ray.put(committed)]),
                batch_format="pyarrow", **{**self._map_options(workers), "batch_size": None})
            context.execution_options.preserve_order = True  # the manifest's order
            context.enable_fallback_to_arrow_object_ext_type = True
            self._await_head_start()
            launched = time.perf_counter()
            outcomes = Outcomes(self.seat)
            # dropping_ray_noise: Ray's error line for every actor of an actor pool
            # (ray#57733), which the user's Dataset may have
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
            self.close()

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
        """The rows the first map task about to tokenize a block offered (waits for them
        while the run goes on); None once the run has ended without an offer (every block
        committed before, or none)."""
        seat = self.seat
        if seat is None:  # the run has ended already
            return None
        return ray.get(seat.ledger.first_sample.remote(seat.job))


_LEDGER_HANDLES: dict[tuple[str, str], Any] = {}  # (node, Ray job) -> the ledger's handle


def cluster_ledger() -> Any:
    """The cluster's ledger, shared by every raypipe driver on it: a detached named actor
    (no CPU), made by the first job and found by the next, so a job on a running cluster
    starts no process for it (measured on a 2-CPU cluster: that process took ~1 CPU-second
    while the job's first worker started). Its state is per job, dropped at the job's
    close; a driver killed before closing leaves its job's counts (a few bytes a unit)."""
    context = ray.get_runtime_context()
    key = (context.get_node_id(), context.get_job_id())
    if key not in _LEDGER_HANDLES:
        _LEDGER_HANDLES.clear()  # an earlier session's, ended
        _LEDGER_HANDLES[key] = ray.remote(num_cpus=0)(UnitLedger).options(
            name=ledger_name(), namespace=LEDGER_NAMESPACE, lifetime="detached",
            get_if_exists=True).remote()
    return _LEDGER_HANDLES[key]


LEDGER_NAMESPACE = "raypipe"
HEAD_START_WAIT_S = 20.0  # a head start not done by then (a busy cluster) is not waited for
UNITS_PER_BLOCK = 64  # units one Ray Data block carries at most
BLOCKS_PER_WORKER = 4  # blocks each worker gets at least, for balance at the job's end


# what Ray Data imports at a Dataset's first execution in a process (its optimizer, planner
# and streaming executor, ~60 modules: 0.06 s measured with ray 2.60, on the way from the
# head start's end to the first unit), imported while the driver waits for the head start
RAY_DATA_EXECUTION_MODULES = ("ray.data._internal.logical.optimizers",
                              "ray.data._internal.planner.planner",
                              "ray.data._internal.execution.streaming_executor")


def import_execution_modules() -> None:
    """Import RAY_DATA_EXECUTION_MODULES now (one a later Ray renamed is passed over: Ray
    Data imports its own at the execution, as it always does)."""
    for name in RAY_DATA_EXECUTION_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def units_per_block(units: int, workers: int) -> int:
    """How many units one Ray Data block carries: the driver pays ~10 ms of CPU per block
    (its executor, the block's object), so at 10^4 units several share a block, while every
    worker still gets BLOCKS_PER_WORKER blocks or more."""
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
    try:
        if dataset is None:
            summary = _with_ray_errors_unwrapped(lambda: run_job(config, runner))
        else:
            summary = _with_ray_errors_unwrapped(
                lambda: run_dataset_job(dataset, describe_dataset(dataset), config, runner))
    finally:  # a job that failed before its run (planning, the self-check) opened its seat
        runner.close()
    return dataclasses.replace(summary, startup_seconds=runner.startup_seconds,
                               data_startup_seconds=runner.data_startup_seconds,
                               unit_retries=runner.retries, executor="ray")
