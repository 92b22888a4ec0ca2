"""The tokenize job, independent of where units run: plan, skip committed, run, manifest.

Invariant: a job (1) resolves the tokenizer and fingerprint, (2) plans units and checks the
text column of every file before touching the output, (3) takes the output's lock (one job
per output), (4) refuses an output made with a different output-shaping config unless
`overwrite`, (5) runs only units without a valid commit record (same fingerprint, same
input identity, files intact), (6) writes `manifest.json` last. Rerunning a finished job
launches nothing and rewrites nothing. The unit runner is the only part that differs
between executors (serial here, Ray actors in raypipe.ray); while a runner with a
`connect()` method (Ray's) connects, the driver self-checks the encoder and then tokenizes
units from the front of the queue itself (`start_run`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from raypipe.config import LOCATION_FIELDS, TokenizeConfig, dump_config_yaml
from raypipe.errors import ConfigError
from raypipe.formats import FORMATS, get_format
from raypipe.io.atomic import remove_stale_temps
from raypipe.io.lock import output_lock
from raypipe.io.manifest import (
    JOB_RECORD,
    MANIFEST_NAME,
    UNITS_DIR,
    FormatSection,
    Manifest,
    UnitRecord,
    WorkUnit,
    committed_unit_record,
    read_manifest,
    shard_table,
    write_manifest,
)
from raypipe.io.store import Store
from raypipe.preprocess.encoder import (
    DocumentEncoder,
    describe_tokenizer,
    load_tokenizer,
    single_threaded_tokenizers,
)
from raypipe.preprocess.inputs import plan_units
from raypipe.preprocess.llmbatch import LLMBatchSpec, write_llmbatch_from_manifest
from raypipe.preprocess.progress import Progress
from raypipe.preprocess.self_check import BackendChoice, choose_backend, sample_texts
from raypipe.preprocess.unit import UnitSettings, tokenize_unit

JOB_PATH = f"{UNITS_DIR}/{JOB_RECORD}"
logger = logging.getLogger("raypipe")
# units -> their records; may also have `connect()`, called while the encoder self-checks
UnitRunner = Callable[[list[WorkUnit], UnitSettings], Iterable[UnitRecord]]


@dataclass
class JobSummary:
    """What the end-of-job summary prints; also returned by `raypipe.tokenize`."""

    output: str
    units: int
    units_run: int
    rows: int
    documents: int
    tokens: int
    tokens_run: int
    skipped: dict[str, int]
    shards: int
    bytes: int
    wall_seconds: float
    run_seconds: float  # first unit started to last committed (the driver's included)
    startup_seconds: float = 0.0
    peak_rss_bytes: int = 0
    steady_seconds: float = 0.0
    packing: dict[str, str] = field(default_factory=dict)  # batch format -> its packing line
    special_literals: int = 0
    special_policy: str = "text"
    backend: str = "tokenizers"
    backend_reason: str = ""
    units_on_driver: int = 0  # run by the driver while the runner connected (Ray starting)
    unit_retries: int = 0  # unit runs lost to a dead worker and run again

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_run / self.run_seconds if self.run_seconds > 0 else 0.0

    @property
    def steady_tokens_per_second(self) -> float:
        return self.tokens_run / self.steady_seconds if self.steady_seconds > 0 else 0.0

    def render(self) -> str:
        skipped = ", ".join(f"{k}={v}" for k, v in self.skipped.items()) or "none"
        return "\n".join([
            f"raypipe tokenize -> {self.output}",
            f"  units      {self.units} ({self.units_run} run"
            + (f", {self.units_on_driver} of them on the driver while Ray started"
               if self.units_on_driver else "")
            + f", {self.units - self.units_run} already committed)",
        ] + ([f"  retried    {self.unit_retries} unit run(s) lost to a dead worker, run again"]
             if self.unit_retries else []) + [
            f"  rows       {self.rows:,}",
            f"  documents  {self.documents:,}",
            f"  skipped    {skipped}",
            f"  special-token literals in {self.special_literals:,} documents (encoded as "
            f"{'plain text' if self.special_policy == 'text' else 'special ids'})",
            f"  tokens     {self.tokens:,} ({self.tokens_run:,} this run)",
            f"  encoder    {self.backend}" + (f" ({self.backend_reason})"
                                              if self.backend_reason else ""),
            f"  shards     {self.shards} per format, {self.bytes / 1e6:,.1f} MB stored",
            f"  wall time  {self.wall_seconds:.2f} s (Ray start-up {self.startup_seconds:.2f} s)",
        ] + ([
            f"  throughput {self.tokens_per_second / 1e6:.3f} M tokens/s over the units run "
            f"({self.steady_tokens_per_second / 1e6:.3f} M/s once workers are up)",
            f"  peak RSS   {self.peak_rss_bytes / 2**20:.0f} MiB per worker (max)",
        ] if self.units_run else ["  nothing to run: every unit was already committed"])
            + [f"  {name:<10} {line}" for name, line in self.packing.items()])


def steady_seconds(records: list[UnitRecord]) -> float:
    """From the first unit's start to the last unit's end: the run without worker start-up."""
    if not records:
        return 0.0
    return max(r.finished_at for r in records) - min(r.started_at for r in records)


def resolve_settings(config: TokenizeConfig) -> UnitSettings:
    tokenizer = load_tokenizer(config.tokenizer)
    info = describe_tokenizer(tokenizer, config.tokenizer, config.bos, config.eos,
                              config.bos_token, config.eos_token)
    return UnitSettings(config=config, tokenizer=info,
                        fingerprint=config.output_fingerprint(info.sha256),
                        output=Store(config.output).uri)


def make_encoder(settings: UnitSettings) -> DocumentEncoder:
    single_threaded_tokenizers()
    tokenizer = load_tokenizer(settings.tokenizer.spec)
    return DocumentEncoder(tokenizer, settings.tokenizer.bos_id, settings.tokenizer.eos_id,
                           settings.config.special_tokens_in_text, settings.tokenizer.backend)


def with_backend(config: TokenizeConfig, settings: UnitSettings,
                 unit: WorkUnit | None) -> tuple[UnitSettings, BackendChoice]:
    """Settings whose tokenizer names the backend the job encodes with (self-checked on a
    sample of `unit`'s texts)."""
    tokenizer = load_tokenizer(settings.tokenizer.spec)
    checking = config.tokenizer_backend != "tokenizers" and unit is not None
    sample = sample_texts(unit, config.text_column) if checking else []
    choice = choose_backend(config.tokenizer_backend, tokenizer,
                            config.special_tokens_in_text, sample)
    info = dataclasses.replace(settings.tokenizer, backend=choice.backend)
    return dataclasses.replace(settings, tokenizer=info), choice


class HeadStart:
    """The front of a job's unit queue, which the driver takes units from while the runner
    connects; closed (under the same lock) before the runner gets the rest."""

    def __init__(self, queue: deque[WorkUnit]):
        self.queue = queue
        self.lock = threading.Lock()
        self.open = True

    def take(self) -> WorkUnit | None:
        with self.lock:
            return self.queue.popleft() if self.open and self.queue else None

    def close(self) -> None:
        with self.lock:
            self.open = False

    def tokenize(self, settings: UnitSettings) -> list[UnitRecord]:
        return list(serial_runner(iter(self.take, None), settings))


@dataclass
class Start:
    """How a job's run began: the settings with the backend its self-check chose, and the
    records of the units the driver tokenizes itself while the runner connects."""

    settings: UnitSettings
    choice: BackendChoice
    head_start: Future[list[UnitRecord]] | None = None


def start_run(config: TokenizeConfig, settings: UnitSettings, unit: WorkUnit | None,
              runner: UnitRunner | None, queue: deque[WorkUnit]) -> Start:
    """The encoder's self-check (~1 s) on a thread, while the runner connects to what it
    runs on (`runner.connect()`, if it has one: a local Ray starts in 3-5 s) on this one;
    then, on that thread until the runner has connected, the driver tokenizes units from
    the front of `queue` itself (Ray's start leaves about a core-second of CPU idle on 2
    cores). Returns once the check is done and the runner connected; the driver's last unit
    may still be running. Without `connect`: the self-check alone."""
    connect = getattr(runner, "connect", None)
    if connect is None:
        return Start(*with_backend(config, settings, unit))
    checked: Future[tuple[UnitSettings, BackendChoice]] = Future()
    head = HeadStart(queue)

    def check_then_tokenize() -> list[UnitRecord]:
        try:
            checked.set_result(with_backend(config, settings, unit))
        except BaseException as exc:
            checked.set_exception(exc)
            raise
        return head.tokenize(checked.result()[0])

    pool = ThreadPoolExecutor(1, thread_name_prefix="raypipe-head-start")
    head_start = pool.submit(check_then_tokenize)
    pool.shutdown(wait=False)
    try:
        connect()
    finally:
        head.close()
    return Start(*checked.result(), head_start=head_start)


def records_of(runner: UnitRunner, units: list[WorkUnit], settings: UnitSettings,
               head_start: Future[list[UnitRecord]] | None) -> Iterator[UnitRecord]:
    """The runner's records as they come, with those of the driver's head start as soon as
    it has finished (progress counts them early). A head start that failed (bad input in
    its unit) raises its error at the runner's next record, which stops the runner: the job
    fails as soon as it would have on the runner."""
    if units:
        records = iter(runner(units, settings))
        try:
            for record in records:
                yield record
                if head_start is not None and head_start.done():
                    yield from head_start.result()
                    head_start = None
        finally:
            close = getattr(records, "close", None)
            if close is not None:
                close()  # a generator runner's own cleanup (Ray's: kill its actors)
    if head_start is not None:
        yield from head_start.result()


def serial_runner(units: Iterable[WorkUnit], settings: UnitSettings) -> Iterator[UnitRecord]:
    """Run units one after another in this process (tests, tiny inputs, debugging, the
    driver's head start); the encoder is loaded at the first unit."""
    encoder = None
    for unit in units:
        encoder = encoder or make_encoder(settings)
        yield tokenize_unit(unit, settings, encoder)


def accepted_fingerprints(config: TokenizeConfig, settings: UnitSettings) -> set[str]:
    """The job's fingerprint, and the one raypipe 0.1-0.2 computed for the same spelling."""
    return {settings.fingerprint, config.spelled_fingerprint(settings.tokenizer.sha256)}


def prepare_output(config: TokenizeConfig, settings: UnitSettings,
                   inputs: list[str]) -> Store:
    """Create the output; refuse one made with another config, or holding units of input
    files no longer given, unless `overwrite`. Configs compare by meaning: the resolved
    input files, the output's URI and the tokenizer's contents, not their spelling."""
    output = Store(settings.output)
    job = {"fingerprint": settings.fingerprint, "config": config.meaning_fields(),
           "tokenizer_sha256": settings.tokenizer.sha256, "inputs": sorted(inputs)}
    if output.exists(JOB_PATH):
        previous = output.read_json(JOB_PATH)
        if previous.get("fingerprint") not in accepted_fingerprints(config, settings):
            if not config.overwrite:
                raise ConfigError(f"{output}: made with a different config "
                                  f"({describe_difference(previous, job)}); "
                                  "pass --overwrite to replace it")
            clear_output(output)
        else:
            check_inputs(config, output, previous.get("inputs"), job["inputs"])
    elif output.exists(MANIFEST_NAME) and not config.overwrite:
        raise ConfigError(f"{output}: holds a manifest without a job record; "
                          "pass --overwrite to replace it")
    if output.local:
        remove_stale_temps(output.root)
    if not output.exists(JOB_PATH) or output.read_json(JOB_PATH) != job:
        output.write_json(JOB_PATH, job)
    return output


def check_inputs(config: TokenizeConfig, output: Store, before: list[str] | None,
                 now: list[str]) -> None:
    """Files may be added to a job's inputs (their units run); an output holding units of
    files that are no longer inputs is refused (unless `overwrite`), naming them."""
    gone = sorted(set(before or ()) - set(now))
    if gone and config.overwrite:
        remove_units_of(output, set(gone))
    elif gone:
        shown = ", ".join(gone[:3]) + (f" and {len(gone) - 3} more" if len(gone) > 3 else "")
        raise ConfigError(f"{output}: holds units of {len(gone)} input file(s) no longer "
                          f"given ({shown}); pass --overwrite to rebuild it from the inputs "
                          "given, or give those files again")


def remove_units_of(output: Store, inputs: set[str]) -> None:
    """Delete the shard files and records of the units made from `inputs` (logged)."""
    removed = 0
    for name in output.list_files(UNITS_DIR):
        if name == JOB_PATH or not name.endswith(".json"):
            continue
        record = UnitRecord.from_json(output.read_json(name), output.uri_of(name))
        if record.unit.uri not in inputs:
            continue
        for shard in record.shards:
            for entries in shard.files.values():
                for entry in entries:
                    output.delete(entry.path)
        output.delete(name)
        removed += 1
    logger.warning("%s: --overwrite removed %d units of %d input file(s) no longer given",
                   output, removed, len(inputs))


def describe_difference(previous: dict[str, Any], current: dict[str, Any]) -> str:
    before = {k: v for k, v in previous.get("config", {}).items() if k not in LOCATION_FIELDS}
    after = current["config"]
    keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    parts = [f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys]
    if previous.get("tokenizer_sha256") != current["tokenizer_sha256"]:
        parts.append("tokenizer contents changed")
    return "; ".join(parts) or "fingerprint differs"


def clear_output(output: Store) -> None:
    """Remove what raypipe wrote (never other files of the user's)."""
    output.delete(MANIFEST_NAME)
    output.delete("config.yaml")
    for name in (*FORMATS, UNITS_DIR):
        output.delete_tree(name)


def run_job(config: TokenizeConfig, runner: UnitRunner = serial_runner,
            progress_every: float = 10.0) -> JobSummary:
    started = time.perf_counter()
    settings = resolve_settings(config)
    extra = ()
    if settings.wants_metadata:
        extra = (*config.metadata_columns, *filter(None, [config.span_column]))
    # plan first: bad input fails before the output directory is touched
    units = plan_units(config.inputs, config.text_column, config.unit_bytes, extra)
    with output_lock(Store(settings.output)):
        return _run_locked(config, settings, units, runner, started, progress_every)


def _run_locked(config: TokenizeConfig, settings: UnitSettings, units: list[WorkUnit],
                runner: UnitRunner, started: float, progress_every: float) -> JobSummary:
    """The job while it holds the output's lock (nothing else writes there)."""
    output = prepare_output(config, settings, sorted({unit.uri for unit in units}))
    accepted = accepted_fingerprints(config, settings)
    records: dict[str, UnitRecord] = {}
    pending = []
    for unit in units:
        record = committed_unit_record(output, unit, accepted)
        if record is None:
            pending.append(unit)
        else:
            records[unit.name] = record
    existing = read_manifest(output) if output.exists(MANIFEST_NAME) else None
    writes_manifest = bool(pending) or existing is None or [
        summary.name for summary in existing.units] != [u.name for u in units]
    choice, queue, head_start = None, deque(pending), None
    progress = Progress(pending, progress_every)  # its clock includes the runner's start
    if writes_manifest:
        start = start_run(config, settings, pending[0] if pending else units[0] if units
                          else None, runner if pending else None, queue)
        settings, choice, head_start = start.settings, start.choice, start.head_start
    fresh = []
    for record in records_of(runner, list(queue), settings, head_start):
        fresh.append(record)
        progress.update(record)
    on_driver = head_start.result() if head_start is not None else []
    # the workers' figures: the driver's RSS holds Ray's, and its units start before them
    driver_ids = {id(record) for record in on_driver}
    on_workers = [r for r in fresh if id(r) not in driver_ids] or fresh
    records.update({r.unit.name: r for r in fresh})
    manifest = build_manifest(config, settings, [records[unit.name] for unit in units])
    if writes_manifest:
        manifest = add_batch_formats(config, output, manifest)
        output.write_bytes("config.yaml", dump_config_yaml(config).encode())
        write_manifest(output, manifest)
        if output.local:
            remove_stale_temps(output.root)  # left by workers killed mid-unit
    else:
        assert existing is not None
        manifest = existing
    totals = manifest.totals
    return JobSummary(
        output=output.uri, units=len(units), units_run=len(pending), rows=totals.rows,
        documents=totals.documents, tokens=totals.tokens,
        tokens_run=sum(r.tokens for r in fresh),
        skipped=totals.skipped, shards=totals.shards, bytes=totals.bytes,
        wall_seconds=time.perf_counter() - started, run_seconds=steady_seconds(fresh),
        peak_rss_bytes=max((r.peak_rss_bytes for r in on_workers), default=0),
        steady_seconds=steady_seconds(on_workers),
        packing={name: packing_line(section.options) for name, section in
                 manifest.formats.items() if "used_tokens" in section.options},
        special_literals=totals.special_literals,
        special_policy=config.special_tokens_in_text,
        backend=manifest.tokenizer.backend,
        backend_reason=choice.reason if choice is not None else "recorded in the manifest",
        units_on_driver=len(on_driver))


def add_batch_formats(config: TokenizeConfig, output: Store, manifest: Manifest) -> Manifest:
    """Pack the batch formats (LLMBATCH) the config asks for from the document shards."""
    for name in config.formats:
        if get_format(name).holds == "batches":
            spec = LLMBatchSpec(config.seq_len, config.batch_size, config.packing,
                                config.seed, config.batches_per_shard)
            manifest = manifest.with_format(
                name, write_llmbatch_from_manifest(output, manifest, spec))
    return manifest


def packing_line(options: dict[str, Any]) -> str:
    """One line on what a batch format's packing kept of the corpus."""
    used, total = options["used_tokens"], options["used_tokens"] + options["cropped_tokens"] \
        + options["dropped_tokens"]
    share = (lambda n: f"{n / total:.2%}") if total else (lambda n: "0")
    return (f"{options['packing']} packing: used {share(used)}, cropped "
            f"{share(options['cropped_tokens'])}, padded {share(options['padded_tokens'])}, "
            f"dropped {share(options['dropped_tokens'])} of the tokens")


def build_manifest(config: TokenizeConfig, settings: UnitSettings,
                   records: list[UnitRecord]) -> Manifest:
    dtypes = settings.shard_spec().token_dtypes()
    formats = {name: FormatSection(dtypes[name].name, shard_table(records, name),
                                   config.format_options(name))
               for name in settings.formats}
    return Manifest.build(settings.fingerprint, settings.tokenizer, formats, config.to_dict(),
                          records)
